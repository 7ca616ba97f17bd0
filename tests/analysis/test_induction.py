"""Induction prompts (tl_attnonly.analysis.induction) against hand-written indexing.

The metric is checked against an explicit loop over rows and positions, its batch-additive form
against the whole-dataset mean (and against discover_circuit's own additivity check), the rows
and corruptions against their definition, and the behaviour on the bundled model: it copies a
little (clean metric above the corrupted one on every seed), so the dataset measures something.
"""

from __future__ import annotations

import pytest
import torch
from models import BRIDGES

import tl_attnonly
from tl_attnonly.analysis import discover_circuit
from tl_attnonly.analysis.induction import (
    InductionDataset,
    induction_token_pool,
    make_induction_dataset,
)
from tl_attnonly.bundled import load_bundled_bridge, load_bundled_model


@pytest.fixture(scope="module")
def bundled():
    """The bundled model: a HookedTransformer (TL 3), a bridge (TL 4)."""
    return load_bundled_bridge() if BRIDGES else load_bundled_model()


def converted_bundled(bundled):
    """The bundled model converted (TL 4: another bridge, converted in place, so ``bundled``
    stays the original)."""
    return tl_attnonly.convert(load_bundled_bridge() if BRIDGES else bundled)


def hand_metric(data: InductionDataset, logits: torch.Tensor) -> float:
    """Mean over rows and over second-half positions p (but the last) of logit[p, token[p+1]]."""
    values = []
    start = data.prefix_len + data.half_len
    for b in range(len(data)):
        for p in range(start, data.tokens.shape[1] - 1):
            values.append(logits[b, p, data.tokens[b, p + 1]].item())
    return sum(values) / len(values)


@pytest.mark.parametrize("corruption", ["first", "second"])
@pytest.mark.parametrize("prepend_bos", [False, True])
def test_rows_repeat_and_corruptions_repeat_nothing(bundled, corruption, prepend_bos):
    data = make_induction_dataset(
        bundled, 7, 5, corruption=corruption, prepend_bos=prepend_bos, seed=2
    )
    prefix = int(prepend_bos)
    assert data.tokens.shape == data.corrupted_tokens.shape == (7, prefix + 10)
    assert data.prefix_len == prefix and data.half_len == 5
    if prepend_bos:
        assert (data.tokens[:, 0] == bundled.tokenizer.bos_token_id).all()
        assert torch.equal(data.tokens[:, 0], data.corrupted_tokens[:, 0])
    first, second = data.tokens[:, prefix : prefix + 5], data.tokens[:, prefix + 5 :]
    assert torch.equal(first, second)
    c_first, c_second = (
        data.corrupted_tokens[:, prefix : prefix + 5],
        data.corrupted_tokens[:, prefix + 5 :],
    )
    kept, changed = (c_second, c_first) if corruption == "first" else (c_first, c_second)
    assert torch.equal(kept, first)
    pool = set(induction_token_pool(bundled))
    for b in range(7):
        assert len(set(first[b].tolist())) == 5  # distinct tokens in a half
        assert not set(changed[b].tolist()) & set(first[b].tolist())  # nothing repeats
        assert set(changed[b].tolist()) | set(first[b].tolist()) <= pool
    assert torch.equal(data.targets, data.tokens[:, prefix + 6 :])


