"""Mixture-of-experts bridges converted: every expert's neurons (and a shared expert's) as
neuron-heads, against the unconverted bridge of the same weights (TransformerLens 3.x and 4.x).

Zoo models (``zoo.py``): Mixtral, Qwen2-MoE (shared expert), Qwen3-MoE, OLMoE, Granite-MoE,
PhiMoE, DeepSeek-V3 (a dense first layer, then a MoE layer with shared experts); GPT-OSS is
refused, naming its clamped SwiGLU. Each check compares with an independent reference: the
unconverted bridge's own hooks and logits, or a Hugging Face expert whose ``down_proj`` column was
zeroed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from zoo import REFUSALS, ZOO, build_bridge, build_hf_model, convert_zoo_bridge, make_config, tokens

from tl_attnonly.bridge import neuron_head_layers, unconvert_bridge
from tl_attnonly.bridge.experts import EXPERT_HOOKS, BridgeNeuronHeadExperts

MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "phimoe", "deepseek_v3"]
#: The MoE blocks' shared experts (bridge MLPs inside the block), by their name there.
SHARED = {"qwen2_moe": "shared_expert", "deepseek_v3": "shared_experts"}
DTYPES = [torch.float32, torch.float64]
#: Max |converted - unconverted| relative to max(1, |reference|): exact SiLU experts.
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def _params(names: list[str]) -> list[Any]:
    return [
        pytest.param(n, d, id=f"{n}-{str(d)[6:]}") for n in names for d in DTYPES
    ]  # fmt: skip


def _moe_layers(bridge: Any) -> dict[int, BridgeNeuronHeadExperts]:
    layers = neuron_head_layers(bridge)
    return {i: m for i, m in enumerate(layers) if isinstance(m, BridgeNeuronHeadExperts)}


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> bool:
    scale = max(1.0, expected.abs().max().item())
    return (actual - expected).abs().max().item() <= TOL[dtype] * scale


@pytest.mark.parametrize(("name", "dtype"), _params(MOE))
def test_experts_run_as_neuron_heads_with_the_bridges_hooks(name, dtype):
    """Head path (``fused=False``): the logits and every hook of the unconverted bridge (router,
    MoE block, shared expert, residual stream) keep their values; every expert's neuron-head
    hooks exist under TL's MoE names and see exactly the tokens routed to it."""
    bridge = build_bridge(name, dtype)
    toks = tokens()
    with torch.no_grad():
        reference, ref_cache = bridge.run_with_cache(toks)
    convert_zoo_bridge(bridge, fused=False)
    moe = _moe_layers(bridge)
    assert moe, "the MoE layers must be converted as experts"
    if name == "deepseek_v3":
        assert sorted(moe) == [1], "DeepSeek-V3's first layer is dense, its second MoE"
        assert "blocks.0.mlp.hook_pattern" in bridge.hook_dict
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(toks)
    assert _close(logits, reference, dtype), (logits - reference).abs().max().item()
    assert set(ref_cache.keys()) <= set(cache.keys())
    for key in ref_cache.keys():
        assert _close(cache[key], ref_cache[key], dtype), key
    n_tokens, top_k = toks.numel(), make_config(name).num_experts_per_tok
    for layer, experts in moe.items():
        assert any(k.startswith(f"blocks.{layer}.mlp.gate.hook_out") for k in ref_cache.keys())
        routed = []
        for e in range(experts.num_experts):
            prefix = f"blocks.{layer}.mlp.experts.{e}"
            for hook in EXPERT_HOOKS:
                assert f"{prefix}.hook_{hook}" in bridge.hook_dict, (prefix, hook)
            pattern = cache[f"{prefix}.hook_pattern"]  # [1, heads, routed, 2]
            gate = cache[f"{prefix}.hook_gate"]  # [routed, d_mlp]
            assert pattern.shape == (1, experts.n_neuron_heads, gate.shape[0], 2)
            # the weight on self is sigmoid of the gate pre-activation (Theorem 3)
            assert _close(pattern[0, :, :, 0].T, torch.sigmoid(gate), dtype)
            routed.append(gate.shape[0])
        assert sum(routed) == n_tokens * top_k
        indices = ref_cache.cache_dict.get(f"blocks.{layer}.mlp.hook_expert_indices")
        if indices is not None and indices.shape == (n_tokens, top_k):
            counts = torch.bincount(indices.flatten(), minlength=experts.num_experts)
            assert counts.tolist() == routed
        for key in experts.shared:
            assert f"blocks.{layer}.mlp.{key}.hook_pattern" in cache.keys()
    assert set(moe[max(moe)].shared) == ({SHARED[name]} if name in SHARED else set())


