"""One neuron's page as data: the JSON record the site and Jupyter show, from an atlas state.

Field names follow Neuronpedia's feature-details schema where one fits (``index``,
``examples_quantiles``, ``top_logits``, ``bottom_logits``, ``act_min``, ``act_max``,
``histogram``, ``activation_frequency``); the rest are this atlas's own (``top_examples``,
``quadrants``, ``self`` weights). A context is ``{"tokens": [ids], "acts": [...], "self": [...],
"row", "pos", "act"}``: its window's token ids (``-1``: outside the row), each token's activation
and self weight, the row and position of its centre token (``before`` tokens into the window) and
the centre's activation. Token strings are in the site's vocabulary (:func:`vocabulary`).

On disk (:func:`encode_record`, read back by :func:`decode_record`) each list of contexts is
packed: the windows' token ids (``uint16``, or ``int32`` for vocabularies of 65,535 tokens or
more; zlib-compressed, which a browser inflates with ``DecompressionStream("deflate")``), their
activations (``int8`` in steps of ``as``, 1/127 of the largest ``|activation|`` among the
record's windows: enough for a hover, a quarter of a float32's bytes) and self weights
(``uint8``, in steps of 1/255) as base64 strings, with the rows, positions and exact centre
activations (to :data:`DIGITS` places) as lists; the histogram's edges, the same for every
neuron, are in the atlas's manifest. That keeps a neuron of SmolLM2 at about 5 kB.
"""

from __future__ import annotations

import base64
import copy
import re
import zlib
from typing import Any

import numpy as np
import torch

from tl_attnonly.analysis.summaries.collect import token_text
from tl_attnonly.atlas.state import EMPTY, AtlasOptions, bucket_edges, fixed_value, hist_edges

#: The sign quadrants of a gated neuron, in the order the state counts them:
#: ``2 * (g <= 0) + (u <= 0)``.
QUADRANTS = ("g+u+", "g+u-", "g-u+", "g-u-")
#: Decimal places kept in the JSON.
DIGITS = 4
#: Steps of a stored window activation on each side of 0 (``int8``).
ACT_LEVELS = 127


def label(layer: int, neuron: int) -> str:
    """``L{layer}N{neuron}``."""
    return f"L{layer}N{neuron}"


def parse_label(text: str) -> tuple[int, int]:
    """``(layer, neuron)`` of a label ``L{layer}N{neuron}`` (surrounding spaces allowed).

    Raises:
        KeyError: If ``text`` is not such a label.
    """
    match = re.fullmatch(r"L(\d+)N(\d+)", text.strip())
    if not match:
        raise KeyError(f"{text!r} is not a neuron label (labels like 'L0N0').")
    return int(match[1]), int(match[2])


def vocabulary(tokenizer: Any, d_vocab: int) -> list[str]:
    """Every token's text (``tokenizer.decode``; ``[id]`` without a tokenizer)."""
    return [token_text(tokenizer, i) for i in range(d_vocab)]


def _r(values: torch.Tensor) -> list[float]:
    return [round(float(v), DIGITS) for v in values.tolist()]


def edge_list(opts: AtlasOptions) -> list[float]:
    """The histogram's bin edges as the records and the manifest store them."""
    return _r(hist_edges(opts))


def contexts(sel: dict[str, torch.Tensor], group: int, opts: AtlasOptions, max_len: int) -> list:
    """The non-empty contexts of ``group`` in the selection ``sel`` (state tensors, on CPU)."""
    out = []
    for slot in range(sel["gidx"].shape[1]):
        gidx = int(sel["gidx"][group, slot])
        if gidx == EMPTY:
            continue
        acts = sel["act"][group, slot]
        out.append({
            "tokens": sel["tokens"][group, slot].tolist(),
            "acts": _r(acts),
            "self": _r(sel["self"][group, slot]),
            "row": gidx // max_len,
            "pos": gidx % max_len,
            "act": round(float(acts[opts.before]), DIGITS),
        })  # fmt: skip
    return out


