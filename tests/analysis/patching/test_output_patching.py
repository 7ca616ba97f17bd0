"""Batched exact patching of head outputs (output deltas, passes from the patched layer on) equals
patching one head (or one neuron) per full forward pass."""

from __future__ import annotations

import pytest
import torch
from conftest import GATED_ZOO, ZOO
from conftest import patch_metric as metric
from conftest import patch_token_pair as _tokens
from models import BRIDGES, facts, make_converted, tl3_extra

from tl_attnonly.analysis import (
    PatchUnit,
    attribute_then_patch,
    attribution_patch,
    get_act_patch_neuron_heads,
    get_act_patch_outputs,
    neuron_level,
    patch_units,
    rank_agreement,
    run_patches,
)
from tl_attnonly.analysis.patching.resume import LayerRuns
from tl_attnonly.hooks import head_act_name, head_names_filter, neuron_act_name


def _one_at_a_time(model, corrupted, clean_cache, unit: PatchUnit, pos: int | None) -> float:
    """The reference: one full forward pass with the unit's clean z put in by a hook."""
    name = head_act_name("z", unit.layer, unit.kind)
    heads = list(unit.heads)

    def hook(z, hook):
        z = z.clone()
        if pos is None:
            z[:, :, heads] = clean_cache[name][:, :, heads]
        else:
            z[:, pos, heads] = clean_cache[name][:, pos, heads]
        return z

    with torch.no_grad():
        return metric(model.run_with_hooks(corrupted, fwd_hooks=[(name, hook)])).item()


MODELS = {
    "silu_ln": ("silu", ZOO["ln_learned"]),
    "gelu_k4_rms": ("gelu", dict(normalization_type="RMS")),
    "parallel_gelu_new": ("gelu_new", ZOO["parallel_neox"]),
    "swiglu_llama": ("silu", GATED_ZOO["llama"]),  # rotary, GQA
    "swiglu_mistral_window": ("silu", GATED_ZOO["mistral_window"]),  # local attention windows
    "geglu_gemma2": (
        "gelu_pytorch_tanh",
        {k: v for k, v in GATED_ZOO["gemma2"].items() if k != "act_fn"},
    ),  # norm after the MLP: hooked
}


#: Parameters whose bridge (TL 4) repeats another's coverage: name -> the one covering it.
_COVERED = {"gelu_k4_rms": "geglu_gemma2 (gated, K = 4)", "swiglu_mistral_window": "swiglu_llama"}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=tl3_extra(_COVERED[n])) if n in _COVERED else n for n in MODELS],
)
@pytest.mark.parametrize("level", ["neuron", "head"])
def test_batched_outputs_equal_one_at_a_time(name, level):
    act, overrides = MODELS[name]
    model = make_converted(act, torch.float64, **overrides)
    clean, corrupted = _tokens()
    _, clean_cache = model.run_with_cache(clean, names_filter=head_names_filter("z"))
    units = patch_units(model, level=level)
    n_neuron = sum(u.kind == "neuron" for u in units)
    assert n_neuron == model.cfg.n_layers * model.cfg.d_mlp * (
        1 if level == "neuron" else facts(model).n_heads_per_neuron
    )
    scores, labels = get_act_patch_outputs(
        model, corrupted, clean_cache, metric, level=level, patches_per_pass=7, progress=False
    )
    assert labels == [u.label for u in units] and scores.dtype == torch.float64
    baseline = metric(model(corrupted)).item()
    assert (scores - baseline).abs().max() > 1e-3  # the patches matter
    picked = list(range(0, len(units), 5)) + [len(units) - 1]  # attn and neuron, both layers
    expected = torch.tensor(
        [_one_at_a_time(model, corrupted, clean_cache, units[i], None) for i in picked],
        dtype=torch.float64,
    )
    torch.testing.assert_close(scores[picked], expected, rtol=0, atol=1e-10)
    # One position at a time, on a few units.
    few = [units[i] for i in picked[:6]]
    per_pos, _ = get_act_patch_outputs(
        model, corrupted, clean_cache, metric, few, per_position=True, positions=[2, 6, 9],
        patches_per_pass=4, progress=False,
    )  # fmt: skip
    expected = torch.tensor(
        [[_one_at_a_time(model, corrupted, clean_cache, u, p) for p in (2, 6, 9)] for u in few],
        dtype=torch.float64,
    )
    torch.testing.assert_close(per_pos, expected, rtol=0, atol=1e-10)


