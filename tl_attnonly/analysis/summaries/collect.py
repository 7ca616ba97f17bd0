""":func:`summarize_neuron_heads`: stream a corpus through a converted model, bounded memory.

:func:`stdlib_corpus` is the default corpus (Python standard-library source, offline).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tl_attnonly.protocol import ModelLike

import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float, Int
from tqdm.auto import tqdm

from tl_attnonly._types import replace_options
from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.summaries.results import (
    RANKINGS,
    HeadGroups,
    NeuronHeadSummaries,
    TopContexts,
)
from tl_attnonly.hooks import neuron_act_name
from tl_attnonly.mlp_protocol import expert_layer_indices

if TYPE_CHECKING:
    from tl_attnonly.protocol import AttnOnlyModel


#: Modules read by :func:`stdlib_corpus` by default (small, stable, present in every CPython).
STDLIB_MODULES = ("textwrap", "string", "shlex", "fnmatch", "glob", "bisect", "heapq", "colorsys")


def stdlib_corpus(
    modules: Iterable[str] = STDLIB_MODULES, lines_per_doc: int = 12
) -> Iterator[str]:
    """Python standard-library source (offline), in documents of ``lines_per_doc`` lines.

    Args:
        modules: Module names (``name.py`` or ``name/__init__.py`` in the stdlib directory).
        lines_per_doc: Lines per yielded document.

    Raises:
        FileNotFoundError: If none of the modules' sources exists (e.g. a stripped install).
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    found = False
    for name in modules:
        for path in (stdlib / f"{name}.py", stdlib / name / "__init__.py"):
            if path.is_file():
                found = True
                lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
                for start in range(0, len(lines), lines_per_doc):
                    text = "".join(lines[start : start + lines_per_doc])
                    if text.strip():
                        yield text
                break
    if not found:
        raise FileNotFoundError(
            f"No source of {list(modules)} in {stdlib}; pass your own corpus (an iterable of "
            "strings or token tensors)."
        )


def token_rows(model: AttnOnlyModel, corpus: Iterable, max_len: int) -> Iterator[torch.Tensor]:
    """1-d token tensors of at most ``max_len`` tokens (strings tokenised with BOS; an encoder's
    with its tokenizer's ``[CLS] .. [SEP]``; token tensors split every ``max_len``)."""
    for item in corpus:
        if isinstance(item, str) and model.is_encoder:  # BERT-style: [CLS] .. [SEP]
            tokens = model.tokenizer(item, return_tensors="pt")["input_ids"][0]
        elif isinstance(item, str):
            tokens = model.to_tokens(item, truncate=False)[0]
        elif isinstance(item, torch.Tensor) and item.ndim in (1, 2):
            rows = item if item.ndim == 2 else item[None]
            for row in rows:
                yield from (row[s : s + max_len] for s in range(0, row.shape[0], max_len))
            continue
        else:
            raise TypeError(
                f"Corpus items must be strings or int tensors [pos] / [batch, pos], got "
                f"{type(item).__name__}."
            )
        for start in range(0, tokens.shape[0], max_len):
            yield tokens[start : start + max_len]


def _batched(rows: Iterator[torch.Tensor], batch_size: int) -> Iterator[list[torch.Tensor]]:
    batch: list[torch.Tensor] = []
    for row in rows:
        batch.append(row)
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


def padded_batches(
    rows: Iterator[torch.Tensor], batch_size: int, max_rows: int | None = None
) -> Iterator[tuple[Int[torch.Tensor, "batch pos"], torch.Tensor, torch.Tensor]]:
    """Batches of at most ``batch_size`` token rows (``max_rows`` in all), right-padded with 0.

    Yields:
        ``(tokens [batch, pos], lengths [batch], valid [batch, pos])``: ``valid`` marks the
        positions inside each row (padding is never counted).
    """
    n_rows = 0
    for batch in _batched(rows, batch_size):
        if max_rows is not None and n_rows >= max_rows:
            return
        if max_rows is not None:
            batch = batch[: max_rows - n_rows]
        lengths = torch.tensor([row.shape[0] for row in batch])
        pad = int(lengths.max())
        tokens = torch.zeros(len(batch), pad, dtype=torch.long)
        for i, row in enumerate(batch):
            tokens[i, : row.shape[0]] = row.cpu()
        n_rows += len(batch)
        yield tokens, lengths, torch.arange(pad)[None, :] < lengths[:, None]