def neuron_record(
    layer_state: dict[str, Any],
    layer: int,
    neuron: int,
    *,
    opts: AtlasOptions,
    max_len: int,
    n_tokens: int,
    logits: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    vocab: list[str],
) -> dict[str, Any]:
    """The record of neuron ``neuron`` of layer ``layer`` (module docstring).

    Args:
        layer_state: The layer's state, on CPU.
        layer, neuron: Which neuron.
        opts: The atlas's options.
        max_len: The row length of the global token indices.
        n_tokens: Tokens seen.
        logits: The layer's :func:`~tl_attnonly.atlas.build.logit_effect` (on CPU).
        vocab: Every token's text.
    """
    st, i = layer_state, neuron
    top_v, top_i, bot_v, bot_i = (t[i] for t in logits)
    hist = st["hist"][i]
    q_edges = bucket_edges(opts).tolist()
    quantiles = []
    for b in range(opts.n_buckets):
        examples = contexts(st["quant"], i * opts.n_buckets + b, opts, max_len)
        if examples:
            hi = q_edges[b + 1] if b + 1 < opts.n_buckets else None
            quantiles.append({"range": [round(q_edges[b], DIGITS), hi and round(hi, DIGITS)],
                              "examples": examples})  # fmt: skip
    record: dict[str, Any] = {
        "index": label(layer, neuron),
        "layer": layer,
        "neuron": neuron,
        "act_min": round(float(st["act_min"][i]), DIGITS),
        "act_max": round(float(st["act_max"][i]), DIGITS),
        "act_mean": round(float(fixed_value(st["act_sum"][i])) / max(n_tokens, 1), DIGITS),
        "activation_frequency": int(st["fire"][i]) / max(n_tokens, 1),
        "n_tokens": n_tokens,
        "histogram": {"edges": edge_list(opts), "counts": hist.tolist()},
        "top_logits": [
            [vocab[t], round(float(v), DIGITS)] for t, v in zip(top_i.tolist(), top_v)
        ],  # fmt: skip
        "bottom_logits": [
            [vocab[t], round(float(v), DIGITS)] for t, v in zip(bot_i.tolist(), bot_v)
        ],  # fmt: skip
        "top_examples": contexts(st["top"], i, opts, max_len),
        "examples_quantiles": quantiles,
        "quadrants": None,
    }
    if "quad" in st:
        record["quadrants"] = {
            name: {"count": int(st["quad_count"][i, q]),
                   "examples": contexts(st["quad"], i * 4 + q, opts, max_len)}
            for q, name in enumerate(QUADRANTS)
        }  # fmt: skip
    return record


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(array.tobytes()).decode("ascii")


def pack_contexts(contexts: list[dict[str, Any]], d_vocab: int) -> dict[str, Any]:
    """A list of contexts as one packed object (module docstring)."""
    wide = d_vocab >= 65535
    tokens = np.array([c["tokens"] for c in contexts], dtype=np.int64).reshape(len(contexts), -1)
    if not wide:
        tokens = np.where(tokens < 0, 65535, tokens)
    acts = np.array([c["acts"] for c in contexts], dtype=np.float64)
    self_w = np.array([c["self"] for c in contexts], dtype=np.float64)
    peak = float(np.abs(acts).max()) if acts.size else 0.0
    step = peak / ACT_LEVELS if peak > 0 else 1.0
    token_bytes = tokens.astype("<i4" if wide else "<u2").tobytes()
    return {
        "n": len(contexts),
        "w": int(tokens.shape[1]),
        "tb": 4 if wide else 2,
        "tokz": base64.b64encode(zlib.compress(token_bytes, 9)).decode("ascii"),
        "a8": _b64(np.clip(np.rint(acts / step), -ACT_LEVELS, ACT_LEVELS).astype(np.int8)),
        "as": step,
        "self": _b64(np.round(np.clip(self_w, 0, 1) * 255).astype(np.uint8)),
        "row": [c["row"] for c in contexts],
        "pos": [c["pos"] for c in contexts],
        "act": [c["act"] for c in contexts],
    }


