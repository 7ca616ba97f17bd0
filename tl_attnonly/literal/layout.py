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
    pre-activations and ``[D + M, D + 2M)`` its post-activations; then ``n_pos = 1 + max_len``
    one-hot position coordinates, the first of which is the bias token's.

    Attributes:
        d_model: ``D``, the original residual width.
        d_mlp: ``M``, neurons per MLP layer.
        n_pos: ``N' = 1 + max_len`` augmented positions.
        hidden: Whether there are hidden (pre/post-activation) coordinates (split layout).
    """

    d_model: int
    d_mlp: int
    n_pos: int
    hidden: bool

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
    def pos_start(self) -> int:
        """First one-hot position coordinate (the bias token's)."""
        return self.d_model + (2 * self.d_mlp if self.hidden else 0)

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
