"""What an exact circuit run (:mod:`.runs`) adds to each input, computed once per run.

A circuit run rebuilds each reader's residual input as the corrupted input plus the current run's
change of the sources joined to it, ``sum_{u -> v} delta_u`` with ``delta_u = (out_u(current) -
out_u(corrupted)) U_u`` (``[batch, pos, d_model]``). Two kinds of redundancy make that sum cheap:

- **Sources with the same outgoing edges** (the same mask row into every later input) always
  appear together, so only their sum is needed: a named neuron and its layer's remainder of a
  circuit expanded from an MLP node (``expand_mask``) are one summed row, like the coarse node.
  :class:`CircuitPlan` merges them (per residual position ``order``), and each merged row's change
  is computed once per run (``delta``), not once per reader.
- **Readers with the same incoming edges** at the same residual site receive the same input:
  it is built once (:meth:`CircuitPlan.inputs`; a dst group's copies of one column, and the
  gate and value of a layer, or ``q``, ``k`` and ``v``, that share their edges).

A merged row that holds every neuron of an MLP layer changes by the layer's output change
(``hook_mlp_out``: ``sum_i delta(post_i) W_out[i]``, the bias cancels), which the run records, so
its neurons' values are not read; where the run passes on only some of the layer's neurons' changes
(:class:`PlanRun`'s ``kept``), the row sums those neurons' terms instead. An expert node's row
(:data:`~.graph.EXPERT`: its weighted output) passing on some of its neurons' changes sums their
terms likewise, each run with its own routing (:mod:`.expert_kept`). Across the runs of one
call (:func:`~.runs.circuit_metrics`), a later run takes the first run's merged rows and their
changes below its first source with other edges.

Each reader's input is then one matrix product ``M^T W`` of the merged rows' changes
``W [rows, batch*pos*d_model]`` and the 0/1 incidence ``M [rows, readers]``, taken as a sparse
product (a circuit's readers mark few rows: only those are read). The result equals the
edge-by-edge sum up to floating-point rounding (the order of the additions).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tl_attnonly.analysis.discovery.expert_kept import KeptKey, expert_kept_change
from tl_attnonly.analysis.discovery.graph import (
    EXPERT,
    EXPERT_NEURON,
    MLP_REST,
    HeadGraph,
    InputGroup,
    SourceGroup,
)
from tl_attnonly.analysis.discovery.sites import Mask, source_values, writer_matrix
from tl_attnonly.hooks import block_act_name

if TYPE_CHECKING:
    from tl_attnonly.protocol import AttnOnlyModel


@dataclass(frozen=True)
class RunCall:
    """What every exact run of one :func:`~.run_metrics.circuit_metrics` call shares: the
    adapted model, the call's graph, the budget for intermediate tensors (``block_bytes``), and
    the model's weights as the runs read them (``weights``: per layer and input, gathered once;
    a search's calls share one dict, its :class:`~tl_attnonly.analysis.task.CorruptedRuns`')."""

    model: AttnOnlyModel
    graph: HeadGraph
    block_bytes: int
    weights: dict = field(default_factory=dict)


class CircuitPlan:
    """A circuit's sources merged by identical outgoing edges (mask only; no activations).

    Args:
        graph: The mask's graph.
        mask: ``(source group, input group) -> bool [n_sources, n_inputs]``.
        reference: Another mask's plan on the same graph, whose orders below ``same_below``
            are taken as they are (the sources there have the same outgoing edges in both
            masks: :func:`~.run_reuse.shared_prefix`).
        same_below: See ``reference``.

    A plan of the same mask object as its ``reference``'s takes the reference's merged rows at
    every order (the same edges), as rows of its own above ``same_below`` (their changes are
    computed, not copied: the runs differ there only in which neurons an MLP node passes on,
    :class:`PlanRun`'s ``kept``).

    Attributes:
        orders: Residual positions that have a source with an edge, increasing.
        members: Per order, ``(group, rows, ids)``: the group's kept rows with an edge and the
            merged row each belongs to.
        n_rows: Per order, the number of merged rows.
        offsets: The first merged row of each order (rows of all orders in one matrix), then
            the total.
        incidence: ``(order, input key) -> bool [n_rows, n_inputs]``: merged row -> reader edges.
        whole: Per order, the merged rows that hold every neuron of one MLP layer (a coarse
            graph's MLP node, or named neurons merged with their remainder): row -> layer. Such
            a row's change is the layer's output change (``hook_mlp_out``).
    """

    def __init__(
        self,
        graph: HeadGraph,
        mask: Mask,
        reference: CircuitPlan | None = None,
        same_below: float = 0,
    ):
        by_order: dict[int, list[SourceGroup]] = {}
        for src in graph.sources:
            if src.labels:
                by_order.setdefault(src.order, []).append(src)
        self.orders: list[int] = []
        self.members: dict[int, list[tuple[SourceGroup, torch.Tensor, torch.Tensor]]] = {}
        self.n_rows: dict[int, int] = {}
        self.incidence: dict[tuple[int, str], torch.Tensor] = {}
        self.whole: dict[int, dict[int, int]] = {}
        self.offsets = [0]  # the first merged row of each order, and the total
        self.mask = mask
        same_mask = reference is not None and reference.mask is mask
        for order, groups in sorted(by_order.items()):
            dsts = [d for d in graph.inputs if d.labels and d.order > order]
            if not dsts:
                continue
            if reference is not None and (order < same_below or same_mask):
                # the reference's edges here (above same_below: rows of this plan's own)
                if order in reference.members:
                    self._take(reference, order, dsts, own=order >= same_below)
                continue
            signature = torch.cat(
                [torch.cat([mask[(s.key, d.key)].cpu() for d in dsts], 1) for s in groups], 0
            )
            used = signature.any(1)
            if not bool(used.any()):
                continue
            unique, ids = torch.unique(signature[used].to(torch.uint8), dim=0, return_inverse=True)
            rows_all = used.nonzero().flatten()
            members = []
            start = 0
            for s in groups:
                n = len(s.labels)
                pick = (rows_all >= start) & (rows_all < start + n)
                if bool(pick.any()):
                    members.append((s, rows_all[pick] - start, ids[pick]))
                start += n
            self.orders.append(order)
            self.members[order] = members
            self.whole[order] = _whole_layers(members)
            self.n_rows[order] = unique.shape[0]
            self.offsets.append(self.offsets[-1] + unique.shape[0])
            offset = 0
            for d in dsts:
                n = len(d.labels)
                self.incidence[(order, d.key)] = unique[:, offset : offset + n].bool()
                offset += n

    def _take(
        self, reference: CircuitPlan, order: int, dsts: list[InputGroup], own: bool = False
    ) -> None:
        """Append ``reference``'s merged rows at ``order`` (the same mask edges there); with
        ``own``, as rows of this plan (a list of its own: :class:`PlanRun` computes their
        changes instead of copying the reference's)."""
        self.orders.append(order)
        members = reference.members[order]
        self.members[order] = list(members) if own else members
        self.whole[order] = reference.whole[order]
        self.n_rows[order] = reference.n_rows[order]
        self.offsets.append(self.offsets[-1] + reference.n_rows[order])
        for d in dsts:
            self.incidence[(order, d.key)] = reference.incidence[(order, d.key)]

    def before(self, dst: InputGroup) -> list[int]:
        """The orders whose sources ``dst`` reads."""
        return [o for o in self.orders if o < dst.order]  # a prefix of the orders

    def columns(self, dst: InputGroup, readers: torch.Tensor) -> torch.Tensor:
        """``bool [rows before dst, len(readers)]``: the merged rows joined to each reader."""
        parts = [self.incidence[(o, dst.key)] for o in self.before(dst)]
        if not parts:
            return torch.zeros(0, len(readers), dtype=torch.bool)
        return torch.cat(parts, 0)[:, readers]  # one gather of the readers for every order


class PlanRun:
    """One circuit run's merged changes and rebuilt inputs.

    Args:
        call: The call's model, graph and ``block_bytes`` (:class:`RunCall`; ``block_bytes``:
            budget for intermediate tensors and for the inputs kept for reuse).
        plan: The run's :class:`CircuitPlan`.
        current, corr: The current run's recorded source activations and the corrupted cache.
        memo: A dict shared by the runs of one batch on one graph, in which what does not
            depend on the mask (each source's writer matrix and corrupted values, a scratch
            matrix for the changes) is kept once computed (default: for this run only).
        reference: The first run of the batch (kept, with its changes), or None. Where this
            run's plan took the reference plan's merged rows (``CircuitPlan(reference=...)``:
            the sources below the first with other edges, which read the same inputs), their
            changes are the reference's, copied instead of computed.
        is_reference: This run is the reference of later ones: its changes are a matrix of
            its own (the later runs share one scratch matrix).
        kept: Layer -> ``bool [d_mlp]``: the neurons whose change that layer's MLP sources
            pass on (:func:`~.runs.circuit_metrics`'s ``kept_neurons``); the others' outputs
            count as the corrupted run's. Layers absent: every neuron. An expert node's label
            -> ``bool [n]``: the neurons whose change it passes on, nothing else of its
            change (:mod:`.expert_kept`).
    """

    def __init__(
        self,
        call: RunCall,
        plan: CircuitPlan,
        current: dict[str, torch.Tensor],
        corr: dict[str, torch.Tensor],
        memo: dict | None = None,
        reference: PlanRun | None = None,
        is_reference: bool = False,
        kept: Mapping[KeptKey, torch.Tensor] | None = None,
    ):
        self.model, self.graph, self.plan = call.model, call.graph, plan
        self.kept = {} if kept is None else kept
        self.memo = {} if memo is None else memo
        self.reference, self.is_reference = reference, is_reference
        self.current, self.corr, self.block_bytes = current, corr, call.block_bytes
        # [rows, batch*pos*d_model]: every merged row's change, rows of each order together
        self.changes: torch.Tensor | None = None
        self.filled: set[int] = set()
        self.built: dict[tuple, torch.Tensor] = {}  # (site, order, column bytes) -> [b, p, d]
        self.site: str | None = None
        self.kept_bytes = 0

    def _fill(self, order: int) -> None:
        """Write each merged row's change at ``order`` into :attr:`changes` (once per run)."""
        like = self.corr[self.model.embed_hooks[0]]  # [batch, pos, d_model]
        b, p, d = like.shape[0], like.shape[1], self.model.cfg.d_model
        if self.changes is None:
            self.changes = self._matrix(self.plan.offsets[-1], b * p * d, like)
        k = self.plan.orders.index(order)
        start_row, end_row = self.plan.offsets[k], self.plan.offsets[k + 1]
        ref = self.reference
        if (
            ref is not None
            and ref.changes is not None
            and order in ref.filled
            and self.plan.members[order] is ref.plan.members.get(order)
        ):  # rows the plan took from the reference's (so did it every order below: the same
            # offsets), whose sources read the same inputs: the same changes
            self.changes[start_row:end_row] = ref.changes[start_row:end_row]
            self.filled.add(order)
            return
        self.changes[start_row:end_row] = 0
        # a layer with kept neurons passes on only theirs: not its output's whole change
        whole = {r: li for r, li in self.plan.whole[order].items() if li not in self.kept}
        for row, layer in whole.items():  # every neuron of the layer: its output's change
            name = block_act_name("mlp_out", layer)
            self.changes[start_row + row] = (self.current[name] - self.corr[name]).flatten()
        for src, rows, ids in self.plan.members[order]:
            if whole:
                own = torch.tensor([int(i) not in whole for i in ids], dtype=torch.bool)
                if not bool(own.any()):
                    continue
                rows, ids = rows[own], ids[own]
            if src.key not in self.memo:  # the same in every run of the batch
                self.memo[src.key] = (
                    writer_matrix(self.model, src, self.graph, like),
                    source_values(self.corr, src, self.graph, self.model),
                )
            U, corrupted = self.memo[src.key]
            change = source_values(self.current, src, self.graph, self.model) - corrupted
            if src.kind in ("neuron", MLP_REST) and src.layer in self.kept:
                change, U = _kept_only(change, U, src, self.kept[src.layer])
            elif src.kind in (EXPERT, EXPERT_NEURON) and self.kept:  # its kept neurons' only
                runs = (self.current, self.corr)
                change = expert_kept_change(
                    self.model, self.graph, src, change, runs, self.kept, self.memo
                )
            merged, which = torch.unique(ids, return_inverse=True)
            if len(merged) < len(rows):
                # several sources per merged row (named neurons beside their remainder): one
                # contraction over them per merged row instead of a [b, p, d] term per source
                for j, target in enumerate(merged.tolist()):
                    r = rows[which == j]
                    DU = torch.einsum("bpur,urd->bpd", *_rows(change, U, r))
                    self.changes[start_row + target] += DU.flatten()
                continue
            per = max(1, b * p * d * change.element_size() * 2)
            step = max(1, self.block_bytes // per)
            for start in range(0, len(rows), step):
                r = rows[start : start + step]
                DU = torch.einsum("bpur,urd->ubpd", *_rows(change, U, r))
                target = (ids[start : start + step] + start_row).to(DU.device)
                self.changes.index_add_(0, target, DU.flatten(1))
        self.filled.add(order)

    def _matrix(self, n_rows: int, width: int, like: torch.Tensor) -> torch.Tensor:
        """``[n_rows, width]`` for the changes (every row written by :meth:`_fill`): a run that
        is not a reference takes the memo's scratch matrix (its first rows), instead of
        allocating one per run."""
        scratch = self.memo.get(("scratch",))
        if self.is_reference or scratch is None or scratch.shape[0] < n_rows:
            fresh = like.new_empty(n_rows, width)
            if not self.is_reference:
                self.memo[("scratch",)] = fresh
            return fresh
        return scratch[:n_rows]

    def inputs(self, dst: InputGroup, site: str, readers: torch.Tensor) -> torch.Tensor:
        """``[batch, pos, len(readers), d_model]``: the corrupted input at ``site`` plus each
        reader's circuit sum; readers with the same edges share one computation."""
        distinct, which = self.distinct_inputs(dst, site, readers)
        return distinct[:, :, which.to(distinct.device)]

    def distinct_inputs(
        self, dst: InputGroup, site: str, readers: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The readers' distinct inputs ``[batch, pos, n_distinct, d_model]`` and, per reader,
        the index of its own ``[len(readers)]`` (readers with the same edges share one input, so
        a caller can normalise and project each distinct input once)."""
        corr = self.corr[site]
        b, p, d = corr.shape
        if site != self.site:  # inputs are shared within one residual site only
            self.site, self.built, self.kept_bytes = site, {}, 0
        M = self.plan.columns(dst, readers)  # [rows before dst, readers]
        unique, which = torch.unique(M.T.to(torch.uint8), dim=0, return_inverse=True)
        keys = [(dst.order, bytes(col.numpy().tobytes())) for col in unique]
        missing = [i for i, key in enumerate(keys) if key not in self.built]
        fresh: dict[int, torch.Tensor] = {}
        if missing:
            cols = unique[missing].T.bool()  # [rows before dst, n_missing]
            rows = cols.any(1).nonzero().flatten()
            if len(rows) == 0:
                total = corr.new_zeros(len(missing), b * p * d)
            else:
                for o in self.plan.before(dst):
                    if o not in self.filled:
                        self._fill(o)
                assert self.changes is not None
                total = _row_sums(cols, self.changes)
            sums = total.view(len(missing), b, p, d)
            for j, i in enumerate(missing):
                fresh[i] = sums[j]
                size = sums[j].numel() * sums[j].element_size()
                if self.kept_bytes + size <= self.block_bytes:
                    self.built[keys[i]] = sums[j]
                    self.kept_bytes += size
        parts = [fresh[i] if i in fresh else self.built[keys[i]] for i in range(len(keys))]
        stacked = torch.stack(parts, 2)  # [b, p, n_unique, d]
        return corr.unsqueeze(2) + stacked, which


def _whole_layers(members: list[tuple[SourceGroup, torch.Tensor, torch.Tensor]]) -> dict[int, int]:
    """The merged rows of one order's ``members`` (:class:`CircuitPlan`) whose sources are
    every neuron (or neuron-head) of one MLP layer: row -> layer."""
    counts: dict[int, int] = {}
    layers: dict[int, set[tuple[int, int]]] = {}
    for src, _, ids in members:
        for i in ids.tolist():
            if src.kind not in ("neuron", MLP_REST):
                layers.setdefault(i, set()).add((-1, 0))  # not an MLP source: never whole
                continue
            counts[i] = counts.get(i, 0) + (len(src.index) if src.kind == MLP_REST else 1)
            layers.setdefault(i, set()).add((src.layer, src.size))
    whole = {}
    for i, seen in layers.items():
        if len(seen) == 1:
            ((layer, size),) = seen
            if layer >= 0 and counts[i] == size:
                whole[i] = layer
    return whole


def source_kept(src: SourceGroup, kept: torch.Tensor) -> torch.Tensor:
    """``bool [len(src.index)]``: which of a neuron source group's neurons (a named group's
    rows, or an MLP remainder's neurons) are among the layer's ``kept`` (``bool [d_mlp]``)."""
    if src.index == tuple(range(len(kept))):  # every neuron of the layer, in order
        return kept
    return kept[torch.tensor(src.index, dtype=torch.long, device=kept.device)]


def _kept_only(
    change: torch.Tensor, U: torch.Tensor, src: SourceGroup, kept: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A neuron source group's ``change [b, p, n, r]`` and writer ``U [n, r, d]`` with only the
    ``kept`` neurons' changes (``kept``: ``bool [d_mlp]`` over the layer): a named neuron left out
    changes by zero; an MLP remainder (one source, its neurons as ``r``) keeps only the columns
    of its kept neurons."""
    mine = source_kept(src, kept.to(change.device))
    if src.kind == MLP_REST:
        cols = mine.nonzero().flatten()
        return change[..., cols], U[:, cols.to(U.device)]
    return change * mine.to(change.dtype)[:, None], U


def _row_sums(cols: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """``[m, F]``: per column of the 0/1 ``cols [n, m]``, the sum of the rows of ``W [>= n, F]``
    it marks (``cols.T @ W[:n]``), as a sparse product: only the marked rows are read, neither
    gathered into a copy nor multiplied by zero (a circuit's readers mark few of the rows)."""
    dense = cols.T.to(W.dtype).to(W.device)
    if W.device.type not in ("cpu", "cuda"):  # no sparse product there
        return dense @ W[: cols.shape[0]]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return dense.to_sparse_csr() @ W[: cols.shape[0]]


def _rows(
    change: torch.Tensor, U: torch.Tensor, r: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``change[:, :, r]`` and ``U[r]``; not gathered where ``r`` is every source in order
    (an MLP remainder is one source: a copy of its writer matrix per run otherwise)."""
    if len(r) == U.shape[0] and bool((r == torch.arange(len(r))).all()):
        return change, U
    return change[:, :, r.to(change.device)], U[r.to(U.device)]


__all__ = ["CircuitPlan", "PlanRun", "RunCall", "source_kept"]
