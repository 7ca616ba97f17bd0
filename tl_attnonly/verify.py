"""Equivalence checks: converted vs original, on logits and every shared activation.

One check serves both model kinds (TransformerLens 3.x and 4.x):

* an :class:`~tl_attnonly.AttnOnlyTransformer` against the ``HookedTransformer`` it was converted
  from;
* a ``TransformerBridge`` converted with :func:`tl_attnonly.convert` against an unconverted bridge
  of the same weights. A bridge converts in place, so the reference is a second bridge
  (:func:`tl_attnonly.cli.bridge_demo.verify_bridge_conversion` builds one per dtype from a loader).

Both kinds have the same hook names; what differs (the reference's name in messages, whether the
MLPs are gated, the coefficients per layer) is read through
:func:`tl_attnonly.adapt.analysis_model`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from tl_attnonly.activations import NeuronHeadCoefficients
from tl_attnonly.adapt import analysis_model
from tl_attnonly.protocol import AttnOnlyModel

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
#: The neuron-head hook :func:`verify_conversion` hooks in the converted run (a mixture of
#: experts: each expert's): with a hook on it a layer evaluates its heads one by one, and a layer
#: whose hook does not fire did not run as neuron-heads.
HEAD_HOOK = re.compile(r"blocks\.(\d+)\.mlp\.(?:experts\.\d+\.)?hook_z")
#: What the reference is called in a :class:`Verdict`, by model kind.
REFERENCE_NAMES = {"HookedTransformer": "original", "TransformerBridge": "unconverted bridge"}


def _in_groups(name: str) -> bool:
    return any(re.search(pattern, name) for pattern in HOOK_GROUPS.values())


def _run_with_cache(
    model: Any, tokens: torch.Tensor, hooks: Sequence[tuple[str, Callable[..., Any]]] = ()
) -> tuple[torch.Tensor, Any]:
    """``model.run_with_cache`` of the hook groups, with ``hooks`` attached during the run."""
    with torch.inference_mode(), model.hooks(fwd_hooks=list(hooks)):
        logits, cache = model.run_with_cache(tokens, names_filter=_in_groups)
    return torch.as_tensor(logits), cache


def _table(
    reference: tuple[torch.Tensor, Any], converted: tuple[torch.Tensor, Any]
) -> pd.DataFrame:
    (logits_a, cache_a), (logits_b, cache_b) = reference, converted
    rows = [_row("logits", [(logits_a, logits_b)])]
    for group, pattern in HOOK_GROUPS.items():
        pairs = [(cache_a[n], cache_b[n]) for n in cache_a.keys() if re.search(pattern, n)]
        if pairs:
            rows.append(_row(group, pairs))
    return pd.DataFrame(rows)


def equivalence_table(
    original: Any,
    converted: Any,
    tokens: torch.Tensor | str | list[str],
) -> pd.DataFrame:
    """Max and mean absolute difference, converted vs original, per activation group.

    Args:
        original: The model before conversion: a ``HookedTransformer``, or an unconverted
            ``TransformerBridge`` (a second bridge of the same weights: a bridge converts in
            place).
        converted: Its converted form (any model with the same hook names).
        tokens: Token ids ``[batch, pos]`` or text (tokenised by ``original``).

    Returns:
        One row per group (logits first, then the shared hooks of :data:`HOOK_GROUPS`) with
        columns ``activation, n_hooks, max_abs_diff, mean_abs_diff, max_abs_value``.
    """
    ids = tokens if isinstance(tokens, torch.Tensor) else original.to_tokens(tokens)
    return _table(_run_with_cache(original, ids), _run_with_cache(converted, ids))


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
        max_abs_diff: ``max |converted logits - reference logits|``, over the converted model's
            plain forward and its run with the neuron-heads evaluated one by one.
        tolerance: The bound it was checked against.
        reference: What the converted model was compared with: ``"original"`` (a
            ``HookedTransformer``) or ``"unconverted bridge"`` (exact activations), or that
            ``+ " with the heads' activation"`` (approximate ones: the reference with each
            neuron's activation replaced by the sum of its heads).
        approximation_diff: ``max |Δlogits|`` against the unmodified reference (the cost of the
            activation approximation; equals ``max_abs_diff`` for exact activations).
        table: The full :func:`equivalence_table` against the unmodified reference.
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
    original: Any,
    converted: Any,
    tokens: torch.Tensor | str | list[str],
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.float64),
    tolerance: float | None = None,
) -> list[Verdict]:
    """Check that ``converted`` computes what ``original`` does, with a verdict per dtype.

    For an exact activation (SiLU) the reference is the original model. For an approximate one
    (ReLU, GELU) the reference is the original with each neuron's activation replaced by the sum
    of its heads (each layer's ``coefficients.evaluate``, added at ``hook_post``): then the
    conversion itself must be exact, and the approximation's own cost is reported beside it
    (``approximation_diff``; its bound per neuron is ``coefficients.max_abs_error()``).

    The converted model runs twice per dtype: as it is (where no hook is attached a neuron-head
    layer may take its fused path) and with a hook on every layer's ``hook_z`` (so the heads run
    one by one, as the hooks see them); both runs' logits must be within the tolerance. A layer
    whose ``hook_z`` does not fire did not run as neuron-heads: that raises instead of passing.

    Both models are cast to each dtype in turn and restored to their dtypes afterwards.

    Args:
        original: The model before conversion: a ``HookedTransformer``, or an unconverted
            ``TransformerBridge`` of the same weights (a bridge converts in place, so this is a
            second bridge; see :func:`tl_attnonly.cli.bridge_demo.verify_bridge_conversion`).
        converted: Its :class:`~tl_attnonly.AttnOnlyTransformer`, or the converted bridge.
        tokens: Token ids ``[batch, pos]`` or text (tokenised by ``original``).
        dtypes: The dtypes to check in.
        tolerance: Bound on ``max |Δlogits|``; default: ``RELATIVE_TOLERANCE[dtype] *
            max(1, max |logits|)``.

    Returns:
        One :class:`Verdict` per dtype.

    Raises:
        TypeError: If ``converted`` is not converted, ``original`` is, or they are one object.
        RuntimeError: If a layer of ``converted`` did not run as neuron-heads.
    """
    adapted = _converted(original, converted)
    ids = tokens if isinstance(tokens, torch.Tensor) else original.to_tokens(tokens)
    saved = (_dtype(original), adapted.cfg.dtype)
    verdicts = []
    try:
        for dtype in dtypes:
            # (cast outside inference mode: the parameters must stay usable for autograd)
            original.to(dtype, print_details=False)
            converted.to(dtype, print_details=False)
            adapted = analysis_model(converted, neuron_heads=False)  # facts of this dtype
            verdicts.append(_verdict(original, adapted, ids, dtype, tolerance))
    finally:
        original.to(saved[0], print_details=False)
        converted.to(saved[1], print_details=False)
    return verdicts


def _converted(original: Any, converted: Any) -> AttnOnlyModel:
    """``converted``'s adapter, after refusing what cannot be verified (before any work)."""
    adapted = analysis_model(converted, neuron_heads=False)
    if not adapted.is_converted:
        raise TypeError(
            f"converted must be converted (an AttnOnlyTransformer, or a TransformerBridge after "
            f"tl_attnonly.convert(bridge)), got an unconverted {type(converted).__name__}; build "
            "it with tl_attnonly.convert(model)."
        )
    if original is converted:
        raise TypeError(
            "original and converted are the same object: a bridge converts in place, so compare "
            "it with a second, unconverted bridge of the same weights (or use "
            "tl_attnonly.cli.bridge_demo.verify_bridge_conversion(load, tokens), which loads one)."
        )
    if analysis_model(original, neuron_heads=False).is_converted:
        raise TypeError(
            f"original must be the model before conversion, got a converted "
            f"{type(original).__name__}: comparing two converted models checks nothing."
        )
    return adapted


