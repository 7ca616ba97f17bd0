"""Dataset-level neuron-head summaries, in the spirit of Neuroscope and SAE dashboards.

:func:`summarize_neuron_heads` streams a corpus (any iterable of strings or token tensors; by
default Python standard-library source, offline) through a converted model and keeps, with memory
bounded by the number of heads (never by the corpus):

- for every neuron-head ``L{l}N{i}(.k)``: the top-``k`` contexts by its weight on itself
  (``hook_pattern[..., 0]``: whether it fires) and by ``|z|`` (what it writes), each with the
  tokens around the position and the head's self weight on every one of them (the bias token gets
  ``1 - self``);
- its firing fraction: the share of positions where its weight on itself exceeds 1/2;
- per neuron and token: the mean of ``hook_post`` (what the neuron writes) over the positions of
  that token, and per neuron-head and token the firing fraction, hence the AUC of "fires" as a
  detector of the token (token selectivity);
- the number of positions seen, per token.

:class:`NeuronHeadSummaries` saves to and loads from a directory (safetensors + JSON), ranks heads
by dataset statistics (:meth:`~NeuronHeadSummaries.rank`; pass the result as ``heads=`` to the
views in :mod:`tl_attnonly.vis`), and renders an HTML page per head
(:func:`tl_attnonly.vis.summaries.summary_html`).
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float, Int
from tqdm.auto import tqdm

from tl_attnonly._types import require_neuron_heads
from tl_attnonly.hooks import neuron_act_name, neuron_head_label

if TYPE_CHECKING:
    from tl_attnonly.encoder import AttnOnlyEncoder
    from tl_attnonly.model import AttnOnlyTransformer

#: Rankings kept per neuron-head: by weight on self, and by |z|.
RANKINGS = ("self", "abs_z")
#: Modules read by :func:`stdlib_corpus` by default (small, stable, present in every CPython).
STDLIB_MODULES = ("textwrap", "string", "shlex", "fnmatch", "glob", "bisect", "heapq", "colorsys")
SUMMARY_FILE = "summaries.safetensors"
META_FILE = "summaries.json"


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


def _token_rows(
    model: AttnOnlyTransformer | AttnOnlyEncoder, corpus: Iterable, max_len: int
) -> Iterator[torch.Tensor]:
    """1-d token tensors of at most ``max_len`` tokens (strings tokenised with BOS)."""
    for item in corpus:
        if isinstance(item, str) and hasattr(model, "encoder_output"):  # BERT-style: [CLS] .. [SEP]
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


@dataclass
class TopContexts:
    """The top-``k`` contexts of every head for one ranking of one layer.

    Attributes:
        values: ``[n, k]`` the ranked value at the context's centre, descending (``-inf``: empty).
        tokens: ``[n, k, window]`` token ids around the centre (``-1`` outside the document).
        self_weight: ``[n, k, window]`` the head's weight on itself at every context token.
        z: ``[n, k, window]`` the head's ``z`` at every context token.
        document: ``[n, k]`` index of the token row (in streaming order); ``position``: ``[n, k]``.
    """

    values: torch.Tensor
    tokens: torch.Tensor
    self_weight: torch.Tensor
    z: torch.Tensor
    document: torch.Tensor
    position: torch.Tensor

    @classmethod
    def empty(cls, n: int, k: int, window: int) -> TopContexts:
        return cls(
            torch.full((n, k), -torch.inf),
            torch.full((n, k, window), -1, dtype=torch.long),
            torch.zeros(n, k, window),
            torch.zeros(n, k, window),
            torch.full((n, k), -1, dtype=torch.long),
            torch.full((n, k), -1, dtype=torch.long),
        )


@dataclass
class NeuronHeadSummaries:
    """Dataset statistics of every neuron-head of a model (see the module docstring).

    Attributes:
        n_layers, d_mlp, n_heads_per_neuron, d_vocab: The model's shape.
        before, after: Context tokens kept before and after each top position.
        top: ``top[ranking][layer]``: :class:`TopContexts` (``ranking`` in :data:`RANKINGS`).
        fire_count: ``[n_layers, n_neuron_heads]`` positions where the head's self weight > 1/2.
        token_count: ``[d_vocab]`` positions seen per token.
        post_sum_by_token: ``[n_layers, d_mlp, d_vocab]`` sum of ``hook_post`` per token.
        fire_count_by_token: ``[n_layers, n_neuron_heads, d_vocab]``.
        n_positions: Positions seen.
        n_rows: Token rows (documents or chunks) seen.
    """

    n_layers: int
    d_mlp: int
    n_heads_per_neuron: int
    d_vocab: int
    before: int
    after: int
    top: dict[str, list[TopContexts]]
    fire_count: torch.Tensor
    token_count: torch.Tensor
    post_sum_by_token: torch.Tensor | None
    fire_count_by_token: torch.Tensor | None
    n_positions: int = 0
    n_rows: int = 0
    meta: dict = field(default_factory=dict)

    @property
    def n_neuron_heads(self) -> int:
        return self.d_mlp * self.n_heads_per_neuron

    def label(self, layer: int, head: int) -> str:
        return neuron_head_label(layer, head, self.n_heads_per_neuron)

    def firing_fraction(self) -> Float[torch.Tensor, "n_layers n_neuron_heads"]:
        """Share of positions where each neuron-head puts more than half its weight on itself."""
        return self.fire_count.double() / max(self.n_positions, 1)

    def _per_token(self, sums: torch.Tensor | None, min_count: int) -> torch.Tensor:
        """``sums / token_count``, NaN for tokens seen fewer than ``min_count`` times."""
        if sums is None:
            raise ValueError("Token statistics were not recorded (token_stats=False).")
        count = self.token_count.double()
        mean = sums.double() / count.clamp(min=1)
        return mean.masked_fill(count < max(min_count, 1), float("nan"))

    def mean_post_by_token(self, min_count: int = 1) -> torch.Tensor:
        """``[n_layers, d_mlp, d_vocab]`` mean ``hook_post`` per token (NaN below ``min_count``)."""
        return self._per_token(self.post_sum_by_token, min_count)

    def firing_fraction_by_token(self, min_count: int = 1) -> torch.Tensor:
        """``[n_layers, n_neuron_heads, d_vocab]`` (NaN below ``min_count``)."""
        return self._per_token(self.fire_count_by_token, min_count)

    def firing_auc_by_token(self, min_count: int = 5) -> torch.Tensor:
        """``[n_layers, n_neuron_heads, d_vocab]``: AUC of "fires" (self weight > 1/2) for a token.

        The area under the ROC curve of the binary firing indicator as a detector of the token,
        ``0.5 + (P(fires | token) - P(fires | other token)) / 2``: 1 when the head fires exactly
        on that token, 0.5 when firing says nothing about it (NaN below ``min_count``).
        """
        tpr = self.firing_fraction_by_token(min_count)  # raises without token statistics
        fire_tok = self.fire_count_by_token
        if fire_tok is None:
            raise ValueError("Token statistics were not recorded (token_stats=False).")
        count = self.token_count.double()
        fire_other = self.fire_count.double()[..., None] - fire_tok.double()
        fpr = fire_other / (self.n_positions - count).clamp(min=1)
        return 0.5 + (tpr - fpr) / 2

    def selectivity(self, layer: int, neuron: int, top: int = 10, min_count: int = 5):
        """Tokens on which neuron ``neuron`` writes most on average: ``[(token, mean, count)]``."""
        mean = self.mean_post_by_token(min_count)[layer, neuron]
        values, idx = mean.nan_to_num(-torch.inf).topk(top)
        return [
            (int(t), float(v), int(self.token_count[t]))
            for t, v in zip(idx, values, strict=True)
            if v > -torch.inf
        ]

    def rank(
        self,
        layer: int,
        by: str = "firing_fraction",
        top: int | None = None,
        level: str = "neuron",
    ) -> list[int]:
        """Neuron-heads of ``layer`` ranked by a dataset statistic (largest first).

        Args:
            by: ``"firing_fraction"``, ``"max_self"`` (best top context by weight on self),
                ``"max_abs_z"`` (best top context by |z|), or ``"selectivity"`` (the best token's
                :meth:`firing_auc_by_token`, tokens seen at least 5 times).
            top: How many neurons (``level="head"``: heads); default all.
            level: ``"neuron"`` (default): neurons ranked by the largest statistic of their ``K``
                heads, each listed with all its heads (consecutively); ``"head"``: heads ranked
                one by one. The same for ``K = 1``.

        Returns:
            Head indices, usable as ``heads=`` in the views of :mod:`tl_attnonly.vis`.
        """
        if level not in ("neuron", "head"):
            raise ValueError(f"level must be 'neuron' or 'head', got {level!r}.")
        if by == "firing_fraction":
            score = self.firing_fraction()[layer]
        elif by == "max_self":
            score = self.top["self"][layer].values[:, 0]
        elif by == "max_abs_z":
            score = self.top["abs_z"][layer].values[:, 0]
        elif by == "selectivity":
            score = self.firing_auc_by_token(min_count=5)[layer].nan_to_num(0.0).max(-1).values
        else:
            raise ValueError(
                "by must be 'firing_fraction', 'max_self', 'max_abs_z' or 'selectivity', got "
                f"{by!r}."
            )
        K = self.n_heads_per_neuron
        if level == "neuron" and K > 1:
            neurons = score.double().reshape(-1, K).amax(-1).argsort(descending=True, stable=True)
            chosen = neurons[: top or len(neurons)].tolist()
            return [n * K + k for n in chosen for k in range(K)]
        order = score.double().argsort(descending=True)
        return order[: top or len(order)].tolist()

    # ------------------------------------------------------------------ persistence
    def save(self, directory: str | Path) -> Path:
        """Write the summaries to ``directory`` (safetensors + JSON); :meth:`load` reads them."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {
            "fire_count": self.fire_count,
            "token_count": self.token_count,
        }
        if self.post_sum_by_token is not None:
            tensors["post_sum_by_token"] = self.post_sum_by_token
        if self.fire_count_by_token is not None:
            tensors["fire_count_by_token"] = self.fire_count_by_token
        for ranking, layers in self.top.items():
            for li, tc in enumerate(layers):
                for name in ("values", "tokens", "self_weight", "z", "document", "position"):
                    tensors[f"top.{ranking}.{li}.{name}"] = getattr(tc, name)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / SUMMARY_FILE))
        meta = dict(
            n_layers=self.n_layers,
            d_mlp=self.d_mlp,
            n_heads_per_neuron=self.n_heads_per_neuron,
            d_vocab=self.d_vocab,
            before=self.before,
            after=self.after,
            n_positions=self.n_positions,
            n_rows=self.n_rows,
            meta=self.meta,
        )
        (directory / META_FILE).write_text(json.dumps(meta, indent=2))
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> NeuronHeadSummaries:
        """Read summaries written by :meth:`save`."""
        from safetensors.torch import load_file

        directory = Path(directory)
        if not (directory / META_FILE).is_file():
            raise FileNotFoundError(
                f"No {META_FILE} in {directory}: expected a directory written by "
                "NeuronHeadSummaries.save()."
            )
        meta = json.loads((directory / META_FILE).read_text())
        tensors = load_file(str(directory / SUMMARY_FILE))
        top = {
            ranking: [
                TopContexts(
                    *(
                        tensors[f"top.{ranking}.{li}.{name}"]
                        for name in ("values", "tokens", "self_weight", "z", "document", "position")
                    )
                )
                for li in range(meta["n_layers"])
            ]
            for ranking in RANKINGS
        }
        return cls(
            n_layers=meta["n_layers"],
            d_mlp=meta["d_mlp"],
            n_heads_per_neuron=meta["n_heads_per_neuron"],
            d_vocab=meta["d_vocab"],
            before=meta["before"],
            after=meta["after"],
            top=top,
            fire_count=tensors["fire_count"],
            token_count=tensors["token_count"],
            post_sum_by_token=tensors.get("post_sum_by_token"),
            fire_count_by_token=tensors.get("fire_count_by_token"),
            n_positions=meta["n_positions"],
            n_rows=meta["n_rows"],
            meta=meta.get("meta", {}),
        )


