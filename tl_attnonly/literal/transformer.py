"""The literal model: :class:`LiteralTransformer`, and reading its neuron patterns compactly."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn as nn
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens import HookedRootModule, HookedTransformerConfig
from transformer_lens.components import Unembed
from transformer_lens.hook_points import HookPoint
from transformer_lens.utilities import lm_cross_entropy_loss

from tl_attnonly._compat import TypedModuleList, apply_softcap
from tl_attnonly.components.literal_attention import LiteralAttention
from tl_attnonly.literal.layout import LiteralBudgetError, ResidualLayout
from tl_attnonly.literal.modules import LiteralBlock


class LiteralTransformer(HookedRootModule):
    """A transformer whose every sublayer is plain softmax attention (built by :func:`to_literal`).

    ``forward(tokens)`` returns logits ``[batch, pos, d_vocab]`` for the real positions. Inside,
    the sequence is ``[bias token, tokens...]`` and the residual stream has width ``d_resid``
    (see :class:`ResidualLayout`); activation hooks follow TransformerLens's names
    (``blocks.{l}.attn.hook_pattern``, ``blocks.{l}.mlp.hook_post``, ...) but cover the augmented
    sequence: index ``[:, 1:]`` for the real positions and ``[..., :d_model]`` for the original
    coordinates. ``run_with_cache`` / ``run_with_hooks`` work as usual.

    Attributes:
        cfg: The original model's config (a copy).
        layout: The augmented residual stream.
        layout_name: ``"neuron"`` (Theorem 3/6) or ``"split"`` (Theorems 7/8).
        omega: The mask penalty (``None`` for ``mask="ordinary"``).
        mask: ``"omega"``, ``"ordinary"`` or ``"causal_ordinary"``.
        budget_bytes: Refuse inputs whose patterns (all sublayers) would exceed this.
    """

    #: Marks the literal form for checks that must not import this class
    #: (:func:`tl_attnonly.adapt.analysis_model`).
    is_literal_form: ClassVar[bool] = True

    cfg: HookedTransformerConfig
    layout: ResidualLayout
    layout_name: str
    omega: float | None
    mask: str
    budget_bytes: int
    blocks: TypedModuleList[LiteralBlock]
    tokenizer: Any  # the original model's (a transformers tokenizer) or None

    def __init__(
        self,
        cfg: HookedTransformerConfig,
        layout: ResidualLayout,
        layout_name: str,
        blocks: list[LiteralBlock],
        W_E: Tensor,
        W_pos: Tensor | None,
        ln_final: nn.Module,
        unembed: Unembed,
        omega: float | None,
        mask: str,
        budget_bytes: int,
    ):
        super().__init__()
        self.cfg = cfg
        self.layout = layout
        self.layout_name = layout_name
        self.omega = omega
        self.mask = mask
        self.budget_bytes = budget_bytes
        self.W_E = nn.Parameter(W_E)
        self.W_pos = nn.Parameter(W_pos) if W_pos is not None else None
        self.hook_embed = HookPoint()  # [batch, pos, d_model]
        self.hook_pos_embed = HookPoint()  # [batch, pos, d_model]
        self.blocks = TypedModuleList(blocks)
        self.ln_final = ln_final
        self.unembed = unembed
        self.setup()

    # ------------------------------------------------------------------ sizes
    @property
    def d_resid(self) -> int:
        """``D'``, the width of the augmented residual stream."""
        return self.layout.d_resid

    @property
    def max_len(self) -> int:
        """Longest input (real tokens) the one-hot position coordinates cover."""
        return self.layout.n_pos - 1

    def sublayers(self) -> list[tuple[str, LiteralAttention]]:
        """``("blocks.{l}.{name}", module)`` for every attention sublayer, in order."""
        return [
            (f"blocks.{i}.{name}", module)
            for i, block in enumerate(self.blocks)
            for name, module in block.sublayers()
        ]

    def summary(self) -> dict[str, Any]:
        """Sizes of the construction: residual width, sublayers and heads per layer.

        Returns:
            A dict with ``D, M, N`` (original width, neurons per layer, ``max_len``), ``D_prime``
            (this model's residual width), ``D_prime_post`` (the post's ``D + M + N + 1``, i.e.
            ``D + 4D + N + 1`` when ``M = 4D``), ``sublayers_per_layer`` and ``heads`` (per
            sublayer name, in layer 0).
        """
        lay = self.layout
        return {
            "layout": self.layout_name,
            "D": lay.d_model,
            "M": lay.d_mlp,
            "N": self.max_len,
            "D_prime": lay.d_resid,
            "D_prime_post": lay.d_model + lay.d_mlp + self.max_len + 1,
            "sublayers_per_layer": len(self.blocks[0].sublayers()),
            "heads": {name: mod.n_heads for name, mod in self.blocks[0].sublayers()},
        }

    def pattern_bytes(self, batch: int, n_tokens: int) -> int:
        """Bytes of every sublayer's pattern for one input (what ``run_with_cache`` stores).

        Args:
            batch: Batch size.
            n_tokens: Real tokens per sequence.
        """
        n = n_tokens + 1
        itemsize = self.W_E.element_size()
        return batch * n * n * itemsize * sum(m.n_heads for _, m in self.sublayers())

    def _check_budget(self, batch: int, n_tokens: int) -> None:
        size = self.pattern_bytes(batch, n_tokens)
        if size > self.budget_bytes:
            heads = sum(m.n_heads for _, m in self.sublayers())
            raise LiteralBudgetError(
                f"The literal form would materialise {size / 2**30:.2f} GiB of attention patterns "
                f"for this input (batch {batch} x {heads} heads in all sublayers x "
                f"{n_tokens + 1}^2 positions x {self.W_E.element_size()} bytes): above "
                f"budget_bytes={self.budget_bytes} ({self.budget_bytes / 2**30:.2f} GiB). Memory "
                "and time grow as O(d_mlp * N^2). Shorten the input, use the structured form "
                "(tl_attnonly.convert(model)), or raise the budget: "
                "to_literal(..., budget_bytes=...) or model.budget_bytes = ...."
            )

    # ------------------------------------------------------------------ forward
    def embed_augmented(
        self, tokens: Int[torch.Tensor, "batch pos"]
    ) -> Float[torch.Tensor, "batch pos_plus_1 d_resid"]:
        """The augmented residual stream before the first layer.

        Args:
            tokens: Real tokens.

        Returns:
            Bias token at position 0 (its one-hot coordinate only), real token ``j`` at ``1 + j``
            (token + position embedding in the original coordinates, plus its one-hot coordinate).
        """
        batch, n = tokens.shape
        if n > self.max_len:
            raise ValueError(
                f"Input of {n} tokens is longer than max_len={self.max_len} (the one-hot position "
                "coordinates); rebuild with to_literal(..., max_len=...)."
            )
        embed = self.hook_embed(self.W_E[tokens])  # [batch, pos, d_model]
        if self.W_pos is not None:
            pos_embed = self.hook_pos_embed(self.W_pos[:n].expand(batch, n, -1))
            embed = embed + pos_embed  # [batch, pos, d_model]
        lay = self.layout
        resid = embed.new_zeros(batch, n + 1, lay.d_resid)
        resid[:, 1:, lay.model_dims] = embed
        idx = torch.arange(n + 1, device=tokens.device)
        resid[:, idx, lay.pos_start + idx] = 1.0
        return resid

    def forward(
        self,
        tokens: Int[torch.Tensor, "batch pos"],
        return_type: str | None = "logits",
        loss_per_token: bool = False,
    ) -> None | Tensor | tuple[Tensor, Tensor]:
        """Run the literal model.

        Args:
            tokens: ``[batch, pos]`` token ids (strings are not accepted: tokenise first).
            return_type: ``"logits"``, ``"loss"``, ``"both"`` or ``None``.
            loss_per_token: As in TransformerLens.

        Returns:
            Logits ``[batch, pos, d_vocab]`` of the real positions, and/or the loss.

        Raises:
            LiteralBudgetError: If the patterns would exceed ``budget_bytes``.
        """
        if not isinstance(tokens, torch.Tensor):
            raise TypeError(
                f"LiteralTransformer takes token ids (an int tensor [batch, pos]), got "
                f"{type(tokens).__name__}. Tokenise with the original model first: "
                "literal(model.to_tokens(text))."
            )
        if tokens.ndim == 1:
            tokens = tokens[None]
        self._check_budget(tokens.shape[0], tokens.shape[1])
        resid = self.embed_augmented(tokens)
        for block in self.blocks:
            resid = block(resid)
        if return_type is None:
            return None
        real = resid[:, 1:, self.layout.model_dims]
        logits = self.unembed(self.ln_final(real))  # [batch, pos, d_vocab]
        # TransformerLens's output soft cap (Gemma 2), applied after the unembedding as there
        logits = apply_softcap(logits, self.cfg.output_logits_soft_cap)
        if return_type == "logits":
            return logits
        loss = lm_cross_entropy_loss(logits, tokens, per_token=loss_per_token)
        if return_type == "loss":
            return loss
        if return_type == "both":
            return logits, loss
        raise ValueError(f"Invalid return_type {return_type!r}")


# ============================================================================ helpers


def neuron_pattern_compact(
    pattern: Float[Tensor, "batch head query_pos key_pos"], n_neuron_heads: int
) -> Float[Tensor, "batch n_neuron_heads pos 2"]:
    """A literal neuron sublayer's dense pattern (or scores) in the structured form's layout.

    Args:
        pattern: ``blocks.{l}.mlp.hook_pattern`` (or ``hook_attn_scores``) of the literal model,
            over the augmented sequence.
        n_neuron_heads: ``d_mlp * K`` (drops the bias head, if any).

    Returns:
        ``[batch, n_neuron_heads, pos, 2]`` with last axis (self, bias token), real queries only.
    """
    p = pattern[:, :n_neuron_heads, 1:]  # real queries
    self_part = torch.diagonal(p[..., 1:], dim1=-2, dim2=-1)
    return torch.stack([self_part, p[..., 0]], dim=-1)


__all__ = [
    "LiteralTransformer",
    "neuron_pattern_compact",
]
