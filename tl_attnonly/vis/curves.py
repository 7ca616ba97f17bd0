"""A found circuit's faithfulness against its size (:func:`faithfulness_curve_figure`).

``discover_circuit`` measures, by exact runs, the faithfulness of the top-``k`` circuits of its
edge ranking at MIB's grid of edge fractions (``circuit.extra["mib_curve"]``, with the curve's
areas CPR and CMD: :mod:`tl_attnonly.analysis.discovery.scoring`) and at the sweep's sizes
(``circuit.curve``). The figure draws both against the number of edges, with the full model's
faithfulness (1) and the found circuit itself.
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from tl_attnonly.analysis.discovery.pruning import mask_size


def faithfulness_curve_figure(circuit: Any, *, width: int = 720, height: int = 420) -> go.Figure:
    """Faithfulness against circuit size: MIB's grid (with CPR and CMD in the title), the sweep's
    sizes and the found circuit.

    Args:
        circuit: A :class:`~tl_attnonly.analysis.Circuit` from ``discover_circuit`` (with
            ``mib_curve=True``, the default, or a sweep: ``circuit.curve``).
        width, height: The figure's size in pixels.

    Returns:
        A plotly figure: x the circuit's edges (log scale), y its faithfulness (exact runs).

    Raises:
        ValueError: If the circuit has neither curve (it was built by hand, or with
            ``mib_curve=False`` and no sweep).
    """
    extra = getattr(circuit, "extra", None) or {}
    mib, sweep = extra.get("mib_curve"), getattr(circuit, "curve", None)
    if mib is None and sweep is None:
        raise ValueError(
            "This circuit has no faithfulness curve: discover_circuit(..., mib_curve=True) (the "
            "default) measures one on MIB's grid of sizes, and its sweep another."
        )
    fig = go.Figure()
    if mib is not None:
        fig.add_trace(
            go.Scatter(
                x=[max(1, e) for e in mib["edges"]], y=list(mib["faithfulness"]),
                mode="lines+markers", name="MIB's grid (top-k of the ranking)",
                customdata=list(mib["fraction"]),
                hovertemplate="%{x} edges (fraction %{customdata})<br>faithfulness %{y:.3f}",
            )
        )  # fmt: skip
    if sweep is not None:
        fig.add_trace(
            go.Scatter(
                x=[max(1, e) for e in sweep["edges"]], y=list(sweep["faithfulness"]),
                mode="markers", name="the sweep's sizes", marker=dict(symbol="x"),
                hovertemplate="%{x} edges<br>faithfulness %{y:.3f}",
            )
        )  # fmt: skip
    fig.add_trace(
        go.Scatter(
            x=[max(1, mask_size(circuit.mask))], y=[circuit.faithfulness], mode="markers",
            name="the circuit found", marker=dict(size=12, symbol="star", color="#d62728"),
            hovertemplate="%{x} edges<br>faithfulness %{y:.3f}",
        )
    )  # fmt: skip
    fig.add_hline(y=1.0, line_dash="dot", line_color="#888", annotation_text="the model")
    fig.add_hline(y=0.0, line_dash="dot", line_color="#bbb")
    title = "Faithfulness against circuit size (exact runs)"
    if mib is not None:
        cpr, cmd = extra["mib_cpr"], extra["mib_cmd"]
        title += f"<br><sup>MIB's grid: CPR {cpr:.3f}, CMD {cmd:.3f}</sup>"
    fig.update_layout(
        title=title, width=width, height=height, template="plotly_white",
        xaxis=dict(title="edges in the circuit", type="log"),
        yaxis=dict(title="faithfulness"), legend=dict(orientation="h", y=-0.2),
    )  # fmt: skip
    return fig


__all__ = ["faithfulness_curve_figure"]
