"""A found circuit (:class:`Circuit`: its edges, metrics, evidence, report) and faithfulness.

:class:`Circuit` is drawn by :func:`tl_attnonly.vis.circuit.circuit_figure`, which sits above
``analysis/``; so that ``analysis/`` imports nothing from ``vis/`` (not even inside a function),
``tl_attnonly.vis.circuit`` registers that function here (:func:`register_figure_builder`) when
it is imported (``import tl_attnonly.vis`` does), and :meth:`Circuit.figure` calls it; with no
builder registered it refuses, saying what to import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from tl_attnonly.analysis.discovery.atlas_links import AtlasLocation, atlas_pages, atlas_url
from tl_attnonly.analysis.discovery.circuit_export import circuit_to_graph_json, circuit_to_mib
from tl_attnonly.analysis.discovery.circuit_io import load_circuit, save_circuit
from tl_attnonly.analysis.discovery.edge_scores import EdgeScores
from tl_attnonly.analysis.discovery.graph import HeadGraph
from tl_attnonly.analysis.discovery.pruning import mask_size, metric_direction, ranking_values
from tl_attnonly.analysis.discovery.sites import Mask

#: What :meth:`Circuit.figure` calls: set by :mod:`tl_attnonly.vis.circuit` on import.
_figure_builder: Callable[..., Any] | None = None


def register_figure_builder(builder: Callable[..., Any]) -> None:
    """Set what :meth:`Circuit.figure` calls, ``builder(circuit, **kwargs)`` (done by
    :mod:`tl_attnonly.vis.circuit` on import)."""
    global _figure_builder
    _figure_builder = builder


def faithfulness(metric_circuit: float, metric_clean: float, metric_corrupted: float) -> float:
    """``(circuit - corrupted) / (clean - corrupted)``: 1 for the full graph, 0 for the empty."""
    denom = metric_clean - metric_corrupted
    if denom == 0:
        raise ZeroDivisionError(
            "The metric is the same on the clean and corrupted inputs; faithfulness is undefined. "
            "Choose inputs (or a metric) that tell them apart."
        )
    return (metric_circuit - metric_corrupted) / denom


@dataclass
class Circuit:
    """A circuit found by :func:`discover_circuit`.

    Attributes:
        scores: Every edge's score (:class:`EdgeScores`).
        mask: The edges kept.
        metric_clean, metric_corrupted, metric_circuit: The metric of the clean run, the
            corrupted run and the circuit run (exact).
        faithfulness: ``(circuit - corrupted) / (clean - corrupted)``.
        gate_value: Per neuron of the circuit, the exact gate/value split of its incoming circuit
            edges (:func:`circuit_gate_value_split`), or None.
        extra: What the search adds (see :func:`~tl_attnonly.analysis.discover_circuit`).
        ceiling: Faithfulness of the graph's every edge (the most any circuit of it can reach).
        curve: The sweep's exact runs: ``top_n, edges, metric, faithfulness`` per size.
        node_patching: Faithfulness of plain node patching of the circuit's nodes (their clean
            outputs in the corrupted run, every other node recomputed), a baseline.
        warnings: What makes the reading doubtful (low ceiling, a curve that falls as edges are
            added, a gate/value row with no edge of that kind); also issued as warnings.
        mlp_split: Per MLP node with named neurons, the exact effect (faithfulness units) of
            removing the named neurons' outgoing edges, the remainder's, and the layer's.
    """

    scores: EdgeScores
    mask: Mask
    metric_clean: float
    metric_corrupted: float
    metric_circuit: float
    faithfulness: float
    gate_value: pd.DataFrame | None = None
    extra: dict = field(default_factory=dict)
    ceiling: float | None = None
    curve: pd.DataFrame | None = None
    node_patching: float | None = None
    warnings: list[str] = field(default_factory=list)
    mlp_split: pd.DataFrame | None = None

    @property
    def graph(self) -> HeadGraph:
        return self.scores.graph

    def edges(self) -> pd.DataFrame:
        """The circuit's edges, sorted by |score|."""
        return self.scores.frame(self.mask)

    def nodes(self) -> list[str]:
        """Labels of the nodes with an edge in the circuit (sources and readers)."""
        frame = self.edges()
        return sorted(set(frame.source) | set(frame.target))

    def opposing(self, n: int = 10) -> pd.DataFrame:
        """The ``n`` edges left out of the circuit with the largest estimated effect *against*
        the clean behaviour (a negative name mover's direct effect, say): what a circuit ranked
        by signed effect (``ranking="signed"``) leaves out by design. Columns as :meth:`edges`,
        most opposing first; ``score`` is the edge's estimated change of the metric. (On a
        circuit with named neurons these are the named-neuron graph's scores; the ranking's are
        ``circuit.extra["coarse"].opposing()``, which :meth:`report` prints.)
        """
        direction = metric_direction(self.metric_clean, self.metric_corrupted)
        left_out = {}
        for key, toward_clean in ranking_values(self.scores, "signed").items():
            keep = (toward_clean < 0) & ~self.mask[key].to(torch.bool)
            if keep.any():
                cut = toward_clean.masked_fill(~keep, 0.0).flatten()
                smallest = cut.topk(min(n, int(keep.sum())), largest=False).indices
                only = torch.zeros_like(keep).flatten()
                only[smallest] = True
                keep = only.view_as(keep)
            left_out[key] = keep
        frame = self.scores.frame(left_out)
        order = (frame.score * direction).sort_values(kind="stable").index
        return frame.loc[order].head(n).reset_index(drop=True)

    def figure(self, **kwargs: Any) -> Any:
        """Plotly figure (:func:`tl_attnonly.vis.circuit.circuit_figure`; same keywords:
        ``atlas=`` links its MLP nodes to their pages in a neuron atlas)."""
        if _figure_builder is None:
            raise RuntimeError(
                "Circuit.figure() draws with tl_attnonly.vis, which is not imported yet: run "
                "`import tl_attnonly.vis` (it registers circuit_figure) and call figure() again, "
                "or call tl_attnonly.vis.circuit_figure(circuit) directly."
            )
        return _figure_builder(self, **kwargs)

    def save(
        self,
        path: str | Path,
        *,
        model: Any = None,
        clean_tokens: torch.Tensor | None = None,
        corrupted_tokens: torch.Tensor | None = None,
    ) -> Path:
        """Write the circuit to the directory ``path``: ``circuit.json`` (what a person reads:
        versions, the model's architecture, sizes and dtype, the graph, every field) and
        ``tensors.safetensors`` (scores, masks, tokens). :meth:`load` reads it back exactly.

        Args:
            path: A directory (created).
            model: The model it was found on: recorded, and checked when loading.
            clean_tokens, corrupted_tokens: The task's tokens ``[batch, pos]``, stored too
                (:func:`~.circuit_io.saved_record` reads them).

        Returns:
            The directory.
        """
        return save_circuit(
            self, path, model=model, clean_tokens=clean_tokens, corrupted_tokens=corrupted_tokens
        )

    @classmethod
    def load(cls, path: str | Path, model: Any = None) -> Circuit:
        """A circuit :meth:`save` wrote, equal to the saved one.

        Args:
            path: The directory.
            model: Refuse the file unless it was saved for a model of this architecture, sizes
                and dtype (None: no check; the graph is rebuilt from the saved shape).

        Raises:
            CircuitFileError: A missing, truncated or edited file (naming the file and key), or
                a model that is not the saved one (naming the field).
        """
        return load_circuit(path, model, make=cls)

    def to_mib(
        self,
        path: str | Path | None = None,
        *,
        level: str = "node",
        model: Any = None,
        d_model: int | None = None,
    ) -> dict[str, Any]:
        """The circuit in MIB's circuit format, ``{"cfg", "nodes", "edges"}`` as
        ``eap.graph.Graph.from_json`` reads it (:func:`~.circuit_export.circuit_to_mib`: the
        mapping; ``level="neuron"`` is refused, MIB's neurons being output dimensions).

        Args:
            path: Write the JSON there too.
            level: ``"node"`` (heads and whole MLP layers, as MIB's graph has them).
            model, d_model: The model it was found on, or its ``d_model`` (MIB's cfg needs it).
        """
        return circuit_to_mib(self, path, level=level, model=model, d_model=d_model)

    def to_graph_json(self, path: str | Path | None = None, **kwargs: Any) -> dict[str, Any]:
        """The circuit as a circuit-tracer / Neuronpedia attribution graph (``metadata``,
        ``qParams``, ``nodes``, ``links``; :func:`~.circuit_export.circuit_to_graph_json`: the
        keywords, node roles and ``ctx_idx``). ``path``: a directory circuit-tracer's local server
        serves (``{slug}.json`` and ``graph-metadata.json``)."""
        return circuit_to_graph_json(self, path, **kwargs)

    def experts_used(
        self, model: Any, clean_tokens: torch.Tensor, corrupted_tokens: torch.Tensor, **kwargs: Any
    ) -> dict[int, torch.Tensor]:
        """The experts each token was routed to in this circuit's exact run, ``{layer: [batch,
        pos, top_k]}`` (:func:`~.circuit_routing.circuit_experts_used`: its keywords): routing is
        recomputed from each run's own input, so the circuit's can differ from the clean run's."""
        from tl_attnonly.analysis.discovery.circuit_routing import circuit_experts_used

        return circuit_experts_used(model, self, clean_tokens, corrupted_tokens, **kwargs)

    def report(self, atlas: AtlasLocation | None = None) -> str:
        """The circuit and its evidence as text: metrics, ceiling, faithfulness (coarse and with
        named neurons), node-patching baseline, the sweep's curve, the curve on MIB's grid with
        its CPR and CMD, the MLP split, the gate/value table, the attention heads, the
        warnings.

        Args:
            atlas: Where a neuron atlas of the model is (a URL or relative path as a string, a
                folder as a ``Path``: :func:`~.atlas_links.atlas_url`); adds a section listing
                each named neuron and MLP layer node with the URL of its atlas page
                (:meth:`atlas_pages`).
        """

        def table(frame: pd.DataFrame, digits: int = 3) -> str:
            return frame.to_string(index=False, float_format=lambda v: f"{v:.{digits}f}")

        from tl_attnonly.analysis.discovery.counts import (
            KV_GROUP_LEGEND,
            LATENT_ATTN_LEGEND,
            WHOLE_MLP_NOTE,
            circuit_counts,
            counts_text,
        )

        coarse = self.extra.get("coarse")
        counts = circuit_counts(self)
        lines = [
            repr(self),
            "counts (as in the figures): " + counts_text(counts),
            f"metric: clean {self.metric_clean:.4g}, corrupted {self.metric_corrupted:.4g}",
        ]
        if counts["kv_groups"]:
            lines.insert(2, KV_GROUP_LEGEND)
        if counts["latent_attn_inputs"]:
            lines.insert(2, LATENT_ATTN_LEGEND)
        if counts["mlp_layers"] and not counts["named_neurons"]:
            lines.append(WHOLE_MLP_NOTE)
        if self.ceiling is not None:
            n_all = (coarse if coarse is not None else self).graph.n_edges()
            lines.append(f"ceiling (all {n_all:,} edges of its graph): {self.ceiling:.3f}")
        if coarse is not None and coarse is not self:
            lines.append(
                f"coarse circuit: {mask_size(coarse.mask):,} edges, faithfulness "
                f"{coarse.faithfulness:.3f}; with named neurons: {mask_size(self.mask):,} edges, "
                f"faithfulness {self.faithfulness:.3f}"
            )
        if "faithfulness_named_only" in self.extra:
            share = self.extra.get("named_share")
            lines.append(
                "named neurons only (every remainder's outgoing edges removed): faithfulness "
                f"{self.extra['faithfulness_named_only']:.3f}"
                + ("" if share is None else f" ({share:.0%} of the MLP layers' effect)")
            )
        if "swept" in self.extra:
            swept, steps = self.extra["swept"], self.extra["pruning"]
            base = coarse if coarse is not None else self
            lines.append(
                f"sweep's top-n circuit: {swept['edges']:,} edges, faithfulness "
                f"{swept['faithfulness']:.3f}; pruned by {len(steps)} exact runs to "
                f"{mask_size(base.mask):,} edges, faithfulness {base.faithfulness:.3f}"
            )
        if self.node_patching is not None:
            lines.append(
                f"node patching of the circuit's sources (baseline): {self.node_patching:.3f}"
            )
        if self.curve is not None:
            lines += ["faithfulness vs size (exact runs):", table(self.curve)]
        if "mib_curve" in self.extra:
            lines += [
                f"on MIB's grid of sizes (top-k of the ranking, exact runs): CPR "
                f"{self.extra['mib_cpr']:.3f} (area under faithfulness; higher recovers more), "
                f"CMD {self.extra['mib_cmd']:.3f} (area under |1 - faithfulness|; lower is "
                "closer to the model)",
                table(self.extra["mib_curve"]),
            ]
        if self.mlp_split is not None:
            lines += [
                "MLP nodes: effect of the named neurons, the remainder, the layer (faithfulness)",
                table(self.mlp_split),
            ]
        if "neuron_stage" in self.extra:
            stage = self.extra["neuron_stage"]
            what = (
                "share lost when cut alone"
                if "share_alone" in stage
                else "faithfulness after each layer, exact runs"
            )
            runs = self.extra.get("neuron_stage_runs")
            lines += [
                f'neurons_per_mlp="auto": named per MLP node, remainder kept and its share, {what}'
                + ("" if runs is None else f" ({runs} exact runs)"),
                table(stage),
            ]
        if self.gate_value is not None:
            lines += [
                "gate/value split (metric units; NaN: no edge of that kind kept)",
                table(self.gate_value, 4),
            ]
        # what the ranking left out: the coarse circuit's (its scores ranked the sweep)
        opposing = (coarse if coarse is not None else self).opposing(5)
        if len(opposing):
            lines += [
                "largest edges against the behaviour left out (estimated change of the metric):",
                ", ".join(f"{r.edge} {r.score:+.3f}" for r in opposing.itertuples()),
            ]
        heads = sorted(
            {n for n in self.nodes() if "H" in n},
            key=lambda h: tuple(int(x) for x in h[1:].split("H")),
        )
        lines.append(f"attention heads ({len(heads)}): " + ", ".join(heads))
        if atlas is not None:
            lines += self._atlas_lines(atlas)
        if "seconds" in self.extra:
            lines.append(
                "time: " + ", ".join(f"{k} {v:.0f} s" for k, v in self.extra["seconds"].items())
            )
        lines.append("warnings: " + ("; ".join(self.warnings) if self.warnings else "none"))
        return "\n".join(lines)

    def atlas_pages(self, atlas: AtlasLocation) -> dict[str, str]:
        """The atlas page of each of its nodes that has one: ``{label: URL}``, the named neurons
        first (in :func:`~.counts.named_neurons`' order), then its other nodes by layer (its
        neuron-heads and MLP layer nodes: :func:`~.atlas_links.atlas_page` says which).

        Args:
            atlas: Where a neuron atlas of the model is (a URL or relative path as a string, a
                folder as a ``Path``: :func:`~.atlas_links.atlas_url`).
        """
        from tl_attnonly.analysis.discovery.counts import kind_layer, named_neurons

        named = named_neurons(self)
        others = sorted(
            (n for n in self.nodes() if n not in named), key=lambda n: (kind_layer(n)[1], n)
        )
        return atlas_pages([*named, *others], atlas)

    def _atlas_lines(self, atlas: AtlasLocation) -> list[str]:
        """:meth:`report`'s section of atlas pages (:meth:`atlas_pages`)."""
        pages = self.atlas_pages(atlas)
        width = max(map(len, pages), default=0)
        return [
            f"atlas pages of its named neurons and MLP nodes ({len(pages)}, atlas "
            f"{atlas_url(atlas)}):",
            *(f"  {label:<{width}}  {url}" for label, url in pages.items()),
        ]

    def __repr__(self) -> str:
        return (
            f"Circuit({mask_size(self.mask)} edges, {len(self.nodes())} nodes, faithfulness="
            f"{self.faithfulness:.4g}, metric clean={self.metric_clean:.4g} corrupted="
            f"{self.metric_corrupted:.4g} circuit={self.metric_circuit:.4g}"
            + (f", ceiling={self.ceiling:.4g}" if self.ceiling is not None else "")
            + ("" if self.node_patching is None else f", node patching={self.node_patching:.4g}")
            + (f", {len(self.warnings)} warning(s)" if self.warnings else "")
            + ")"
        )


__all__ = ["Circuit", "faithfulness", "register_figure_builder"]