def test_a_neuron_is_all_its_heads_and_labels_pick_units():
    model = make_converted("gelu_new", torch.float64, normalization_type="LN")
    K = facts(model).n_heads_per_neuron
    assert K == 4
    clean, corrupted = _tokens()
    _, cc = model.run_with_cache(clean, names_filter=head_names_filter("z"))
    by_neuron, labels = get_act_patch_outputs(
        model, corrupted, cc, metric, ["L1N3", "L0N5.2", "L1H0"], progress=False
    )
    assert labels == ["L1N3", "L0N5", "L1H0"]  # at neuron level a head stands for its neuron

    def post_hook(post, hook):  # patching all K heads of L1N3 = patching its hook_post
        post = post.clone()
        post[..., 3] = cc_post[neuron_act_name("post", 1)][..., 3]
        return post

    _, cc_post = model.run_with_cache(clean, names_filter=neuron_act_name("post", 1))
    with torch.no_grad():
        logits = model.run_with_hooks(
            corrupted, fwd_hooks=[(neuron_act_name("post", 1), post_hook)]
        )
    assert by_neuron[0].item() == pytest.approx(metric(logits).item(), abs=1e-10)
    by_head, head_labels = get_act_patch_outputs(
        model, corrupted, cc, metric, ["L1N3"], level="head", progress=False
    )
    assert head_labels == [f"L1N3.{k}" for k in range(K)]
    assert (by_head - by_neuron[0]).abs().min() > 1e-6  # one head is not the neuron


def test_batched_z_sweep_equals_one_patch_per_pass_in_float64():
    model = make_converted("gelu", torch.float64, normalization_type="LN")
    clean, corrupted = _tokens()
    _, cc = model.run_with_cache(clean, names_filter=head_names_filter("z", "pattern"))
    for kind, per_position in [("z", False), ("z", True), ("pattern", False)]:
        kwargs = dict(per_position=per_position, heads=[0, 5, 77], positions=[2, 6], level="head")
        batched = get_act_patch_neuron_heads(
            model, corrupted, cc, metric, kind, progress=False, **kwargs
        )
        reference = []
        for layer in range(2):
            name = neuron_act_name(kind, layer)
            for pos in [2, 6] if per_position else [None]:
                for head in [0, 5, 77]:

                    def hook(act, hook, head=head, pos=pos, name=name, kind=kind):
                        act = act.clone()
                        if kind == "pattern":
                            act[:, head] = cc[name][:, head]
                        elif pos is None:
                            act[:, :, head] = cc[name][:, :, head]
                        else:
                            act[:, pos, head] = cc[name][:, pos, head]
                        return act

                    with torch.no_grad():
                        logits = model.run_with_hooks(corrupted, fwd_hooks=[(name, hook)])
                    reference.append(metric(logits).item())
        expected = torch.tensor(reference, dtype=torch.float64).reshape(batched.shape)
        torch.testing.assert_close(batched, expected, rtol=0, atol=1e-10)


def test_memory_budget_refuses_with_directions():
    model = make_converted("silu", torch.float64, normalization_type="LN")
    clean, corrupted = _tokens()
    _, cc = model.run_with_cache(clean, names_filter=head_names_filter("z"))
    with pytest.raises(MemoryError, match="Raise max_bytes, or patch a smaller batch"):
        get_act_patch_outputs(model, corrupted, cc, metric, max_bytes=1000, progress=False)
    with pytest.raises(MemoryError, match="patches_per_pass=None"):
        run_patches(model, corrupted, cc, metric, [], patches_per_pass=10_000, max_bytes=2**20)
    with pytest.raises(KeyError, match="head_names_filter"):
        _, pattern_only = model.run_with_cache(clean, names_filter=head_names_filter("pattern"))
        get_act_patch_outputs(model, corrupted, pattern_only, metric, progress=False)
    with pytest.raises(ValueError, match="level"):
        patch_units(model, level="layer")  # type: ignore[arg-type]
    with pytest.raises(IndexError, match="positions must be in"):
        get_act_patch_outputs(model, corrupted, cc, metric, per_position=True, positions=[10])


