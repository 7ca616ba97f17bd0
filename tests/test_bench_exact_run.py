"""``benchmarks/bench_exact_run.py`` runs end to end on the bundled model (the figures issue 47
asks for: one exact run over one forward pass of the same batch)."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_exact_run_prints_the_ratio_per_circuit_size(capsys):
    bench = runpy.run_path(str(ROOT / "benchmarks" / "bench_exact_run.py"), run_name="bench")
    bench["main"](["--sizes", "10", "all", "--runs", "1", "--repeats", "1", "--threads", "1"])
    out = capsys.readouterr().out
    assert out.startswith("config: bundled model, bracket task, 112 prompts")
    edges = int(re.search(r"coarse graph, ([\d,]+) edges", out)[1].replace(",", ""))
    lines = re.findall(r"circuit of top (\w+) edges \(([\d,]+) kept\): [\d.]+ ms per exact run, "
                       r"([\d.]+)x the forward pass", out)  # fmt: skip
    assert [size for size, _, _ in lines] == ["10", "all"]
    assert int(lines[0][1]) <= 10 and int(lines[1][1].replace(",", "")) == edges
    assert all(float(ratio) > 0 for _, _, ratio in lines)
