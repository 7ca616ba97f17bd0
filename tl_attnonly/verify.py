"""Equivalence checks: converted vs original, on logits and every shared activation."""

from __future__ import annotations

import re
from typing import Union

import pandas as pd
import torch
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
    tokens: Union[torch.Tensor, str, list[str]],
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


__all__ = [
    "HOOK_GROUPS",
    "equivalence_table",
]
