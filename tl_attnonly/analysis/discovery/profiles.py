"""Profiles of a circuit's named neurons: gate/value split, top dataset contexts, sign quadrants.

:func:`neuron_profiles` takes a :class:`~tl_attnonly.analysis.Circuit` (from
:func:`~tl_attnonly.analysis.discover_circuit`) and, for each neuron named in it
(:func:`named_neurons`: the ``L{l}N{i}`` nodes, in the order the neuron stage named them), puts
in one table (:attr:`NeuronProfiles.table`):

a. **gate/value split**: the circuit's own exact split (``circuit.gate_value``:
   :func:`~tl_attnonly.analysis.circuit_gate_value_split`); neurons it left out
   (``max_gate_value_neurons``) are split here when the clean and corrupted tokens and the metric
   are given, else their cells are NaN and ``gate_value_from`` says ``"not measured"``;
b. **top dataset contexts** over a corpus (default the bundled prompts,
   :func:`tl_attnonly.corpora.load_prompts`), streamed as
   :func:`~tl_attnonly.analysis.summarize_neuron_heads` streams it (the same row splitting and
   top-k merge), ranked by ``|output|``, the neuron's product ``o = sum_k z_k`` (what it writes
   along ``W_out[i]``: ``act_K(pre)`` for a plain MLP, ``act_K(g) * u`` for a gated one, its
   bias excluded); also its firing fraction (the mean of its heads' weight on themselves above
   1/2), its mean output and the tokens it writes most on;
c. **sign quadrants** for gated neurons (GLUScope): every corpus position falls in one of
   :data:`QUADRANTS` by the sign of the gate pre-activation ``g`` (``hook_pre``) and of the
   linear branch ``u`` (``hook_pre_linear``), ``+`` meaning ``> 0`` and ``-`` ``<= 0``; per
   quadrant the share of positions (``share_*``), its part of the mean output (``output_*``:
   the quadrant's sum of ``o`` over all positions, so the four add up to ``mean_output``), its
   share of ``sum |o|`` (``abs_share_*``) and its top contexts (:meth:`NeuronProfiles.contexts`).

:meth:`NeuronProfiles.figure` draws the neuron circuit
(:func:`tl_attnonly.vis.neuron_circuit.neuron_circuit_figure`, registered when
:mod:`tl_attnonly.vis` is imported, as :meth:`Circuit.figure` is).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch
from jaxtyping import Int

from tl_attnonly._types import tokens_on_model_device
from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.discovery.circuit import Circuit
from tl_attnonly.analysis.discovery.counts import named_neurons
from tl_attnonly.analysis.discovery.gate_value import circuit_gate_value_split
from tl_attnonly.analysis.discovery.graph import HeadGraph
from tl_attnonly.analysis.discovery.profile_stats import (
    ALL,
    NEURON_LABEL,
    QUADRANTS,
    collect_stats,
    parse_neuron_label,
    profile_examples,
    top_tokens_text,
)
from tl_attnonly.analysis.summaries.collect import SummaryOptions, summary_options
from tl_attnonly.analysis.task import DiscoveryTask

if TYPE_CHECKING:
    from tl_attnonly.analysis.discovery.positions import PositionClasses
    from tl_attnonly.analysis.discovery.sites import DiscoveryMetric
    from tl_attnonly.protocol import ModelLike

#: :func:`neuron_profiles`' own defaults for the corpus pass (fewer, shorter contexts and no
#: progress bar, unlike :class:`~tl_attnonly.analysis.SummaryOptions`' defaults).
PROFILE_OPTIONS = SummaryOptions(
    k=5, before=8, after=2, max_len=None, batch_size=16, max_rows=None, token_stats=True,
    max_bytes=2**30, progress=False,
)  # fmt: skip

#: The columns of the gate/value split copied from ``circuit.gate_value``.
GATE_VALUE_COLUMNS = ("gate", "value", "both", "interaction", "n_gate_edges", "n_value_edges")

#: What :meth:`NeuronProfiles.figure` calls: set by :mod:`tl_attnonly.vis.neuron_circuit`.
_figure_builder: Callable[..., Any] | None = None


def register_profiles_figure_builder(builder: Callable[..., Any]) -> None:
    """Set what :meth:`NeuronProfiles.figure` calls, ``builder(profiles, **kwargs)`` (done by
    :mod:`tl_attnonly.vis.neuron_circuit` on import)."""
    global _figure_builder
    _figure_builder = builder


@dataclass
class NeuronProfiles:
    """What :func:`neuron_profiles` returns.

    Attributes:
        table: One row per named neuron (module docstring): ``neuron, layer, index, gated``, the
            gate/value split (:data:`GATE_VALUE_COLUMNS`, ``gate_value_from``),
            ``firing_fraction, mean_output, max_abs_output, top_tokens, top_contexts`` and, per
            quadrant ``q`` of :data:`QUADRANTS`, ``share_q, output_q, abs_share_q`` (NaN for a
            neuron of a plain MLP).
        examples: Every kept context: ``neuron, ranking`` (:data:`ALL` or a quadrant), ``rank,
            output`` (``o`` at the centre), ``self_weight`` (its heads' mean weight on
            themselves there), ``document`` (token row, streaming order), ``position, token,
            text`` (the window, centre in brackets ``⟦ ⟧``).
        circuit: The circuit profiled.
        n_positions, n_rows: Corpus positions and token rows seen.
        notes: What limits the reading (neurons whose split was not measured, ...).
    """

    table: pd.DataFrame
    examples: pd.DataFrame
    circuit: Circuit
    n_positions: int
    n_rows: int
    notes: list[str] = field(default_factory=list)

    @property
    def neurons(self) -> list[str]:
        return list(self.table.neuron)

    def row(self, neuron: str) -> pd.Series:
        """The table's row of ``neuron``."""
        rows = self.table[self.table.neuron == neuron]
        if rows.empty:
            raise KeyError(f"{neuron!r} is not profiled; the profiled neurons are {self.neurons}.")
        return rows.iloc[0]

    def contexts(self, neuron: str, ranking: str = ALL) -> pd.DataFrame:
        """Top contexts of ``neuron``: over every position (``ranking="all"``) or in a quadrant."""
        if ranking != ALL and ranking not in QUADRANTS:
            raise ValueError(f"ranking must be {ALL!r} or one of {QUADRANTS}, got {ranking!r}.")
        self.row(neuron)
        picked = self.examples[
            (self.examples.neuron == neuron) & (self.examples.ranking == ranking)
        ]
        return picked.reset_index(drop=True)

    def quadrants(self, neuron: str) -> pd.DataFrame:
        """One row per quadrant of a gated neuron: ``quadrant, share, output, abs_share``.

        Raises:
            ValueError: For a neuron of a plain MLP (one pre-activation, no quadrants).
        """
        row = self.row(neuron)
        if not row.gated:
            raise ValueError(
                f"{neuron} is a neuron of a plain MLP (one pre-activation): sign quadrants are "
                "defined for gated MLPs only (gate g and linear branch u)."
            )
        return pd.DataFrame(
            [
                dict(
                    quadrant=q,
                    share=row[f"share_{q}"],
                    output=row[f"output_{q}"],
                    abs_share=row[f"abs_share_{q}"],
                )
                for q in QUADRANTS
            ]
        )

    def figure(self, **kwargs: Any) -> Any:
        """Plotly figure of the neuron circuit
        (:func:`tl_attnonly.vis.neuron_circuit.neuron_circuit_figure`; same keywords)."""
        if _figure_builder is None:
            raise RuntimeError(
                "NeuronProfiles.figure() draws with tl_attnonly.vis, which is not imported yet: "
                "run `import tl_attnonly.vis` and call figure() again, or call "
                "tl_attnonly.vis.neuron_circuit_figure(profiles) directly."
            )
        return _figure_builder(self, **kwargs)

    def __repr__(self) -> str:
        return (
            f"NeuronProfiles({len(self.table)} neurons, {self.n_positions} positions in "
            f"{self.n_rows} rows" + (f", {len(self.notes)} note(s)" if self.notes else "") + ")"
        )


