"""What every neuron-head layer shares: coefficients, keys, the (self, bias) pattern, ``W_O``.

A neuron-head (Huben & Morris 2023, Theorem 3) is an attention head of internal dimension 1 whose
query position sees two keys: the token itself (key 1) and a bias token (key 0). The plain layer
(:class:`~tl_attnonly.components.NeuronHeadMLP`) and the gated one
(:class:`~tl_attnonly.components.GatedNeuronHeadMLP`) differ only in where queries and values come
from; the keys, the scores, the softmax over the two keys and the output map are the same and live
here once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Dict

import torch
import torch.nn.functional as F
from jaxtyping import Float
from transformer_lens.hook_points import HookPoint

from tl_attnonly._compat import CanBeUsedAsMLP, global_module_hooks, has_hooks
from tl_attnonly.activations import (
    NeuronHeadCoefficients,
    head_coefficients,
    representable_slopes,
)
from tl_attnonly.components._fused_kernel import compiled_kernel, kernel_failed

if TYPE_CHECKING:
    from transformer_lens import HookedTransformerConfig

#: Neuron-head quantities that are functions of the layer's pre-activations alone (see
#: :meth:`NeuronHeadBase.derive_activation`); ``result`` also needs ``W_out``.
DERIVABLE_HOOKS = ("q", "k", "v", "attn_scores", "pattern", "z")


#: Elements per chunk (``K * rows * d_mlp``) of the fused path's temporaries: small enough to stay
#: in a CPU core's cache, large enough that the per-chunk overhead stays small.
FUSED_CHUNK_ELEMENTS = 1 << 17

#: Measured bound of the fused path against the head path, in units of the dtype's machine
#: epsilon times ``sum_k (|f_k x| + |e_k| + 2 |g_k|)`` (see ``NeuronHeadBase._fused_activation``).
FUSED_ERROR_ULPS = 4.0


def records_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd records an operation on ``tensors`` (which then takes no ``out=``)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class NeuronHeadBase(CanBeUsedAsMLP):
    """Base of the neuron-head layers: per-head coefficients, derived keys and output weights.

    Subclasses declare their parameters and hook points (``hook_q, hook_k, hook_v,
    hook_attn_scores, hook_pattern, hook_z, hook_result``) and compute queries and values.

    Args:
        cfg: The model config.
        coefficients: Per-head coefficients; default: :func:`head_coefficients` of ``cfg.act_fn``.
    """

    #: The hook points whose values determine every derivable neuron-head quantity, in the order
    #: :meth:`_head_z` takes them (a gated layer adds ``hook_pre_linear``).
    derive_inputs: ClassVar[tuple[str, ...]] = ("hook_pre",)
    #: What the layer says of itself to the analysis tools, which never ask its class
    #: (:class:`~tl_attnonly.mlp_protocol.MLPLayer`): a neuron-head layer, plain (a gated layer
    #: says so), dense.
    converted: ClassVar[bool] = True
    gated: ClassVar[bool] = False
    is_mixture_of_experts: ClassVar[bool] = False

    hook_post: HookPoint
    hook_q: HookPoint
    hook_k: HookPoint
    hook_v: HookPoint
    hook_attn_scores: HookPoint
    hook_pattern: HookPoint
    hook_z: HookPoint

    def __init__(
        self,
        cfg: Dict | HookedTransformerConfig,
        coefficients: NeuronHeadCoefficients | None = None,
    ):
        super().__init__(cfg)
        self.select_activation_function()
        self.coefficients = (
            coefficients if coefficients is not None else head_coefficients(self.cfg.act_fn)
        )
        self.n_heads_per_neuron = self.coefficients.n_heads
        self.n_neuron_heads = self.d_mlp * self.n_heads_per_neuron
        #: Whether to compute and hook per-head results (like TL's ``cfg.use_attn_result``).
        self.use_neuron_result = False
        #: Whether the fused path (no q/k/scores/pattern materialised) may be used when no hook is
        #: attached to the neuron-head hook points.
        self.fused = True
        #: Whether the fused path evaluates the K heads with a kernel built by ``torch.compile``
        #: (where it can be built; otherwise the eager fused path, after one warning).
        self.compiled = False
        self._coef_cache: dict[tuple[Any, ...], tuple[torch.Tensor, ...]] = {}
        # While deriving (see derive_activation): the quantity wanted, and where it is put.
        self._deriving: str | None = None
        self._derived: torch.Tensor | None = None

    # ------------------------------------------------------------------ coefficients
    def _coefs(self, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(b, d, f, e, g), each ``[K]``, in ``like``'s dtype and device (cached); a slope ``b``
        beyond the dtype (``relu_k = 1e6`` in float16) is held at its largest finite value
        (:func:`~tl_attnonly.activations.representable_slopes`)."""
        key = (like.dtype, like.device)
        if key not in self._coef_cache:
            c = self.coefficients
            self._coef_cache[key] = tuple(
                torch.tensor(vals, dtype=like.dtype, device=like.device)
                for vals in (representable_slopes(c.b, like.dtype), c.d, c.f, c.e, c.g)
            )
        return self._coef_cache[key]

    def coefficient_tensors(self, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The coefficients ``(b, d, f, e, g)``, each ``[K]``, as tensors in ``like``'s dtype and
        device (cached; :attr:`coefficients` holds them as floats)."""
        return self._coefs(like)

    @property
    def _exact_silu(self) -> bool:
        """One head with ``b = f = 1`` and ``d = e = g = 0``: the activation is exactly SiLU."""
        c = self.coefficients
        return c.n_heads == 1 and (c.b, c.d, c.f, c.e, c.g) == ((1,), (0,), (1,), (0,), (0,))

    def _fused_coefs(self, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(b, d, f, e - g), each ``[K, 1, 1]``, for the fused path (cached)."""
        key = (like.dtype, like.device, "fused")
        if key not in self._coef_cache:
            b, d, f, e, g = self._coefs(like)
            self._coef_cache[key] = tuple(t.view(-1, 1, 1) for t in (b, d, f, e - g))
        return self._coef_cache[key]

    def _fused_activation(
        self, x: Float[torch.Tensor, "batch pos d_mlp"]
    ) -> Float[torch.Tensor, "batch pos d_mlp"]:
        """The sum of a neuron's K heads as one scalar function of ``x``, no per-head tensor.

        ``sum_k z_k = sum_k (f_k x + e_k - g_k) sigmoid(b_k x + d_k) + sum_k g_k``. Exact SiLU
        heads use ``F.silu`` (TransformerLens's own function, so the output is the original's bit
        for bit). Otherwise, without autograd, the K terms are evaluated on row chunks small
        enough to stay in cache (``[K, rows, d_mlp]``, about :data:`FUSED_CHUNK_ELEMENTS`
        elements), never materialising ``[..., d_mlp, K]`` for the whole input.

        With ``compiled`` set, a kernel built by ``torch.compile`` evaluates the K terms in one
        pass over ``x`` (no autograd; where it cannot be built, a warning and the eager path).

        The same function as the head path's ``sum_k z``, but not the same arithmetic: the two
        agree to rounding, not bit for bit. Bound, tested over many shapes and scales
        (``tests/components/test_fused_heads.py``): ``|fused - head path| <= FUSED_ERROR_ULPS *
        eps(dtype) * sum_k (|f_k x| + |e_k| + 2 |g_k|)`` elementwise.
        """
        if self._exact_silu:
            return F.silu(x)
        out = self._run_compiled(x)
        if out is not None:
            return out
        shape = x.shape
        x = x.reshape(-1, self.d_mlp)
        b, d, f, ce = self._fused_coefs(x)
        g_sum = sum(self.coefficients.g)
        if records_grad(x):
            out = (torch.addcmul(ce, f, x) * torch.sigmoid(torch.addcmul(d, b, x))).sum(0)
            return (out + g_sum if g_sum != 0 else out).reshape(shape)
        out = torch.empty_like(x)
        n_heads = self.n_heads_per_neuron
        rows = max(1, FUSED_CHUNK_ELEMENTS // (n_heads * self.d_mlp))
        for r0 in range(0, x.shape[0], rows):
            xc, oc = x[r0 : r0 + rows], out[r0 : r0 + rows]
            if n_heads == 1:
                torch.addcmul(d[0], b[0], xc, out=oc).sigmoid_()
                oc.mul_(torch.addcmul(ce[0], f[0], xc))
                continue
            s = torch.addcmul(d, b, xc).sigmoid_()  # [K, rows, d_mlp], in cache
            s.mul_(torch.addcmul(ce, f, xc))
            torch.sum(s, 0, out=oc)
        if g_sum != 0:
            out.add_(g_sum)
        return out.reshape(shape)

    def _run_compiled(self, *inputs: torch.Tensor) -> torch.Tensor | None:
        """The compiled kernel on ``inputs`` (``x``, or gate and linear branch); ``None`` where it
        is not to be used (``compiled`` unset, exact SiLU heads, autograd) or cannot be built here
        (see :mod:`tl_attnonly.components._fused_kernel`)."""
        if not self.compiled or self._exact_silu or records_grad(*inputs):
            return None
        device = inputs[0].device
        try:  # torch.compile may refuse at once (unsupported platform) or on the first call
            kernel = compiled_kernel(self.coefficients, device, gated=len(inputs) == 2)
            return None if kernel is None else kernel(*inputs)
        except Exception as error:  # no compiler, no Triton, ...: the eager path instead
            kernel_failed(device, error)
            return None

    def _per_head(self, per_neuron: torch.Tensor, per_k: torch.Tensor) -> torch.Tensor:
        """``[..., d_mlp] x [K] -> [..., d_mlp * K]`` (head ``i*K + k``)."""
        return (per_neuron.unsqueeze(-1) * per_k).flatten(-2)

    # ------------------------------------------------------------------ derived head weights
    @property
    def _out_matrix(self) -> Float[torch.Tensor, "d_mlp d_model"]:
        """``W_out`` as a ``[d_mlp, d_model]`` tensor (TL's MoE experts store an ``nn.Linear``)."""
        return self.W_out

    @property
    def out_matrix(self) -> Float[torch.Tensor, "d_mlp d_model"]:
        """The output weights ``[d_mlp, d_model]``: row ``i`` is what neuron ``i`` writes per unit
        of ``hook_post`` (``W_out`` for dense layers, the ``nn.Linear``'s weight transposed for
        MoE experts)."""
        return self._out_matrix

    @property
    def W_K(self) -> Float[torch.Tensor, "n_neuron_heads d_model 1"]:
        """Key weights of the real tokens: zero (every real token's key is the constant 1)."""
        return self._out_matrix.new_zeros(self.n_neuron_heads, self.cfg.d_model, 1)

    @property
    def b_K(self) -> Float[torch.Tensor, "n_neuron_heads 1"]:
        """Key biases of the real tokens: one."""
        return self._out_matrix.new_ones(self.n_neuron_heads, 1)

    @property
    def k_bias_token(self) -> Float[torch.Tensor, "n_neuron_heads 1"]:
        """The bias token's key: zero, so its score is 0 whatever the query."""
        return self._out_matrix.new_zeros(self.n_neuron_heads, 1)

    @property
    def W_O(self) -> Float[torch.Tensor, "n_neuron_heads 1 d_model"]:
        """Output weights: ``W_out[i]`` for every head of neuron ``i``."""
        return self._out_matrix.repeat_interleave(self.n_heads_per_neuron, dim=0).unsqueeze(1)

    @property
    def b_O(self) -> Float[torch.Tensor, " d_model"]:
        """Output bias of the layer: ``out = sum_h result[h] + b_O`` (``b_out`` here)."""
        return self.b_out  # type: ignore[return-value]

    @property
    def b_post(self) -> Float[torch.Tensor, " d_mlp"]:
        """What ``hook_post`` adds to the sum of each neuron's head outputs: zero here (gated
        layers: TL's ``b_in``). So ``z`` of a ``K = 1`` neuron is ``hook_post - b_post``."""
        return self._out_matrix.new_zeros(self.d_mlp)

    def self_weight(self, pre: torch.Tensor) -> torch.Tensor:
        """Each neuron's first head's weight on itself, ``sigmoid(b_0 pre + d_0)``, elementwise
        on any shape of the neuron's pre-activation (``hook_pre``; a gated layer's gate): the
        head path's ``hook_pattern[:, i * K, :, 0]`` (same operations, so equal to rounding)
        without running the head path for every neuron. The neuron atlas reads it at the few
        positions it keeps."""
        c = self.coefficients
        b, d, *_ = self._coefs(pre)
        q = pre if c.b[0] == 1 else pre * b[0]
        return torch.sigmoid(q if c.d[0] == 0 else q + d[0])

    def neuron_of_head(self, head: int) -> tuple[int, int]:
        """``(neuron, k)`` of a neuron-head index."""
        return divmod(head, self.n_heads_per_neuron)

    # ------------------------------------------------------------------ forward pieces
    def _uses_head_path(self) -> bool:
        """Whether the hooked head path must run (a head hook is attached, results are on, ...)."""
        if self.use_neuron_result or not self.fused:
            return True
        return any(has_hooks(getattr(self, f"hook_{name}")) for name in DERIVABLE_HOOKS)

    def _hook(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``hook_{name}(tensor)`` in a forward pass; while deriving, no hook runs and the wanted
        quantity is recorded instead."""
        if self._deriving is None:
            return getattr(self, f"hook_{name}")(tensor)
        if name == self._deriving:
            self._derived = tensor
        return tensor

    #: The neuron-heads as attention heads, every hook point (via :meth:`_hook`) on the way:
    #: ``_head_z(*inputs) -> z`` ``[batch, pos, n_neuron_heads, 1]``, ``inputs`` the values of
    #: :attr:`derive_inputs` (a method of each subclass, whose parameters name those inputs).
    _head_z: Callable[..., Float[torch.Tensor, "batch pos n_neuron_heads 1"]]

    def derive_activation(self, name: str, **inputs: torch.Tensor) -> torch.Tensor:
        """A neuron-head quantity recomputed from the layer's inputs, exactly as an unedited
        forward pass with a caching hook on it would have stored it (same arithmetic, same
        shapes, so bit for bit).

        Args:
            name: One of :data:`DERIVABLE_HOOKS` (``q, k, v, attn_scores, pattern, z``).
            **inputs: The values of :attr:`derive_inputs` in that pass (``hook_pre=...``; a
                gated layer also ``hook_pre_linear=...``), ``[batch, pos, d_mlp]``.

        Returns:
            The quantity in its hook's shape.

        Raises:
            ValueError: For another name, or missing inputs.
        """
        if name not in DERIVABLE_HOOKS:
            raise ValueError(
                f"Cannot derive {name!r} from the pre-activations; derivable: {DERIVABLE_HOOKS}."
            )
        missing = [hook for hook in self.derive_inputs if hook not in inputs]
        if missing:
            raise ValueError(f"derive_activation({name!r}) needs {missing} as keyword arguments.")
        self._deriving, self._derived = name, None
        try:
            self._head_z(*(inputs[hook] for hook in self.derive_inputs))
            derived = self._derived
        finally:
            self._deriving, self._derived = None, None
        assert derived is not None
        return derived

    def _held(self, name: str) -> bool:
        """Whether the tensor passed through ``hook_{name}`` may be held or edited in place by
        someone else: a hook is attached (to it, or to every module: torch's global hooks), or
        the quantity is being derived (and recorded)."""
        if self._deriving is not None or has_hooks(getattr(self, f"hook_{name}")):
            return True
        return global_module_hooks()

    def _own(self, name: str, tensor: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """``tensor`` for ``hook_{name}``, copied if it shares memory with ``source`` and may be
        held (:meth:`_held`): only then could an in-place edit leak into ``source`` or into
        another hook's tensor."""
        if not self._held(name):
            return tensor
        shared = tensor.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
        return tensor.clone() if shared else tensor

    def _reusable(self, name: str, tensor: torch.Tensor, *inputs: torch.Tensor) -> bool:
        """Whether ``tensor``, our own buffer just passed through ``hook_{name}``, may take the
        next step's result (computed from it and ``inputs``): nobody holds it (:meth:`_held`),
        and no autograd graph records any of them. That saves a fresh allocation, whose first
        touch costs about as much as the arithmetic."""
        if self._held(name) or records_grad(tensor, *inputs):
            return False
        return all(t.dtype == tensor.dtype for t in inputs)

    def _keys(
        self, q: Float[torch.Tensor, "batch pos n_neuron_heads 1"]
    ) -> Float[torch.Tensor, "batch pos n_neuron_heads 1"] | None:
        """The real tokens' keys (all 1) through ``hook_k``; ``None`` when nothing can see them.

        Hooked (or derived), the keys get their own memory, so an edit made in place takes effect
        exactly like a returned one; with no hook the product ``q * 1 = q`` is skipped.
        """
        if self._deriving == "k" or (self._deriving is None and self._held("k")):
            return self._hook("k", q.new_ones(q.shape))
        return None

    @staticmethod
    def _head_view(
        planes: Float[torch.Tensor, "2 batch pos n_neuron_heads"],
    ) -> Float[torch.Tensor, "batch n_neuron_heads query_pos 2"]:
        """The TransformerLens-ordered view of (self, bias) planes (no copy)."""
        return planes.permute(1, 3, 2, 0)

    @staticmethod
    def _planes(
        view: Float[torch.Tensor, "batch n_neuron_heads query_pos 2"],
    ) -> Float[torch.Tensor, "2 batch pos n_neuron_heads"]:
        """The (self, bias) planes of a TransformerLens-ordered view (no copy)."""
        return view.permute(3, 0, 2, 1)

    def _attend(
        self,
        q: Float[torch.Tensor, "batch pos n_neuron_heads 1"],
        k: Float[torch.Tensor, "batch pos n_neuron_heads 1"] | None,
        bias_plane: bool = True,
    ) -> Float[torch.Tensor, "2 batch pos n_neuron_heads"]:
        """Scores and the softmax over (self, bias) of hooked queries and keys, through the hooks.

        ``k is None`` (from :meth:`_keys`): every key is 1, so ``q * 1 = q`` is skipped. The bias
        token's key is 0 and not a hook point, so its score is 0 whatever the query (even an
        infinite one). Scores and pattern are held as two contiguous planes, the self column
        and the bias column, ``[2, batch, pos, head]`` (so every step below is one contiguous
        pass); the hooks see the TransformerLens-ordered view ``[batch, head, query_pos, 2]`` of
        them (no transposing copies), and the (hooked) pattern is returned as planes.

        ``bias_plane=False`` (the caller reads only the self plane: the bias token's value is 0):
        where no hook sees the scores or the pattern (:meth:`_held`) and autograd records
        nothing, the bias planes are left unwritten, since no one reads them.
        """
        batch, pos, n_heads, _ = q.shape
        scores = q.new_empty(2, batch, pos, n_heads)
        scores[0].copy_(q.squeeze(-1) if k is None else (q * k).squeeze(-1))
        unseen = not (bias_plane or records_grad(q) or self._held("attn_scores"))
        if not unseen:
            scores[1].zero_()
        # [batch, n_neuron_heads, query_pos, 2]
        scores = self._planes(self._hook("attn_scores", self._head_view(scores)))
        # softmax over two keys, written as sigmoids of the score differences:
        # pattern = sigmoid((s_self - s_bias, s_bias - s_self)), the second the first negated
        if records_grad(scores):  # autograd: no out= arguments
            diff = scores[0] - scores[1]
            pattern = torch.stack((diff.sigmoid(), diff.neg().sigmoid()))  # plane by plane
        else:
            if self._reusable("attn_scores", scores):
                # Our own scores, unseen and unedited: the bias plane is 0 and s - 0 is s
                # exactly, so the self plane already holds the difference; the pattern
                # overwrites the scores.
                pattern = scores
            else:
                pattern = scores.new_empty(scores.shape)
                if unseen:  # the bias plane of the scores is unwritten, and would be 0
                    pattern[0].copy_(scores[0])
                else:
                    torch.sub(scores[0], scores[1], out=pattern[0])
            # One sigmoid per plane, whether or not the bias plane is computed: the vector
            # kernel rounds its tail elements differently, so the self plane's values must
            # not depend on whether a hook sees the pattern.
            if not unseen or self._held("pattern"):
                torch.neg(pattern[0], out=pattern[1])
                pattern[1].sigmoid_()
            pattern[0].sigmoid_()  # (unseen: the bias plane stays unread, unwritten)
        # [batch, n_neuron_heads, query_pos, 2]
        return self._planes(self._hook("pattern", self._head_view(pattern)))

    def _mix_values(
        self,
        pattern: Float[torch.Tensor, "2 batch pos n_neuron_heads"],
        v: Float[torch.Tensor, "batch pos n_neuron_heads 1"],
        bias_value: Float[torch.Tensor, "n_neuron_heads 1"] | None = None,
    ) -> Float[torch.Tensor, "batch pos n_neuron_heads 1"]:
        """``z = pattern_self * v + pattern_bias * bias_value`` (the bias token's value; ``None``
        where it is 0), before ``hook_z``.

        Written into the pattern's own memory when nobody holds the pattern
        (:meth:`_reusable`); the same products and sum either way, so the same bits.
        """
        p_self, p_bias = pattern[0].unsqueeze(-1), pattern[1].unsqueeze(-1)
        inputs = (v,) if bias_value is None else (v, bias_value)
        if not self._reusable("pattern", pattern, *inputs) or p_self.shape != v.shape:
            z = p_self * v
            return z if bias_value is None else z.add_(p_bias * bias_value)
        z = torch.mul(p_self, v, out=p_self)
        if bias_value is None:
            return z
        return z.add_(torch.mul(p_bias, bias_value, out=p_bias))

    def _post_correction(
        self, post: Float[torch.Tensor, "batch pos d_mlp"]
    ) -> Float[torch.Tensor, "batch pos d_mlp"] | None:
        """Run ``hook_post`` when the output is built from per-head results: returns the edit
        (hooked minus unhooked, exactly 0 where nothing changed, whether the hook returned a
        tensor or edited in place), or ``None`` when no hook is attached."""
        if not has_hooks(self.hook_post):
            self.hook_post(post)
            return None
        before = post.clone()
        return self.hook_post(post) - before

    def _sum_heads(
        self, z: Float[torch.Tensor, "batch pos n_neuron_heads 1"]
    ) -> Float[torch.Tensor, "batch pos d_mlp"]:
        """Sum each neuron's ``K`` head outputs (never a view of ``z`` that ``hook_post`` could
        edit in place)."""
        post = z.reshape(*z.shape[:2], self.d_mlp, self.n_heads_per_neuron)
        if self.n_heads_per_neuron > 1:
            return post.sum(-1)
        post = post.squeeze(-1)
        return post.clone() if has_hooks(self.hook_post) else post


__all__ = [
    "DERIVABLE_HOOKS",
    "FUSED_CHUNK_ELEMENTS",
    "FUSED_ERROR_ULPS",
    "NeuronHeadBase",
]
