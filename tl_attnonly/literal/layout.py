"""The augmented residual stream of the literal form, its defaults and its memory error."""

from __future__ import annotations

from dataclasses import dataclass

from tl_attnonly.options import DEFAULT_BUDGET_BYTES, LayoutName, MaskOption

#: Hooks of ``blocks.{l}.mlp`` shared, by name, with the structured form's neuron-heads.
SHARED_NEURON_HOOKS = ("hook_pre", "hook_q", "hook_k", "hook_v", "hook_attn_scores",
                       "hook_pattern", "hook_z", "hook_result", "hook_post")  # fmt: skip


class LiteralBudgetError(MemoryError):
    """The literal form would need more memory than its configured budget."""


# ============================================================================ layout


@dataclass(frozen=True)
class ResidualLayout:
    """Coordinates of the augmented residual stream (width ``d_resid = D'``).

    ``[0, D)`` the original residual stream; for the split layout ``[D, D + M)`` the MLP's
    pre-activations and ``[D + M, D + 2M)`` its post-activations; for a gated MLP (split layout)
    also ``[D + 2M, D + 3M)`` the linear branch ``u`` (TransformerLens's ``hook_pre_linear``) and
    ``[D + 3M, D + 4M)`` the products ``g * u``; then ``n_pos = 1 + max_len`` one-hot position
    coordinates, the first of which is the bias token's.

    Attributes:
        d_model: ``D``, the original residual width.
        d_mlp: ``M``, neurons per MLP layer.
        n_pos: ``N' = 1 + max_len`` augmented positions.
        hidden: Whether there are hidden (pre/post-activation) coordinates (split layout).
        gated: Whether there are also linear-branch and product coordinates (gated MLP).
    """

    d_model: int
    d_mlp: int
    n_pos: int
    hidden: bool
    gated: bool = False

    def __post_init__(self) -> None:
        if self.gated and not self.hidden:
            raise ValueError("A gated layout needs the hidden coordinates (hidden=True).")

    @property
    def model_dims(self) -> slice:
        """The original ``D`` coordinates."""
        return slice(0, self.d_model)

    @property
    def pre_dims(self) -> slice:
        """Hidden pre-activation coordinates (split layout)."""
        return slice(self.d_model, self.d_model + self.d_mlp)

    @property
    def post_dims(self) -> slice:
        """Hidden post-activation coordinates (split layout)."""
        return slice(self.d_model + self.d_mlp, self.d_model + 2 * self.d_mlp)

    @property
    def linear_dims(self) -> slice:
        """Hidden linear-branch coordinates ``u = x W_in`` (gated split layout)."""
        return slice(self.d_model + 2 * self.d_mlp, self.d_model + 3 * self.d_mlp)

    @property
    def product_dims(self) -> slice:
        """Hidden product coordinates ``~ g * u`` (gated split layout)."""
        return slice(self.d_model + 3 * self.d_mlp, self.d_model + 4 * self.d_mlp)

    @property
    def n_hidden(self) -> int:
        """Number of hidden coordinates: 0, ``2M`` (split) or ``4M`` (gated split)."""
        return (4 if self.gated else 2 if self.hidden else 0) * self.d_mlp

    @property
    def pos_start(self) -> int:
        """First one-hot position coordinate (the bias token's)."""
        return self.d_model + self.n_hidden

    @property
    def pos_dims(self) -> slice:
        """All one-hot position coordinates."""
        return slice(self.pos_start, self.pos_start + self.n_pos)

    @property
    def bias_row(self) -> int:
        """The bias token's coordinate (its embedding)."""
        return self.pos_start

    @property
    def real_rows(self) -> slice:
        """The real positions' one-hot coordinates: exactly one of them is 1 on a real token."""
        return slice(self.pos_start + 1, self.pos_start + self.n_pos)

    @property
    def d_resid(self) -> int:
        """``D'``, the augmented residual width."""
        return self.pos_start + self.n_pos


__all__ = [
    "DEFAULT_BUDGET_BYTES",
    "SHARED_NEURON_HOOKS",
    "LayoutName",
    "LiteralBudgetError",
    "MaskOption",
    "ResidualLayout",
]
