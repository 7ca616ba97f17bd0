"""``benchmarks/bench_atlas.py`` runs end to end on the bundled model, so the table in
docs/atlas.md cannot rot."""

from __future__ import annotations

import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_atlas_prints_the_table(capsys):
    bench = runpy.run_path(str(ROOT / "benchmarks" / "bench_atlas.py"), run_name="bench_atlas")
    bench["main"](["--models", "bundled", "--rows", "8", "--warm-rows", "0", "8",
                   "--repeats", "1", "--batch-size", "4"])  # fmt: skip
    out = capsys.readouterr().out
    assert "| model | state before (rows) | forward tokens/s | atlas tokens/s |" in out
    rows = [line for line in out.splitlines() if line.startswith("| bundled |")]
    assert [row.split("|")[2].strip() for row in rows] == ["0", "8"]
    for row in rows:
        assert 0 < float(row.split("|")[5]) < 10  # a ratio atlas / forward