def _gate_value(
    circuit: Circuit,
    neurons: Sequence[str],
    task: DiscoveryTask | None,
    progress: bool,
    notes: list[str],
) -> pd.DataFrame:
    """The split of every neuron: the circuit's rows, the others measured here (or NaN)."""
    parts = []
    if circuit.gate_value is not None:
        have = circuit.gate_value[circuit.gate_value.node.isin(neurons)]
        parts.append(have.assign(gate_value_from="circuit"))
    done = set(parts[0].node) if parts else set()
    missing = [n for n in neurons if n not in done]
    if missing and task is not None:
        model = task.model
        graph = circuit.graph
        nodes = graph.node_labels() if graph.restricted else None
        again = HeadGraph(model, nodes=nodes, positions=graph.positions)
        if again.block_keys() != graph.block_keys():  # pragma: no cover - a guard, not a path
            raise RuntimeError("The circuit's graph could not be rebuilt from its node labels.")
        measured = circuit_gate_value_split(
            model, circuit.mask, task.clean, task.corrupted, task.metric, neurons=missing,
            nodes=nodes, batch_size=task.batch_size, progress=progress, positions=task.positions,
        )  # fmt: skip
        parts.append(measured.assign(gate_value_from="measured here"))
    elif missing:
        why = (
            "the circuit has no split (discover_circuit(..., gate_value=False))"
            if circuit.gate_value is None
            else "the circuit's split covers max_gate_value_neurons neurons"
        )
        notes.append(
            f"gate/value split not measured for {len(missing)} neuron(s) ({', '.join(missing[:5])}"
            f"{', ...' if len(missing) > 5 else ''}): {why}; pass clean_tokens, "
            "corrupted_tokens and metric to measure them (NaN in the table)."
        )
        nan = {c: [math.nan] * len(missing) for c in GATE_VALUE_COLUMNS}
        parts.append(pd.DataFrame({"node": missing, **nan, "gate_value_from": "not measured"}))
    parts = [part for part in parts if len(part)]
    return pd.concat(parts).set_index("node")


