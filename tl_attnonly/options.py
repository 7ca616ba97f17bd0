"""Options: how MLP neurons are turned into neuron-heads, and how the literal form is built.

:class:`ConversionOptions` are small, frozen and JSON-serialisable, so a converted model can be
saved and rebuilt exactly (:meth:`tl_attnonly.AttnOnlyTransformer.save_pretrained`).
:class:`LiteralOptions` are the options of :func:`tl_attnonly.literal.to_literal`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from tl_attnonly._types import replace_options
from tl_attnonly.activations import (
    DEFAULT_RELU_K,
    FIT_RANGE,
    MAX_GELU_HEADS,
    SUPPORTED_ACTIVATIONS,
    NeuronHeadCoefficients,
    check_relu_k,
    head_coefficients,
    max_score_magnitude,
)
from tl_attnonly.components.clamped_gating import CLAMP_OPTIONS

if TYPE_CHECKING:
    from transformer_lens import HookedTransformerConfig

    from tl_attnonly._types import CoefficientsLike


@dataclass(frozen=True)
class ConversionOptions:
    """How each MLP neuron becomes attention heads.

    Attributes:
        n_heads_per_neuron: Heads per neuron (K) for the GELU family; ``None`` picks the package
            default. SiLU and ReLU always use one head per neuron.
        relu_k: Sharpness of the ReLU approximation ``x * sigmoid(relu_k * x)`` (= SiLU(kx)/k),
            whose maximal error is ``0.2785 / relu_k``.
        gelu_method: ``"fit"`` (the package's fitted K-head approximations) or ``"paper"`` (the
            paper's one-head ``x * sigmoid(1.702 x)``).
        fused: When no hook is attached to the neuron-head hooks, evaluate each neuron's sum of
            heads as one scalar function of ``pre`` (no per-head tensors). Exact SiLU heads then
            give the original model's output bit for bit; otherwise the two paths agree to
            rounding: ``|fused - head path| <= 4 eps sum_k (|f_k x| + |e_k| + 2 |g_k|)`` per
            neuron (measured over many shapes, ``tests/components/test_fused_heads.py``).
        compiled: Evaluate the fused path with a kernel built by ``torch.compile`` (one pass over
            the pre-activations instead of several over K times them; the same bound). Where
            ``torch.compile`` cannot build it (no C++ compiler on the CPU, no Triton on a GPU),
            one warning, then the eager fused path. The first forward pass per shape family
            pays for compiling (seconds). Not used under autograd, nor for exact SiLU heads
            (already TransformerLens's own ``F.silu``).
        clamp: Experts whose gated activation clamps (GPT-OSS's clamped SwiGLU, ``(clamp(u, -7,
            7) + 1) * g' sigmoid(1.702 g')``, ``g' = min(g, 7)``; a clamp is not an attention
            head). ``"refuse"`` (default): refused before any work. ``"check"``: converted
            (TransformerBridge only) to neuron-heads of the unclamped activation, exact wherever
            the clamp is inactive; every forward pass counts where it would have acted,
            records it on the expert (``clamp_count``, ``clamp_max_change``) and warns
            (:class:`~tl_attnonly.components.clamped_gating.ClampActiveWarning`) with the
            layer, the count and the largest change of the activation there.
    """

    n_heads_per_neuron: int | None = None
    relu_k: float = DEFAULT_RELU_K
    gelu_method: str = "fit"
    fused: bool = True
    compiled: bool = False
    clamp: str = "refuse"

    def __post_init__(self) -> None:
        """Refuse invalid options at once, whatever the activation they will be used with."""
        check_relu_k(self.relu_k)
        k = self.n_heads_per_neuron
        if k is not None and (
            isinstance(k, bool)
            or not isinstance(k, numbers.Integral)
            or not 1 <= k <= MAX_GELU_HEADS
        ):
            raise ValueError(
                f"n_heads_per_neuron must be None (the default) or an integer in "
                f"1..{MAX_GELU_HEADS}, got {k!r}."
            )
        if self.gelu_method not in ("fit", "paper"):
            raise ValueError(f"gelu_method must be 'fit' or 'paper', got {self.gelu_method!r}.")
        if not isinstance(self.fused, bool):
            raise ValueError(f"fused must be True or False, got {self.fused!r}.")
        if not isinstance(self.compiled, bool):
            raise ValueError(f"compiled must be True or False, got {self.compiled!r}.")
        if self.clamp not in CLAMP_OPTIONS:
            raise ValueError(
                f"clamp must be one of {', '.join(map(repr, CLAMP_OPTIONS))} (what to do with "
                f"experts that clamp their gated activation, GPT-OSS's), got {self.clamp!r}."
            )

    def coefficients(self, act_fn: str | None) -> NeuronHeadCoefficients:
        """The per-head coefficients for a model whose MLP activation is ``act_fn``.

        Raises:
            ValueError: If ``act_fn`` cannot be written as neuron-heads, or the options do not fit
                it (e.g. several heads per neuron for SiLU).
        """
        if act_fn is None:
            raise ValueError("The model's cfg.act_fn is None: nothing to convert.")
        return head_coefficients(
            act_fn,
            n_heads=self.n_heads_per_neuron,
            relu_k=self.relu_k,
            gelu_method=self.gelu_method,
        )

    def with_overrides(
        self,
        n_heads_per_neuron: int | None = None,
        relu_k: float | None = None,
        gelu_method: str | None = None,
        fused: bool | None = None,
        compiled: bool | None = None,
        clamp: str | None = None,
    ) -> ConversionOptions:
        """A copy with the options that are given (not ``None``) replaced.

        This is how ``convert(model, conversion=..., relu_k=...)`` and the ``from_pretrained``
        methods merge an options object with options given one by one (the latter win).

        Example:
            >>> options = ConversionOptions(relu_k=50).with_overrides(n_heads_per_neuron=2)
            >>> options.n_heads_per_neuron, options.relu_k
            (2, 50)
        """
        changes: dict[str, Any] = {
            "n_heads_per_neuron": n_heads_per_neuron,
            "relu_k": relu_k,
            "gelu_method": gelu_method,
            "fused": fused,
            "compiled": compiled,
            "clamp": clamp,
        }
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (see :meth:`from_dict`)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ConversionOptions:
        """Inverse of :meth:`to_dict`; unknown keys raise ``TypeError``."""
        return cls(**d)


#: Layouts of the literal form: ``"neuron"`` (Theorems 3, 6) or ``"split"`` (Theorems 7, 8).
LayoutName = Literal["neuron", "split"]
#: How the literal form masks: in the weights (Theorem 9), or with ordinary masks.
MaskOption = Literal["omega", "ordinary", "causal_ordinary"]
#: Default memory budget (bytes) for the literal model's weights and for one input's patterns.
DEFAULT_BUDGET_BYTES = 2**30


@dataclass(frozen=True)
class LiteralOptions:
    """How :func:`tl_attnonly.literal.to_literal` builds the literal attention-only form.

    Attributes:
        omega: Penalty for disallowed (query, key) pairs; ``None``: the default
            (:data:`tl_attnonly.literal.DEFAULT_OMEGA`, 1e4). A warning says when it overflows
            ``dtype`` or is too small for ``tol``.
        layout: ``"neuron"``: per layer the model's attention sublayer and one sublayer of
            ``d_mlp * K`` neuron-heads (Theorems 3 and 6). ``"split"``: the post's four sublayers
            per layer: attention, ``W_in`` heads (Theorem 7), activation heads (Theorem 8),
            ``W_out`` heads (Theorem 7) that also clear the hidden coordinates. A gated MLP
            needs ``"split"`` and gets five: attention, ``W_gate``/``W_in`` heads, product heads
            (:func:`tl_attnonly.literal.product_heads`), activation heads, ``W_out`` heads.
        mask: ``"omega"``: every mask (causal, self + bias token, self only) written into the
            weights (Theorem 9); the attention has no mask at all. ``"causal_ordinary"``: the
            model's own causal mask is an ordinary mask, the rest as ``"omega"``.
            ``"ordinary"``: every mask an ordinary ``-inf`` mask (exact; no omega).
        coefficients: Per-head ``b, d, f, e, g`` to use instead of those of the conversion
            options.
        max_len: Longest input; sets the ``1 + max_len`` one-hot position coordinates
            (``None``: ``cfg.n_ctx``).
        dtype: Dtype of the result (``None``: the model's). Built in float64, then cast.
        tol: Attention mass allowed to leak to masked keys, for the omega warning (``None``: the
            dtype's rounding unit).
        linear_d_head: Internal dimension of the linear-map heads (split layout; ``None``:
            ``cfg.d_head``).
        budget_bytes: Refuse to build weights, or to run inputs whose patterns, exceed this.
        use_attn_result: Materialise per-head results (``hook_result``) in every sublayer.
        product_eps: Gated MLPs (``layout="split"``): the product heads' score scale; their error
            is ``eps^2 |g u|^3 / 12`` plus rounding of order ``(2 / eps) u``. ``None``:
            :func:`tl_attnonly.literal.default_product_eps` of ``dtype``. Ignored otherwise.
    """

    omega: float | None = None
    layout: LayoutName = "neuron"
    mask: MaskOption = "omega"
    coefficients: CoefficientsLike | None = None
    max_len: int | None = None
    dtype: torch.dtype | None = None
    tol: float | None = None
    linear_d_head: int | None = None
    budget_bytes: int = DEFAULT_BUDGET_BYTES
    use_attn_result: bool = False
    product_eps: float | None = None

    def __post_init__(self) -> None:
        omega = self.omega
        if omega is not None and (
            isinstance(omega, bool)
            or not isinstance(omega, numbers.Real)
            or not math.isfinite(omega)
            or omega <= 0
        ):
            raise ValueError(
                "omega must be a finite number > 0 (the penalty on disallowed query-key pairs; "
                f"None: the default, see omega_requirement()), got {omega!r}."
            )
        if self.product_eps is not None and not self.product_eps > 0:
            raise ValueError(f"product_eps must be positive, got {self.product_eps}")
        if self.layout not in ("neuron", "split"):
            raise ValueError(f"layout must be 'neuron' or 'split', got {self.layout!r}")
        if self.mask not in ("omega", "ordinary", "causal_ordinary"):
            raise ValueError(
                f"mask must be 'omega', 'ordinary' or 'causal_ordinary', got {self.mask!r}"
            )

    def with_overrides(self, **changes: Any) -> LiteralOptions:
        """A copy with the given fields replaced (``to_literal(model, omega=..., ...)``).

        Raises:
            TypeError: For a name that is not an option, listing the options.
        """
        return replace_options(
            self,
            changes,
            "Unknown literal-form option(s) {unknown}; the options are {names} "
            "(tl_attnonly.LiteralOptions).",
        )


def tl_mlp_class_name(cfg: HookedTransformerConfig) -> str:
    """The name of the MLP class TransformerLens builds for ``cfg``.

    Mirrors ``transformer_lens.factories.mlp_factory.MLPFactory.create_mlp`` without building it:
    ``"MLP"``, ``"GatedMLP"``, ``"GatedMLP4Bit"``, ``"MoE"`` or ``"GptOssMoE"``.
    """
    if cfg.num_experts:
        return "GptOssMoE" if cfg.original_architecture == "GptOssForCausalLM" else "MoE"
    if cfg.gated_mlp:
        return "GatedMLP4Bit" if cfg.load_in_4bit else "GatedMLP"
    return "MLP"


def check_convertible(
    cfg: HookedTransformerConfig,
    options: ConversionOptions,
    *,
    form: Literal["structured", "literal"] = "literal",
) -> None:
    """Refuse, before anything is built or copied, a model the conversion cannot represent.

    An attention-only config (``attn_only=True``) passes for the structured form: it has no
    neurons, so its attention-only form is the model itself, with zero neuron-heads.

    Args:
        cfg: The config of the model to convert.
        options: The conversion options.
        form: ``"structured"`` (neuron-head layers: plain and gated MLPs, mixture-of-experts) or
            ``"literal"`` (plain softmax attention everywhere: plain MLPs, and gated MLPs in the
            ``"split"`` layout, which :func:`tl_attnonly.literal.check_literal_supported`
            checks). The default is the stricter literal form.

    Raises:
        ValueError: An activation that is not supported; an attention-only model for the
            literal form.
        NotImplementedError: An MLP class or option the form cannot represent (named).
    """
    if form not in ("structured", "literal"):
        raise ValueError(f"form must be 'structured' or 'literal', got {form!r}.")
    supported = ", ".join(SUPPORTED_ACTIVATIONS)
    if cfg.attn_only:
        if form == "structured":
            return  # no MLPs: nothing to convert, built exactly like the HookedTransformer
        raise ValueError(
            "This model is already attention-only (cfg.attn_only=True): it has no MLP neurons for "
            "the literal form to convert; tl_attnonly.convert(model) returns a copy."
        )
    mlp_class = tl_mlp_class_name(cfg)
    if cfg.load_in_4bit:
        raise NotImplementedError(
            f"4-bit quantised MLP weights (load_in_4bit=True, TL's {mlp_class}) are not supported; "
            "load the model in float32 or float64 first."
        )
    if mlp_class == "GptOssMoE":
        raise NotImplementedError(
            "GPT-OSS mixture-of-experts MLPs (TL's GptOssMoE) are not supported on a "
            "HookedTransformer: each expert clamps its gate to <= 7 and its linear branch to "
            "[-7, 7] before the product, and a clamp is not an attention head. Supported: dense "
            "MLPs, gated MLPs and TL's MoE (Mixtral/OLMoE style). A GPT-OSS TransformerBridge "
            "converts with ConversionOptions(clamp='check'): exact where the clamp is inactive, "
            "checked and warned on every forward pass (docs/bridge.md)."
        )
    if form == "literal" and mlp_class == "MoE":
        raise NotImplementedError(
            f"Mixture-of-experts MLPs (TL's MoE, num_experts={cfg.num_experts}) are not supported "
            "by the literal form: top-k routing is not a softmax head. Use form='structured' "
            f"(experts as neuron-heads, TL's router). Literal form: dense MLPs with act_fn in "
            f"{supported}."
        )
    options.coefficients(cfg.act_fn)  # raises ValueError naming the activation


def overflow_warning(
    coefficients: CoefficientsLike,
    dtype: torch.dtype,
    x_range: float = FIT_RANGE,
    *,
    scores: bool = False,
) -> str | None:
    """A warning message if ``dtype`` cannot hold the neuron-heads' values, else ``None``.

    In the structured form a score (``b x + d``) that overflows to ``+-inf`` is harmless: the
    bias token's score is exactly 0, so the pattern is ``sigmoid(+-inf)`` = 1 or 0, exactly
    what the sigmoid saturates to anyway. Only values (``f x + e``, ``g``) that overflow make
    outputs inf/NaN. In the literal form (``scores=True``) an infinite score makes the softmax
    NaN, so scores count too.

    Args:
        coefficients: The neuron-heads' coefficients.
        dtype: The dtype the model runs in.
        x_range: Pre-activations assumed to lie in ``|x| <= x_range``.
        scores: Also check the scores (the literal form).
    """
    if not dtype.is_floating_point:
        return None
    limit = torch.finfo(dtype).max
    magnitude = max_score_magnitude(coefficients, x_range)
    worst = max(magnitude) if scores else magnitude.value
    if worst < limit:
        return None
    what = "scores/values" if scores else "values"
    return (
        f"Neuron-head {what} reach {worst:.3g} for pre-activations |x| <= {x_range}, "
        f"beyond the largest {dtype} ({limit:.3g}): outputs will overflow to inf/NaN. Use a "
        "smaller relu_k, fewer heads per neuron, or float32/bfloat16."
    )


__all__ = [
    "DEFAULT_BUDGET_BYTES",
    "ConversionOptions",
    "LayoutName",
    "LiteralOptions",
    "MaskOption",
    "check_convertible",
    "overflow_warning",
    "tl_mlp_class_name",
]
