"""Mixture-of-experts (TL's MoE) with every expert's neurons as gated neuron-heads."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, make_tokens
from transformer_lens import HookedTransformer
from transformer_lens.components import MoE

from tl_attnonly import AttnOnlyTransformer, convert
from tl_attnonly.components import GatedNeuronHeadExpert, NeuronHeadMoE

TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
DTYPES = [torch.float64, torch.float32]
MOE = dict(normalization_type="RMS", gated_mlp=True, num_experts=4, experts_per_token=2)


def moe_model(act_fn="silu", dtype=torch.float64, **overrides) -> HookedTransformer:
    model = make_model(act_fn, dtype, **{**MOE, **overrides})
    # TL builds MoE's nn.Linear layers in float32 whatever cfg.dtype says: move them.
    return model.to(dtype, print_details=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm_topk_prob", [False, True], ids=["mixtral", "olmoe"])
def test_moe_matches_original_router_untouched(norm_topk_prob, dtype):
    model = moe_model(dtype=dtype, norm_topk_prob=norm_topk_prob)
    converted = convert(model)
    assert all(isinstance(m, NeuronHeadMoE) for m in converted.neuron_heads)
    assert isinstance(converted.blocks[0].mlp, MoE)  # TL's router and forward
    tokens = make_tokens()
    logits, cache = model.run_with_cache(tokens)
    logits_c, cache_c = converted.run_with_cache(tokens)
    assert (logits_c - logits).abs().max() <= TOL[dtype]
    for name in ("hook_expert_weights", "hook_expert_indices", "experts.2.hook_gate"):
        key = f"blocks.0.mlp.{name}"
        assert torch.equal(cache[key], cache_c[key]), key
    for layer in range(2):
        for e in range(4):
            key = f"blocks.{layer}.mlp.experts.{e}.hook_post"
            torch.testing.assert_close(cache_c[key], cache[key], rtol=0, atol=TOL[dtype])
    n_routed = cache_c["blocks.0.mlp.experts.1.hook_post"].shape[0]
    pattern = cache_c["blocks.0.mlp.experts.1.hook_pattern"]
    assert pattern.shape == (1, converted.n_neuron_heads, n_routed, 2)


@pytest.mark.parametrize("act_fn", ["gelu_pytorch_tanh", "relu"])
def test_moe_geglu_reglu_within_bound(act_fn):
    model = moe_model(act_fn)
    converted = convert(model)
    tokens = make_tokens()
    _, cache = model.run_with_cache(tokens)
    _, cache_c = converted.run_with_cache(tokens)
    expert = converted.blocks[0].mlp.experts[0]
    c = expert.coefficients
    err = 0.2785 / c.relu_k if c.relu_k else c.max_abs_error()
    u = cache["blocks.0.mlp.experts.0.hook_pre"]
    diff = cache_c["blocks.0.mlp.experts.0.hook_post"] - cache["blocks.0.mlp.experts.0.hook_post"]
    assert (diff.abs() <= u.abs() * err + 1e-12).all()


def test_fused_path_is_the_original_bit_for_bit_and_results_sum():
    model = moe_model()
    converted = convert(model)
    tokens = make_tokens()
    fused = converted(tokens)
    assert torch.equal(fused, model(tokens))  # SwiGLU experts: F.silu(g) * u, TL's arithmetic
    for mlp in converted.neuron_heads:
        mlp.fused = False
    torch.testing.assert_close(converted(tokens), fused, rtol=0, atol=1e-12)  # head path
    converted.set_use_neuron_result(True)
    _, cache = converted.run_with_cache(tokens)
    expert = converted.blocks[0].mlp.experts[3]
    result = cache["blocks.0.mlp.experts.3.hook_result"]
    post = cache["blocks.0.mlp.experts.3.hook_post"]
    torch.testing.assert_close(result.sum(-2)[0], post @ expert.W_out.weight.T, rtol=0, atol=1e-12)
    torch.testing.assert_close(converted(tokens), fused, rtol=0, atol=1e-12)


def test_all_bias_pattern_turns_an_expert_neuron_off():
    model = moe_model()
    converted = convert(model)
    tokens = make_tokens()
    neuron = 3

    def all_bias(pattern, hook):
        pattern[:, neuron, :, 0] = 0.0
        pattern[:, neuron, :, 1] = 1.0
        return pattern

    def zero_post(post, hook):
        post[..., neuron] = 0.0  # TL's MoE experts have no b_in
        return post

    name = "blocks.1.mlp.experts.2.hook_{}"
    edited = converted.run_with_hooks(tokens, fwd_hooks=[(name.format("pattern"), all_bias)])
    expected = model.run_with_hooks(tokens, fwd_hooks=[(name.format("post"), zero_post)])
    torch.testing.assert_close(edited, expected, rtol=0, atol=1e-10)
    assert (edited - converted(tokens)).abs().max() > 1e-6


def test_state_dict_names_round_trip_and_save_load(tmp_path):
    model = moe_model()
    converted = convert(model)
    assert converted.state_dict().keys() == model.state_dict().keys()
    assert isinstance(converted.blocks[0].mlp.experts[0], GatedNeuronHeadExpert)
    back = converted.to_hooked_transformer().to(torch.float64, print_details=False)
    tokens = make_tokens()
    assert type(back.blocks[0].mlp) is MoE and torch.equal(back(tokens), model(tokens))
    loaded = AttnOnlyTransformer.load(converted.save_pretrained(tmp_path / "moe"))
    assert torch.equal(loaded(tokens), converted(tokens))


def test_literal_form_refuses_moe_by_name():
    with pytest.raises(NotImplementedError, match="MoE"):
        convert(moe_model(), form="literal")
