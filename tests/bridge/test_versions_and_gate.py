"""TransformerLens 3.x / 4.x seam, and the analysis tools' refusal of a bridge.

Runs on both versions: on 4.x (no HookedTransformer) the HookedTransformer-only entry points
raise an ImportError that names the bridge route; on 3.x the analysis tools refuse a bridge with
directions before any work.
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch
from bridge_models import make_bridge, make_tokens

import tl_attnonly
from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER
from tl_attnonly._types import require_neuron_heads

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


@TL4
@pytest.mark.parametrize("module", ["analysis", "vis", "report"])
def test_analysis_packages_refuse_at_import_on_tl4(module):
    with pytest.raises(ImportError, match="TransformerBridge"):
        importlib.import_module(f"tl_attnonly.{module}")


@TL4
def test_convert_of_a_non_bridge_names_the_call_on_tl4():
    with pytest.raises(ImportError, match=r"tl_attnonly\.convert\(Linear\).*TransformerBridge"):
        tl_attnonly.convert(torch.nn.Linear(2, 2))


def test_gate_refuses_a_bridge_with_directions():
    bridge = make_bridge("gpt2")
    with pytest.raises(TypeError, match=r"not converted.*tl_attnonly\.convert\(bridge\)"):
        require_neuron_heads(bridge)
    tl_attnonly.convert(bridge)
    with pytest.raises(TypeError, match=r"is converted.*neuron_head_layers\(bridge\)"):
        require_neuron_heads(bridge)


@TL3
def test_analysis_tools_refuse_a_converted_bridge_before_any_work():
    from tl_attnonly.analysis import get_act_patch_neuron_heads, get_neuron_head_results
    from tl_attnonly.vis import neuron_head_attention_view

    bridge = tl_attnonly.convert(make_bridge("llama"))
    tokens = make_tokens()
    runs = []
    bridge.blocks[0].mlp.hook_pattern.add_hook(lambda t, hook: runs.append(1), is_permanent=True)
    with pytest.raises(TypeError, match="neuron_head_layers"):
        neuron_head_attention_view(bridge, 0, tokens[0])
    with pytest.raises(TypeError, match="neuron_head_layers"):
        get_act_patch_neuron_heads(bridge, tokens, tokens, lambda logits: logits.sum(), 0)
    assert runs == [], "refused before running the model"
    _, cache = bridge.run_with_cache(tokens)
    with pytest.raises(TypeError, match="neuron_head_layers"):
        get_neuron_head_results(cache, 0)
