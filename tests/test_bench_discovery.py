"""``benchmarks/bench_discovery.py`` end to end on small configs: every stage of the default
``discover_circuit`` is printed with its configuration, and the ``--gpt2-small`` two-stage
measurement still runs."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER

ROOT = Path(__file__).resolve().parents[1]
# the default call's stages (it names no neuron: no "neurons" stage)
STAGES = ("edge scores", "sweep", "pruning", "MIB curve", "node patching", "gate/value")


def _bench():
    return runpy.run_path(str(ROOT / "benchmarks" / "bench_discovery.py"), run_name="bench")


def test_default_discovery_prints_each_stage_and_the_peak_memory_with_its_config(capsys):
    _bench()["main"](["--examples", "4", "--threads", "1"])
    lines = capsys.readouterr().out.splitlines()
    kind = "" if HAS_HOOKED_TRANSFORMER else ", converted TransformerBridge"  # the default kind
    config = f"[bundled tiny-stdlib-silu fp32{kind}, bracket task 4 prompts x 6 tokens, batch all, "
    assert lines and all(line.startswith(config) for line in lines), lines
    seconds = {}
    for stage in STAGES:
        [match] = [re.search(rf"\] {re.escape(stage)}: ([\d.]+) s$", line) for line in lines
                   if f"] {stage}: " in line]  # fmt: skip
        seconds[stage] = float(match.group(1))
    [total] = [line for line in lines if "] total: " in line]
    stages = float(re.search(r"\(stages ([\d.]+) s\)", total).group(1))
    assert abs(stages - sum(seconds.values())) < 0.1 * len(STAGES)
    assert float(re.search(r"total: ([\d.]+) s", total).group(1)) >= stages - 0.05
    assert re.search(r"peak memory above the loaded model \d+ MiB$", total)
    [circuit] = [line for line in lines if "] circuit: " in line]
    assert re.search(r"coarse \d+ of 125 edges, faithfulness [\d.]+ \(ceiling 1\.000", circuit)
    assert re.search(r"\d+ exact sweep runs, [1-9]\d* pruning runs", circuit)


def test_auto_neuron_stage_prints_its_table_and_runs(capsys):
    """``--neurons-per-mlp auto`` prints the stage's table and totals (the default joint
    search's table has no ``runs`` column: the count comes from the circuit)."""
    _bench()["main"](["--examples", "4", "--threads", "1", "--neurons-per-mlp", "auto"])
    out = capsys.readouterr().out
    assert "defaults but neurons_per_mlp=auto" in out
    [totals] = [line for line in out.splitlines() if "] neuron stage: " in line]
    assert re.search(r"\d+ named neurons, \d+ remainder\(s\) kept, [1-9]\d* runs$", totals)


@pytest.mark.skipif(not HAS_HOOKED_TRANSFORMER, reason="both kinds need HookedTransformer")
def test_both_kinds_in_one_run_find_the_same_circuit(capsys):
    """``--kind both``: the AttnOnlyTransformer and the converted bridge of the bundled model, one
    after the other, then a line comparing the circuits and the times."""
    _bench()["main"](["--examples", "8", "--threads", "1", "--kind", "both"])
    lines = capsys.readouterr().out.splitlines()
    hooked = [line for line in lines if ", AttnOnlyTransformer, bracket" in line]
    bridge = [line for line in lines if ", converted TransformerBridge, bracket" in line]
    assert len(hooked) == len(bridge) == len(STAGES) + 2
    [compare] = [line for line in lines if "bridge vs AttnOnlyTransformer" in line]
    edges = re.search(r"circuit edges (\d+) vs (\d+), faithfulness ([\d.]+) vs ([\d.]+)", compare)
    assert edges.group(1) == edges.group(2) and edges.group(3) == edges.group(4)
    assert re.search(r"time [\d.]+x$", compare)


@pytest.mark.skipif(not HAS_HOOKED_TRANSFORMER, reason="a HookedTransformer-shaped random model")
def test_gpt2_small_two_stage_measurement_runs_on_a_small_config(capsys):
    argv = ["--gpt2-small", "--layers", "1", "--d-mlp", "32", "--vocab", "50", "--prompts", "2",
            "--pos", "4", "--n-nodes", "10", "--top-n", "5", "--threads", "1"]  # fmt: skip
    _bench()["main"](argv)
    out = capsys.readouterr().out
    tag = "[GPT-2-small-shaped 1L d_mlp 32 gelu, 2x4, batch 4, N=10 T=5, 1 threads]"
    assert out.startswith("config: 1 layers")
    assert f"{tag} restricted graph: " in out and f"{tag} two-stage total " in out


def test_repeats_print_medians_of_the_default_kind(capsys):
    """``--repeats``: a warm-up run, then medians; the lines keep their shape."""
    _bench()["main"](["--examples", "4", "--threads", "1", "--repeats", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(STAGES) + 2
    assert all(
        line.split("] ")[0].endswith(", median of 2 runs after a warm-up run") for line in lines
    )
    [total] = [line for line in lines if "] total: " in line]
    assert re.search(r"\(stages [\d.]+ s\), runs [\d.]+-[\d.]+ s, CPU [\d.]+ s; peak", total)
    assert lines[-1].endswith("; the same in every run")


def test_repeats_alternate_the_kinds_round_by_round(monkeypatch):
    """Both kinds loaded, one warm-up run each, then rounds in alternating order (a drift of the
    machine's load falls on both kinds alike); each kind's runs reported together."""
    measure = _bench()["measure_kinds"]
    order: list[str] = []
    monkeypatch.setitem(measure.__globals__, "_run", lambda kind, *rest: order.append(kind) or kind)
    monkeypatch.setitem(measure.__globals__, "_report", lambda config, runs: (config, runs))
    found = measure(
        ("hooked", "bridge"), lambda kind, note: (kind, 0, 0, 0, kind + note), 3, None, False
    )
    assert order == ["hooked", "bridge"] + [
        "hooked",
        "bridge",
        "bridge",
        "hooked",
        "hooked",
        "bridge",
    ]
    note = ", median of 3 runs interleaved with the other kind after a warm-up run"
    assert found == {kind: (kind + note, [kind] * 3) for kind in ("hooked", "bridge")}
    order.clear()
    found = measure(
        ("hooked", "bridge"), lambda kind, note: (kind, 0, 0, 0, kind + note), 1, None, False
    )
    assert order == ["hooked", "bridge"]  # one run: no warm-up, each kind in turn
    assert found == {kind: (kind, [kind]) for kind in ("hooked", "bridge")}


@pytest.mark.skipif(not HAS_HOOKED_TRANSFORMER, reason="both kinds need HookedTransformer")
def test_both_kinds_interleaved_print_the_ratio_of_medians(capsys):
    _bench()["main"](["--examples", "4", "--threads", "1", "--kind", "both", "--repeats", "2"])
    lines = capsys.readouterr().out.splitlines()
    note = ", median of 2 runs interleaved with the other kind after a warm-up run] "
    assert sum(note in line for line in lines) == 2 * (len(STAGES) + 2)
    [compare] = [line for line in lines if "bridge vs AttnOnlyTransformer" in line]
    assert re.search(
        r"medians of 2 interleaved runs, ratio per round [\d.]+-[\d.]+; CPU time [\d.]+x; "
        r"time [\d.]+x$",
        compare,
    )
    edges = re.search(r"circuit edges (\d+) vs (\d+), faithfulness ([\d.]+) vs ([\d.]+)", compare)
    assert edges.group(1) == edges.group(2) and edges.group(3) == edges.group(4)
