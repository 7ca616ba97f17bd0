"""What every neuron-head layer shares: coefficients, keys, the (self, bias) pattern, ``W_O``.

A neuron-head (Huben & Morris 2023, Theorem 3) is an attention head of internal dimension 1 whose
query position sees two keys: the token itself (key 1) and a bias token (key 0). The plain layer
(:class:`~tl_attnonly.components.NeuronHeadMLP`) and the gated one
(:class:`~tl_attnonly.components.GatedNeuronHeadMLP`) differ only in where queries and values come
from; the keys, the scores, the softmax over the two keys and the output map are the same and live
here once.
"""

from __future__ import annotations

from typing import Dict, Optional, Union

import torch
from jaxtyping import Float
from transformer_lens import HookedTransformerConfig
from transformer_lens.hook_points import HookPoint

from tl_attnonly._compat import CanBeUsedAsMLP, has_hooks
from tl_attnonly.activations import NeuronHeadCoefficients, head_coefficients


class NeuronHeadBase(CanBeUsedAsMLP):
    """Base of the neuron-head layers: per-head coefficients, derived keys and output weights.

    Subclasses declare their parameters and hook points (``hook_q, hook_k, hook_v,
    hook_attn_scores, hook_pattern, hook_z, hook_result``) and compute queries and values.

    Args:
        cfg: The model config.
        coefficients: Per-head coefficients; default: :func:`head_coefficients` of ``cfg.act_fn``.
    """

    hook_q: HookPoint
    hook_k: HookPoint
    hook_v: HookPoint
    hook_attn_scores: HookPoint
    hook_pattern: HookPoint
    hook_z: HookPoint

    def __init__(
        self,
        cfg: Union[Dict, HookedTransformerConfig],
        coefficients: Optional[NeuronHeadCoefficients] = None,
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
        self._coef_cache: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, ...]] = {}

    # ------------------------------------------------------------------ coefficients
    def _coefs(self, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(b, d, f, e, g), each ``[K]``, in ``like``'s dtype and device (cached)."""
        key = (like.dtype, like.device)
        if key not in self._coef_cache:
            c = self.coefficients
            self._coef_cache[key] = tuple(
                torch.tensor(vals, dtype=like.dtype, device=like.device)
                for vals in (c.b, c.d, c.f, c.e, c.g)
            )
        return self._coef_cache[key]

    def _per_head(self, per_neuron: torch.Tensor, per_k: torch.Tensor) -> torch.Tensor:
        """``[..., d_mlp] x [K] -> [..., d_mlp * K]`` (head ``i*K + k``)."""
        return (per_neuron.unsqueeze(-1) * per_k).flatten(-2)

    # ------------------------------------------------------------------ derived head weights
    @property
    def W_K(self) -> Float[torch.Tensor, "n_neuron_heads d_model 1"]:
        """Key weights of the real tokens: zero (every real token's key is the constant 1)."""
        return self.W_out.new_zeros(self.n_neuron_heads, self.cfg.d_model, 1)

    @property
    def b_K(self) -> Float[torch.Tensor, "n_neuron_heads 1"]:
        """Key biases of the real tokens: one."""
        return self.W_out.new_ones(self.n_neuron_heads, 1)

    @property
    def k_bias_token(self) -> Float[torch.Tensor, "n_neuron_heads 1"]:
        """The bias token's key: zero, so its score is 0 whatever the query."""
        return self.W_out.new_zeros(self.n_neuron_heads, 1)

    @property
    def W_O(self) -> Float[torch.Tensor, "n_neuron_heads 1 d_model"]:
        """Output weights: ``W_out[i]`` for every head of neuron ``i``."""
        return self.W_out.repeat_interleave(self.n_heads_per_neuron, dim=0).unsqueeze(1)

    @property
    def b_O(self) -> Float[torch.Tensor, " d_model"]:
        """Output bias of the layer (``b_out``)."""
        return self.b_out  # type: ignore[return-value]

    def neuron_of_head(self, head: int) -> tuple[int, int]:
        """``(neuron, k)`` of a neuron-head index."""
        return divmod(head, self.n_heads_per_neuron)

    # ------------------------------------------------------------------ forward pieces
    def _uses_head_path(self) -> bool:
        """Whether the hooked head path must run (a head hook is attached, results are on, ...)."""
        if self.use_neuron_result or not self.fused:
            return True
        return any(
            has_hooks(hp)
            for hp in (
                self.hook_q,
                self.hook_k,
                self.hook_v,
                self.hook_attn_scores,
                self.hook_pattern,
                self.hook_z,
            )
        )

    def _keys(
        self, q: Float[torch.Tensor, "batch pos n_neuron_heads 1"]
    ) -> tuple[Float[torch.Tensor, "batch pos n_neuron_heads 1"], bool]:
        """The real tokens' keys (all 1, expanded: no memory spent) through ``hook_k``, and whether
        a hook left them untouched."""
        keys = q.new_ones(()).expand(q.shape)
        k = self.hook_k(keys)
        return k, k is keys

    def _attend(
        self,
        q: Float[torch.Tensor, "batch pos n_neuron_heads 1"],
        k: Float[torch.Tensor, "batch pos n_neuron_heads 1"],
        keys_untouched: bool = False,
    ) -> Float[torch.Tensor, "batch pos n_neuron_heads 2"]:
        """Scores and the softmax over (self, bias) of hooked queries and keys, through the hooks.

        ``keys_untouched`` (from :meth:`_keys`): every key is 1, so ``q * 1 = q`` and ``q * 0 = 0``
        exactly and the products are skipped. Returns the (hooked) pattern in ``[batch, pos, head,
        2]`` memory order; the hooks see the TransformerLens-ordered view ``[batch, head,
        query_pos, 2]`` (no transposing copies).
        """
        batch, pos, n_heads, _ = q.shape
        scores = q.new_empty(batch, pos, n_heads, 2)
        if keys_untouched:  #: q * 1 = q and q * 0 = 0 exactly, so skip the products
            scores[..., 0] = q.squeeze(-1)
            scores[..., 1] = 0
        else:
            scores[..., 0] = (q * k).squeeze(-1)
            scores[..., 1] = (q * self.k_bias_token.to(q.dtype)).squeeze(-1)
        # [batch, n_neuron_heads, query_pos, 2]
        scores = self.hook_attn_scores(scores.transpose(1, 2)).transpose(1, 2)
        # softmax over two keys, written as sigmoids of the score differences
        diff = scores[..., 0] - scores[..., 1]  # and -diff == scores[..., 1] - scores[..., 0]
        pattern = torch.stack((diff, diff.neg()), dim=-1).sigmoid_()
        # [batch, n_neuron_heads, query_pos, 2]
        return self.hook_pattern(pattern.transpose(1, 2)).transpose(1, 2)

    def _sum_heads(
        self, z: Float[torch.Tensor, "batch pos n_neuron_heads 1"]
    ) -> Float[torch.Tensor, "batch pos d_mlp"]:
        """Sum each neuron's ``K`` head outputs."""
        post = z.reshape(*z.shape[:2], self.d_mlp, self.n_heads_per_neuron)
        return post.squeeze(-1) if self.n_heads_per_neuron == 1 else post.sum(-1)
