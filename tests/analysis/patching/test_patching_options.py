"""PatchingOptions: one options object or the old keywords give the same patching results."""

from __future__ import annotations

import pytest
import torch
from conftest import patch_metric as metric
from conftest import patch_token_pair as _tokens
from models import make_converted

from tl_attnonly.analysis import (
    PatchingOptions,
    attribute_then_patch,
    get_act_patch_neuron_heads,
    get_act_patch_outputs,
    path_patch_grid,
    path_patch_receiver_sweep,
    path_patch_sweep,
)


@pytest.fixture(scope="module")
def setup():
    model = make_converted("gelu", n_heads_per_neuron=2)
    clean, corrupted = _tokens()
    _, cache = model.run_with_cache(clean)
    return model, clean, corrupted, cache


def test_options_object_equals_keywords(setup):
    model, _, corrupted, cache = setup
    kw = dict(per_position=True, positions=[2, 6], patches_per_pass=3, progress=False)
    by_keyword, labels = get_act_patch_outputs(model, corrupted, cache, metric, ["L0N1"], **kw)
    options = PatchingOptions(**kw)
    by_options, labels2 = get_act_patch_outputs(
        model, corrupted, cache, metric, ["L0N1"], options=options
    )
    assert labels == labels2
    torch.testing.assert_close(by_options, by_keyword, rtol=0, atol=0)
    a = get_act_patch_neuron_heads(model, corrupted, cache, metric, layers=[1], heads=[0, 3], **kw)
    b = get_act_patch_neuron_heads(
        model, corrupted, cache, metric, layers=[1], heads=[0, 3], options=options
    )
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_keyword_replaces_the_option(setup):
    model, _, corrupted, cache = setup
    base = PatchingOptions(per_position=True, progress=False)
    values, _ = get_act_patch_outputs(
        model, corrupted, cache, metric, ["L0N1"], options=base, per_position=False
    )
    assert values.shape == (1,)  # not [1, pos]
    assert base.with_overrides(max_bytes=7).max_bytes == 7 and base.max_bytes != 7


def test_unknown_keyword_names_the_options(setup):
    model, _, corrupted, cache = setup
    with pytest.raises(TypeError, match=r"PatchingOptions.*patches_per_pass"):
        get_act_patch_outputs(model, corrupted, cache, metric, progres=False)
    with pytest.raises(TypeError, match="Unknown patching option"):
        PatchingOptions().with_overrides(batch=2)
    with pytest.raises(TypeError, match="takes a tl_attnonly.analysis.PatchingOptions"):
        get_act_patch_outputs(model, corrupted, cache, metric, options={"progress": False})


@pytest.mark.parametrize(
    "call",
    [
        lambda m, cl, co, c, o: path_patch_sweep(m, cl, co, ["L1N0.0"], metric, options=o),
        lambda m, cl, co, c, o: path_patch_receiver_sweep(m, cl, co, ["L0H0"], metric, options=o),
        lambda m, cl, co, c, o: path_patch_grid(m, cl, co, ["L0H0"], ["L1N0.0"], metric, options=o),
        lambda m, cl, co, c, o: attribute_then_patch(m, cl, co, metric, options=o),
    ],
)
def test_an_option_a_function_does_not_use_is_refused(setup, call):
    model, clean, corrupted, cache = setup
    with pytest.raises(ValueError, match=r"does not use the patching option\(s\) \['per_position'"):
        call(model, clean, corrupted, cache, PatchingOptions(per_position=True))


def test_path_sweep_keeps_its_default_of_16_patches_per_pass(setup, monkeypatch):
    import tl_attnonly.analysis.patching.sweeps as sweeps

    seen = []
    original = sweeps.resolve_patching_options

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append(out.patches_per_pass)
        return out

    monkeypatch.setattr(sweeps, "resolve_patching_options", spy)
    model, clean, corrupted, _ = setup
    path_patch_sweep(model, clean, corrupted, ["L1N0.0"], metric, senders=["L0H0"], progress=False)
    path_patch_sweep(
        model, clean, corrupted, ["L1N0.0"], metric, senders=["L0H0"],
        options=PatchingOptions(progress=False),
    )  # fmt: skip
    assert seen == [16, None]
