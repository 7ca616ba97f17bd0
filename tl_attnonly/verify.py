"""Equivalence checks: converted vs original, on logits and every shared activation."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch

from tl_attnonly.activations import NeuronHeadCoefficients

if TYPE_CHECKING:  # annotations only: Verdict also serves the bridge path on TL 4.x
    from transformer_lens import HookedTransformer

#: Shared hook groups reported by :func:`equivalence_table` (name -> regex on hook names).
HOOK_GROUPS = {
    "resid_pre": r"blocks\.\d+\.hook_resid_pre$",
    "attn_out": r"blocks\.\d+\.hook_attn_out$",
    "resid_mid": r"blocks\.\d+\.hook_resid_mid$",
    "mlp pre": r"blocks\.\d+\.mlp\.hook_pre$",
    "mlp post": r"blocks\.\d+\.mlp\.hook_post$",
    "mlp_out": r"blocks\.\d+\.hook_mlp_out$",
    "resid_post": r"blocks\.\d+\.hook_resid_post$",
}


@torch.inference_mode()
def equivalence_table(
    original: HookedTransformer,
    converted: HookedTransformer,
    tokens: torch.Tensor | str | list[str],
) -> pd.DataFrame:
    """Max and mean absolute difference, converted vs original, per activation group.

    Args:
        original: The model before conversion.
        converted: Its converted form (any model with the same hook names).
        tokens: Token ids ``[batch, pos]`` or text (tokenised by ``original``).

    Returns:
        One row per group (logits first, then the shared hooks of :data:`HOOK_GROUPS`) with
        columns ``activation, n_hooks, max_abs_diff, mean_abs_diff, max_abs_value``.
    """
    if not isinstance(tokens, torch.Tensor):
        tokens = original.to_tokens(tokens)
    names = lambda name: any(re.search(p, name) for p in HOOK_GROUPS.values())
    logits_a, cache_a = original.run_with_cache(tokens, names_filter=names)
    logits_b, cache_b = converted.run_with_cache(tokens, names_filter=names)
    rows = [_row("logits", [(torch.as_tensor(logits_a), torch.as_tensor(logits_b))])]
    for group, pattern in HOOK_GROUPS.items():
        pairs = [(cache_a[n], cache_b[n]) for n in cache_a.keys() if re.search(pattern, n)]
        if pairs:
            rows.append(_row(group, pairs))
    return pd.DataFrame(rows)


def _row(name: str, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    diffs = [(a.double() - b.double()).abs() for a, b in pairs]
    return {
        "activation": name,
        "n_hooks": len(pairs),
        "max_abs_diff": max(d.max().item() for d in diffs),
        "mean_abs_diff": sum(d.mean().item() for d in diffs) / len(diffs),
        "max_abs_value": max(a.abs().max().item() for a, _ in pairs),
    }


#: Default tolerance on ``max |Δlogits|``, relative to ``max(1, max |logits|)``, per dtype: a
#: few hundred units in the last place of the logits.
RELATIVE_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10}


@dataclass
class Verdict:
    """One dtype's result of :func:`verify_conversion`.

    Attributes:
        dtype: The dtype both models ran in.
        max_abs_diff: ``max |converted logits - reference logits|``.
        tolerance: The bound it was checked against.
        reference: What the converted model was compared with: ``"original"`` (exact
            activations), or ``"original with the heads' activation"`` (approximate ones: the
            original with each neuron's activation replaced by the sum of its heads).
        approximation_diff: ``max |Δlogits|`` against the unmodified original (the cost of the
            activation approximation; equals ``max_abs_diff`` for exact activations).
        table: The full :func:`equivalence_table` against the unmodified original.
    """

    dtype: torch.dtype
    max_abs_diff: float
    tolerance: float
    reference: str
    approximation_diff: float
    table: pd.DataFrame

    @property
    def passed(self) -> bool:
        """``max_abs_diff <= tolerance`` (NaN fails)."""
        return bool(self.max_abs_diff <= self.tolerance)


def verify_conversion(
    original: HookedTransformer,
    converted: Any,
    tokens: torch.Tensor | str | list[str],
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.float64),
    tolerance: float | None = None,
) -> list[Verdict]:
    """Check that ``converted`` computes what ``original`` does, with a verdict per dtype.

    For an exact activation (SiLU) the reference is the original model. For an approximate one
    (ReLU, GELU) the reference is the original with each neuron's activation replaced by the sum
    of its heads (``converted.coefficients.evaluate``): then the conversion itself must be exact,
    and the approximation's own cost is reported beside it (``approximation_diff``; its bound
    per neuron is ``converted.coefficients.max_abs_error()``).

    Both models are cast to each dtype in turn and restored to their dtypes afterwards.

    Args:
        original: The MLP model.
        converted: Its :class:`~tl_attnonly.AttnOnlyTransformer`.
        tokens: Token ids ``[batch, pos]`` or text (tokenised by ``original``).
        dtypes: The dtypes to check in.
        tolerance: Bound on ``max |Δlogits|``; default: ``RELATIVE_TOLERANCE[dtype] *
            max(1, max |logits|)``.

    Returns:
        One :class:`Verdict` per dtype.
    """
    if not hasattr(converted, "coefficients"):
        raise TypeError(
            f"converted must be a tl_attnonly.AttnOnlyTransformer, got {type(converted).__name__}; "
            "build it with tl_attnonly.convert(model)."
        )
    if not isinstance(tokens, torch.Tensor):
        tokens = original.to_tokens(tokens)
    coefficients = converted.coefficients
    exact = coefficients.method == "exact"
    saved = (original.cfg.dtype, converted.cfg.dtype)
    verdicts = []
    try:
        for dtype in dtypes:
            original.to(dtype, print_details=False)
            converted.to(dtype, print_details=False)
            table = equivalence_table(original, converted, tokens)
            # (casting above stays outside inference mode: the parameters must remain usable
            # for autograd afterwards)
            with torch.inference_mode():
                logits = converted(tokens)
                if exact:
                    reference, ref_logits = "original", original(tokens)
                else:
                    reference = "original with the heads' activation"
                    ref_logits = original.run_with_hooks(
                        tokens, fwd_hooks=_head_activation_hooks(original, coefficients)
                    )
            diff = (logits.double() - ref_logits.double()).abs().max().item()
            if tolerance is None:
                scale = max(1.0, ref_logits.abs().max().item())
                bound = RELATIVE_TOLERANCE.get(dtype, 1e-2) * scale
            else:
                bound = float(tolerance)
            approx = float(table.loc[table["activation"] == "logits", "max_abs_diff"].iloc[0])
            verdicts.append(Verdict(dtype, diff, bound, reference, approx, table))
    finally:
        original.to(saved[0], print_details=False)
        converted.to(saved[1], print_details=False)
    return verdicts


def _head_activation_hooks(model: HookedTransformer, coefficients: NeuronHeadCoefficients) -> list:
    """Hooks that make ``model``'s MLPs use the heads' activation instead of their own.

    ``hook_post`` gains ``(heads(pre) - act(pre))``, times the linear branch for a gated MLP, so
    whatever else the MLP adds there (a gated MLP's ``b_in``) is kept.
    """
    saved: dict[str, torch.Tensor] = {}

    def save(act: torch.Tensor, hook: Any) -> None:
        saved[hook.name] = act

    def replace_post(post: torch.Tensor, hook: Any) -> torch.Tensor:
        prefix = hook.name.removesuffix("hook_post")
        pre = saved[prefix + "hook_pre"]
        delta = coefficients.evaluate(pre) - coefficients.reference(pre)
        if prefix + "hook_pre_linear" in saved:
            delta = delta * saved[prefix + "hook_pre_linear"]
        return post + delta

    hooks: list[tuple[str, Callable[..., Any]]] = []
    for layer in range(model.cfg.n_layers):
        mlp = f"blocks.{layer}.mlp."
        hooks.append((mlp + "hook_pre", save))
        if model.cfg.gated_mlp:
            hooks.append((mlp + "hook_pre_linear", save))
        hooks.append((mlp + "hook_post", replace_post))
    return hooks


__all__ = [
    "HOOK_GROUPS",
    "RELATIVE_TOLERANCE",
    "Verdict",
    "equivalence_table",
    "verify_conversion",
]
