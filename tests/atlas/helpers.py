"""What the atlas tests share: the bundled model as either kind, a small corpus of token rows,
and every token's activations read from the model's own hooks, one row at a time."""

from __future__ import annotations

import pytest
import torch

import tl_attnonly
from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER
from tl_attnonly.analysis.summaries import stdlib_corpus

MAX_LEN, N_ROWS, BATCH = 48, 8, 4
KINDS = ["hooked", "bridge"]


def bundled(kind: str):
    """The bundled model, converted, as ``kind`` (skipped where TransformerLens lacks it)."""
    from tl_attnonly.bundled import load_bundled_bridge, load_bundled_model

    if kind == "hooked":
        if not HAS_HOOKED_TRANSFORMER:
            pytest.skip("needs HookedTransformer (TransformerLens 3.x)")
        return tl_attnonly.convert(load_bundled_model())
    return tl_attnonly.convert(load_bundled_bridge())


def corpus_rows(model) -> list[torch.Tensor]:
    """:data:`N_ROWS` token rows of at most :data:`MAX_LEN` tokens (a few hundred tokens)."""
    rows: list[torch.Tensor] = []
    for doc in stdlib_corpus():
        tokens = model.to_tokens(doc)[0]
        rows.extend(tokens[s : s + MAX_LEN] for s in range(0, tokens.shape[0], MAX_LEN))
        if len(rows) >= N_ROWS:
            return rows[:N_ROWS]
    raise AssertionError("corpus too small")


def hooked_acts(model, rows: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Per layer, every token's ``post``, ``pre``, self weight ``[tokens, d_mlp]``, tokens and
    global index ``row * MAX_LEN + pos``, from ``run_with_cache`` of each row alone."""
    n_layers = model.cfg.n_layers
    out: list[dict[str, list]] = [{"post": [], "pre": [], "self": [], "lin": [], "gidx": []}
                                  for _ in range(n_layers)]  # fmt: skip
    for r, row in enumerate(rows):
        with torch.no_grad():
            _, cache = model.run_with_cache(row[None])
        for li in range(n_layers):
            pattern = cache[f"blocks.{li}.mlp.hook_pattern"][0, :, :, 0].T  # [pos, H]
            d_mlp = cache[f"blocks.{li}.mlp.hook_post"].shape[-1]
            k = pattern.shape[1] // d_mlp
            out[li]["post"].append(cache[f"blocks.{li}.mlp.hook_post"][0].float())
            out[li]["pre"].append(cache[f"blocks.{li}.mlp.hook_pre"][0].float())
            out[li]["self"].append(pattern[:, ::k].float())
            name = f"blocks.{li}.mlp.hook_pre_linear"
            if name in cache:
                out[li]["lin"].append(cache[name][0].float())
            out[li]["gidx"].append(r * MAX_LEN + torch.arange(row.shape[0]))
    return [{k: torch.cat(v) for k, v in layer.items() if v} for layer in out]
