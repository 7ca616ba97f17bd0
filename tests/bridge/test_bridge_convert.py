"""tl_attnonly.convert(bridge): a TransformerBridge's MLPs as neuron-heads (TL 3.x and 4.x).

Every test compares the converted bridge with the same bridge unconverted (computed before
conversion, or after ``unconvert_bridge``): logits, the bridge's own MLP hooks, generation; and
checks the neuron-head hooks exist, fire, and carry the MLP's computation.
"""

from __future__ import annotations

import pytest
import torch
from bridge_models import ARCHITECTURES, GELU, SILU, make_bridge, make_tokens

import tl_attnonly
from tl_attnonly import ConversionOptions
from tl_attnonly.bridge import (
    BRIDGE_NEURON_HEAD_HOOKS,
    BridgeGatedNeuronHeadMLP,
    BridgeNeuronHeadMLP,
    is_converted_bridge,
    neuron_head_layers,
    unconvert_bridge,
)

ALL = SILU + GELU
TOL = {torch.float32: 1e-4, torch.float64: 1e-10}
#: The bridge's own MLP-side hooks (those that exist on the architecture are compared).
BRIDGE_MLP_HOOKS = ("hook_in", "hook_pre", "hook_pre_linear", "hook_post", "hook_out")


@pytest.fixture
def tokens() -> torch.Tensor:
    return make_tokens()


def _mlp_hook_names(bridge, layer: int) -> list[str]:
    names = [f"blocks.{layer}.mlp.{hook}" for hook in BRIDGE_MLP_HOOKS]
    names.append(f"blocks.{layer}.hook_mlp_out")
    return [name for name in names if name in bridge.hook_dict]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("arch", SILU)