def _dtype(model: Any) -> torch.dtype:
    return analysis_model(model, neuron_heads=False).cfg.dtype


def _verdict(
    original: Any,
    converted: AttnOnlyModel,
    tokens: torch.Tensor,
    dtype: torch.dtype,
    tolerance: float | None,
) -> Verdict:
    n_layers = converted.cfg.n_layers
    matches = ((name, HEAD_HOOK.fullmatch(name)) for name in converted.hook_dict)
    head_hooks = [(name, match) for name, match in matches if match is not None]
    fired: set[int] = set()

    def record(layer: int) -> Callable[..., None]:
        def hook(act: torch.Tensor, hook: Any) -> None:
            fired.add(layer)

        return hook

    hooks = [(name, record(int(match[1]))) for name, match in head_hooks]
    heads_run = _run_with_cache(converted.model, tokens, hooks)
    missing = [f"blocks.{layer}.mlp" for layer in range(n_layers) if layer not in fired]
    if missing:  # the neuron-heads did not run: never report a PASS for that
        raise RuntimeError(
            f"The converted model's neuron-head hooks (hook_z) did not fire in "
            f"{', '.join(missing)}: those MLPs did not run as neuron-heads. Please report this."
        )
    reference_run = _run_with_cache(original, tokens)
    table = _table(reference_run, heads_run)
    layers = converted.neuron_heads
    name = REFERENCE_NAMES.get(converted.kind, "original")
    ref_logits = reference_run[0]
    if any(layer.coefficients.method != "exact" for layer in layers):
        name += " with the heads' activation"
        coefficients = [layer.coefficients for layer in layers]
        head_activation = _head_activation_hooks(coefficients, converted.cfg.gated_mlp)
        with torch.inference_mode():
            ref_logits = original.run_with_hooks(tokens, fwd_hooks=head_activation)
    with torch.inference_mode():
        plain = converted.model(tokens)
    diff = max(
        (logits.double() - ref_logits.double()).abs().max().item()
        for logits in (heads_run[0], plain)
    )
    if tolerance is None:
        scale = max(1.0, ref_logits.abs().max().item())
        bound = RELATIVE_TOLERANCE.get(dtype, 1e-2) * scale
    else:
        bound = float(tolerance)
    approx = float(table.loc[table["activation"] == "logits", "max_abs_diff"].iloc[0])
    return Verdict(dtype, diff, bound, name, approx, table)


