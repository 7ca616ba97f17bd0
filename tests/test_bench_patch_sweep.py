"""``benchmarks/bench_patch_sweep.py`` runs end to end on the bundled model (issue 47, item 4: a
patching sweep with the metric's declared positions against every position's logits)."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_patch_sweep_prints_both_sweeps_per_layer_and_their_agreement(capsys):
    bench = runpy.run_path(str(ROOT / "benchmarks" / "bench_patch_sweep.py"), run_name="bench")
    bench["main"](["--layers", "1", "--threads", "1"])
    out = capsys.readouterr().out
    assert out.startswith("config: bundled model, 2 random IOI-shaped pairs x 14")
    line = re.search(r"layer 1: ([\d,]+) patches; every position ([\d.]+) s, declared ([\d.]+) s "
                     r"\(([\d.]+)x\); max \|difference\| ([\d.e+-]+)", out)  # fmt: skip
    assert line is not None, out
    assert int(line[1].replace(",", "")) == 512  # the bundled model's d_mlp, K = 1
    assert float(line[5]) < 1e-4  # the same values
    assert re.search(r"total: every position [\d.]+ s, declared [\d.]+ s \([\d.]+x\)", out)


def test_bench_patch_sweep_whole_patches_every_neuron_head_and_checks_three(capsys):
    bench = runpy.run_path(str(ROOT / "benchmarks" / "bench_patch_sweep.py"), run_name="bench")
    bench["main"](["--whole", "--threads", "1"])
    out = capsys.readouterr().out
    assert re.search(r"every neuron-head: 1,024 patches in [\d.]+ s", out), out
    diff = re.search(r"one patch per forward pass: max \|difference\| ([\d.e+-]+)", out)
    assert diff is not None and float(diff[1]) < 1e-4
