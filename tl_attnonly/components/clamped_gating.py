"""A clamped SwiGLU (GPT-OSS's experts) as neuron-heads: exact where the clamp is inactive.

GPT-OSS's experts compute, per neuron, from the gate ``g`` and the linear branch ``u`` (both with
their biases)::

    act(g, u) = (clamp(u, -L, L) + 1) * gc * sigmoid(alpha * gc),   gc = min(g, L)

(``alpha = 1.702``, ``L = limit = 7``). Without the clamp this is a gated neuron-head exactly:
one head per neuron, query ``alpha * g`` (so the weight on itself is ``sigmoid(alpha g)``), value
``g * (u + 1)``: the coefficients ``b = alpha, d = 0, f = 1, e = g = 0``
(:class:`ScaledSiluCoefficients`) and the linear branch ``u + 1``. A clamp is not an attention
head, so the neuron-heads compute the *unclamped* activation: equal to GPT-OSS's wherever
``g <= L`` and ``|u| <= L``. Elsewhere they differ, and never silently: every forward pass of a
converted expert counts the elements where the clamp would have acted, computes there (in
float64) the largest ``|act_unclamped - act|``, records both on the expert
(:class:`ClampRecord`) and the layer emits a :class:`ClampActiveWarning` naming itself.

This module imports on every TransformerLens version; the bridge's experts
(:mod:`tl_attnonly.bridge.experts`) use it.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from jaxtyping import Float

from tl_attnonly.activations import NeuronHeadCoefficients

#: Name of the option that converts clamped experts (``ConversionOptions.clamp``), its values.
CLAMP_OPTIONS = ("refuse", "check")


class ClampActiveWarning(UserWarning):
    """A converted clamped-SwiGLU layer met inputs where the original's clamp acts: there its
    output differs from the original model's (by the recorded change; see
    :class:`ClampRecord`)."""


@dataclass(frozen=True)
class ScaledSiluCoefficients(NeuronHeadCoefficients):
    """One exact head of ``x * sigmoid(alpha x)`` (``b = alpha``; ``alpha = 1`` is SiLU).

    ``reference`` is that function itself (not a TransformerLens ``act_fn``), so
    :meth:`~tl_attnonly.activations.NeuronHeadCoefficients.max_abs_error` is 0 up to rounding.
    """

    def reference(self, x: Float[torch.Tensor, "..."]) -> Float[torch.Tensor, "..."]:
        """``x * sigmoid(alpha x)``, in ``x``'s dtype."""
        return x * torch.sigmoid(x * self.b[0])


@dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS's gated activation ``(clamp(u, -L, L) + 1) * gc * sigmoid(alpha gc)``,
    ``gc = min(g, L)``.

    Attributes:
        alpha: The sigmoid's slope (GPT-OSS: 1.702).
        limit: The clamp ``L`` (GPT-OSS: 7.0).
    """

    alpha: float
    limit: float

    #: What the linear branch's neuron-head value is offset by: ``v = g * (u + 1)``.
    linear_offset = 1.0

    def coefficients(self) -> NeuronHeadCoefficients:
        """The neuron-heads of the unclamped activation: one exact head per neuron."""
        return ScaledSiluCoefficients(
            "scaled_silu", "exact", (self.alpha,), (0.0,), (1.0,), (0.0,), (0.0,)
        )

    def clamped(
        self, gate: Float[torch.Tensor, "..."], up: Float[torch.Tensor, "..."]
    ) -> Float[torch.Tensor, "..."]:
        """The original (clamped) activation, GPT-OSS's arithmetic."""
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def unclamped(
        self, gate: Float[torch.Tensor, "..."], up: Float[torch.Tensor, "..."]
    ) -> Float[torch.Tensor, "..."]:
        """What the neuron-heads compute: the activation without the clamp."""
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def active(
        self, gate: Float[torch.Tensor, "..."], up: Float[torch.Tensor, "..."]
    ) -> torch.Tensor:
        """Where the clamp acts: ``g > L`` or ``|u| > L`` (bool, the shape of ``gate``)."""
        return (gate > self.limit) | (up.abs() > self.limit)

    def change(
        self, gate: Float[torch.Tensor, "..."], up: Float[torch.Tensor, "..."]
    ) -> tuple[int, float]:
        """``(n, max |unclamped - clamped|)`` over the ``n`` elements where the clamp acts,
        computed in float64 on those elements only (``(0, 0.0)`` where it acts nowhere)."""
        mask = self.active(gate, up)
        count = int(mask.sum())
        if count == 0:
            return 0, 0.0
        g = gate.detach()[mask].to(torch.float64)
        u = up.detach()[mask].to(torch.float64)
        return count, float((self.unclamped(g, u) - self.clamped(g, u)).abs().max())

    def describe(self) -> str:
        """For messages: the activation and its clamp."""
        return (
            f"(clamp(u, -{self.limit:g}, {self.limit:g}) + 1) * g' * sigmoid({self.alpha:g} g'), "
            f"g' = min(g, {self.limit:g})"
        )