def token_text(tokenizer: Any, token: int) -> str:
    """A token as text (``tokenizer.decode``; ``"[id]"`` without a tokenizer or for an empty
    decode; ``""`` for ``-1``, a context window's outside)."""
    if token < 0:
        return ""
    if tokenizer is None:
        return f"[{token}]"
    text = tokenizer.decode([token])
    return text if text else f"[{token}]"


def merge_top(
    top: TopContexts,
    values: Float[torch.Tensor, "batch pos n"],
    tokens: Int[torch.Tensor, "batch pos"],
    self_weight: Float[torch.Tensor, "batch pos n"],
    z: Float[torch.Tensor, "batch pos n"],
    lengths: torch.Tensor,
    row_offset: int,
    before: int,
    after: int,
) -> TopContexts:
    """Merge one batch's candidates into ``top`` (positions past a row's length are excluded)."""
    batch, pos, n = values.shape
    k = top.values.shape[1]
    valid = torch.arange(pos)[None, :] < lengths[:, None]  # [batch, pos]
    flat = values.masked_fill(~valid[..., None], -torch.inf).reshape(batch * pos, n)
    kk = min(k, batch * pos)
    cand_vals, cand_idx = flat.topk(kk, dim=0)  # [kk, n]
    cand_vals, cand_idx = cand_vals.T, cand_idx.T  # [n, kk]
    b_idx, p_idx = cand_idx // pos, cand_idx % pos
    offsets = torch.arange(-before, after + 1)
    ctx_pos = p_idx[..., None] + offsets  # [n, kk, window]
    inside = (ctx_pos >= 0) & (ctx_pos < lengths[b_idx][..., None])
    ctx_clamped = ctx_pos.clamp(0, pos - 1)
    b_exp = b_idx[..., None].expand_as(ctx_pos)
    head = torch.arange(n)[:, None, None].expand_as(ctx_pos)
    # A candidate of value -inf is no context (padding, or a token not counted): it stays empty
    # as TopContexts.empty has it (document and position -1, tokens -1), where fewer than k
    # positions were counted.
    empty = torch.isneginf(cand_vals)  # [n, kk]
    inside = inside & ~empty[..., None]
    ctx_tokens = tokens[b_exp, ctx_clamped].masked_fill(~inside, -1)
    ctx_self = self_weight[b_exp, ctx_clamped, head].masked_fill(~inside, 0.0)
    ctx_z = z[b_exp, ctx_clamped, head].masked_fill(~inside, 0.0)
    all_vals = torch.cat([top.values, cand_vals.float()], dim=1)
    order = all_vals.topk(k, dim=1).indices  # [n, k]; ties keep the earlier (existing) entry

    def pick(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        both = torch.cat([old, new.to(old.dtype)], dim=1)
        index = order.reshape(order.shape + (1,) * (both.ndim - 2)).expand(
            order.shape + both.shape[2:]
        )
        return both.gather(1, index)

    return TopContexts(
        pick(top.values, cand_vals),
        pick(top.tokens, ctx_tokens),
        pick(top.self_weight, ctx_self),
        pick(top.z, ctx_z),
        pick(top.document, (b_idx + row_offset).masked_fill(empty, -1)),
        pick(top.position, p_idx.masked_fill(empty, -1)),
    )


@dataclass(frozen=True)
class SummaryOptions:
    """Options of :func:`summarize_neuron_heads` (each also accepted by keyword there).

    Attributes:
        k: Top contexts kept per head and ranking.
        before, after: Context tokens kept around each top position.
        max_len: Longest token row (longer rows are split); default ``model.cfg.n_ctx``.
        batch_size: Rows per forward pass (rows are right-padded; padding is never counted).
        max_rows: Stop after this many rows.
        token_stats: Record per-token statistics (``[layers, heads, d_vocab]`` counters).
        max_bytes: Refuse, before any work, when the statistics would need more memory.
        progress: Progress bar over batches.
    """

    k: int = 10
    before: int = 12
    after: int = 3
    max_len: int | None = None
    batch_size: int = 16
    max_rows: int | None = None
    token_stats: bool = True
    max_bytes: int = 2**30
    progress: bool = True

    def with_overrides(self, **changes: Any) -> SummaryOptions:
        """A copy with the given fields replaced.

        Raises:
            TypeError: For a name that is not an option, listing the options.
        """
        return replace_options(
            self,
            changes,
            "Unknown summary option(s) {unknown}; the options are {names} "
            "(tl_attnonly.analysis.SummaryOptions).",
        )


def summary_options(
    caller: str, options: SummaryOptions | None, overrides: dict[str, Any]
) -> SummaryOptions:
    """``options`` (default :class:`SummaryOptions`) with ``overrides`` replaced.

    Raises:
        TypeError: If ``options`` is not a :class:`SummaryOptions`, or for an unknown option.
    """
    if options is not None and not isinstance(options, SummaryOptions):
        raise TypeError(
            f"{caller}(..., options=...) takes a tl_attnonly.analysis.SummaryOptions, got "
            f"{type(options).__name__}."
        )
    return (options or SummaryOptions()).with_overrides(**overrides)


def cached_batches(
    model: AttnOnlyModel,
    corpus: Iterable[str | torch.Tensor] | None,
    names: set[str],
    opts: SummaryOptions,
) -> Iterator[tuple[Int[torch.Tensor, "batch pos"], torch.Tensor, torch.Tensor, Any]]:
    """The streaming pass of the summaries: ``corpus`` in padded batches, each run once.

    Args:
        model: An adapted model (:func:`~tl_attnonly.adapt.analysis_model`).
        corpus: As :func:`summarize_neuron_heads`'s (``None``: :func:`stdlib_corpus`).
        names: The hooks to cache.
        opts: ``max_len`` (default ``model.cfg.n_ctx``), ``batch_size``, ``max_rows``,
            ``progress``.

    Yields:
        ``(tokens [batch, pos], lengths [batch], valid [batch, pos], cache)``: the cache of
        ``names`` for the batch (an encoder's padding masked out of its attention; a
        ``HookedTransformer``'s run stops after its last block, ``stop_at_layer=n_layers``, so
        no hook after it is cached; a ``TransformerBridge``'s ``stop_at_layer`` stops only
        before a block, so it runs whole).
    """
    device = model.cfg.device
    rows = token_rows(model, stdlib_corpus() if corpus is None else corpus,
                      opts.max_len or model.cfg.n_ctx)  # fmt: skip
    bar = tqdm(desc="summaries (rows)", disable=not opts.progress, unit="row")
    for tokens, lengths, valid in padded_batches(rows, opts.batch_size, opts.max_rows):
        kwargs: dict[str, Any] = {}
        if model.is_encoder:  # bidirectional: padding must be masked out
            kwargs["one_zero_attention_mask"] = valid.long().to(device)
        else:  # every block runs; the final norm and unembedding do not
            kwargs["stop_at_layer"] = model.cfg.n_layers
        with torch.no_grad():
            _, cache = model.run_with_cache(
                tokens.to(device), names_filter=lambda n: n in names, **kwargs
            )
        yield tokens, lengths, valid, cache
        bar.update(tokens.shape[0])
    bar.close()


def add_heads(
    top: dict[str, list[TopContexts]],
    fire: list[torch.Tensor],
    group: int,
    self_w: Float[torch.Tensor, "batch pos n"],
    z: Float[torch.Tensor, "batch pos n"],
    here: torch.Tensor,
    tokens: Int[torch.Tensor, "batch pos"],
    lengths: torch.Tensor,
    row_offset: int,
    opts: SummaryOptions,
) -> None:
    """Count one batch into the firing counts ``fire[group]`` ``[n]`` and top contexts
    ``top[ranking][group]`` of ``n`` heads, at the positions ``here`` only.

    Args:
        here: ``[batch, pos, n]`` (or ``[batch, pos, 1]``) the positions each head counts: not
            padding, and for an expert's head routed to its expert.
        row_offset: The batch's first row (in streaming order).
        opts: ``before`` and ``after``.
    """
    fire[group] += (here & (self_w > 0.5)).sum((0, 1))
    for ranking, values in (("self", self_w), ("abs_z", z.abs())):
        top[ranking][group] = merge_top(
            top[ranking][group], values.masked_fill(~here, -torch.inf), tokens, self_w, z,
            lengths, row_offset, opts.before, opts.after,
        )  # fmt: skip


def _head_groups(model: AttnOnlyModel) -> list[HeadGroups]:
    """Per layer, its heads' groups (:attr:`NeuronHeadSummaries.groups`); none without a mixture
    of experts."""
    if not expert_layer_indices([block.mlp for block in model.blocks]):
        return []
    from tl_attnonly.analysis.experts.routing import layer_heads

    groups = []
    for layer in range(model.cfg.n_layers):
        experts = [expert for expert, _ in layer_heads(model, layer)]
        groups.append([(e, experts.count(e)) for e in dict.fromkeys(experts)])
    return groups


def _hook_names(model: AttnOnlyModel, groups: list[HeadGroups], kinds: tuple[str, ...]) -> set[str]:
    """The hooks the summaries read: a dense layer's ``blocks.{l}.mlp.hook_{kind}``; an expert
    layer's experts' and, for routed experts, the router's top-k indices."""
    from tl_attnonly.analysis.experts.routing import expert_hook_name, routing_hook_name

    names = set()
    for layer in range(model.cfg.n_layers):
        experts = [e for e, _ in groups[layer]] if groups else [None]
        if experts == [None]:
            names |= {neuron_act_name(kind, layer) for kind in kinds}
            continue
        if any(isinstance(e, int) for e in experts):
            names.add(routing_hook_name(layer, model))
        names |= {
            expert_hook_name(layer, e, kind) for e in experts if e is not None for kind in kinds
        }
    return names


def _layer_values(
    cache: Any, layer: int, experts: bool, kinds: tuple[str, ...], n_pos: int
) -> list[torch.Tensor]:
    """``self_w [batch, pos, n]``, ``z [batch, pos, n]`` (float32) and with ``"post"`` in
    ``kinds`` ``post [batch, pos, n / K]`` (float64) of ``layer``'s neuron-heads, on the CPU; an
    expert layer's experts' end to end, NaN where a token was not routed to the expert."""
    if experts:
        from tl_attnonly.analysis.experts.routing import expert_heads_as_dense

        read = {kind: expert_heads_as_dense(cache, layer, kind, n_pos) for kind in kinds}
    else:
        read = {kind: cache[neuron_act_name(kind, layer)] for kind in kinds}
    values = [
        read["pattern"][..., 0].transpose(1, 2).float().cpu(),
        read["z"][..., 0].float().cpu(),
    ]
    if "post" in read:
        post = read["post"].double().cpu()
        values.append(post.masked_fill(post.isnan(), 0.0) if experts else post)
    return values


def summarize_neuron_heads(
    model: ModelLike,
    corpus: Iterable[str | torch.Tensor] | None = None,
    *,
    options: SummaryOptions | None = None,
    **overrides: Any,
) -> NeuronHeadSummaries:
    """Stream ``corpus`` through ``model`` and summarise every neuron-head (module docstring).

    A mixture-of-experts layer's neuron-heads are its experts' end to end (routed experts, then
    the shared ones; labelled ``L{l}E{e}N{n}``, ``L{l}SN{n}``), each counted over the tokens
    routed to its expert only, as :func:`~tl_attnonly.analysis.experts.
    summarize_expert_neuron_heads` counts them (:attr:`NeuronHeadSummaries.groups`).

    Args:
        model: An :class:`~tl_attnonly.AttnOnlyTransformer` or
            :class:`~tl_attnonly.AttnOnlyEncoder` (padding is masked out of its attention), or a
            converted ``TransformerBridge``, with a tokenizer if the corpus holds strings.
        corpus: Strings and/or int token tensors (``[pos]`` or ``[batch, pos]``); default
            :func:`stdlib_corpus`.
        k: Top contexts kept per head and ranking.
        before, after: Context tokens kept around each top position.
        max_len: Longest token row (longer rows are split); default ``model.cfg.n_ctx``.
        batch_size: Rows per forward pass (rows are right-padded; padding is never counted).
        max_rows: Stop after this many rows.
        token_stats: Record per-token statistics (``[layers, heads, d_vocab]`` counters).
        max_bytes: Refuse, before any work, when the statistics would need more memory.
        progress: Progress bar over batches.
        options: A :class:`SummaryOptions` holding the options above (``k`` to ``progress``);
            each is also accepted by keyword, replacing the one in ``options``.

    Returns:
        :class:`NeuronHeadSummaries`.

    Raises:
        TypeError: For a keyword that is not an option (naming :class:`SummaryOptions`).
        MemoryError: When the statistics would need more than ``max_bytes``.
    """
    opts = summary_options("summarize_neuron_heads", options, overrides)
    k, before, after, max_len = opts.k, opts.before, opts.after, opts.max_len
    token_stats, max_bytes = opts.token_stats, opts.max_bytes
    model = analysis_model(model)
    cfg = model.cfg
    assert cfg.d_mlp is not None  # a converted model has MLPs
    L, K, V = cfg.n_layers, model.n_heads_per_neuron, cfg.d_vocab
    groups = _head_groups(model)
    widths = [sum(n for _, n in layer) for layer in groups] or [cfg.d_mlp * K] * L
    H = max(widths)
    N, G = H // K, max((len(layer) for layer in groups), default=0)
    window = before + after + 1
    need = (L * H * k * (2 + 3 * window)) * 8 * len(RANKINGS)
    if token_stats:
        need += L * (N + H + G) * V * 8
    if need > max_bytes:
        raise MemoryError(
            f"The summaries need {need / 2**30:.2f} GiB (budget {max_bytes / 2**30:.2f} GiB): "
            f"{L} layers x {H} neuron-heads{' x ' + str(V) + ' tokens' if token_stats else ''}. "
            "Pass token_stats=False, a smaller k, or max_bytes=... to raise the budget."
        )
    max_len = max_len or cfg.n_ctx
    top = {r: [TopContexts.empty(w, k, window) for w in widths] for r in RANKINGS}
    fire = [torch.zeros(w, dtype=torch.long) for w in widths]
    token_count = torch.zeros(V, dtype=torch.long)
    post_sum = torch.zeros(L, N, V, dtype=torch.float64) if token_stats else None
    fire_tok = torch.zeros(L, H, V, dtype=torch.long) if token_stats else None
    group_positions = torch.zeros(L, G, dtype=torch.long) if groups else None
    group_tok = torch.zeros(L, G, V, dtype=torch.long) if groups and token_stats else None
    kinds = ("pattern", "z", "post") if token_stats else ("pattern", "z")
    expert_layers = set(expert_layer_indices([block.mlp for block in model.blocks]))
    n_positions = n_rows = 0
    for tokens, lengths, valid, cache in cached_batches(
        model, corpus, _hook_names(model, groups, kinds), opts
    ):
        flat_tokens = tokens[valid]  # [n_valid]
        token_count += torch.bincount(flat_tokens, minlength=V)
        for li, w in enumerate(widths):
            self_w, z, *post = _layer_values(cache, li, li in expert_layers, kinds, tokens.shape[1])
            here = valid[..., None] & ~self_w.isnan()  # counted: not padding, routed
            add_heads(top, fire, li, self_w, z, here, tokens, lengths, n_rows, opts)
            if post_sum is not None and fire_tok is not None:
                post_sum[li, : w // K].index_add_(1, flat_tokens, post[0][valid].T)
                fires = here & (self_w > 0.5)
                fire_tok[li, :w].index_add_(1, flat_tokens, fires[valid].T.long())
            if group_positions is not None:  # each group's first head: its routed positions
                starts = torch.tensor([0, *(n for _, n in groups[li])]).cumsum(0)[:-1]
                routed = here[..., starts]  # [batch, pos, groups]
                group_positions[li, : len(starts)] += routed.sum((0, 1))
                if group_tok is not None:
                    group_tok[li, : len(starts)].index_add_(1, flat_tokens, routed[valid].T.long())
        n_positions += int(valid.sum())
        n_rows += tokens.shape[0]
    fire_count = torch.zeros(L, H, dtype=torch.long)
    for li, w in enumerate(widths):
        fire_count[li, :w] = fire[li]
    return NeuronHeadSummaries(
        n_layers=L,
        d_mlp=N,
        n_heads_per_neuron=K,
        d_vocab=V,
        before=before,
        after=after,
        top=top,
        fire_count=fire_count,
        token_count=token_count,
        post_sum_by_token=post_sum,
        fire_count_by_token=fire_tok,
        n_positions=n_positions,
        n_rows=n_rows,
        meta={"k": k, "max_len": max_len},
        groups=groups,
        group_positions=group_positions,
        group_token_count=group_tok,
    )


__all__ = [
    "STDLIB_MODULES",
    "SummaryOptions",
    "add_heads",
    "cached_batches",
    "merge_top",
    "summary_options",
    "padded_batches",
    "stdlib_corpus",
    "summarize_neuron_heads",
    "token_rows",
    "token_text",
]