def test_silu_logits_match_unconverted(arch, dtype, tokens):
    bridge = make_bridge(arch, dtype)
    reference = bridge(tokens)
    assert tl_attnonly.convert(bridge) is bridge  # in place, same object
    assert is_converted_bridge(bridge)
    torch.testing.assert_close(bridge(tokens), reference, rtol=0, atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("arch", GELU)
def test_gelu_heads_within_stated_bound(arch, dtype, tokens):
    """Layer 0's hook_post differs from the original's by at most the K-head fit's stated error
    (times |up| for a gated MLP); the logits stay close."""
    bridge = make_bridge(arch, dtype)
    ref_logits, ref = bridge.run_with_cache(tokens)
    tl_attnonly.convert(bridge)
    layer = neuron_head_layers(bridge)[0]
    bound = layer.coefficients.max_abs_error()
    assert layer.n_heads_per_neuron > 1 and bound > 0
    logits, cache = bridge.run_with_cache(tokens)
    pre = ref["blocks.0.mlp.hook_pre"]
    assert 1 < pre.abs().max() < 20, "inputs must probe the fit inside its range"
    torch.testing.assert_close(cache["blocks.0.mlp.hook_pre"], pre, rtol=0, atol=0)
    scale = 1.0
    if arch == "gemma":
        scale = ref["blocks.0.mlp.hook_pre_linear"].abs()
    post_err = (cache["blocks.0.mlp.hook_post"] - ref["blocks.0.mlp.hook_post"]).abs()
    fp_slack = 1e-5 if dtype == torch.float32 else 1e-12
    assert (post_err <= bound * scale + fp_slack).all()
    assert post_err.max() >= bound / 100, "inputs should probe the approximation"
    assert (logits - ref_logits).abs().max() <= 1000 * bound


@pytest.mark.parametrize("arch", ALL)
def test_gelu_k_option_reaches_every_layer(arch):
    bridge = make_bridge(arch)
    act_fn = ARCHITECTURES[arch][3]
    if act_fn == "silu":
        with pytest.raises(ValueError, match="n_heads"):
            tl_attnonly.convert(bridge, ConversionOptions(n_heads_per_neuron=3))
        assert not is_converted_bridge(bridge), "a refusal must leave the bridge unchanged"
        return
    tl_attnonly.convert(bridge, ConversionOptions(n_heads_per_neuron=3))
    assert {layer.n_heads_per_neuron for layer in neuron_head_layers(bridge)} == {3}
    assert {layer.coefficients.activation for layer in neuron_head_layers(bridge)} == {act_fn}


@pytest.mark.parametrize("arch", ALL)
def test_bridge_mlp_hooks_keep_their_values(arch, tokens):
    """hook_in, hook_pre(_linear), hook_post, hook_out and hook_mlp_out are the unconverted
    bridge's (exactly where nothing approximate ran before them: layer 0's inputs and
    pre-activations; the rest within the logit tolerance for SiLU)."""
    bridge = make_bridge(arch)
    names = _mlp_hook_names(bridge, 0) + _mlp_hook_names(bridge, 1)
    for hook in ("mlp.hook_in", "mlp.hook_pre", "mlp.hook_post", "mlp.hook_out", "hook_mlp_out"):
        assert f"blocks.0.{hook}" in names
    _, ref = bridge.run_with_cache(tokens, names_filter=names)
    tl_attnonly.convert(bridge)
    _, cache = bridge.run_with_cache(tokens, names_filter=names)
    assert set(cache.keys()) == set(ref.keys()) >= set(names)
    layer0_inputs = ("hook_in", "hook_pre", "gate.hook_out", "hook_pre_linear", "in.hook_out")
    for name in ref.keys():
        exact = name in [f"blocks.0.mlp.{hook}" for hook in layer0_inputs]
        atol = 0 if exact else (1e-10 if arch in SILU else 1e-2)
        torch.testing.assert_close(cache[name], ref[name], rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_neuron_head_hooks_registered_and_cached(arch, tokens):
    bridge = make_bridge(arch)
    tl_attnonly.convert(bridge)
    names = [f"blocks.{i}.mlp.hook_{n}" for i in range(2) for n in BRIDGE_NEURON_HEAD_HOOKS]
    assert set(names) <= set(bridge.hook_dict)
    layer = neuron_head_layers(bridge)[0]
    layer.use_neuron_result = True  # hook_result fires only with per-head results on
    _, cache = bridge.run_with_cache(tokens)
    batch, pos = tokens.shape
    heads = layer.n_neuron_heads
    assert cache["blocks.0.mlp.hook_pattern"].shape == (batch, heads, pos, 2)
    assert cache["blocks.0.mlp.hook_attn_scores"].shape == (batch, heads, pos, 2)
    assert cache["blocks.0.mlp.hook_z"].shape == (batch, pos, heads, 1)
    assert cache["blocks.0.mlp.hook_result"].shape == (batch, pos, heads, 32)
    # the heads carry the MLP: sum of each neuron's z (+ b_post) is hook_post
    z = cache["blocks.0.mlp.hook_z"].reshape(batch, pos, layer.d_mlp, -1).sum(-1)
    torch.testing.assert_close(z + layer.b_post, cache["blocks.0.mlp.hook_post"])
    # per-head results sum to the MLP output (minus the output bias)
    result = cache["blocks.0.mlp.hook_result"].sum(-2) + layer.b_O
    torch.testing.assert_close(result, cache["blocks.0.mlp.hook_out"])
    # the pattern is what derive_activation recomputes from the cached pre-activations
    inputs = {hook: cache[f"blocks.0.mlp.{hook}"] for hook in layer.derive_inputs}
    torch.testing.assert_close(
        layer.derive_activation("pattern", **inputs), cache["blocks.0.mlp.hook_pattern"]
    )


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_conversion_is_not_a_no_op(arch, tokens):
    """A hook on hook_pattern fires on the converted bridge, and all-bias patterns switch every
    neuron off (hook_post = 0 for SiLU / sum g = 0 for the GELU fits): the MLP really runs as
    neuron-heads."""
    bridge = make_bridge(arch)
    fired = []

    def all_bias(pattern, hook):
        fired.append(hook.name)
        pattern[..., 0] = 0.0
        pattern[..., 1] = 1.0
        return pattern

    assert "blocks.0.mlp.hook_pattern" not in bridge.hook_dict
    tl_attnonly.convert(bridge)
    _, cache = bridge.run_with_cache(tokens, names_filter="blocks.0.mlp.hook_post")
    assert cache["blocks.0.mlp.hook_post"].abs().max() > 0.1
    stored = {}

    def store(post, hook):
        stored["post"] = post.clone()

    bridge.run_with_hooks(
        tokens,
        fwd_hooks=[("blocks.0.mlp.hook_pattern", all_bias), ("blocks.0.mlp.hook_post", store)],
    )
    assert fired == ["blocks.0.mlp.hook_pattern"]
    layer = neuron_head_layers(bridge)[0]
    g_sum = sum(layer.coefficients.g) if isinstance(layer, BridgeNeuronHeadMLP) else 0.0
    torch.testing.assert_close(stored["post"], torch.full_like(stored["post"], g_sum))


def test_hooks_context_names_filter_and_stop_at_layer(tokens):
    bridge = make_bridge("llama")
    tl_attnonly.convert(bridge)
    seen = []
    with bridge.hooks(fwd_hooks=[("blocks.1.mlp.hook_z", lambda z, hook: seen.append(z.shape))]):
        bridge(tokens)
    assert seen == [(3, 7, 48, 1)]
    bridge(tokens)
    assert len(seen) == 1, "hooks() removes its hooks on exit"
    _, cache = bridge.run_with_cache(tokens, names_filter=lambda name: "mlp.hook_pattern" in name)
    assert sorted(cache.keys()) == ["blocks.0.mlp.hook_pattern", "blocks.1.mlp.hook_pattern"]
    _, cache = bridge.run_with_cache(
        tokens, names_filter=lambda name: "mlp.hook_pattern" in name, stop_at_layer=1
    )
    assert list(cache.keys()) == ["blocks.0.mlp.hook_pattern"]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_weights_are_shared_not_copied(arch, tokens):
    bridge = make_bridge(arch)
    params_before = {name: p.data_ptr() for name, p in bridge.named_parameters()}
    numel = sum(p.numel() for p in bridge.parameters())
    state_before = {name: t.data_ptr() for name, t in bridge.state_dict().items()}
    tl_attnonly.convert(bridge)
    assert {name: p.data_ptr() for name, p in bridge.named_parameters()} == params_before
    assert {name: t.data_ptr() for name, t in bridge.state_dict().items()} == state_before
    assert sum(p.numel() for p in bridge.parameters()) == numel
    layer = neuron_head_layers(bridge)[0]
    assert not list(layer.parameters(recurse=False)), "the neuron-head layer owns no weights"
    mlp = bridge.blocks[0].mlp
    assert layer.W_in.data_ptr() == getattr(mlp, "in").original_component.weight.data_ptr()
    assert layer.W_out.data_ptr() == mlp.out.original_component.weight.data_ptr()
    # an in-place edit of the model's weight shows in the converted bridge
    before = bridge(tokens)
    with torch.no_grad():
        mlp.out.original_component.weight.mul_(2.0)
    assert not torch.allclose(bridge(tokens), before)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_padding_and_batch(arch):
    """Right-padded batch with an attention mask: same logits as unconverted (the mask reaches
    attention; the neuron-heads are per position)."""
    bridge = make_bridge(arch)
    tokens = make_tokens(batch=3, pos=6)
    mask = torch.ones_like(tokens)
    mask[0, 4:] = 0
    mask[2, 5:] = 0
    reference = bridge(tokens, attention_mask=mask)
    tl_attnonly.convert(bridge)
    logits = bridge(tokens, attention_mask=mask)
    atol = 1e-10 if arch in SILU else 1e-2
    assert not torch.allclose(reference, bridge(tokens)), "the mask must matter"
    torch.testing.assert_close(logits, reference, rtol=0, atol=atol)


def test_generate_gives_the_same_tokens():
    bridge = make_bridge("llama")
    prompt = make_tokens(batch=2, pos=4)
    kwargs = dict(max_new_tokens=6, do_sample=False, verbose=False)
    reference = bridge.generate(prompt, **kwargs)
    tl_attnonly.convert(bridge)
    generated = bridge.generate(prompt, **kwargs)
    assert torch.equal(generated, reference)


def test_unconvert_restores_the_original_modules(tokens):
    bridge = make_bridge("qwen2")
    original = [block.mlp.original_component for block in bridge.blocks]
    reference = bridge(tokens)
    n_hooks = len(bridge.hook_dict)
    tl_attnonly.convert(bridge)
    assert len(bridge.hook_dict) == n_hooks + 2 * len(BRIDGE_NEURON_HEAD_HOOKS)
    assert all(isinstance(layer, BridgeGatedNeuronHeadMLP) for layer in neuron_head_layers(bridge))
    unconvert_bridge(bridge)
    assert [block.mlp.original_component for block in bridge.blocks] == original
    assert len(bridge.hook_dict) == n_hooks
    assert torch.equal(bridge(tokens), reference)
    assert not is_converted_bridge(bridge)


def test_converting_twice_remounts(tokens):
    bridge = make_bridge("llama")
    reference = bridge(tokens)
    tl_attnonly.convert(bridge)
    first = neuron_head_layers(bridge)
    tl_attnonly.convert(bridge)
    assert all(a is not b for a, b in zip(first, neuron_head_layers(bridge)))
    torch.testing.assert_close(bridge(tokens), reference, rtol=0, atol=1e-10)
    unconvert_bridge(bridge)
    assert torch.equal(bridge(tokens), reference)


# ---------------------------------------------------------------- compatibility mode


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_compatibility_mode_then_convert(arch, tokens):
    """Converted after enable_compatibility_mode(): the neuron-heads read the processed weights
    (folded layer norms, centred weights), so the logits are the processed bridge's."""
    bridge = make_bridge(arch)
    bridge.enable_compatibility_mode(disable_warnings=True)
    reference, ref_cache = bridge.run_with_cache(tokens)
    tl_attnonly.convert(bridge)
    logits, cache = bridge.run_with_cache(tokens)
    atol = 1e-10 if arch in SILU else 1e-2
    torch.testing.assert_close(logits, reference, rtol=0, atol=atol)
    torch.testing.assert_close(
        cache["blocks.0.mlp.hook_pre"], ref_cache["blocks.0.mlp.hook_pre"], rtol=0, atol=0
    )
    assert "blocks.1.mlp.hook_pattern" in cache


def test_compatibility_mode_after_convert_refuses_then_reconvert_works(tokens):
    """enable_compatibility_mode() after conversion makes a gated bridge MLP compute itself: a
    forward pass then raises (never silently the original MLP); converting again fixes it."""
    reference_bridge = make_bridge("llama")
    reference_bridge.enable_compatibility_mode(disable_warnings=True)
    reference = reference_bridge(tokens)

    bridge = make_bridge("llama")
    tl_attnonly.convert(bridge)
    bridge.enable_compatibility_mode(disable_warnings=True)
    with pytest.raises(RuntimeError, match="convert\\(bridge\\) again"):
        bridge(tokens)
    tl_attnonly.convert(bridge)
    torch.testing.assert_close(bridge(tokens), reference, rtol=0, atol=1e-10)
    _, cache = bridge.run_with_cache(tokens, names_filter=lambda name: "mlp.hook_z" in name)
    assert len(cache) == 2


# ---------------------------------------------------------------- refusals


def test_refuses_unsupported_experts_naming_the_layer():
    """Mixtures of experts convert (tests/bridge/test_moe_bridge.py); experts with an activation
    no neuron-head represents are refused before any change, naming the experts."""
    import transformers
    from bridge_models import build_bridge_from_module

    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, hidden_act="relu2",
    )  # fmt: skip
    bridge = build_bridge_from_module(
        transformers.MixtralForCausalLM(config).eval(), "MixtralForCausalLM", hf_config=config
    )
    experts = bridge.blocks[0].mlp.original_component.experts
    with pytest.raises(ValueError, match=r"blocks\.0\.mlp\.experts .*not one neuron-heads can"):
        tl_attnonly.convert(bridge)
    assert bridge.blocks[0].mlp.original_component.experts is experts


def test_experts_without_layout_flags_are_refused_naming_the_transformers_version():
    """transformers 5.17's grouped experts (Mixtral's and the others') lack a layout flag
    (``has_post_expert_norm``): refused before any change, saying to upgrade (seen with the lent
    GPU machine's transformers 5.17; here, on any version, a flag is taken away)."""
    import transformers
    from bridge_models import build_bridge_from_module

    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
    )  # fmt: skip
    bridge = build_bridge_from_module(
        transformers.MixtralForCausalLM(config).eval(), "MixtralForCausalLM", hf_config=config
    )
    experts = bridge.blocks[0].mlp.original_component.experts
    experts.is_transposed = None
    match = r"blocks\.0\.mlp\.experts .*its layout \(\w+\).*transformers [\d.]+.*pip install -U"
    with pytest.raises(NotImplementedError, match=match):
        tl_attnonly.convert(bridge)
    assert bridge.blocks[0].mlp.original_component.experts is experts


