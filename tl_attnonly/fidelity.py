"""How faithful is the attention-only encoder? Hidden states, sentence embeddings, rankings.

For a BERT-style :class:`~transformer_lens.HookedEncoder` (e.g. ``all-MiniLM-L6-v2`` from
:func:`tl_attnonly.minilm.load_minilm`), :func:`fidelity_table` converts the model once per
approximation (the paper's one-head ``x * sigmoid(1.702 x)``, then the fitted ``K``-head GELUs
for ``K = 1..max_heads``) and measures, on real sentences:

* ``max_abs_dhidden`` / ``mean_abs_dhidden``: max and mean ``|converted - original|`` of the final
  hidden states, over every non-padding token and feature;
* ``min_pooled_cos``: the smallest cosine similarity, over sentences, between the converted and the
  original mean-pooled sentence embedding;
* ``spearman``: Spearman's rank correlation between the original and converted cosine similarities
  of all sentence pairs, and ``discordant_pairs``: how many pairs-of-pairs swap order
  (0 = ranking preserved exactly);
* ``act_max_err``: the approximation's own max ``|heads(x) - GELU(x)|`` over its fit range.

:func:`preactivation_stats` reports the MLP pre-activations the heads actually see (per layer max
``|x|``, 99.9th percentile, how many exceed the fit range and where). The bundled sentences
(:func:`load_sentences`) are 60 English sentences; lines ``2i`` and ``2i + 1`` for ``i < 20`` are
paraphrases of each other, so the pair similarities span near-duplicates to unrelated.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F
from jaxtyping import Float
from transformer_lens import HookedEncoder

from tl_attnonly.corpora import load_sentences
from tl_attnonly.fidelity_lm import to_markdown
from tl_attnonly.hooked.encoder import convert_encoder
from tl_attnonly.hooks import neuron_act_name
from tl_attnonly.minilm import DEFAULT_MAX_LENGTH, encode_sentences, tokenize
from tl_attnonly.options import ConversionOptions

#: The column order of :func:`fidelity_table`.
FIDELITY_COLUMNS = (
    "method",
    "K",
    "act_max_err",
    "max_abs_dhidden",
    "mean_abs_dhidden",
    "min_pooled_cos",
    "spearman",
    "discordant_pairs",
    "seconds",
)

#: Pre-activations beyond this magnitude count as "large" in :func:`preactivation_stats`.
LARGE_PREACTIVATION = 20.0


@dataclass
class EncodedSentences:
    """An encoder's outputs on a list of sentences (see :func:`encode_for_fidelity`).

    Attributes:
        hidden: Per sentence, the final hidden states of its real tokens, ``[n_tokens, d_model]``.
        pooled: Mean-pooled (not normalised) sentence embeddings, ``[n_sentences, d_model]``.
    """

    hidden: list[Float[torch.Tensor, "pos d_model"]]
    pooled: Float[torch.Tensor, "batch d_model"]


def _length_buckets(
    tokenizer: Any, sentences: Sequence[str], max_length: int, batch_size: int
) -> list[list[int]]:
    """Sentence indices in batches of similar token length (little padding)."""
    if isinstance(sentences, str):
        raise TypeError("Pass a list of sentences, not a single string.")
    ids = tokenizer(list(sentences), truncation=True, max_length=max_length)["input_ids"]
    order = sorted(range(len(sentences)), key=lambda i: len(ids[i]))
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def encode_for_fidelity(
    model: HookedEncoder,
    tokenizer: Any,
    sentences: Sequence[str],
    max_length: int = DEFAULT_MAX_LENGTH,
    batch_size: int = 16,
) -> EncodedSentences:
    """Per-sentence final hidden states (real tokens only) and mean-pooled embeddings.

    Sentences are batched by token length, so little time goes into padding; a sentence's result
    does not depend on the batch it lands in (padding is masked out of attention).
    """
    hidden: list[torch.Tensor] = [torch.empty(0)] * len(sentences)
    pooled: list[torch.Tensor] = [torch.empty(0)] * len(sentences)
    for idx in _length_buckets(tokenizer, sentences, max_length, batch_size):
        h, p, mask = encode_sentences(
            model, tokenizer, [sentences[i] for i in idx], normalize=False, max_length=max_length
        )
        for row, i in enumerate(idx):
            hidden[i] = h[row, : int(mask[row].sum())]
            pooled[i] = p[row]
    return EncodedSentences(hidden, torch.stack(pooled))


def spearman(a: Float[torch.Tensor, " n"], b: Float[torch.Tensor, " n"]) -> float:
    """Spearman's rank correlation of two 1-d tensors (ranks by sorting; ties are not averaged)."""
    ranks = []
    for x in (a, b):
        r = torch.empty_like(x, dtype=torch.float64)
        r[x.argsort()] = torch.arange(len(x), dtype=torch.float64)
        ranks.append(r - r.mean())
    ra, rb = ranks
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def discordant_pairs(a: Float[torch.Tensor, " n"], b: Float[torch.Tensor, " n"]) -> int:
    """How many pairs ``(i, j)`` are ordered differently by ``a`` and ``b`` (0: same ranking)."""
    sa = torch.sign(a.unsqueeze(0) - a.unsqueeze(1))
    sb = torch.sign(b.unsqueeze(0) - b.unsqueeze(1))
    return int((sa != sb).triu(1).sum())


