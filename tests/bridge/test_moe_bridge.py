"""Mixture-of-experts bridges converted: every expert's neurons (and a shared expert's) as
neuron-heads, against the unconverted bridge of the same weights (TransformerLens 3.x and 4.x).

Zoo models (``zoo.py``): Mixtral, Qwen2-MoE (shared expert), Qwen3-MoE, OLMoE, Granite-MoE,
PhiMoE, DeepSeek-V3 (a dense first layer, then a MoE layer with shared experts); GPT-OSS (its
clamped SwiGLU, interleaved, transposed and biased) is refused by default, naming the option,
and with ``clamp="check"`` is exact where the clamp is inactive and warned where it acts. Each
check compares with an independent reference: the unconverted bridge's own hooks and logits, or
a Hugging Face expert whose ``down_proj`` column was zeroed.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from zoo import REFUSALS, ZOO, build_bridge, build_hf_model, convert_zoo_bridge, make_config, tokens

from tl_attnonly.bridge import neuron_head_layers, unconvert_bridge
from tl_attnonly.bridge.expert_modules import EXPERT_HOOKS, BridgeNeuronHeadExperts
from tl_attnonly.components import ClampActiveWarning

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
        got, want = cache[key], ref_cache[key]
        if got.shape != want.shape:  # MLA's hook_z: split into W_O's heads (attention_layout)
            assert key.endswith(("attn.hook_z", "attn.o.hook_in")), key
            got, want = got.flatten(-2), want.flatten(-2)
        assert _close(got, want, dtype), key
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
    """Without ``clamp="check"``, GPT-OSS's experts (they clamp the gate (<= 7) and the linear
    branch ([-7, 7]) before the product) are refused before any change, naming the clamp, the
    layer and the option (as TL 3.x's ``HookedTransformer`` route refuses ``GptOssMoE``:
    tests/test_convert.py::test_gpt_oss_moe_refused)."""
    from tl_attnonly import ConversionOptions, convert

    assert ZOO["gpt_oss"].mlp == "moe"
    bridge = build_bridge("gpt_oss", torch.float64)
    toks = tokens()
    hooks = set(bridge.hook_dict)
    with torch.no_grad():
        reference = bridge(toks)
    with pytest.raises(REFUSALS) as info:
        convert(bridge, ConversionOptions())  # the default: clamp="refuse"
    message = str(info.value)
    assert "blocks.0.mlp.experts" in message and "clamp" in message, message
    assert "ConversionOptions(clamp='check')" in message and "Supported" in message
    assert set(bridge.hook_dict) == hooks
    with torch.no_grad():
        assert torch.equal(bridge(toks), reference)
    with pytest.raises(ValueError, match="1 head per neuron"):  # its exact head is one head
        convert(bridge, ConversionOptions(clamp="check", n_heads_per_neuron=4))
    with pytest.raises(ValueError, match="clamp must be one of"):
        ConversionOptions(clamp="ignore")


def test_gpt_oss_clamp_is_active_on_the_zoo_model():
    """The check is needed: on the zoo model the clamp changes some expert outputs (an
    unclamped SwiGLU would not be GPT-OSS)."""
    bridge = build_bridge("gpt_oss", torch.float64)
    experts = bridge.original_model.model.layers[0].mlp.experts
    x = 4 * torch.randn(
        64, bridge.cfg.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    gate_up = x @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    assert bool((gate > experts.limit).any() or (up.abs() > experts.limit).any())


def _hf_gate_up(bridge: Any, layer: int, x: torch.Tensor, expert: int) -> tuple[Any, Any]:
    """Gate and up of a GPT-OSS expert of the *unconverted* Hugging Face module, in float64 (its
    own interleaved layout and biases, not the converted module's views)."""
    hf = _experts_module(bridge, layer)
    hf = hf.__dict__.get("hf_experts", hf)
    with torch.no_grad():
        w = hf.gate_up_proj[expert].to(torch.float64)
        gate_up = x.to(torch.float64) @ w + hf.gate_up_proj_bias[expert].to(torch.float64)
    return gate_up[..., ::2], gate_up[..., 1::2]


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
def test_gpt_oss_exact_where_the_clamp_is_inactive(dtype):
    """``clamp="check"``: on the zoo input the clamp is inactive, so the converted experts are
    the unconverted bridge's. Head path: logits and every hook of the unconverted bridge within
    the exact tolerance; each expert's ``hook_gate``/``hook_pre`` are Hugging Face's gate and up
    (its interleaved, biased, transposed layout, recomputed in float64), its pattern is
    ``sigmoid(1.702 g)``, nothing recorded, no warning. Fused path: bit for bit."""
    toks = tokens()
    bridge = build_bridge("gpt_oss", dtype)
    with torch.no_grad():
        reference, ref_cache = bridge.run_with_cache(toks)
    convert_zoo_bridge(bridge, fused=False, clamp="check")
    moe = _moe_layers(bridge)
    assert sorted(moe) == [0, 1]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", ClampActiveWarning)
        logits, cache = bridge.run_with_cache(toks)
    assert _close(logits, reference, dtype), (logits - reference).abs().max().item()
    for key in ref_cache.keys():
        assert _close(cache[key], ref_cache[key], dtype), key
    for layer, experts in moe.items():
        assert experts.clamp is not None and experts.clamp_count == 0
        x = cache[f"blocks.{layer}.mlp.hook_in"].flatten(0, 1)
        indices = cache[f"blocks.{layer}.mlp.hook_expert_indices"]
        for e in range(experts.num_experts):
            prefix = f"blocks.{layer}.mlp.experts.{e}"
            _, token = torch.where(indices.T == e)
            gate, up = _hf_gate_up(bridge, layer, x[token], e)
            assert _close(cache[f"{prefix}.hook_gate"].to(torch.float64), gate, dtype)
            assert _close(cache[f"{prefix}.hook_pre"].to(torch.float64), up, dtype)
            pattern = cache[f"{prefix}.hook_pattern"][0, :, :, 0].T
            assert _close(pattern, torch.sigmoid(1.702 * cache[f"{prefix}.hook_gate"]), dtype)
    fused = build_bridge("gpt_oss", dtype)
    with torch.no_grad():
        assert torch.equal(convert_zoo_bridge(fused)(toks), reference)


def test_gpt_oss_clamp_acting_is_warned_counted_and_measured():
    """Inputs large enough for the clamp to act: every forward pass warns
    (:class:`ClampActiveWarning`, naming the layer), and the count and the largest activation
    change recorded on the experts are those recomputed from the unconverted Hugging Face
    experts; the logits differ from the unconverted bridge's (never silently equal)."""
    toks = tokens()
    bridge = build_bridge("gpt_oss", torch.float64)
    with torch.no_grad():  # layer 0's MoE input six times larger
        bridge.original_model.model.layers[0].post_attention_layernorm.weight.mul_(6)
        reference, ref_cache = bridge.run_with_cache(toks)
    limit, alpha = 7.0, 1.702
    count, change = 0, 0.0
    x = ref_cache["blocks.0.mlp.hook_in"].flatten(0, 1)
    router = bridge.original_model.model.layers[0].mlp.router
    with torch.no_grad():
        indices = router(x)[-1]  # [tokens, top_k]
    for e in range(4):
        _, token = torch.where(indices.T == e)
        gate, up = _hf_gate_up(bridge, 0, x[token], e)
        acts = (gate > limit) | (up.abs() > limit)
        g, u = gate[acts], up[acts]
        gc, uc = g.clamp(max=limit), u.clamp(-limit, limit)
        diff = (u + 1) * g * torch.sigmoid(alpha * g) - (uc + 1) * gc * torch.sigmoid(alpha * gc)
        count += int(acts.sum())
        change = max(change, float(diff.abs().max())) if acts.any() else change
    assert count > 0, "the input must make the clamp act"
    convert_zoo_bridge(bridge, clamp="check")
    experts = _moe_layers(bridge)[0]
    for _ in range(2):
        with torch.no_grad(), pytest.warns(ClampActiveWarning, match="blocks.0.mlp.experts") as w:
            logits = bridge(toks)
        assert f"acted on {count} of " in str(w[0].message), str(w[0].message)
    assert experts.clamp_count == 2 * count
    assert experts.clamp_max_change == pytest.approx(change, rel=1e-12)
    assert (logits - reference).abs().max().item() > 1e-6
    experts.reset_clamp_record()
    assert experts.clamp_count == 0 and experts.clamp_max_change == 0.0


def test_gpt_oss_zeroing_a_neuron_head_equals_zeroing_the_hf_neuron():
    """The interleaved, transposed, biased layout is read right: zeroing one neuron-head's
    ``hook_z`` equals zeroing that neuron's ``down_proj`` row ([E, d_mlp, d_model]) in the
    Hugging Face model; an in-place edit of the grouped weights shows in the heads."""
    toks = tokens()
    converted = convert_zoo_bridge(build_bridge("gpt_oss", torch.float64))
    reference = build_bridge("gpt_oss", torch.float64)
    expert, neuron = 1, 5
    with torch.no_grad():
        clean = converted(toks)
        reference.original_model.model.layers[1].mlp.experts.down_proj[expert, neuron] = 0.0
        expected = reference(toks)
        ablated = converted.run_with_hooks(
            toks,
            fwd_hooks=[(f"blocks.1.mlp.experts.{expert}.hook_z", _zero_neuron_hook(neuron))],
        )
    assert (expected - clean).abs().max().item() > 1e-3, "the neuron must matter"
    assert _close(ablated, expected, torch.float64)
    views = _moe_layers(converted)[1][expert]
    grouped = _moe_layers(converted)[1].gate_up_proj
    assert views.W_gate.data_ptr() == grouped[expert].data_ptr()  # column 0 of [d_model, 2m]
    assert views.W_in.data_ptr() == grouped[expert, :, 1:].data_ptr()
    twin = build_bridge("gpt_oss", torch.float64)
    with torch.no_grad():
        for model in (converted, twin):
            _experts_module(model, 1).gate_up_proj_bias[expert].add_(0.5)
        assert _close(converted(toks), twin(toks), torch.float64)
        assert not _close(converted(toks), clean, torch.float64)


def _first_forward_counter(bridge: Any) -> list[int]:
    ran: list[int] = []
    bridge.blocks[0].register_forward_pre_hook(lambda module, args: ran.append(1))
    return ran


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3"])
def test_analysis_tools_refuse_mixtures_of_experts_by_layer(name):
    """As on ``AttnOnlyTransformer``'s ``NeuronHeadMoE`` (tests/analysis/test_gated_analysis.py,
    tests/analysis/discovery): the tools that need dense neuron-heads refuse a converted MoE
    bridge's expert layer before any work, naming it and the expert tools to use instead
    (neuron-head patching sweeps the layer's experts: a clean cache without them is refused)
    (``analysis_model`` takes the model: tests/bridge/test_moe_tools.py; ``discover_circuit``
    takes an expert layer as one node: tests/analysis/discovery/test_moe_discovery.py; the
    summaries read its experts' heads: tests/analysis/test_moe_summaries.py)."""
    from tl_attnonly.adapt import analysis_model
    from tl_attnonly.analysis import composition_scores, get_act_patch_neuron_heads

    bridge = convert_zoo_bridge(build_bridge(name, torch.float32))
    layer = min(_moe_layers(bridge))
    ran = _first_forward_counter(bridge)
    toks = tokens()
    match = rf"blocks\.{layer}\.mlp is a mixture of experts \(BridgeNeuronHeadExperts\)"
    assert analysis_model(bridge).blocks[layer].mlp.is_mixture_of_experts
    with pytest.raises(KeyError, match="neuron_names_filter"):  # patched through its experts
        get_act_patch_neuron_heads(
            bridge, toks, {}, lambda logits: logits[0, -1, 0], layers=[layer]
        )
    with pytest.raises(NotImplementedError, match=match):
        composition_scores(bridge, "Q", senders=[f"L{layer}N0"])
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
