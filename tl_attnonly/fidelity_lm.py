"""How faithful is a converted language model? Logits of converted vs original on real prompts.

For a decoder (``HookedTransformer`` with a tokenizer, e.g. SmolLM2 from
:func:`tl_attnonly.smollm2.load_smollm2`) and its conversion, :func:`compare_lms` runs both on the
same prompts and measures, over every real (non-padding) token of every prompt:

* ``max_abs_dlogit`` / ``mean_abs_dlogit``: max and mean ``|converted - original|`` of the logits;
* ``max_abs_dlogprob``: max ``|Δ log_softmax(logits)|`` (what sampling and the loss see);
* ``top1_agreement``: the fraction of tokens whose most likely next token is the same;
* ``max_abs_logit``: the largest ``|logit|`` of the original, for scale.

Prompts are batched by length and padded on the right; in a causal model a token never attends to
the padding after it, so the real tokens' logits do not depend on the batch. The bundled prompts
(:func:`load_prompts`) are the 60 sentences of ``data/sentences.txt`` and the 240 of
``data/prompts.txt`` (facts, narrative, dialogue, code, numbers, IOI-style sentences; ``\\n`` in a
line is a newline).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch
from jaxtyping import Int

from tl_attnonly.corpora import load_prompts

if TYPE_CHECKING:
    from transformer_lens import HookedTransformer

#: The columns :func:`compare_lms` returns, in order.
LM_FIDELITY_COLUMNS = (
    "max_abs_dlogit",
    "mean_abs_dlogit",
    "max_abs_dlogprob",
    "top1_agreement",
    "max_abs_logit",
    "n_tokens",
)


def token_batches(
    tokenizer: Any, prompts: Sequence[str], batch_size: int = 16, pad_id: int = 0
) -> Iterator[tuple[Int[torch.Tensor, "batch pos"], Int[torch.Tensor, " batch"]]]:
    """Prompts tokenized (no BOS added), sorted by length, right-padded, in batches.

    Yields:
        ``(tokens, lengths)``: ``tokens[i, :lengths[i]]`` are prompt ``i``'s tokens.
    """
    if isinstance(prompts, str):
        raise TypeError("Pass a list of prompts, not a single string.")
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    for start in range(0, len(order), batch_size):
        chunk = [ids[i] for i in order[start : start + batch_size]]
        lengths = torch.tensor([len(c) for c in chunk])
        tokens = torch.full((len(chunk), int(lengths.max())), pad_id, dtype=torch.long)
        for row, c in enumerate(chunk):
            tokens[row, : len(c)] = torch.tensor(c)
        yield tokens, lengths


def compare_lms(
    original: HookedTransformer,
    converted: torch.nn.Module,
    prompts: Sequence[str],
    tokenizer: Any = None,
    batch_size: int = 16,
    progress: bool = False,
) -> dict[str, float]:
    """Logits of ``converted`` against ``original`` on ``prompts`` (see the module docstring).

    Args:
        original: The reference causal model (its dtype is used as is).
        converted: A model with the same vocabulary, e.g. ``tl_attnonly.convert(original)`` or the
            original in another dtype.
        prompts: The prompts.
        tokenizer: Default ``original.tokenizer``.
        batch_size: Prompts per forward pass.
        progress: Show a progress bar.

    Returns:
        The metrics of :data:`LM_FIDELITY_COLUMNS`, over every real token of every prompt.
    """
    models = {"original": original, "converted": converted}
    pairs = [("original", "converted")]
    return compare_lm_pairs(models, pairs, prompts, tokenizer, batch_size, progress)[pairs[0]]


def compare_lm_pairs(
    models: dict[str, torch.nn.Module],
    pairs: Sequence[tuple[str, str]],
    prompts: Sequence[str],
    tokenizer: Any = None,
    batch_size: int = 16,
    progress: bool = False,
) -> dict[tuple[str, str], dict[str, float]]:
    """:func:`compare_lms` for several ``(reference, other)`` pairs, one forward pass per model.

    Args:
        models: Named causal models with one vocabulary (on one device).
        pairs: ``(reference name, other name)`` pairs to compare.
        prompts: The prompts.
        tokenizer: Default: the first model's ``tokenizer``.
        batch_size: Prompts per forward pass.
        progress: Show a progress bar.

    Returns:
        Per pair, the metrics of :data:`LM_FIDELITY_COLUMNS`.
    """
    from tqdm.auto import tqdm

    first = next(iter(models.values()))
    cfg: Any = first.cfg
    if cfg.attention_dir != "causal":
        raise ValueError("compare_lms pads on the right, which is only safe for causal models.")
    tokenizer = tokenizer if tokenizer is not None else getattr(first, "tokenizer", None)
    if tokenizer is None:
        raise ValueError("The model has no tokenizer: pass tokenizer=....")
    unknown = sorted({name for pair in pairs for name in pair} - set(models))
    if unknown:
        raise KeyError(f"pairs name models {unknown} that are not in models {sorted(models)}")
    stats = {pair: {"worst": 0.0, "worst_lp": 0.0, "total": 0.0, "largest": 0.0, "agree": 0}
             for pair in pairs}  # fmt: skip
    n = 0
    device = next(first.parameters()).device
    batches = list(token_batches(tokenizer, prompts, batch_size))
    for tokens, lengths in tqdm(batches, desc="prompts", unit="batch", disable=not progress):
        real = (torch.arange(tokens.shape[1])[None, :] < lengths[:, None]).to(device)
        tokens = tokens.to(device)
        logits = {}
        with torch.no_grad():
            for name, model in models.items():
                logits[name] = model(tokens)[real].double()  # [n_real, d_vocab]
        logprobs = {name: x.log_softmax(-1) for name, x in logits.items()}
        for pair, s in stats.items():
            a, b = logits[pair[0]], logits[pair[1]]
            diff = (b - a).abs()
            s["worst"] = max(s["worst"], float(diff.max()))
            s["total"] += float(diff.sum())
            s["largest"] = max(s["largest"], float(a.abs().max()))
            lp = (logprobs[pair[1]] - logprobs[pair[0]]).abs()
            s["worst_lp"] = max(s["worst_lp"], float(lp.max()))
            s["agree"] += int((a.argmax(-1) == b.argmax(-1)).sum())
        n += int(real.sum())
        del logits, logprobs
    d_vocab = cfg.d_vocab_out
    return {
        pair: {
            "max_abs_dlogit": s["worst"],
            "mean_abs_dlogit": s["total"] / (n * d_vocab),
            "max_abs_dlogprob": s["worst_lp"],
            "top1_agreement": s["agree"] / n,
            "max_abs_logit": s["largest"],
            "n_tokens": float(n),
        }
        for pair, s in stats.items()
    }


def to_markdown(df: pd.DataFrame, floatfmt: dict[str, str] | None = None) -> str:
    """A GitHub markdown table of ``df`` (no ``tabulate`` needed); NaN cells are left empty.

    Args:
        df: The table.
        floatfmt: Format spec per column (default ``".3g"`` for floats).
    """
    floatfmt = floatfmt or {}
    header = "| " + " | ".join(str(c) for c in df.columns) + " |"
    rule = "|" + "|".join("---" for _ in df.columns) + "|"
    lines = [header, rule]
    for _, row in df.iterrows():
        cells = []
        for col in df.columns:
            value = row[col]
            if isinstance(value, float) and value != value:  # NaN: not measured
                cells.append("")
            elif isinstance(value, float):
                cells.append(format(value, floatfmt.get(col, ".3g")))
            else:
                cells.append(str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


__all__ = [
    "LM_FIDELITY_COLUMNS",
    "compare_lm_pairs",
    "compare_lms",
    "load_prompts",
    "to_markdown",
    "token_batches",
]