@pytest.mark.parametrize("act", ["tanh", "relu2"])
def test_refuses_unsupported_activation_before_any_work(act):
    bridge = make_bridge("llama", hidden_act=act)
    original = [block.mlp.original_component for block in bridge.blocks]
    with pytest.raises(ValueError, match=r"blocks\.0\.mlp .*not one neuron-heads can represent"):
        tl_attnonly.convert(bridge)
    assert [block.mlp.original_component for block in bridge.blocks] == original


def test_identifies_activation_by_value_not_by_config():
    """The config says one activation, the module runs another: the module's is converted."""
    bridge = make_bridge("llama", hidden_act="gelu_pytorch_tanh")
    tl_attnonly.convert(bridge)
    assert neuron_head_layers(bridge)[0].coefficients.activation == "gelu_new"


def test_refuses_share_weights_false_and_literal_form():
    bridge = make_bridge("llama")
    with pytest.raises(ValueError, match="in place"):
        tl_attnonly.convert(bridge, share_weights=False)
    with pytest.raises(NotImplementedError, match="structured form only"):
        tl_attnonly.convert(bridge, form="literal")
    with pytest.raises(NotImplementedError, match="structured form only"):
        tl_attnonly.convert(bridge, omega=1e4)  # a literal-form option
    assert not is_converted_bridge(bridge)