def unpack_contexts(packed: dict[str, Any]) -> list[dict[str, Any]]:
    """The contexts of :func:`pack_contexts` (activations and self weights as stored)."""
    n, w = packed["n"], packed["w"]
    if n == 0:
        return []
    raw = zlib.decompress(base64.b64decode(packed["tokz"]))
    acts = np.frombuffer(base64.b64decode(packed["a8"]), dtype=np.int8) * packed["as"]
    tokens = np.frombuffer(raw, dtype="<i4" if packed["tb"] == 4 else "<u2").astype(np.int64)
    if packed["tb"] == 2:
        tokens = np.where(tokens == 65535, -1, tokens)
    self_w = np.frombuffer(base64.b64decode(packed["self"]), dtype=np.uint8) / 255.0
    tokens, acts, self_w = tokens.reshape(n, w), acts.reshape(n, w), self_w.reshape(n, w)
    return [{"tokens": tokens[i].tolist(), "acts": [round(float(a), DIGITS) for a in acts[i]],
             "self": [round(float(x), DIGITS) for x in self_w[i]], "row": packed["row"][i],
             "pos": packed["pos"][i], "act": packed["act"][i]} for i in range(n)]  # fmt: skip


def _holders(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The objects holding the record's other lists of contexts (under ``examples``): the
    quantile buckets, then the quadrants."""
    return [*record["examples_quantiles"], *(record.get("quadrants") or {}).values()]


def encode_record(record: dict[str, Any], d_vocab: int) -> dict[str, Any]:
    """The record as the site stores it: every distinct context once, packed, in ``pool``
    (:func:`pack_contexts`), each list of contexts a list of indices into it; no histogram
    edges."""
    out = copy.deepcopy(record)
    pool: list[dict[str, Any]] = []
    where: dict[tuple[int, int], int] = {}

    def indices(contexts: list[dict[str, Any]]) -> list[int]:
        for context in contexts:
            where.setdefault((context["row"], context["pos"]), len(where))
            if len(pool) < len(where):
                pool.append(context)
        return [where[(c["row"], c["pos"])] for c in contexts]

    out["top_examples"] = indices(out["top_examples"])
    for holder in _holders(out):
        holder["examples"] = indices(holder["examples"])
    out["pool"] = pack_contexts(pool, d_vocab)
    out["histogram"] = {"counts": out["histogram"]["counts"]}
    return out


def decode_record(data: dict[str, Any], hist_edges: list[float]) -> dict[str, Any]:
    """The record :func:`encode_record` stored (``hist_edges``: the manifest's)."""
    out = copy.deepcopy(data)
    pool = unpack_contexts(out.pop("pool"))
    out["top_examples"] = [pool[i] for i in out["top_examples"]]
    for holder in _holders(out):
        holder["examples"] = [pool[i] for i in holder["examples"]]
    out["histogram"] = {"edges": hist_edges, "counts": out["histogram"]["counts"]}
    return out


def top_tokens(record: dict[str, Any], vocab: list[str], before: int, n: int = 3) -> list[str]:
    """The ``n`` most frequent centre tokens of the record's top contexts (ties: by rank)."""
    counts: dict[int, int] = {}
    for example in record["top_examples"]:
        token = example["tokens"][before]
        counts[token] = counts.get(token, 0) + 1
    ranked = sorted(counts, key=lambda t: -counts[t])  # stable: first seen first among ties
    return [vocab[t] for t in ranked[:n] if t >= 0]


def centre_tokens(record: dict[str, Any], before: int) -> list[float]:
    """The distinct centre tokens of the record's top contexts, flat: ``[id, count, act, ...]``
    (``act``: the largest centre activation among those contexts), most frequent first (ties:
    by rank). What :meth:`~tl_attnonly.atlas.notebook.Atlas.search` reads."""
    found: dict[int, list[float]] = {}
    for example in record["top_examples"]:
        token = example["tokens"][before]
        if token >= 0:
            entry = found.setdefault(token, [token, 0, example["act"]])
            entry[1] += 1
            entry[2] = max(entry[2], example["act"])
    ranked = sorted(found.values(), key=lambda e: -e[1])  # stable: first seen first among ties
    return [x for entry in ranked for x in entry]


__all__ = [
    "ACT_LEVELS",
    "DIGITS",
    "QUADRANTS",
    "centre_tokens",
    "contexts",
    "decode_record",
    "edge_list",
    "encode_record",
    "label",
    "neuron_record",
    "pack_contexts",
    "parse_label",
    "top_tokens",
    "unpack_contexts",
    "vocabulary",
]
