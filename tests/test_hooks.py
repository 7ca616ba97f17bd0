"""Hook names, head labels and names_filter presets (tl_attnonly.hooks)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, make_tokens

from tl_attnonly import convert
from tl_attnonly.hooks import (
    HeadRef,
    NamesFilter,
    all_head_refs,
    attn_head_label,
    attn_names_filter,
    decomposition_names_filter,
    exact_names_filter,
    head_labels,
    head_names_filter,
    neuron_head_label,
    neuron_head_refs,
    neuron_names_filter,
    parse_head_label,
)


@pytest.fixture(scope="module")
def four_layers():
    return convert(make_model("silu", n_layers=4))


# ---------------------------------------------------------------------------------- labels
@pytest.mark.parametrize("K", [1, 3])
def test_labels_round_trip(K):
    for layer, head in [(0, 0), (3, 7), (11, 3 * 1024 + 2)]:
        ref = HeadRef("neuron", layer, head)
        assert parse_head_label(ref.label(K), K) == ref
        assert ref.label(K) == neuron_head_label(layer, head, K)
    assert parse_head_label("L3H7", K) == HeadRef("attn", 3, 7)
    assert attn_head_label(3, 7) == HeadRef("attn", 3, 7).label(K) == "L3H7"


def test_label_errors():
    assert parse_head_label("L3N1024.2", 4) == HeadRef("neuron", 3, 1024 * 4 + 2)
    with pytest.raises(ValueError, match="neuron_head_refs"):
        parse_head_label("L3N1024", 4)  # a neuron, i.e. 4 heads
    with pytest.raises(ValueError, match="heads per"):
        parse_head_label("L3N1024.4", 4)
    with pytest.raises(ValueError, match="Cannot parse"):
        parse_head_label("L3X1")
    with pytest.raises(ValueError, match="no '.k'"):
        parse_head_label("L3H1.0")
    assert neuron_head_refs(2, 5, 3) == [HeadRef("neuron", 2, h) for h in (15, 16, 17)]


def test_all_head_refs_order(four_layers):
    model = four_layers
    refs = all_head_refs(model)
    n_attn = model.cfg.n_layers * model.cfg.n_heads
    assert len(refs) == n_attn + model.cfg.n_layers * model.n_neuron_heads
    assert all(r.kind == "attn" for r in refs[:n_attn])
    assert all(r.kind == "neuron" for r in refs[n_attn:])
    assert refs[n_attn] == HeadRef("neuron", 0, 0)
    labels = head_labels(refs)
    assert labels[:3] == ["L0H0", "L0H1", "L1H0"] and labels[n_attn + 1] == "L0N1"
    assert len(set(labels)) == len(labels)
    assert all_head_refs(model, kinds=("neuron",), layers=[2])[0] == HeadRef("neuron", 2, 0)
    with pytest.raises(ValueError, match="subset"):
        all_head_refs(model, kinds=("mlp",))


# ---------------------------------------------------------------------------------- filters
def _cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for t in cache.values())


def test_preset_cache_holds_only_the_named_hooks(four_layers):
    """Memory check: 'patterns of layers 2-3 only' caches exactly two tensors of known size."""
    model = four_layers
    tokens = make_tokens(batch=3, pos=7)
    only = neuron_names_filter("pattern", layers=range(2, 4))
    _, cache = model.run_with_cache(tokens, names_filter=only)
    assert sorted(cache.keys()) == ["blocks.2.mlp.hook_pattern", "blocks.3.mlp.hook_pattern"]
    itemsize = torch.empty((), dtype=model.cfg.dtype).element_size()
    expected = 2 * 3 * model.n_neuron_heads * 7 * 2 * itemsize
    assert _cache_bytes(cache) == expected
    assert only.resolve(model) == sorted(cache.keys())
    # The same run without a filter holds far more.
    _, everything = model.run_with_cache(tokens)
    assert _cache_bytes(everything) > 10 * expected


def test_filters_select_exact_names(four_layers):
    model = four_layers
    names = set(model.hook_dict)
    z = head_names_filter("z", layers=[1])
    assert set(filter(z, names)) == {"blocks.1.attn.hook_z", "blocks.1.mlp.hook_z"}
    assert set(filter(neuron_names_filter("scores", layers=0), names)) == {
        "blocks.0.mlp.hook_attn_scores"
    }
    assert set(filter(attn_names_filter("pattern"), names)) == {
        f"blocks.{i}.attn.hook_pattern" for i in range(4)
    }
    union = z | exact_names_filter("hook_embed")
    assert isinstance(union, NamesFilter)
    assert set(filter(union, names)) == {
        "hook_embed",
        "blocks.1.attn.hook_z",
        "blocks.1.mlp.hook_z",
    }
    assert "hook_embed" in repr(union) and "mlp.hook_z" in repr(union)
    # Neither a prefix nor a longer name matches.
    assert not neuron_names_filter("pre")("blocks.0.mlp.hook_pre_linear")
    assert not neuron_names_filter("z")("blocks.0.mlp.hook_zz")
    with pytest.raises(ValueError, match="expected one of"):
        neuron_names_filter("attention")
    with pytest.raises(ValueError, match="attention-head hooks"):
        attn_names_filter("post")
    with pytest.raises(ValueError, match="at least one"):
        neuron_names_filter()


def test_decomposition_preset(four_layers):
    model = four_layers
    selected = set(decomposition_names_filter().resolve(model))
    expected = {"hook_embed", "hook_pos_embed", "ln_final.hook_scale", "blocks.0.hook_resid_pre"}
    for i in range(4):
        expected |= {
            f"blocks.{i}.attn.hook_z",
            f"blocks.{i}.mlp.hook_z",
            f"blocks.{i}.ln1.hook_scale",
            f"blocks.{i}.ln2.hook_scale",
            f"blocks.{i}.hook_resid_post",
        }
    assert selected == expected
    # No [batch, pos, n_neuron_heads, d_model] tensor, no dense pattern.
    _, cache = model.run_with_cache(make_tokens(), names_filter=decomposition_names_filter())
    assert set(cache.keys()) == expected
    assert max(t.numel() for t in cache.values()) <= 2 * 10 * model.n_neuron_heads


def test_a_wildcard_sublayer_stands_for_one_name():
    """``*`` in a rule's sublayer matches one dotted segment: every expert's hook, not a hook
    inside an expert's submodule, nor the dense layer's."""
    only = NamesFilter([("mlp.experts.*", "post", None), ("mlp.shared*", "out", frozenset([1]))])
    assert only("blocks.0.mlp.experts.3.hook_post")
    assert only("blocks.1.mlp.shared_expert_gate.hook_out")
    assert not only("blocks.0.mlp.shared_expert.hook_out")  # layer 0 is not in the rule's layers
    assert not only("blocks.0.mlp.experts.3.inner.hook_post")
    assert not only("blocks.0.mlp.hook_post")
    assert not only("blocks.1.mlp.shared_experts.gate.hook_out")


def test_presets_work_on_the_literal_form():
    """The literal form uses the same hook grammar, so the presets restrict its cache too."""
    literal = convert(make_model("silu", normalization_type="LN"), form="literal")
    only = neuron_names_filter("pattern", layers=1) | head_names_filter("z", layers=0)
    _, cache = literal.run_with_cache(make_tokens(), names_filter=only)
    expected = ["blocks.0.attn.hook_z", "blocks.0.mlp.hook_z", "blocks.1.mlp.hook_pattern"]
    assert sorted(cache.keys()) == expected == only.resolve(literal)
