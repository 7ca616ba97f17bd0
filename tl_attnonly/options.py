"""Conversion options: how MLP neurons are turned into neuron-heads.

The options are small, frozen and JSON-serialisable, so a converted model can be saved and rebuilt
exactly (:meth:`tl_attnonly.AttnOnlyTransformer.save_pretrained`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch
from transformer_lens.config.hooked_transformer_config import HookedTransformerConfig

from tl_attnonly.activations import (
    DEFAULT_RELU_K,
    FIT_RANGE,
    SUPPORTED_ACTIVATIONS,
    NeuronHeadCoefficients,
    head_coefficients,
    max_score_magnitude,
)


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
        fused: Skip materialising queries, keys, scores and patterns when no hook is attached to
            them. Both paths give bit-identical outputs; this only saves time and memory.
    """

    n_heads_per_neuron: Optional[int] = None
    relu_k: float = DEFAULT_RELU_K
    gelu_method: str = "fit"
    fused: bool = True

    def coefficients(self, act_fn: Optional[str]) -> NeuronHeadCoefficients:
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

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (see :meth:`from_dict`)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ConversionOptions:
        """Inverse of :meth:`to_dict`; unknown keys raise ``TypeError``."""
        return cls(**d)


def check_convertible(cfg: HookedTransformerConfig, options: ConversionOptions) -> None:
    """Refuse, before anything is built or copied, a model the conversion cannot represent.

    Args:
        cfg: The config of the model to convert.
        options: The conversion options.

    Raises:
        ValueError: No MLPs (``attn_only``), or an activation that is not supported.
        NotImplementedError: Gated MLPs, mixture-of-experts, 4-bit weights.
    """
    supported = ", ".join(SUPPORTED_ACTIVATIONS)
    if cfg.attn_only:
        raise ValueError(
            "This model is already attention-only (cfg.attn_only=True): it has no MLP neurons to "
            "convert."
        )
    if cfg.gated_mlp:
        raise NotImplementedError(
            f"Gated MLPs (act(x W_gate) * (x W_in), act_fn={cfg.act_fn!r}) are not supported: a "
            "neuron-head's output is linear in its value, so a product of two projections is not "
            f"one head. Supported: non-gated MLPs with act_fn in {supported}."
        )
    if cfg.num_experts:
        raise NotImplementedError(
            f"Mixture-of-experts MLPs (num_experts={cfg.num_experts}) are not supported: routing "
            f"is not an attention head. Supported: dense MLPs with act_fn in {supported}."
        )
    if cfg.load_in_4bit:
        raise NotImplementedError(
            "4-bit quantised MLP weights are not supported; load the model in float32 or "
            "float64 first."
        )
    options.coefficients(cfg.act_fn)  # raises ValueError naming the activation


def overflow_warning(
    coefficients: NeuronHeadCoefficients, dtype: torch.dtype, x_range: float = FIT_RANGE
) -> Optional[str]:
    """A warning message if ``dtype`` cannot hold the neuron-heads' scores/values, else ``None``."""
    if not dtype.is_floating_point:
        return None
    limit = torch.finfo(dtype).max
    worst = max(max_score_magnitude(coefficients, x_range))
    if worst < limit:
        return None
    return (
        f"Neuron-head scores/values reach {worst:.3g} for pre-activations |x| <= {x_range}, "
        f"beyond the largest {dtype} ({limit:.3g}): outputs will overflow to inf/NaN. Use a "
        "smaller relu_k, fewer heads per neuron, or float32/bfloat16."
    )
