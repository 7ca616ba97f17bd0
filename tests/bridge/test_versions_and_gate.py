"""TransformerLens 3.x / 4.x seam, and the analysis tools on a bridge.

Runs on both versions: on 4.x (no HookedTransformer) the HookedTransformer-only entry points
raise an ImportError that names the bridge route, and the analysis tools import; on both the
analysis tools take a converted bridge and refuse an unconverted one with directions, before any
work.
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch
from bridge_models import make_bridge, make_tokens

import tl_attnonly
from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER
from tl_attnonly.adapt import analysis_model

TL4 = pytest.mark.skipif(HAS_HOOKED_TRANSFORMER, reason="TransformerLens 4.x behaviour")
TL3 = pytest.mark.skipif(not HAS_HOOKED_TRANSFORMER, reason="needs HookedTransformer (TL 3.x)")


def test_version_seam_matches_the_installed_transformer_lens():
    has = importlib.util.find_spec("transformer_lens.HookedTransformer") is not None
    assert HAS_HOOKED_TRANSFORMER is has


def test_bridge_names_work_on_every_version():
    from tl_attnonly.hooks import neuron_act_name

    assert neuron_act_name("pattern", 1) == "blocks.1.mlp.hook_pattern"
    assert tl_attnonly.ConversionOptions(n_heads_per_neuron=2).n_heads_per_neuron == 2
    assert tl_attnonly.head_coefficients("silu").n_heads == 1
    bridge = tl_attnonly.convert(make_bridge("llama"))
    _, cache = bridge.run_with_cache(make_tokens(), names_filter=neuron_act_name("pattern", 0))
    assert list(cache.keys()) == ["blocks.0.mlp.hook_pattern"]


@TL4
@pytest.mark.parametrize("name", ["AttnOnlyTransformer", "AttnOnlyEncoder", "to_literal"])
def test_hooked_transformer_names_point_to_the_bridge_on_tl4(name):
    with pytest.raises(ImportError, match=r"tl_attnonly\.convert\(bridge\)"):
        getattr(tl_attnonly, name)


@pytest.mark.parametrize("module", ["analysis", "vis"])
def test_analysis_packages_import_on_every_version(module):
    assert importlib.import_module(f"tl_attnonly.{module}").__all__


@TL4
def test_convert_of_a_non_bridge_names_the_call_on_tl4():
    with pytest.raises(ImportError, match=r"tl_attnonly\.convert\(Linear\).*TransformerBridge"):
        tl_attnonly.convert(torch.nn.Linear(2, 2))


def test_gate_refuses_an_unconverted_bridge_with_directions():
    bridge = make_bridge("gpt2")
    with pytest.raises(TypeError, match=r"TransformerBridge has no neuron-heads.*in place"):
        analysis_model(bridge)
    assert analysis_model(bridge, neuron_heads=False).model is bridge
    tl_attnonly.convert(bridge)
    adapted = analysis_model(bridge)
    assert adapted.model is bridge and adapted.kind == "TransformerBridge"


@TL3
def test_analysis_tools_run_on_a_converted_bridge_and_refuse_an_unconverted_one_first():
    from tl_attnonly.analysis import get_act_patch_neuron_heads, get_neuron_head_results
    from tl_attnonly.vis import neuron_head_attention_view

    bridge = make_bridge("llama")
    tokens = make_tokens()
    runs = []
    bridge.blocks[0].mlp.hook_out.add_hook(lambda t, hook: runs.append(1), is_permanent=True)
    with pytest.raises(TypeError, match="convert it first"):
        neuron_head_attention_view(bridge, 0, tokens[0])
    with pytest.raises(TypeError, match="convert it first"):
        get_act_patch_neuron_heads(bridge, tokens, tokens, lambda logits: logits.sum(), 0)
    assert runs == [], "refused before running the model"
    tl_attnonly.convert(bridge)
    _, cache = bridge.run_with_cache(tokens)
    results = get_neuron_head_results(cache, 0)  # [batch, pos, n_neuron_heads, d_model]
    torch.testing.assert_close(
        results.sum(-2) + bridge.blocks[0].mlp.out.original_component.weight.new_zeros(32),
        cache["blocks.0.hook_mlp_out"],
        rtol=0,
        atol=1e-12,
    )
    view = neuron_head_attention_view(bridge, 0, tokens[0], top_k=4)
    assert len(view.heads) == 4
