"""Which TransformerBridge architectures convert exactly, approximately, or are refused: measured.

Builds every model of the bridge zoo (``tests/bridge/zoo.py``: tiny random Hugging Face models,
2 layers, d_model 64, d_mlp 96, vocab 128, built offline from their configs), wraps each in a
TransformerBridge (``build_bridge_from_module``), converts it with ``tl_attnonly.convert`` and
prints a Markdown table: architecture, MLP kind, activation, verdict, and max |converted -
unconverted| logit over a ``[2, 9]`` batch of random tokens:

* ``default fp64``: default options (fused path: for exact SiLU, TransformerLens's own ``F.silu``);
* ``heads fp64`` / ``heads fp32``: ``ConversionOptions(fused=False)``, every neuron-head evaluated.

Usage: ``python scripts/bridge_zoo_table.py`` (run from the repository root).
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "bridge"))

from zoo import ZOO, Measurement, measure  # noqa: E402


def _tl_version() -> str:
    from importlib.metadata import version

    return version("transformer-lens")


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.1e}"


def _reason(m: Measurement) -> str:
    text = m.reason.replace("|", "/").replace("\n", " ")
    if m.verdict in ("refused", "error"):
        # The message's first sentence says what is refused; the rest lists what is supported.
        text = text.split(". ")[0]
    return text


def table() -> str:
    """The Markdown table (one row per zoo model)."""
    rows = [
        "| zoo model | architecture | MLP | activation | verdict | default fp64 | heads fp64 "
        "| heads fp32 | reason |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, spec in ZOO.items():
        fp64 = torch.float32 if spec.no_fp64 else torch.float64
        default = measure(name, fp64)
        heads64 = measure(name, fp64, fused=False)
        heads32 = measure(name, torch.float32, fused=False)
        act = spec.act
        if default.act_fn and default.act_fn != spec.act:
            act += f" (as {default.act_fn})"
        if default.verdict == "approximate":
            act += f", max act err {default.act_error:.1e}"
        mlp = "BERT encoder, plain" if spec.encoder else spec.mlp
        note = _reason(default)
        if spec.no_fp64 and default.verdict != "refused":
            note = f"fp64 columns are fp32: {spec.no_fp64}"
        rows.append(
            f"| {name} | {spec.architecture} | {mlp} | {act} | {default.verdict} "
            f"| {_fmt(default.max_dlogit)} | {_fmt(heads64.max_dlogit)} "
            f"| {_fmt(heads32.max_dlogit)} | {note} |"
        )
    return "\n".join(rows)


def main() -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    start = time.perf_counter()
    body = table()
    print(
        f"TransformerLens {_tl_version()}, transformers {transformers.__version__}, "
        f"torch {torch.__version__}; {len(ZOO)} zoo models; "
        f"{time.perf_counter() - start:.0f} s.\n"
    )
    print(body)


if __name__ == "__main__":
    main()
