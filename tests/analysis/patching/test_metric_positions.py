"""Patching runs from a block unembed only the positions a metric declares it reads
(``logit_positions``; issue 47: the unembedding is a large part of a run from a late block), give
the values of every position's logits, and refuse a metric that reads more than it declares."""

from __future__ import annotations

import pytest
import torch
from conftest import GATED_ZOO, PATCH_TARGETS, ZOO
from conftest import patch_token_pair as _tokens
from models import make_converted

from tl_attnonly.analysis import get_act_patch_neuron_heads, get_act_patch_outputs
from tl_attnonly.analysis.ioi.prompts import IOIDataset
from tl_attnonly.hooks import head_names_filter

#: each row's read position ([2, 10] tokens; the corrupted ones differ at 2 and 6)
END = torch.tensor([9, 7])

MODELS = {
    "silu_ln": ("silu", ZOO["ln_learned"]),
    "swiglu_llama": ("silu", GATED_ZOO["llama"]),  # rotary, GQA
    "geglu_gemma2": (  # norms after each sublayer, logit soft cap
        "gelu_pytorch_tanh",
        {k: v for k, v in GATED_ZOO["gemma2"].items() if k != "act_fn"},
    ),
}


def _reads_end(logits: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(logits.shape[0])
    return logits[rows, END.to(logits.device)][:, PATCH_TARGETS].sum()


def _declaring():
    def metric(logits: torch.Tensor) -> torch.Tensor:
        return _reads_end(logits)

    metric.logit_positions = lambda indices: END[indices]  # type: ignore[attr-defined]
    return metric


class _UnembedRows:
    """The ``[rows, pos]`` of every input the model's unembedding sees."""

    def __init__(self, model):
        self.shapes: list[tuple[int, int]] = []
        self.handle = model.unembed.register_forward_hook(
            lambda module, args, out: self.shapes.append(tuple(args[0].shape[:2]))
        )


@pytest.mark.parametrize("name", list(MODELS))
def test_declared_positions_give_every_positions_values(name):
    act, overrides = MODELS[name]
    model = make_converted(act, torch.float64, **overrides)
    clean, corrupted = _tokens()
    _, cache = model.run_with_cache(clean, names_filter=head_names_filter("z"))
    units = ["L0H1", "L0N3", "L1N5", "L1H0"]
    outputs = [
        get_act_patch_outputs(model, corrupted, cache, m, units, patches_per_pass=3)[0]
        for m in (_reads_end, _declaring())
    ]
    z = [
        get_act_patch_neuron_heads(model, corrupted, cache, m, "z", heads=[0, 4, 9], level="head")
        for m in (_reads_end, _declaring())
    ]
    assert (outputs[0] - _reads_end(model(corrupted)).item()).abs().max() > 1e-4  # they matter
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=1e-10)
    torch.testing.assert_close(z[1], z[0], rtol=0, atol=1e-10)


def test_only_the_declared_positions_are_unembedded():
    """Each patched pass unembeds one position per row where the metric declares it: the passes
    that unembed every position for a metric that declares nothing unembed one instead (a
    bridge's passes that record its blocks' arguments still run whole)."""
    act, overrides = MODELS["swiglu_llama"]
    model = make_converted(act, torch.float64, **overrides)
    clean, corrupted = _tokens()
    _, cache = model.run_with_cache(clean, names_filter=head_names_filter("z"))
    for run in (
        lambda m: get_act_patch_outputs(model, corrupted, cache, m, ["L0N3", "L1H0", "L1N5"]),
        lambda m: get_act_patch_neuron_heads(model, corrupted, cache, m, "z", heads=[0, 4]),
    ):
        run(_reads_end)  # once-per-model checks
        counts = []
        for metric in (_reads_end, _declaring()):
            seen = _UnembedRows(model)
            run(metric)
            seen.handle.remove()
            counts.append([sum(pos == 1 for _, pos in seen.shapes), len(seen.shapes)])
        (plain_one, plain_all), (one, every) = counts
        assert plain_one == 0 and one > 0 and every == plain_all, counts


def test_a_metric_reading_more_than_it_declares_is_refused_before_any_patch():
    act, overrides = MODELS["silu_ln"]
    model = make_converted(act, torch.float64, **overrides)
    clean, corrupted = _tokens()
    _, cache = model.run_with_cache(clean, names_filter=head_names_filter("z"))

    def every_position(logits: torch.Tensor) -> torch.Tensor:
        return logits[..., PATCH_TARGETS].mean()

    every_position.logit_positions = lambda indices: END[indices]  # type: ignore[attr-defined]
    seen = _UnembedRows(model)
    with pytest.raises(ValueError, match="logit_positions"):
        get_act_patch_outputs(model, corrupted, cache, every_position, ["L0N3", "L1H0"])
    seen.handle.remove()
    assert seen.shapes == [tuple(corrupted.shape)]  # the corrupted run only


def test_a_task_dataset_s_metric_declares_its_end_positions():
    tokens = torch.randint(5, 50, (3, 9), generator=torch.Generator().manual_seed(0))
    tokens[:, 5] = tokens[:, 2]
    tokens[:, 1] = (tokens[:, 2] + 1) % 50
    corrupted = tokens.clone()
    corrupted[:, 5] = (tokens[:, 5] + 3) % 50
    n = 3
    data = IOIDataset.from_tokens(
        tokens, corrupted, torch.full((n,), 1), torch.full((n,), 2), torch.full((n,), 5),
        torch.tensor([8, 7, 6]),
    )  # fmt: skip
    assert torch.equal(data.metric.logit_positions(torch.arange(n)), data.end_pos)
    assert torch.equal(data.metric.logit_positions(torch.tensor([2])), torch.tensor([6]))
    logits = torch.randn(n, 9, 50, dtype=torch.float64)
    assert data.metric(logits) == data.logit_diff(logits).mean()
    assert IOIDataset.metric(data, logits) == data.metric(logits)
