"""``benchmarks/bench_forward.py`` end to end on a small config: its rows exist and its
conversion-memory figures are right for every model of a run, not only the first."""

from __future__ import annotations

import os
import re
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_conversion_memory_is_measured_afresh_for_every_model(monkeypatch, capsys):
    """Copying holds the model twice (about 2x), sharing once (about 1x), for the second model
    of a run too (measured in one process, it read 1.00x copying: freed pages were reused)."""
    # the conversion-memory child process imports this checkout's package
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    bench = runpy.run_path(str(ROOT / "benchmarks" / "bench_forward.py"), run_name="bench_forward")
    argv = ["bench_forward.py", "--layers", "1", "--vocab", "1000", "--shapes", "1x512"]
    monkeypatch.setattr(sys, "argv", [*argv, "--repeats", "1", "--act", "silu", "gelu_new"])
    bench["main"]()
    out = capsys.readouterr().out
    copy = re.findall(
        r"\| (\w+) \| conversion peak memory / model size \(copy\) \| 1 \| ([\d.]+)", out
    )
    share = re.findall(
        r"\| (\w+) \| conversion peak memory / model size \(share_weights=True\) \| 1 \| ([\d.]+)",
        out,
    )
    assert [act for act, _ in copy] == ["silu", "gelu_new"], out
    for act, ratio in copy:
        assert 1.8 <= float(ratio) <= 2.3, (act, ratio)
    for act, ratio in share:
        assert float(ratio) <= 1.05, (act, ratio)
    assert out.count("| forward, batch 1, N=512 |") == 2