@pytest.mark.parametrize("name", MOE)
def test_default_conversion_fused_path(name):
    """Default options (fused path), float32 and float64: the logits are the unconverted
    bridge's, bit for bit (the experts' fused path is Hugging Face's eager loop)."""
    toks = tokens()
    for dtype in DTYPES:
        bridge = build_bridge(name, dtype)
        with torch.no_grad():
            reference = bridge(toks)
            logits = convert_zoo_bridge(bridge)(toks)
        assert torch.equal(logits, reference), dtype


def _zero_neuron_hook(neuron: int) -> Any:
    def hook(z: torch.Tensor, hook: Any) -> torch.Tensor:
        z = z.clone()
        z[..., neuron, :] = 0.0  # one head per SiLU neuron
        return z

    return hook


def _hf_down(bridge: Any, layer: int, where: str) -> torch.Tensor:
    """The Hugging Face ``down_proj`` weight of ``where`` (``experts`` or a shared expert) in
    ``layer`` of an unconverted bridge."""
    block = bridge.original_model.model.layers[layer].mlp
    if where == "experts":
        return block.experts.down_proj
    return getattr(block, where).down_proj.weight


@pytest.mark.parametrize(("name", "dtype"), _params(MOE))
def test_zeroing_a_neuron_head_equals_zeroing_the_hf_neuron(name, dtype):
    """Zeroing one neuron-head's ``hook_z`` (a routed expert's, and a shared expert's) changes the
    logits exactly as zeroing that neuron's ``down_proj`` column in the Hugging Face model."""
    toks = tokens()
    converted = convert_zoo_bridge(build_bridge(name, dtype))
    layer = max(_moe_layers(converted))
    experts = _moe_layers(converted)[layer]
    sites = [("experts", 1), *((key, None) for key in experts.shared)]
    with torch.no_grad():
        clean = converted(toks)
    for where, expert in sites:
        neuron = 5
        hook_name = (
            f"blocks.{layer}.mlp.experts.{expert}.hook_z"
            if where == "experts"
            else f"blocks.{layer}.mlp.{where}.hook_z"
        )
        reference = build_bridge(name, dtype)
        with torch.no_grad():
            down = _hf_down(reference, layer, where)
            if where == "experts":
                down[expert, :, neuron] = 0.0  # [E, d_model, d_mlp]
            else:
                down[:, neuron] = 0.0  # [d_model, d_mlp]
            expected = reference(toks)
            ablated = converted.run_with_hooks(
                toks, fwd_hooks=[(hook_name, _zero_neuron_hook(neuron))]
            )
        assert (expected - clean).abs().max().item() > 1e-3, "the neuron must matter"
        assert _close(ablated, expected, dtype), (where, (ablated - expected).abs().max().item())


def _experts_module(bridge: Any, layer: int) -> Any:
    """What the Hugging Face MoE block of ``layer`` calls as its experts (unwrapping a bridge
    component: Qwen2-MoE's bridge wraps them); ``None`` for a dense layer."""
    experts = getattr(bridge.original_model.model.layers[layer].mlp, "experts", None)
    return getattr(experts, "original_component", experts)