def _merge_top(
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
        pick(top.document, b_idx + row_offset),
        pick(top.position, p_idx),
    )


def summarize_neuron_heads(
    model: AttnOnlyTransformer | AttnOnlyEncoder,
    corpus: Iterable[str | torch.Tensor] | None = None,
    *,
    k: int = 10,
    before: int = 12,
    after: int = 3,
    max_len: int | None = None,
    batch_size: int = 16,
    max_rows: int | None = None,
    token_stats: bool = True,
    max_bytes: int = 2**30,
    progress: bool = True,
) -> NeuronHeadSummaries:
    """Stream ``corpus`` through ``model`` and summarise every neuron-head (module docstring).

    Args:
        model: An :class:`~tl_attnonly.AttnOnlyTransformer` or
            :class:`~tl_attnonly.AttnOnlyEncoder` (padding is masked out of its attention), with a
            tokenizer if the corpus holds strings.
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

    Returns:
        :class:`NeuronHeadSummaries`.
    """
    require_neuron_heads(model)
    cfg = model.cfg
    assert cfg.d_mlp is not None  # a converted model has MLPs
    L, N, K, V = cfg.n_layers, cfg.d_mlp, model.n_heads_per_neuron, cfg.d_vocab
    H = N * K
    window = before + after + 1
    need = (L * H * k * (2 + 3 * window)) * 8 * len(RANKINGS)
    if token_stats:
        need += L * (N + H) * V * 8
    if need > max_bytes:
        raise MemoryError(
            f"The summaries need {need / 2**30:.2f} GiB (budget {max_bytes / 2**30:.2f} GiB): "
            f"{L} layers x {H} neuron-heads{' x ' + str(V) + ' tokens' if token_stats else ''}. "
            "Pass token_stats=False, a smaller k, or max_bytes=... to raise the budget."
        )
    if corpus is None:
        corpus = stdlib_corpus()
    max_len = max_len or cfg.n_ctx
    top = {r: [TopContexts.empty(H, k, window) for _ in range(L)] for r in RANKINGS}
    fire = torch.zeros(L, H, dtype=torch.long)
    token_count = torch.zeros(V, dtype=torch.long)
    post_sum = torch.zeros(L, N, V, dtype=torch.float64) if token_stats else None
    fire_tok = torch.zeros(L, H, V, dtype=torch.long) if token_stats else None
    names = {neuron_act_name(kind, li) for li in range(L) for kind in ("pattern", "z", "post")}
    n_positions = n_rows = 0
    device = cfg.device
    rows = _token_rows(model, corpus, max_len)
    bar = tqdm(desc="summaries (rows)", disable=not progress, unit="row")
    for batch in _batched(rows, batch_size):
        if max_rows is not None and n_rows >= max_rows:
            break
        if max_rows is not None:
            batch = batch[: max_rows - n_rows]
        lengths = torch.tensor([row.shape[0] for row in batch])
        pad = int(lengths.max())
        tokens = torch.zeros(len(batch), pad, dtype=torch.long)
        for i, row in enumerate(batch):
            tokens[i, : row.shape[0]] = row.cpu()
        valid = torch.arange(pad)[None, :] < lengths[:, None]  # [batch, pos]
        kwargs: dict[str, Any] = {}
        if hasattr(model, "encoder_output"):  # bidirectional: padding must be masked out
            kwargs["one_zero_attention_mask"] = valid.long().to(device)
        with torch.no_grad():
            _, cache = model.run_with_cache(
                tokens.to(device), names_filter=lambda n: n in names, **kwargs
            )
        flat_tokens = tokens[valid]  # [n_valid]
        token_count += torch.bincount(flat_tokens, minlength=V)
        for li in range(L):
            self_w = cache[neuron_act_name("pattern", li)][..., 0].transpose(1, 2).float().cpu()
            z = cache[neuron_act_name("z", li)][..., 0].float().cpu()  # [batch, pos, H]
            post = cache[neuron_act_name("post", li)].double().cpu()  # [batch, pos, N]
            fires = self_w > 0.5
            fire[li] += (fires & valid[..., None]).sum((0, 1))
            if post_sum is not None and fire_tok is not None:
                post_sum[li].index_add_(1, flat_tokens, post[valid].T)
                fire_tok[li].index_add_(1, flat_tokens, fires[valid].T.long())
            for ranking, values in (("self", self_w), ("abs_z", z.abs())):
                top[ranking][li] = _merge_top(
                    top[ranking][li], values, tokens, self_w, z, lengths, n_rows, before, after
                )
        n_positions += int(valid.sum())
        n_rows += len(batch)
        bar.update(len(batch))
    bar.close()
    return NeuronHeadSummaries(
        n_layers=L,
        d_mlp=N,
        n_heads_per_neuron=K,
        d_vocab=V,
        before=before,
        after=after,
        top=top,
        fire_count=fire,
        token_count=token_count,
        post_sum_by_token=post_sum,
        fire_count_by_token=fire_tok,
        n_positions=n_positions,
        n_rows=n_rows,
        meta={"k": k, "max_len": max_len},
    )


__all__ = [
    "RANKINGS",
    "NeuronHeadSummaries",
    "TopContexts",
    "stdlib_corpus",
    "summarize_neuron_heads",
]