def test_metric_matches_hand_loop_and_is_additive(bundled):
    data = make_induction_dataset(bundled, 6, 4, prepend_bos=True, seed=1)
    logits = torch.randn(6, data.tokens.shape[1], bundled.cfg.d_vocab, dtype=torch.float64)
    assert data.metric(logits).item() == pytest.approx(hand_metric(data, logits), abs=1e-12)
    additive = data.additive_metric()
    rows = torch.arange(6)
    whole = additive(logits, rows).item()
    parts = sum(additive(logits[i : i + 4], rows[i : i + 4]).item() for i in (0, 4))
    assert whole == pytest.approx(data.metric(logits).item(), abs=1e-12)
    assert parts == pytest.approx(whole, abs=1e-12)
    # the subset's metric is the mean of its own rows, weighted by its share of the dataset
    sub = additive(logits[[1, 3]], torch.tensor([1, 3])).item()
    assert sub == pytest.approx(hand_metric(data.select([1, 3]), logits[[1, 3]]) * 2 / 6)
    top = logits[:, data.query_positions].argmax(-1)
    assert data.accuracy(logits) == pytest.approx((top == data.targets).double().mean().item())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bundled_model_copies_more_on_clean_rows(bundled, seed):
    """The bundled 2-layer model barely does induction (top-1 accuracy ~0), but its logit of the
    repeated token is higher with the copy present than without (by 0.1-0.7 at these sizes)."""
    data = make_induction_dataset(bundled, 16, 6, seed=seed)
    with torch.no_grad():
        clean = data.metric(bundled(data.tokens)).item()
        corrupted = data.metric(bundled(data.corrupted_tokens)).item()
    assert clean > corrupted + 0.05


def test_discover_circuit_accepts_the_additive_metric_in_batches(bundled):
    converted = converted_bundled(bundled)
    data = make_induction_dataset(bundled, 4, 3, seed=0)
    circuit = discover_circuit(
        converted, data.tokens, data.corrupted_tokens, data.additive_metric(), top_n=10,
        batch_size=2, progress=False, neurons_per_mlp=0, gate_value=False,
    )  # fmt: skip
    with torch.no_grad():
        clean = data.metric(bundled(data.tokens)).item()
        corrupted = data.metric(bundled(data.corrupted_tokens)).item()
    assert circuit.metric_clean == pytest.approx(clean, abs=1e-4)
    assert circuit.metric_corrupted == pytest.approx(corrupted, abs=1e-4)


def test_from_tokens_and_errors(bundled):
    tokens = torch.tensor([[9, 1, 2, 3, 1, 2, 3]])
    corrupted = torch.tensor([[9, 4, 5, 6, 1, 2, 3]])
    data = InductionDataset.from_tokens(tokens, corrupted, prefix_len=1)
    assert (data.prefix_len, data.half_len) == (1, 3)
    assert data.query_positions.tolist() == [4, 5] and data.targets.tolist() == [[2, 3]]
    with pytest.raises(ValueError, match="odd"):
        InductionDataset.from_tokens(tokens, corrupted)
    with pytest.raises(ValueError, match="repeat"):
        InductionDataset.from_tokens(corrupted, tokens, prefix_len=1)
    with pytest.raises(ValueError, match="one shape"):
        InductionDataset(tokens, corrupted[:, :-1], 1, 3)
    with pytest.raises(ValueError, match="do not match"):
        data.metric(torch.zeros(1, 5, 10))
    with pytest.raises(ValueError, match="corruption="):
        make_induction_dataset(bundled, 2, corruption="swap")
    with pytest.raises(ValueError, match="half_len"):
        make_induction_dataset(bundled, 2, 1)
    with pytest.raises(ValueError, match="pool has 3"):
        make_induction_dataset(bundled, 2, 2, pool=[5, 6, 7])
    with pytest.raises(ValueError, match="d_vocab"):
        make_induction_dataset(bundled, 2, 2, pool=[1, 2, 3, bundled.cfg.d_vocab])


@pytest.mark.slow
def test_the_smollm2_induction_script_stages_run_on_the_bundled_model(bundled, capsys):
    # scripts/circuit_smollm2_induction.py prints the induction figures; its stages take any model.
    import argparse
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "scripts" / "circuit_smollm2_induction.py"
    spec = importlib.util.spec_from_file_location("circuit_smollm2_induction", path)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    data = make_induction_dataset(bundled, 4, 3, seed=0)
    args = argparse.Namespace(
        target=0.8, batch_size=2, neurons_per_mlp=2, corruption="first", half_len=3
    )
    script.stage_check(bundled, data)
    circuit = script.stage_discover(converted_bundled(bundled), data, args)
    out = capsys.readouterr().out
    for text in ("top-1 accuracy", "## discover_circuit, defaults (induction", "peak resident"):
        assert text in out
    assert "seconds" in circuit.extra and circuit.report() in out
