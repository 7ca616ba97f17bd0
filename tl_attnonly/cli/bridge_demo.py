"""What the demo needs that is specific to a TransformerBridge: a bridge converts in place.

The equivalence check (:func:`tl_attnonly.verify.verify_conversion`) and the report
(:func:`tl_attnonly.report.write_demo_report`) serve both model kinds. A bridge differs in one
fact: :func:`tl_attnonly.convert` converts it in place, so its reference is a second bridge of the
same weights. :func:`verify_bridge_conversion` builds both from a loader, per dtype.

Kept under their documented names: :func:`write_bridge_report` (the full report of a converted
bridge) and :func:`self_weight_figure` (one plotly heatmap of a layer's neuron-heads' weight on
self; :func:`tl_attnonly.vis.neuron_head_strips` draws both weights for many heads).

It lives with the command line because it uses the tools (verify, report, vis), which sit above
the bridge form; ``tl_attnonly.bridge.demo``, its old path, is a deprecated alias.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go
import torch

from tl_attnonly.bridge.convert import convert_bridge
from tl_attnonly.options import ConversionOptions
from tl_attnonly.verify import Verdict, verify_conversion

#: Neuron-heads per layer in :func:`self_weight_figure`.
REPORT_TOP_K = 32


def verify_bridge_conversion(
    load: Callable[[torch.dtype], Any],
    tokens: torch.Tensor | str,
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.float64),
    options: ConversionOptions | None = None,
    tolerance: float | None = None,
) -> list[Verdict]:
    """Check that a converted bridge computes what the unconverted one does, per dtype.

    For each dtype, ``load(dtype)`` is called twice: the first bridge is the reference, the
    second is converted in place (:func:`~tl_attnonly.bridge.convert_bridge`) and checked against
    the first with :func:`tl_attnonly.verify.verify_conversion` (exact activations: against the
    unconverted bridge; ReLU / GELU: against the unconverted bridge with the heads' activation; a
    bridge whose neuron-heads did not run raises).

    Args:
        load: ``dtype -> TransformerBridge`` (unconverted), e.g.
            ``lambda dtype: load_bundled_bridge(dtype=dtype)``.
        tokens: Token ids ``[batch, pos]`` or text (tokenised by the bridge).
        dtypes: The dtypes to check in.
        options: Conversion options.
        tolerance: Bound on ``max |Δlogits|``; default
            ``tl_attnonly.verify.RELATIVE_TOLERANCE[dtype] * max(1, max |logits|)``.

    Returns:
        One :class:`~tl_attnonly.verify.Verdict` per dtype.
    """
    verdicts = []
    for dtype in dtypes:
        reference = load(dtype)
        converted = convert_bridge(load(dtype), options, progress=False)
        verdicts += verify_conversion(reference, converted, tokens, [dtype], tolerance)
    return verdicts


def write_bridge_report(
    bridge: Any,
    prompt: str,
    path: str | Path,
    *,
    equivalence: dict[str, pd.DataFrame],
    model_name: str,
    top_k: int = REPORT_TOP_K,
) -> Path:
    """The full report (:func:`tl_attnonly.report.write_demo_report`) of a converted bridge,
    given its equivalence tables (e.g. ``{"float64": verdict.table}``)."""
    from tl_attnonly.report import write_demo_report

    return write_demo_report(
        None,
        bridge,
        prompt,
        path,
        equivalence=equivalence,
        top_k=top_k,
        model_name=model_name,
        progress=False,
    )


def self_weight_figure(
    cache: Any,
    layer: int,
    str_tokens: Sequence[str],
    top_k: int = REPORT_TOP_K,
    n_heads_per_neuron: int | None = None,
) -> go.Figure:
    """A plotly heatmap of one layer's most active neuron-heads (rows, most active first: largest
    ``max |z|``) over the tokens (columns, labelled): each cell is the head's weight on its own
    token (its weight on the bias token is 1 minus that). Read from the cache of a converted
    model of either kind (``hook_pattern``, ``hook_z``; batch 0).

    For many heads with both weights per token see
    :func:`tl_attnonly.vis.neuron_head_strips`.

    Args:
        cache: ``run_with_cache`` of a converted model holding the layer's ``hook_pattern`` and
            ``hook_z``.
        layer: The layer.
        str_tokens: The prompt's tokens (labels).
        top_k: Heads drawn.
        n_heads_per_neuron: Unused (read from the cache's model); kept for old calls.
    """
    from tl_attnonly.hooks import neuron_head_label
    from tl_attnonly.vis.figures import tick_label
    from tl_attnonly.vis.patterns import rank_neuron_heads
    from tl_attnonly.vis.sources import converted_model_of, weights_and_z

    k = converted_model_of(cache).n_heads_per_neuron
    heads = rank_neuron_heads(cache, layer, None, top_k, "z", 0, "head")
    pattern, _ = weights_and_z(cache, layer, heads, len(str_tokens), 0)
    fig = go.Figure(
        go.Heatmap(
            z=pattern[..., 0],
            x=list(range(len(str_tokens))),
            y=[neuron_head_label(layer, h, k) for h in heads],
            zmin=0,
            zmax=1,
            colorscale="Reds",
            colorbar=dict(title="on self"),
            hovertemplate="%{y} at token %{x}<br>weight on self %{z:.3f}<extra></extra>",
        )
    )
    fig.update_layout(
        title=f"Layer {layer}: weight on self of the {len(heads)} most active neuron-heads "
        "(1 - weight on the bias token)",
        height=max(300, 16 * len(heads) + 150),
        xaxis=dict(
            title="token",
            tickmode="array",
            tickvals=list(range(len(str_tokens))),
            ticktext=[tick_label(t) for t in str_tokens],
            tickangle=-60,
        ),
        yaxis=dict(autorange="reversed", title="neuron-head", type="category"),
    )
    return fig


__all__ = ["REPORT_TOP_K", "self_weight_figure", "verify_bridge_conversion", "write_bridge_report"]
