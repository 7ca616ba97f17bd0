"""``benchmarks/bench_scale.py --quick`` runs end to end, so the scaling table cannot rot."""

from __future__ import annotations

import json
import os
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_scale_quick_prints_the_tables_and_json(tmp_path, monkeypatch, capsys):
    # the peak-memory child process imports this checkout's package
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    bench = runpy.run_path(str(ROOT / "benchmarks" / "bench_scale.py"), run_name="bench_scale")
    out_json = tmp_path / "scale.json"
    bench["main"](["--quick", "--json", str(out_json)])
    out = capsys.readouterr().out
    configs = list(bench["CONFIGS"])
    for name in configs:
        assert f"### {name}" in out
    assert out.count("| d_mlp | N | fwd orig (s) |") == len(configs)
    assert out.count("Slopes (log-log exponent") == len(configs)
    assert "| literal form: time / peak forward |" in out  # it fits at --quick's sizes
    rows = json.loads(out_json.read_text())["rows"]
    assert len(rows) == len(configs) * 2 * 2  # configs x d_mlp x N of --quick
    for row in rows:
        assert min(row["fwd_o"], row["fwd_c"], row["rwc_o"], row["rwc_c"]) > 0
        assert {"peak_fwd_o", "peak_fwd_c", "peak_rwc_o", "peak_rwc_c"} <= row.keys()
        assert "literal_s" in row or row["literal"].startswith("over budget")
    # the slope fit itself: exact on a power law
    assert abs(bench["slope"]([128, 256, 512], [3.0, 12.0, 48.0]) - 2.0) < 1e-12
