"""``benchmarks/bench_discovery_scaling.py`` runs end to end on a tiny random model (issue 47,
item 5: the default call's time and memory against model size and prompt count)."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_discovery_scaling_prints_a_row_per_model_and_prompt_count(capsys):
    bench = runpy.run_path(str(ROOT / "benchmarks" / "bench_discovery_scaling.py"), run_name="b")
    rows = bench["main"](["--scales", "tiny", "--prompt-counts", "4", "--prompts", "2", "--pos",
                          "8", "--threads", "1"])  # fmt: skip
    out = capsys.readouterr().out
    assert out.startswith("config: random Llama-like models, fp32, converted TransformerBridge")
    assert [(row["model"], row["prompts"]) for row in rows] == [("tiny", 2), ("tiny", 4)]
    assert all(row["total_s"] > 0 and row["parameters"] > 0 for row in rows)
    table = re.findall(r"^\| tiny \| [\d.]+M \| (\d+) \| [\d.]+ s \| [\d.]+ s \| [\d,]+ MiB \| "
                       r"[\d,]+ edges \|$", out, flags=re.M)  # fmt: skip
    assert table == ["2", "4"]