def test_unknown_keyword_is_named_not_taken_for_a_literal_option():
    """A misspelt or foreign keyword (``progress``) is a TypeError naming it, for a bridge and a
    HookedTransformer alike, not a refusal of the literal form (failed before: "structured form
    only" / "belong to form='literal'")."""
    from conftest import HAS_HOOKED_TRANSFORMER, make_model

    models = [make_bridge("llama")] + ([make_model()] if HAS_HOOKED_TRANSFORMER else [])
    for model in models:
        with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['progress'\]"):
            tl_attnonly.convert(model, progress=False)


def test_refuses_a_nonstandard_mlp_forward():
    """An MLP whose forward is not down(act(gate x) * up x) fails the self-check, named."""
    bridge = make_bridge("llama")
    hf_mlp = bridge.blocks[1].mlp.original_component
    hf_mlp.act_fn = torch.nn.SiLU()
    hf_mlp.register_forward_hook(lambda module, args, output: output * 1.5)
    with pytest.raises(NotImplementedError, match=r"blocks\.1\.mlp .*not the standard"):
        tl_attnonly.convert(bridge)
    assert not is_converted_bridge(bridge)


# ---------------------------------------------------------------- devices


def test_each_layer_lives_on_its_mlps_device(tokens):
    """The meta device stands in for a second device: a layer whose MLP is on meta converts
    (no values read, nothing moved) and reports that device; the other stays on the CPU."""
    bridge = make_bridge("llama")
    for name in ("gate", "in", "out"):
        getattr(bridge.blocks[1].mlp, name).to("meta")
    tl_attnonly.convert(bridge)
    first, second = neuron_head_layers(bridge)
    assert first.device.type == "cpu" and second.device.type == "meta"
    assert first.W_Q.device.type == "cpu" and second.W_Q.device.type == "meta"
    moved = {id(p) for p in bridge.blocks[1].mlp.parameters()}
    assert moved
    for name, param in bridge.named_parameters():
        assert param.device.type == ("meta" if id(param) in moved else "cpu"), name


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpu_split(tokens):
    """Layers split over two GPUs with accelerate's device map: each neuron-head layer computes
    on its MLP's GPU and the logits equal the unconverted split bridge's."""
    from accelerate import dispatch_model
    from bridge_models import ARCHITECTURES, build_bridge_from_module, make_hf

    hf, config = make_hf("llama")
    device_map = {
        "model.embed_tokens": 0,
        "model.rotary_emb": 0,
        "model.layers.0": 0,
        "model.layers.1": 1,
        "model.norm": 1,
        "lm_head": 1,
    }
    hf = dispatch_model(hf, device_map=device_map)
    bridge = build_bridge_from_module(hf, ARCHITECTURES["llama"][0], hf_config=config)
    reference = bridge(tokens.to("cuda:0")).cpu()
    tl_attnonly.convert(bridge)
    first, second = neuron_head_layers(bridge)
    assert first.device == torch.device("cuda:0") and second.device == torch.device("cuda:1")
    torch.testing.assert_close(bridge(tokens.to("cuda:0")).cpu(), reference, rtol=0, atol=1e-10)