def _split(gate_up: torch.Tensor, concatenated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate and linear branch of a ``[..., 2 * d_mlp]`` tensor, concatenated or interleaved."""
    if concatenated:
        gate, up = gate_up.chunk(2, dim=-1)
        return gate, up
    return gate_up[..., ::2], gate_up[..., 1::2]


def find_clamped_gating(what: str, hf_experts: Any) -> ClampedSwiGLU | None:
    """The clamped SwiGLU an experts module's custom ``_apply_gate`` computes, found by its
    values, not its name: ``None`` where the module has no numeric ``alpha`` and ``limit``.

    Its ``_apply_gate`` runs on float64 values spread over ``[-3L, 3L]`` (so the clamp acts on
    some and not on others) and must equal :meth:`ClampedSwiGLU.clamped` to rounding.

    Raises:
        NotImplementedError: ``alpha`` and ``limit`` present, but the gating computes something
            else (named, with the difference).
    """
    alpha, limit = (getattr(hf_experts, name, None) for name in ("alpha", "limit"))
    numeric = all(
        isinstance(v, numbers.Real) and not isinstance(v, bool) and float(v) > 0
        for v in (alpha, limit)
    )
    if not numeric:
        return None
    gating = ClampedSwiGLU(float(cast(float, alpha)), float(cast(float, limit)))
    concatenated = bool(getattr(hf_experts, "is_concatenated", True))
    values = torch.linspace(-3 * gating.limit, 3 * gating.limit, 2 * 61, dtype=torch.float64)
    gate_up = torch.stack(torch.meshgrid(values[::2], values, indexing="ij"), -1).flatten(1)
    gate, up = _split(gate_up, concatenated)
    with torch.no_grad():
        theirs = hf_experts._apply_gate(gate_up)
    ours = gating.clamped(gate, up)
    if theirs.shape != ours.shape or not torch.allclose(theirs, ours, rtol=1e-12, atol=1e-12):
        difference = (
            f"differs by {float((theirs - ours).abs().max()):.3g}"
            if theirs.shape == ours.shape
            else f"gives shape {tuple(theirs.shape)}, not {tuple(ours.shape)}"
        )
        raise NotImplementedError(
            f"{what}: its gated activation ({type(hf_experts).__name__}._apply_gate, alpha="
            f"{alpha}, limit={limit}) is not the clamped SwiGLU {gating.describe()}: it "
            f"{difference} on a test grid."
        )
    return gating


class ClampRecord:
    """Mixin of a converted expert of a clamped SwiGLU: checks every forward pass where the clamp
    would have acted, and records it.

    Attributes:
        clamp: The gating (``None``: not clamped; the expert's activation is standard).
        clamp_count: Elements (token x neuron) where the clamp acted, over every forward pass
            since conversion or :meth:`reset_clamp_record`.
        clamp_max_change: The largest ``|unclamped - clamped|`` activation (``hook_post``)
            there, over the same passes.
        last_clamp: ``(n, max change)`` of the latest forward pass.
    """

    clamp: ClampedSwiGLU | None = None
    clamp_count: int = 0
    clamp_max_change: float = 0.0
    last_clamp: tuple[int, float] = (0, 0.0)

    def reset_clamp_record(self) -> None:
        """Forget what earlier forward passes recorded."""
        self.clamp_count, self.clamp_max_change, self.last_clamp = 0, 0.0, (0, 0.0)

    def _checked_linear(
        self, gate: Float[torch.Tensor, "pos d_mlp"], up: Float[torch.Tensor, "pos d_mlp"]
    ) -> Float[torch.Tensor, "pos d_mlp"]:
        """The linear branch the neuron-heads multiply by (``u + 1`` for a clamped SwiGLU, else
        ``u``), after recording where the clamp would have acted on ``(gate, up)``."""
        if self.clamp is None:
            return up
        self.last_clamp = self.clamp.change(gate, up)
        self.clamp_count += self.last_clamp[0]
        self.clamp_max_change = max(self.clamp_max_change, self.last_clamp[1])
        return up + self.clamp.linear_offset


def warn_clamp(name: str, experts: Sequence[ClampRecord], n_elements: int) -> None:
    """One :class:`ClampActiveWarning` for a layer whose experts' latest forward pass met the
    clamp (nothing where none did).

    Args:
        name: The layer's hook prefix (``blocks.{l}.mlp.experts``).
        experts: Its experts, in order.
        n_elements: Elements (routed token x neuron) the experts computed in that pass.
    """
    hits = {e: expert.last_clamp for e, expert in enumerate(experts) if expert.last_clamp[0]}
    if not hits:
        return
    clamp = experts[0].clamp
    assert clamp is not None
    count = sum(n for n, _ in hits.values())
    change = max(c for _, c in hits.values())
    per_expert = ", ".join(f"{e}: {n}" for e, (n, _) in hits.items())
    warnings.warn(
        f"{name}: the original's clamp (gate > {clamp.limit:g} or |up| > {clamp.limit:g}) acted "
        f"on {count} of {n_elements} expert activations in this forward pass (by expert: "
        f"{per_expert}); there the neuron-heads' unclamped activation differs from the "
        f"original's by up to {change:.6g} (hook_post), so this output is not the unconverted "
        f"model's. Recorded on each expert (clamp_count, clamp_max_change).",
        ClampActiveWarning,
        stacklevel=3,
    )


__all__ = [
    "CLAMP_OPTIONS",
    "ClampActiveWarning",
    "ClampRecord",
    "ClampedSwiGLU",
    "ScaledSiluCoefficients",
    "find_clamped_gating",
    "warn_clamp",
]
