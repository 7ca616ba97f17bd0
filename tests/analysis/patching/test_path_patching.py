"""Receivers of path patching (tl_attnonly.analysis.patching.paths.parse_receiver)."""

from __future__ import annotations

import pytest
import torch
from conftest import patch_metric as _metric
from conftest import patch_token_pair as _pair_of_runs
from models import facts, make_converted

from tl_attnonly.analysis import (
    path_patch,
    path_patch_grid,
    path_patch_receiver_sweep,
    path_patch_sweep,
    receiver_label,
)
from tl_attnonly.analysis.patching.paths import Receiver, parse_receiver
from tl_attnonly.hooks import HeadRef


@pytest.mark.parametrize(
    ("ref", "inputs"),
    [(HeadRef("attn", 1, 0), "qkv"), (HeadRef("neuron", 0, 5), "qv")],
)
def test_a_head_ref_receives_all_its_inputs(ref, inputs):
    # A HeadRef is a NamedTuple: it must not be read as a (label, inputs) pair.
    assert parse_receiver(ref) == Receiver(ref, inputs)


def test_a_pair_names_the_inputs():
    ref = HeadRef("attn", 1, 0)
    assert parse_receiver((ref, "kq")) == Receiver(ref, "qk")
    assert parse_receiver(("L2N17.1", "v"), n_heads_per_neuron=2) == Receiver(
        HeadRef("neuron", 2, 35), "v"
    )
    with pytest.raises(ValueError, match="subset of 'qv'"):
        parse_receiver((HeadRef("neuron", 0, 1), "k"))


# ------------------------------------------------------------------------- sweeps over receivers
def _receivers(K: int) -> list[str]:
    k = (lambda i: f".{i}") if K > 1 else (lambda i: "")
    return ["L0H1:q", "L1H0:k", "L1H1", "L1H0:v", f"L1N3{k(1)}:v", f"L0N5{k(0)}", f"L1N7{k(2)}:q",
            "logits"]  # fmt: skip


@pytest.mark.parametrize(
    ("act", "overrides"),
    [
        ("gelu_new", dict(normalization_type="LN")),  # K = 4
        ("silu", dict(normalization_type="RMS", n_heads=4, d_head=4, n_key_value_heads=2)),  # GQA
    ],
)
def test_receiver_sweep_equals_one_path_patch_per_receiver(act, overrides):
    model = make_converted(act, torch.float64, **overrides)
    K = facts(model).n_heads_per_neuron
    receivers = _receivers(K)
    clean, corrupted = _pair_of_runs()
    senders = [
        "L0H0",
        *(r.split(":")[0] for r in _receivers(K)[5:6]),
        "L0N9" + (".3" if K > 1 else ""),
    ]
    swept, labels = path_patch_receiver_sweep(
        model, clean, corrupted, senders, _metric, receivers=receivers, patches_per_pass=3,
        progress=False,
    )  # fmt: skip
    assert labels == [receiver_label(parse_receiver(r, K), K) for r in receivers]
    assert labels[-1] == "logits" and swept.dtype == torch.float64
    single = torch.tensor(
        [path_patch(model, clean, corrupted, senders, [r], _metric) for r in receivers],
        dtype=torch.float64,
    )
    torch.testing.assert_close(swept, single, rtol=0, atol=1e-10)
    baseline = _metric(model(corrupted)).item()
    # L0H1 reads before L0 writes
    assert swept[0].item() == pytest.approx(baseline, abs=1e-12)
    assert (swept[1:] - baseline).abs().min() > 1e-7  # every later receiver is reached


def test_receiver_sweep_defaults_and_grid():
    model = make_converted("silu", torch.float64, normalization_type="LN")
    clean, corrupted = _pair_of_runs()
    swept, labels = path_patch_receiver_sweep(model, clean, corrupted, ["L0N4"], _metric,
                                              progress=False)  # fmt: skip
    n_neuron_heads = facts(model).n_neuron_heads
    n_heads = model.cfg.n_layers * (model.cfg.n_heads + n_neuron_heads)
    assert len(labels) == n_heads + 1 and labels[0] == "L0H0:qkv" and labels[-1] == "logits"
    assert labels[n_heads - 1] == f"L1N{n_neuron_heads - 1}:qv"
    senders, receivers = ["L0H1", "L0N4", "L1N0"], ["L1H0:q", "L1N3", "logits", "L0N2:v"]
    grid, rows, cols = path_patch_grid(
        model, clean, corrupted, senders, receivers, _metric, patches_per_pass=2, progress=False
    )
    assert rows == senders and cols == ["L1H0:q", "L1N3:qv", "logits", "L0N2:v"]
    expected = torch.tensor(
        [[path_patch(model, clean, corrupted, [s], [r], _metric) for r in receivers]
         for s in senders],
        dtype=torch.float64,
    )  # fmt: skip
    torch.testing.assert_close(grid, expected, rtol=0, atol=1e-10)
    assert grid.std() > 1e-4
    column = labels.index("L1N3:qv")
    assert swept[column].item() == pytest.approx(grid[1, 1].item(), abs=1e-10)


def test_sweeps_refuse_beyond_their_memory_budget():
    model = make_converted("silu", torch.float64, normalization_type="LN")
    clean, corrupted = _pair_of_runs()
    for sweep in (path_patch_sweep, path_patch_receiver_sweep):
        args = (["L1N0"], _metric) if sweep is path_patch_sweep else (["L0N0"], _metric)
        with pytest.raises(MemoryError, match="max_bytes"):
            sweep(model, clean, corrupted, *args, max_bytes=10_000, progress=False)
        with pytest.raises(MemoryError, match="patches_per_pass=None"):
            sweep(model, clean, corrupted, *args, patches_per_pass=64, max_bytes=2**20,
                  progress=False)  # fmt: skip
    values, _ = path_patch_sweep(
        model, clean, corrupted, ["L1N0"], _metric, senders=["L0H0", "L0N3"],
        patches_per_pass=None, progress=False,
    )  # fmt: skip
    assert values.shape == (2,)