@pytest.mark.parametrize("name", MOE)
def test_weights_shared_state_dict_unchanged_and_unconvert_restores(name):
    """No copy: each expert's weights are views of the grouped parameters, an in-place edit shows
    in the converted bridge, ``state_dict`` keys and tensors are unchanged, and unconversion puts
    the Hugging Face experts back (same logits, no neuron-head hooks)."""
    toks = tokens()
    bridge = build_bridge(name, torch.float64)
    before = bridge.state_dict()
    hf_experts = {i: type(_experts_module(bridge, i)) for i in range(2)}
    with torch.no_grad():
        reference = bridge(toks)
    convert_zoo_bridge(bridge)
    during = bridge.state_dict()
    assert list(during) == list(before)
    assert all(during[k].data_ptr() == before[k].data_ptr() for k in before)
    for layer, experts in _moe_layers(bridge).items():
        grouped = experts.gate_up_proj
        assert _experts_module(bridge, layer) is experts, (
            "the converted block must call the neuron-head experts"
        )
        expert = experts[2]
        d_mlp = expert.d_mlp
        assert expert.W_gate.data_ptr() == grouped[2, :d_mlp].data_ptr()
        assert expert.W_in.data_ptr() == grouped[2, d_mlp:].data_ptr()
        assert expert.W_out.data_ptr() == experts.down_proj[2].data_ptr()
    # an in-place edit of the shared weights shows in the heads: same as on an unconverted twin
    twin = build_bridge(name, torch.float64)
    layer = max(_moe_layers(bridge))
    with torch.no_grad():
        for model in (bridge, twin):
            model.original_model.model.layers[layer].mlp.experts.gate_up_proj[0].mul_(1.5)
        assert _close(bridge(toks), twin(toks), torch.float64)
        assert not _close(bridge(toks), reference, torch.float64)
        for model in (bridge, twin):
            model.original_model.model.layers[layer].mlp.experts.gate_up_proj[0].div_(1.5)
    unconvert_bridge(bridge)
    assert not any(".experts." in k and "hook_pattern" in k for k in bridge.hook_dict)
    assert not any(k.endswith("mlp.hook_pattern") for k in bridge.hook_dict)
    for i in range(2):
        assert type(_experts_module(bridge, i)) is hf_experts[i]
    assert list(bridge.state_dict()) == list(before)
    with torch.no_grad():
        assert torch.equal(bridge(toks), reference)


def test_grouped_mm_kernel_float32():
    """The default experts kernel (transformers' grouped matmul, float32 only) vs the converted
    experts (the eager loop as neuron-heads): equal within float32 rounding."""
    import transformers
    from transformer_lens.model_bridge.sources import build_bridge_from_module

    hf, _ = build_hf_model("mixtral", torch.float32)
    config = make_config("mixtral")
    config._experts_implementation = None  # transformers' default: grouped_mm
    model = transformers.MixtralForCausalLM(config)
    model.load_state_dict(hf.state_dict())
    model.eval()
    assert model.config._experts_implementation != "eager"
    bridge = build_bridge_from_module(model, "MixtralForCausalLM", hf_config=config)
    toks = tokens()
    with torch.no_grad():
        reference = bridge(toks)
        logits = convert_zoo_bridge(bridge, fused=False)(toks)
    assert _close(logits, reference, torch.float32)


def test_neuron_results_sum_to_the_output():
    """``set_use_neuron_result``: every expert's ``hook_result`` fires, per head ``[1, routed,
    heads, d_model]``, and the logits stay the unconverted bridge's."""
    from tl_attnonly.bridge import set_use_neuron_result

    bridge = build_bridge("qwen2_moe", torch.float64)
    toks = tokens()
    with torch.no_grad():
        reference = bridge(toks)
    convert_zoo_bridge(bridge)
    set_use_neuron_result(bridge, True)
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(toks)
    assert _close(logits, reference, torch.float64)
    result = cache["blocks.1.mlp.experts.0.hook_result"]
    z = cache["blocks.1.mlp.experts.0.hook_z"]
    assert result.shape == (*z.shape[:3], 64)
    assert "blocks.1.mlp.shared_expert.hook_result" in cache.keys()