# ------------------------------------------------------------------------- attribution, then exact
@pytest.mark.parametrize("level", ["neuron", "head"])
def test_attribute_then_patch_exact_column_is_direct_patching(level):
    model = make_converted("gelu_new", torch.float64, normalization_type="LN")
    clean, corrupted = _tokens()
    check = attribute_then_patch(model, clean, corrupted, metric, k=6, level=level, progress=False)
    table = check.table
    assert len(table) == 6 and check.level == level
    # The k units are the k largest |attribution| at that level.
    _, cc = model.run_with_cache(clean, names_filter=head_names_filter("z"))
    scores, labels = attribution_patch(model, cc, corrupted, metric)
    if level == "neuron":
        scores, labels = neuron_level(scores, labels)
        assert all("." not in label for label in table["label"] if "N" in label)
    top = scores.abs().topk(6).indices.tolist()
    assert table["label"].tolist() == [labels[i] for i in top]
    torch.testing.assert_close(
        torch.tensor(table["attribution"].to_numpy()), scores[top], rtol=0, atol=1e-12
    )
    # Exact column: one full forward pass per unit with its clean z (all its heads) put in.
    units = patch_units(model, table["label"].tolist(), level=level)
    direct = torch.tensor(
        [_one_at_a_time(model, corrupted, cc, u, None) for u in units], dtype=torch.float64
    )
    corrupted_metric = metric(model(corrupted)).item()
    assert check.corrupted_metric == pytest.approx(corrupted_metric, abs=1e-12)
    torch.testing.assert_close(
        torch.tensor(table["effect"].to_numpy()), direct - corrupted_metric, rtol=0, atol=1e-10
    )
    assert (table["effect"].abs() > 1e-4).all()  # the effects are real
    effect = torch.tensor(table["effect"].to_numpy())
    assert check.agreement == rank_agreement(torch.tensor(table["attribution"].to_numpy()), effect)
    assert sorted(table["effect_rank"]) == list(range(1, 7))
    assert table["effect_rank"].iloc[int(effect.abs().argmax())] == 1


@pytest.mark.parametrize(
    "overrides",
    [ZOO["ln_learned"], pytest.param(ZOO["rms_rotary"], marks=tl3_extra("gqa")), ZOO["gqa"],
     ZOO["parallel_neox"], GATED_ZOO["mistral_window"]],
    ids=["ln_learned", "rms_rotary", "gqa", "parallel_neox", "mistral_window"],
)  # fmt: skip
def test_runs_from_a_layer_skip_unchanged_leading_positions_exactly(overrides):
    """A change at positions >= p: running positions p.. against the corrupted keys and values of
    the prefix gives the logits of the full run from that layer (a bridge has no frozen key-value
    cache: it runs every position, and must give the same logits)."""
    model = make_converted("silu", torch.float64, **overrides)
    _, corrupted = _tokens()
    runs = LayerRuns(model, corrupted)
    assert runs.prefix_reuse == (not BRIDGES)
    g = torch.Generator().manual_seed(0)
    for layer, first in [(1, 3), (0, 5), (2, 4), (1, corrupted.shape[1])]:
        resid = runs.resid(layer).repeat(3, 1, 1)
        change = torch.randn(resid.shape, generator=g, dtype=resid.dtype)
        change[:, :first] = 0
        full = runs.run(resid + change, layer)
        skipping = runs.run(resid + change, layer, first_pos=first)
        torch.testing.assert_close(skipping, full, rtol=0, atol=1e-10)
        if runs.prefix_reuse:
            assert first in runs._runner._prefixes or first == corrupted.shape[1]
    with torch.no_grad():  # and the runs from a layer are the model's
        torch.testing.assert_close(runs.run(runs.resid(1), 1), model(corrupted), rtol=0, atol=1e-12)