def pair_similarities(
    pooled: Float[torch.Tensor, "batch d_model"],
) -> Float[torch.Tensor, " n_pairs"]:
    """Cosine similarities of all sentence pairs ``i < j`` (``batch * (batch - 1) / 2`` values)."""
    unit = F.normalize(pooled.double(), dim=-1)
    sims = unit @ unit.T
    i, j = torch.triu_indices(len(pooled), len(pooled), offset=1)
    return sims[i, j]


def per_sentence_fidelity(reference: EncodedSentences, converted: EncodedSentences) -> pd.DataFrame:
    """Per sentence: ``max_abs_dhidden``, ``mean_abs_dhidden``, ``pooled_cos``, ``n_tokens``."""
    cos = F.cosine_similarity(converted.pooled.double(), reference.pooled.double(), dim=-1)
    records = []
    for i, (ref, conv) in enumerate(zip(reference.hidden, converted.hidden, strict=True)):
        delta = (conv.double() - ref.double()).abs()  # [n_tokens, d_model]
        records.append(
            {
                "max_abs_dhidden": float(delta.max()),
                "mean_abs_dhidden": float(delta.mean()),
                "pooled_cos": float(cos[i]),
                "n_tokens": len(ref),
            }
        )
    return pd.DataFrame.from_records(records)


def compare_encoders(
    reference: HookedEncoder | EncodedSentences,
    converted: HookedEncoder,
    tokenizer: Any,
    sentences: Sequence[str],
    max_length: int = DEFAULT_MAX_LENGTH,
) -> dict[str, float]:
    """Fidelity of ``converted`` to ``reference`` on ``sentences``.

    Args:
        reference: The original encoder, or its :func:`encode_for_fidelity` outputs.
        converted: The converted encoder.
        tokenizer: The tokenizer of both.
        sentences: At least 3 sentences.
        max_length: Truncation length in tokens.

    Returns:
        ``max_abs_dhidden``, ``mean_abs_dhidden`` (over every real token and feature),
        ``min_pooled_cos`` (over sentences), ``spearman`` and ``discordant_pairs`` (of the cosine
        similarities of all sentence pairs).
    """
    if len(sentences) < 3:
        raise ValueError(
            f"Need at least 3 sentences to rank pair similarities, got {len(sentences)}."
        )
    if not isinstance(reference, EncodedSentences):
        reference = encode_for_fidelity(reference, tokenizer, sentences, max_length)
    ours = encode_for_fidelity(converted, tokenizer, sentences, max_length)
    per_sentence = per_sentence_fidelity(reference, ours)
    n_tokens = per_sentence["n_tokens"]
    ref_sims, sims = pair_similarities(reference.pooled), pair_similarities(ours.pooled)
    return {
        "max_abs_dhidden": float(per_sentence["max_abs_dhidden"].max()),
        "mean_abs_dhidden": float(
            (per_sentence["mean_abs_dhidden"] * n_tokens).sum() / n_tokens.sum()
        ),
        "min_pooled_cos": float(per_sentence["pooled_cos"].min()),
        "spearman": spearman(ref_sims, sims),
        "discordant_pairs": discordant_pairs(ref_sims, sims),
    }