def test_a_perturbed_head_fails_the_comparison():
    """The comparisons above can fail: a 1e-3 change of one expert's pattern moves the logits
    outside the float64 tolerance."""
    bridge = build_bridge("mixtral", torch.float64)
    toks = tokens()
    with torch.no_grad():
        reference = bridge(toks)
    convert_zoo_bridge(bridge)

    def nudge(pattern: torch.Tensor, hook: Any) -> torch.Tensor:
        return pattern * (1 + 1e-3)

    with torch.no_grad():
        logits = bridge.run_with_hooks(
            toks, fwd_hooks=[("blocks.1.mlp.experts.0.hook_pattern", nudge)]
        )
    assert not _close(logits, reference, torch.float64)


# --- refusals ---------------------------------------------------------------------------------


def test_gpt_oss_clamped_experts_refused_naming_the_clamp():
    """GPT-OSS's experts clamp the gate (<= 7) and the linear branch ([-7, 7]) before the product:
    refused before any change, naming the clamp and the layer (as TL 3.x's ``HookedTransformer``
    route refuses ``GptOssMoE``: tests/test_convert.py::test_gpt_oss_moe_refused)."""
    assert ZOO["gpt_oss"].mlp == "moe"
    bridge = build_bridge("gpt_oss", torch.float64)
    toks = tokens()
    hooks = set(bridge.hook_dict)
    with torch.no_grad():
        reference = bridge(toks)
    with pytest.raises(REFUSALS) as info:
        convert_zoo_bridge(bridge)
    message = str(info.value)
    assert "blocks.0.mlp.experts" in message and "clamp" in message, message
    assert "Supported" in message
    assert set(bridge.hook_dict) == hooks
    with torch.no_grad():
        assert torch.equal(bridge(toks), reference)


