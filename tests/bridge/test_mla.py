"""Multi-head latent attention (DeepSeek-V3's MLA, dense MLPs): per-head tools are right.

TransformerLens's bridge splits ``hook_z`` (the output projection's input) by ``cfg.d_head``,
which for MLA is not the heads' value width: 8 "heads" of 8 where the layer has 4 heads of 16.
``tl_attnonly.convert`` gives ``hook_z`` the split of ``W_O``'s heads
(:mod:`tl_attnonly.bridge.attention_layout`), and an analysis of an unconverted MLA bridge is
refused before any work. Checked against the definition: patching head ``h`` is patching columns
``h * 16 : (h + 1) * 16`` of the output projection's input of the unconverted bridge, and the
per-head results sum to the attention output.
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import tl_attnonly  # noqa: E402
from tl_attnonly.adapt import analysis_model  # noqa: E402
from tl_attnonly.analysis import get_act_patch_all_heads, head_logit_attrs  # noqa: E402
from tl_attnonly.analysis.cache.views import get_attn_head_results  # noqa: E402

transformers = pytest.importorskip("transformers")
zoo = pytest.importorskip("zoo")

CLEAN, CORRUPTED = zoo.tokens(), zoo.tokens(seed=2)
V_HEAD = 16  # the zoo's v_head_dim


def metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 3].sum() - logits[:, -1, 5].sum()


@pytest.fixture(scope="module")
def pair():
    from transformer_lens.model_bridge.sources._bridge_builder import build_bridge_from_module

    cfg = zoo.make_config("deepseek_v3")
    cfg.first_k_dense_replace = cfg.num_hidden_layers  # dense MLPs: MLA is the subject here
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(cfg)
    zoo._redraw(hf, 0)
    hf = hf.to(torch.float64).eval()

    def make():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return build_bridge_from_module(
                copy.deepcopy(hf), "DeepseekV3ForCausalLM", hf_config=cfg
            )

    return make(), tl_attnonly.convert(make())


def test_hook_z_is_split_into_the_heads_of_w_o(pair):
    original, converted = pair
    n_heads = converted.cfg.n_heads
    with torch.no_grad():
        _, cache = converted.run_with_cache(CLEAN)
        _, ocache = original.run_with_cache(CLEAN)
    z = cache["blocks.0.attn.hook_z"]
    assert tuple(z.shape[-2:]) == (n_heads, V_HEAD)
    assert tuple(analysis_model(converted).blocks[0].attn.W_O.shape[:2]) == (n_heads, V_HEAD)
    flat = ocache["blocks.0.attn.hook_z"].flatten(-2)  # the unconverted split (8 x 8)
    torch.testing.assert_close(z.flatten(-2), flat, rtol=0, atol=0)  # same values


def test_head_patching_patches_whole_heads(pair):
    original, converted = pair
    with torch.no_grad():
        _, clean_cache = converted.run_with_cache(CLEAN)
        _, oclean = original.run_with_cache(CLEAN)
    scores, labels = get_act_patch_all_heads(converted, CORRUPTED, clean_cache, metric)
    n_layers, n_heads = converted.cfg.n_layers, converted.cfg.n_heads
    expected = []
    for layer in range(n_layers):
        name = f"blocks.{layer}.attn.o.hook_in"
        clean = oclean[name].flatten(-2) if oclean[name].dim() == 4 else oclean[name]
        for head in range(n_heads):
            cols = slice(head * V_HEAD, (head + 1) * V_HEAD)

            def patch(act, hook, cols=cols, clean=clean):
                flat = (act.flatten(-2) if act.dim() == 4 else act).clone()
                flat[..., cols] = clean[..., cols]
                return flat.view_as(act)

            with torch.no_grad():
                logits = original.run_with_hooks(CORRUPTED, fwd_hooks=[(name, patch)])
            expected.append(metric(logits).item())
    attn = [i for i, label in enumerate(labels) if "H" in label]
    heads = [f"L{layer}H{h}" for layer in range(n_layers) for h in range(n_heads)]
    assert [labels[i] for i in attn] == heads
    torch.testing.assert_close(
        scores[attn], torch.tensor(expected, dtype=scores.dtype), rtol=1e-10, atol=1e-10
    )


def test_head_results_sum_to_the_attention_output(pair):
    _, converted = pair
    with torch.no_grad():
        _, cache = converted.run_with_cache(CLEAN)
    model = analysis_model(converted)
    for layer in range(converted.cfg.n_layers):
        results = get_attn_head_results(cache, layer)
        total = results.sum(-2) + model.blocks[layer].attn.b_O
        torch.testing.assert_close(
            total, cache[f"blocks.{layer}.hook_attn_out"], rtol=1e-10, atol=1e-10
        )
    attrs = head_logit_attrs(cache, torch.tensor([3, 4]), pos_slice=-1)
    assert torch.isfinite(attrs).all()


def test_an_unconverted_mla_bridge_is_refused_naming_the_repair(pair):
    original, _ = pair
    with pytest.raises(NotImplementedError, match=r"hook_z is split into 8 heads of 8.*convert"):
        analysis_model(original, neuron_heads=False)


def test_unconvert_restores_the_bridge_s_own_split():
    from transformer_lens.model_bridge.sources._bridge_builder import build_bridge_from_module

    cfg = zoo.make_config("deepseek_v3")
    cfg.first_k_dense_replace = cfg.num_hidden_layers
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bridge = build_bridge_from_module(hf, "DeepseekV3ForCausalLM", hf_config=cfg)
    before = type(bridge.blocks[0].attn.o.hook_in.hook_conversion)
    split = bridge.blocks[0].attn.o.hook_in.hook_conversion.d_head
    tl_attnonly.convert(bridge)
    assert bridge.blocks[0].attn.o.hook_in.hook_conversion.d_head == V_HEAD
    from tl_attnonly.bridge.convert import unconvert_bridge

    unconvert_bridge(bridge)
    conversion = bridge.blocks[0].attn.o.hook_in.hook_conversion
    assert type(conversion) is before and conversion.d_head == split


def test_blocks_without_attention_need_no_repair():
    """A hybrid model's linear-attention or state-space blocks have no ``attn``: the repair and
    the check pass over them (TransformerLens 4.3's Qwen3.5 suite: its conversion raised an
    AttributeError there, after the MLPs had been converted)."""
    from types import SimpleNamespace

    from tl_attnonly.bridge.attention_layout import check_z_layout, head_layout, repair_z_layouts

    assert head_layout(None) is None
    block = torch.nn.Module()  # no attn submodule
    assert repair_z_layouts(SimpleNamespace(blocks=[block, block])) == []
    check_z_layout(None, 0)