def _head_activation_hooks(
    coefficients: Sequence[NeuronHeadCoefficients], gated: bool
) -> list[tuple[str, Callable[..., Any]]]:
    """Hooks that make an unconverted model's MLPs use the heads' activation instead of their own.

    ``hook_post`` gains ``(heads(pre) - act(pre))``, times the linear branch for a gated MLP, so
    whatever else the MLP adds there (a gated MLP's ``b_in``) is kept. Each hook knows its layer by
    closure (a bridge's aliased hooks carry their target's name, e.g. ``blocks.0.mlp.out.hook_in``
    for ``blocks.0.mlp.hook_post`` on TransformerLens 4.x).

    Args:
        coefficients: Each layer's coefficients.
        gated: Whether the MLPs are gated (``hook_pre_linear``: the linear branch).
    """
    saved: dict[tuple[int, str], torch.Tensor] = {}

    def save(layer: int, kind: str) -> Callable[..., None]:
        def hook(act: torch.Tensor, hook: Any) -> None:
            saved[layer, kind] = act

        return hook

    def replace_post(layer: int) -> Callable[..., torch.Tensor]:
        def hook(post: torch.Tensor, hook: Any) -> torch.Tensor:
            pre = saved[layer, "pre"]
            delta = coefficients[layer].evaluate(pre) - coefficients[layer].reference(pre)
            if gated:
                delta = delta * saved[layer, "pre_linear"]
            return post + delta

        return hook

    hooks: list[tuple[str, Callable[..., Any]]] = []
    for layer in range(len(coefficients)):
        mlp = f"blocks.{layer}.mlp."
        hooks.append((mlp + "hook_pre", save(layer, "pre")))
        if gated:
            hooks.append((mlp + "hook_pre_linear", save(layer, "pre_linear")))
        hooks.append((mlp + "hook_post", replace_post(layer)))
    return hooks


__all__ = [
    "HEAD_HOOK",
    "HOOK_GROUPS",
    "REFERENCE_NAMES",
    "RELATIVE_TOLERANCE",
    "Verdict",
    "equivalence_table",
    "verify_conversion",
]