def test_gpt_oss_clamp_is_active_on_the_zoo_model():
    """The refusal is needed: on the zoo model the clamp changes some expert outputs (an
    unclamped SwiGLU would not be GPT-OSS)."""
    bridge = build_bridge("gpt_oss", torch.float64)
    experts = bridge.original_model.model.layers[0].mlp.experts
    x = 4 * torch.randn(
        64, bridge.cfg.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    gate_up = x @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    assert bool((gate > experts.limit).any() or (up.abs() > experts.limit).any())


def _first_forward_counter(bridge: Any) -> list[int]:
    ran: list[int] = []
    bridge.blocks[0].register_forward_pre_hook(lambda module, args: ran.append(1))
    return ran


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3"])
def test_analysis_tools_refuse_mixtures_of_experts_by_layer(name):
    """As on ``AttnOnlyTransformer``'s ``NeuronHeadMoE`` (tests/analysis/test_gated_analysis.py,
    tests/analysis/discovery): the analysis tools refuse a converted MoE bridge before any work,
    naming the first MoE layer and the experts' hooks to use instead."""
    from tl_attnonly.adapt import analysis_model
    from tl_attnonly.analysis import (
        discover_circuit,
        get_act_patch_neuron_heads,
        summarize_neuron_heads,
    )

    bridge = convert_zoo_bridge(build_bridge(name, torch.float32))
    layer = min(_moe_layers(bridge))
    ran = _first_forward_counter(bridge)
    toks = tokens()
    match = rf"blocks\.{layer}\.mlp is a mixture of experts \(BridgeNeuronHeadExperts\)"
    with pytest.raises(NotImplementedError, match=match):
        analysis_model(bridge)
    with pytest.raises(NotImplementedError, match=match):
        discover_circuit(bridge, toks, toks, lambda logits: logits[:, -1, 0].mean())
    with pytest.raises(NotImplementedError, match=match):
        get_act_patch_neuron_heads(bridge, toks, {}, lambda logits: logits[0, -1, 0])
    with pytest.raises(NotImplementedError, match=match):
        summarize_neuron_heads(bridge, [toks[0]])
    assert not ran, "refused before any forward pass"


def test_neuron_head_cache_of_a_moe_bridge_keeps_expert_entries():
    """``tl_attnonly.neuron_head_cache`` takes a converted MoE bridge's cache (it has neuron-head
    hooks, under the experts) and answers the experts' names as stored, like an
    ``AttnOnlyTransformer`` MoE's cache."""
    import tl_attnonly

    bridge = convert_zoo_bridge(build_bridge("mixtral", torch.float32))
    with torch.no_grad():
        _, cache = bridge.run_with_cache(tokens())
    wrapped = tl_attnonly.neuron_head_cache(cache)
    key = "blocks.1.mlp.experts.3.hook_z"
    assert wrapped[key] is cache[key]


def _hooked_mixtral(hf: Any, config: Any, dtype: torch.dtype) -> Any:
    """The zoo Mixtral as a ``HookedTransformer`` (TL 3.x: TL's own weight conversion, no
    processing, the Hugging Face rotary tables)."""
    from kinds import _hf_rotary
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_mixtral_weights

    cfg = HookedTransformerConfig(
        n_layers=2, d_vocab=config.vocab_size, dtype=dtype, device="cpu", n_ctx=64,
        d_model=config.hidden_size, n_heads=4, d_head=16, n_key_value_heads=2,
        d_mlp=config.intermediate_size, act_fn="silu", normalization_type="RMS",
        positional_embedding_type="rotary", rotary_dim=16, rotary_adjacent_pairs=False,
        final_rms=True, gated_mlp=True, eps=config.rms_norm_eps,
        num_experts=config.num_local_experts, experts_per_token=config.num_experts_per_tok,
        norm_topk_prob=True, original_architecture="MixtralForCausalLM",
    )  # fmt: skip
    model = HookedTransformer(cfg)
    model.load_state_dict(convert_mixtral_weights(hf, cfg), strict=False)
    sin, cos = _hf_rotary(hf, cfg.n_ctx, cfg.rotary_dim)
    for block in model.blocks:
        block.attn.rotary_sin.copy_(sin.to(dtype))
        block.attn.rotary_cos.copy_(cos.to(dtype))
    return model.to(dtype).eval()


def test_expert_hooks_as_on_attn_only_transformer():
    """TL 3.x: the converted bridge's expert hooks are the ``AttnOnlyTransformer`` MoE's (same
    weights): the same names, shapes (the same routed tokens, in the same order) and values, to
    the float32 rounding of Hugging Face's RMSNorm (float32 inside)."""
    from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER

    if not HAS_HOOKED_TRANSFORMER:
        pytest.skip("TransformerLens 4.x has no HookedTransformer")
    from transformer_lens.model_bridge.sources import build_bridge_from_module

    import tl_attnonly

    hf, config = build_hf_model("mixtral", torch.float64)
    hooked = tl_attnonly.convert(_hooked_mixtral(hf, config, torch.float64))
    bridge = build_bridge_from_module(hf, "MixtralForCausalLM", hf_config=config)
    convert_zoo_bridge(bridge)
    toks = tokens()
    with torch.no_grad():
        logits_h, cache_h = hooked.run_with_cache(toks)
        logits_b, cache_b = bridge.run_with_cache(toks)
    torch.testing.assert_close(logits_b, logits_h, rtol=1e-5, atol=1e-5)

    def expert_keys(cache: Any) -> set[str]:
        return {k for k in cache.keys() if ".mlp.experts." in k and k.split(".")[4].isdigit()}

    keys = expert_keys(cache_h)
    assert len(keys) == 2 * 4 * (len(EXPERT_HOOKS) - 1)  # hook_result fires only when asked
    assert expert_keys(cache_b) == keys
    for key in sorted(keys):
        torch.testing.assert_close(cache_b[key], cache_h[key], rtol=1e-5, atol=1e-5, msg=key)