def test_relu_mlp_converts_within_the_sigmoid_bound(tokens):
    bridge = make_bridge("llama", hidden_act="relu")
    _, ref = bridge.run_with_cache(tokens, names_filter="blocks.0.mlp.hook_post")
    tl_attnonly.convert(bridge, ConversionOptions(relu_k=1000.0))
    layer = neuron_head_layers(bridge)[0]
    assert layer.coefficients.activation == "relu"
    _, cache = bridge.run_with_cache(
        tokens, names_filter=["blocks.0.mlp.hook_post", "blocks.0.mlp.hook_pre_linear"]
    )
    bound = layer.coefficients.max_abs_error() * cache["blocks.0.mlp.hook_pre_linear"].abs()
    error = (cache["blocks.0.mlp.hook_post"] - ref["blocks.0.mlp.hook_post"]).abs()
    assert (error <= bound + 1e-12).all() and error.max() > 0


def test_hook_result_edit_reaches_the_output(tokens):
    """With per-head results on, zeroing every head's result leaves the output bias only."""
    from tl_attnonly.bridge import set_use_neuron_result

    bridge = tl_attnonly.convert(make_bridge("gpt2"))
    set_use_neuron_result(bridge, True)
    reference = bridge(tokens)

    def zero(result, hook):
        return torch.zeros_like(result)

    _, cache = bridge.run_with_cache(tokens, names_filter="blocks.0.mlp.hook_out")
    assert not torch.allclose(cache["blocks.0.mlp.hook_out"], neuron_head_layers(bridge)[0].b_O)
    stored = {}
    bridge.run_with_hooks(
        tokens,
        fwd_hooks=[
            ("blocks.0.mlp.hook_result", zero),
            ("blocks.0.mlp.hook_out", lambda out, hook: stored.setdefault("out", out.clone())),
        ],
    )
    b_O = neuron_head_layers(bridge)[0].b_O
    torch.testing.assert_close(stored["out"], b_O.expand_as(stored["out"]), rtol=0, atol=1e-12)
    torch.testing.assert_close(bridge(tokens), reference, rtol=0, atol=0)


def test_gradients_match_unconverted(tokens):
    bridge = make_bridge("llama")
    bridge(tokens).logsumexp(-1).sum().backward()
    params = bridge.named_parameters()
    reference = {name: p.grad.clone() for name, p in params if p.grad is not None}
    bridge.zero_grad()
    tl_attnonly.convert(bridge)
    bridge(tokens).logsumexp(-1).sum().backward()
    grads = {name: p.grad for name, p in bridge.named_parameters() if p.grad is not None}
    assert grads.keys() == reference.keys() and any("mlp" in name for name in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference[name], rtol=0, atol=1e-10, msg=name)


def test_train_mode_keeps_gpt2_mlp_dropout(tokens):
    bridge = make_bridge("gpt2", resid_pdrop=0.5)
    tl_attnonly.convert(bridge)
    layer = neuron_head_layers(bridge)[0]
    assert isinstance(layer.dropout, torch.nn.Dropout) and layer.dropout.p == 0.5
    bridge.train()
    _, cache = bridge.run_with_cache(tokens, names_filter="blocks.0.mlp.hook_out")
    out = cache["blocks.0.mlp.hook_out"]
    assert (out == 0).float().mean() > 0.3, "half the MLP output is dropped in train mode"
