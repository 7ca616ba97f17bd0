"""Argument checks shared by the analysis modules."""

from __future__ import annotations

from typing import Any


def require_neuron_heads(model: Any) -> None:
    """Raise a ``TypeError`` that says what to do unless ``model`` has structured neuron-heads."""
    if hasattr(model, "neuron_heads"):
        return
    name = type(model).__name__
    if name == "LiteralTransformer":
        raise TypeError(
            "The analysis tools work on the structured form; a LiteralTransformer has no "
            "structured neuron-heads. Analyse tl_attnonly.convert(model) instead, or use the "
            "literal model's hooks (same names: blocks.{l}.mlp.hook_pattern, ...) with "
            "run_with_cache / run_with_hooks and the tl_attnonly.hooks presets."
        )
    raise TypeError(
        f"{name} has no neuron-heads: convert it first (tl_attnonly.convert(model)) and use the "
        "converted model (and its caches)."
    )