def neuron_profiles(
    model: ModelLike,
    circuit: Circuit,
    corpus: Iterable[str | torch.Tensor] | None = None,
    *,
    neurons: Sequence[str] | None = None,
    clean_tokens: Int[torch.Tensor, "batch pos"] | None = None,
    corrupted_tokens: Int[torch.Tensor, "batch pos"] | None = None,
    metric: DiscoveryMetric | None = None,
    positions: PositionClasses | None = None,
    run_batch_size: int | None = None,
    n_top_tokens: int = 3,
    min_token_count: int = 3,
    options: SummaryOptions | None = None,
    **overrides: Any,
) -> NeuronProfiles:
    """Profile every named neuron of ``circuit`` (module docstring): one table, one figure.

    Args:
        model: The model the circuit was found on (an :class:`~tl_attnonly.AttnOnlyTransformer`
            or a converted ``TransformerBridge``).
        circuit: From :func:`~tl_attnonly.analysis.discover_circuit` (neuron level).
        corpus: Strings and/or int token tensors (``[pos]`` or ``[batch, pos]``), as for
            :func:`~tl_attnonly.analysis.summarize_neuron_heads`; default the bundled prompts
            (:func:`tl_attnonly.corpora.load_prompts`).
        neurons: Which neurons (``"L3N17"``); default :func:`named_neurons` of the circuit.
        clean_tokens, corrupted_tokens, metric, positions: The circuit's data, to measure the
            gate/value split of neurons ``circuit.gate_value`` lacks (else NaN, with a note).
        run_batch_size: Examples per exact run of that split (``discover_circuit``'s
            ``batch_size``); default all at once.
        n_top_tokens: Tokens listed in ``top_tokens`` (largest mean ``|output|``).
        min_token_count: Tokens seen fewer times are not listed.
        options: A :class:`~tl_attnonly.analysis.SummaryOptions` with the corpus pass's options
            (default :data:`PROFILE_OPTIONS`, this function's own defaults: ``k=5``,
            ``before=8``, ``after=2``, ``progress=False``, the others ``SummaryOptions``'):
            ``k`` (top contexts kept per neuron and ranking: every position, each quadrant),
            ``before`` / ``after`` (context tokens kept around each top position), ``max_len``
            (longest token row, longer rows are split; default ``model.cfg.n_ctx``),
            ``batch_size`` (corpus rows per forward pass), ``max_rows`` (stop after this many
            rows), ``token_stats`` (record each neuron's mean output per token:
            ``top_tokens``), ``max_bytes`` (refuse, before any work, when the per-token
            statistics would need more) and ``progress`` (a bar over corpus rows).
        **overrides: Fields of ``options`` given one by one (they win), e.g. ``k=2``.

    Returns:
        :class:`NeuronProfiles`.

    Raises:
        TypeError: If ``circuit`` is not a :class:`~tl_attnonly.analysis.Circuit`.
        ValueError: For a head-level circuit, a circuit with no named neuron, a neuron the model
            lacks, a position-resolved circuit whose split must be measured without
            ``positions``, ``k`` or ``batch_size`` below 1, or ``before`` / ``after`` below 0.
        MemoryError: When the per-token statistics would need more than ``max_bytes``.
    """
    opts = summary_options(
        "neuron_profiles", PROFILE_OPTIONS if options is None else options, overrides
    )
    k, before, after, batch_size = opts.k, opts.before, opts.after, opts.batch_size
    token_stats, max_bytes = opts.token_stats, opts.max_bytes
    model = analysis_model(model)
    clean_tokens, corrupted_tokens = tokens_on_model_device(model, clean_tokens, corrupted_tokens)
    task = (
        None
        if clean_tokens is None or corrupted_tokens is None or metric is None
        else DiscoveryTask(
            model, clean_tokens, corrupted_tokens, metric, positions, batch_size=run_batch_size
        )
    )
    if not isinstance(circuit, Circuit):
        raise TypeError(
            f"neuron_profiles profiles a Circuit from discover_circuit, got "
            f"{type(circuit).__name__}."
        )
    if not circuit.graph.neuron_level:
        raise ValueError(
            "neuron_profiles reads neuron-level circuits (neuron_level=True, the default); this "
            "circuit's graph has neuron-heads 'L{l}N{i}.{k}' as nodes."
        )
    if k < 1 or batch_size < 1 or before < 0 or after < 0:
        raise ValueError(
            f"k and batch_size must be >= 1 and before, after >= 0; got k={k}, "
            f"batch_size={batch_size}, before={before}, after={after}."
        )
    chosen = list(neurons) if neurons is not None else named_neurons(circuit)
    if not chosen:
        raise ValueError(
            "The circuit names no neuron (no 'L{l}N{i}' node): run discover_circuit with "
            "neurons_per_mlp > 0 or 'auto' (the default names 8 per MLP node), or pass neurons=."
        )
    d_mlp = int(model.cfg.d_mlp or 0)
    bad = [
        n
        for n in chosen
        if not NEURON_LABEL.match(n)
        or not (parse_neuron_label(n)[0] < model.cfg.n_layers and parse_neuron_label(n)[1] < d_mlp)
    ]
    if bad:
        raise ValueError(
            f"neurons must be neuron labels 'L{{layer}}N{{index}}' of this model "
            f"({model.cfg.n_layers} layers, d_mlp {d_mlp}); got {bad[:5]}."
        )
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"neurons lists a neuron twice: {chosen}.")
    need = len(chosen) * model.cfg.d_vocab * 8 if token_stats else 0
    if need > max_bytes:
        raise MemoryError(
            f"The per-token statistics need {need / 2**30:.2f} GiB (budget "
            f"{max_bytes / 2**30:.2f} GiB): {len(chosen)} neurons x {model.cfg.d_vocab} tokens. "
            "Pass token_stats=False, fewer neurons=, or max_bytes=... to raise the budget."
        )
    gate_value_needed = circuit.gate_value is None or not set(chosen) <= set(
        circuit.gate_value.node
    )
    if (
        gate_value_needed
        and clean_tokens is not None
        and circuit.graph.positions is not None
        and positions is None
    ):
        raise ValueError(
            "This circuit's edges are resolved by position class "
            f"({list(circuit.graph.positions)}): pass positions= (the PositionClasses it was "
            "found with) to measure the gate/value split of the neurons it lacks."
        )
    if corpus is None:
        from tl_attnonly.corpora import load_prompts

        corpus = load_prompts()
    notes: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        split = _gate_value(circuit, chosen, task, opts.progress, notes)
    notes += [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    stats, n_positions, n_rows = collect_stats(
        model, chosen, corpus, opts.with_overrides(max_len=opts.max_len or model.cfg.n_ctx)
    )
    if n_positions == 0:
        raise ValueError("The corpus gave no token (an empty corpus, or max_rows=0).")
    tokenizer = getattr(model, "tokenizer", None)
    examples, best = profile_examples(stats, tokenizer, before)
    rows = {}
    for layer, st in stats.items():
        for j, label in enumerate(st.labels):
            row: dict[str, Any] = dict(
                neuron=label, layer=layer, index=int(st.index[j]), gated=st.gated
            )
            for column in GATE_VALUE_COLUMNS:
                row[column] = split.loc[label, column]
            row["gate_value_from"] = split.loc[label, "gate_value_from"]
            row["firing_fraction"] = float(st.fire[j]) / n_positions
            row["mean_output"] = float(st.out_sum[j]) / n_positions
            row["max_abs_output"] = float(st.max_abs[j])
            row["top_tokens"] = top_tokens_text(st, j, tokenizer, n_top_tokens, min_token_count)
            row["top_contexts"] = " | ".join(best.get(label, [])[:3])
            for q_i, q in enumerate(QUADRANTS):
                if st.gated:
                    total_abs = float(st.quad_abs[j].sum())
                    row[f"share_{q}"] = float(st.quad_count[j, q_i]) / n_positions
                    row[f"output_{q}"] = float(st.quad_sum[j, q_i]) / n_positions
                    row[f"abs_share_{q}"] = (
                        float(st.quad_abs[j, q_i]) / total_abs if total_abs > 0 else math.nan
                    )
                else:
                    row[f"share_{q}"] = row[f"output_{q}"] = row[f"abs_share_{q}"] = math.nan
            rows[label] = row
    table = pd.DataFrame([rows[label] for label in chosen])
    return NeuronProfiles(table, examples, circuit, n_positions, n_rows, notes)


__all__ = [
    "ALL",
    "GATE_VALUE_COLUMNS",
    "QUADRANTS",
    "NeuronProfiles",
    "named_neurons",
    "neuron_profiles",
    "parse_neuron_label",
    "register_profiles_figure_builder",
]