def fidelity_table(
    model: HookedEncoder,
    tokenizer: Any,
    sentences: Sequence[str],
    max_heads: int = 6,
    include_paper: bool = True,
    max_length: int = DEFAULT_MAX_LENGTH,
) -> pd.DataFrame:
    """Fidelity of the attention-only encoder for each GELU approximation.

    Converts ``model`` (untouched) once per row -- the paper's one-head ``x * sigmoid(1.702 x)``
    (``method="paper"``), then the fitted approximations with ``K = 1..max_heads`` heads per
    neuron (``method="fit"``) -- and compares it with ``model`` on ``sentences`` (see
    :func:`compare_encoders`), in the model's dtype.

    Args:
        model: A GELU ``HookedEncoder`` (e.g. from :func:`tl_attnonly.minilm.load_minilm`).
        tokenizer: Its tokenizer.
        sentences: The sentences, e.g. :func:`load_sentences`.
        max_heads: Largest ``K``.
        include_paper: Include the paper's one-head row.
        max_length: Truncation length in tokens.

    Returns:
        One row per approximation, columns :data:`FIDELITY_COLUMNS` (``seconds``: conversion plus
        encoding the sentences).
    """
    rows = [ConversionOptions(gelu_method="paper")] if include_paper else []
    rows += [ConversionOptions(n_heads_per_neuron=k) for k in range(1, max_heads + 1)]
    reference = encode_for_fidelity(model, tokenizer, sentences, max_length)
    records = []
    for options in rows:
        start = time.perf_counter()
        converted = convert_encoder(model, conversion=options).eval()
        metrics = compare_encoders(reference, converted, tokenizer, sentences, max_length)
        seconds = time.perf_counter() - start
        coefficients = converted.coefficients
        records.append(
            {
                "method": options.gelu_method,
                "K": coefficients.n_heads,
                "act_max_err": coefficients.max_abs_error(),
                **metrics,
                "seconds": seconds,
            }
        )
        del converted
    return pd.DataFrame.from_records(records, columns=list(FIDELITY_COLUMNS))


def preactivation_stats(
    model: HookedEncoder,
    tokenizer: Any,
    sentences: Sequence[str],
    large: float = LARGE_PREACTIVATION,
    max_length: int = DEFAULT_MAX_LENGTH,
    batch_size: int = 16,
) -> pd.DataFrame:
    """The MLP pre-activations (``blocks.{l}.mlp.hook_pre``) over the real (non-padding) tokens.

    Returns:
        One row per layer: ``max_abs``, ``p99_9_abs`` (99.9th percentile of ``|x|``), ``min``,
        ``max``, ``n_large`` (entries with ``|x| > large``), ``n_large_tokens`` (tokens with any
        such entry) and ``large_at_cls`` (how many of those are the ``[CLS]`` token, position 0).
    """
    n_layers = model.cfg.n_layers
    pres: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]  # [n_tokens, d_mlp] chunks
    is_cls: list[torch.Tensor] = []  # [n_tokens] chunks
    device = next(model.parameters()).device
    for idx in _length_buckets(tokenizer, sentences, max_length, batch_size):
        enc = tokenize(tokenizer, [sentences[i] for i in idx], max_length)
        mask = enc["attention_mask"].to(device)
        with torch.no_grad():
            _, cache = model.run_with_cache(
                enc["input_ids"].to(device),
                return_type=None,
                token_type_ids=enc["token_type_ids"].to(device),
                one_zero_attention_mask=mask,
                names_filter=lambda name: name.endswith("mlp.hook_pre"),
            )
        real = mask.bool()  # [batch, pos]
        position = torch.arange(real.shape[1], device=device).expand_as(real)
        is_cls.append(position[real] == 0)
        for layer in range(n_layers):
            pres[layer].append(cache[neuron_act_name("pre", layer)][real].double())
    cls = torch.cat(is_cls)
    records = []
    for layer in range(n_layers):
        x = torch.cat(pres[layer])  # [n_tokens, d_mlp]
        big = (x.abs() > large).any(-1)  # [n_tokens]
        records.append(
            {
                "layer": layer,
                "max_abs": float(x.abs().max()),
                "p99_9_abs": float(torch.quantile(x.abs().flatten().float()[:16_000_000], 0.999)),
                "min": float(x.min()),
                "max": float(x.max()),
                "n_large": int((x.abs() > large).sum()),
                "n_large_tokens": int(big.sum()),
                "large_at_cls": int((big & cls).sum()),
            }
        )
    return pd.DataFrame.from_records(records)


def activation_error_at(
    options: ConversionOptions, act_fn: str, xs: Sequence[float]
) -> list[float]:
    """``|heads(x) - act(x)|`` (float64) of the approximation ``options`` picks, at ``xs``.

    Used to say what the fit does at pre-activations outside its fit range.
    """
    coefficients = options.coefficients(act_fn)
    x = torch.tensor(list(xs), dtype=torch.float64)
    return [float(v) for v in (coefficients.evaluate(x) - coefficients.reference(x)).abs()]


__all__ = [
    "FIDELITY_COLUMNS",
    "LARGE_PREACTIVATION",
    "EncodedSentences",
    "activation_error_at",
    "compare_encoders",
    "discordant_pairs",
    "encode_for_fidelity",
    "fidelity_table",
    "load_sentences",
    "pair_similarities",
    "per_sentence_fidelity",
    "preactivation_stats",
    "spearman",
    "to_markdown",
]
