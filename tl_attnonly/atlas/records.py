"""One neuron's page as data: the JSON record the site and Jupyter show, from an atlas state.

Field names follow Neuronpedia's feature-details schema where one fits (``index``,
``examples_quantiles``, ``top_logits``, ``bottom_logits``, ``act_min``, ``act_max``,
``histogram``, ``activation_frequency``); the rest are this atlas's own (``top_examples``,
``quadrants``, ``self`` weights). A context is ``{"tokens": [ids], "acts": [...], "self": [...],
"row", "pos", "act"}``: its window's token ids (``-1``: outside the row), each token's activation
and self weight, the row and position of its centre token (``before`` tokens into the window) and
the centre's activation. Token strings are in the site's vocabulary (:func:`vocabulary`).
"""

from __future__ import annotations

from typing import Any

import torch

from tl_attnonly.analysis.summaries.collect import token_text
from tl_attnonly.atlas.state import EMPTY, AtlasOptions, bucket_edges, fixed_value, hist_edges

#: The sign quadrants of a gated neuron, in the order the state counts them:
#: ``2 * (g <= 0) + (u <= 0)``.
QUADRANTS = ("g+u+", "g+u-", "g-u+", "g-u-")
#: Decimal places kept in the JSON.
DIGITS = 4


def label(layer: int, neuron: int) -> str:
    """``L{layer}N{neuron}``."""
    return f"L{layer}N{neuron}"


def vocabulary(tokenizer: Any, d_vocab: int) -> list[str]:
    """Every token's text (``tokenizer.decode``; ``[id]`` without a tokenizer)."""
    return [token_text(tokenizer, i) for i in range(d_vocab)]


def _r(values: torch.Tensor) -> list[float]:
    return [round(float(v), DIGITS) for v in values.tolist()]


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
        "histogram": {"edges": _r(hist_edges(opts)), "counts": hist.tolist()},
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


def top_tokens(record: dict[str, Any], vocab: list[str], before: int, n: int = 3) -> list[str]:
    """The ``n`` most frequent centre tokens of the record's top contexts (ties: by rank)."""
    counts: dict[int, int] = {}
    for example in record["top_examples"]:
        token = example["tokens"][before]
        counts[token] = counts.get(token, 0) + 1
    ranked = sorted(counts, key=lambda t: -counts[t])  # stable: first seen first among ties
    return [vocab[t] for t in ranked[:n] if t >= 0]


__all__ = [
    "DIGITS",
    "QUADRANTS",
    "contexts",
    "label",
    "neuron_record",
    "top_tokens",
    "vocabulary",
]
