"""compare_lms / compare_lm_pairs on the bundled model, and the bundled prompts."""

from __future__ import annotations

import copy

import pytest
import torch

from tl_attnonly import convert
from tl_attnonly.bundled import load_bundled_model
from tl_attnonly.fidelity_lm import (
    LM_FIDELITY_COLUMNS,
    compare_lm_pairs,
    compare_lms,
    load_prompts,
    token_batches,
)


@pytest.fixture(scope="module")
def bundled():
    return load_bundled_model()


def test_prompts_are_three_hundred_varied_lines():
    prompts = load_prompts()
    assert len(prompts) == 300 and len(set(prompts)) == 300
    assert any("\n" in p for p in prompts)  # code prompts have real newlines
    assert any(p.startswith("When Mary and John") for p in prompts)


def test_batches_are_sorted_right_padded_and_complete(bundled):
    prompts = load_prompts()[:40]
    seen = []
    for tokens, lengths in token_batches(bundled.tokenizer, prompts, batch_size=7, pad_id=-1):
        assert tokens.shape[0] == lengths.shape[0] <= 7
        for row, n in zip(tokens, lengths):
            assert (row[n:] == -1).all() and (row[:n] >= 0).all()
            seen.append(row[:n].tolist())
    expected = [bundled.tokenizer(p)["input_ids"] for p in prompts]
    assert sorted(seen) == sorted(expected)


def test_padding_does_not_change_the_real_tokens_logits(bundled):
    prompts = load_prompts()[:24]
    perturbed = bundled.to(torch.float64, print_details=False)
    reference = {"a": perturbed, "b": perturbed}
    one = compare_lm_pairs(reference, [("a", "b")], prompts, batch_size=1)[("a", "b")]
    many = compare_lm_pairs(reference, [("a", "b")], prompts, batch_size=24)[("a", "b")]
    assert one["max_abs_dlogit"] == many["max_abs_dlogit"] == 0.0
    assert one["n_tokens"] == many["n_tokens"]
    bundled.to(torch.float32, print_details=False)


def test_metrics_vanish_for_an_exact_conversion_and_see_a_perturbation(bundled):
    prompts = load_prompts()[:32]
    same = compare_lms(bundled, convert(bundled), prompts)  # SiLU: exact
    assert tuple(same) == LM_FIDELITY_COLUMNS
    assert same["max_abs_dlogit"] < 1e-4 and same["top1_agreement"] == 1.0
    perturbed = copy.deepcopy(bundled)
    noise = torch.randn(perturbed.unembed.W_U.shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        perturbed.unembed.W_U.add_(0.05 * noise)
    worse = compare_lms(bundled, perturbed, prompts)
    assert worse["max_abs_dlogit"] > 100 * max(same["max_abs_dlogit"], 1e-6)
    assert 0 < worse["mean_abs_dlogit"] < worse["max_abs_dlogit"]
    assert worse["max_abs_dlogprob"] > 0 and worse["top1_agreement"] < 1.0
    with pytest.raises(KeyError, match="missing"):
        compare_lm_pairs({"a": bundled}, [("a", "missing")], prompts)
