"""The tools on an :class:`~tl_attnonly.AttnOnlyTransformer` with TransformerLens's mixture of
experts (``NeuronHeadMoE``, TransformerLens 3.x), against the unconverted ``HookedTransformer``:
attention-head patching equals ``transformer_lens.patching``'s head sweep, the expert components
(routing weight x expert output, the weights the top-k of TL's ``hook_expert_weights``) sum to its
``hook_mlp_out`` and the residual decomposition to its residual stream, and patching every
expert's contribution at once is patching its ``hook_mlp_out``. The bridges' side:
``tests/bridge/test_moe_tools.py``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, make_tokens
from models import hooked_only

import tl_attnonly
from tl_attnonly.analysis import decompose_resid_heads, get_act_patch_all_heads
from tl_attnonly.analysis.experts import (
    decompose_resid_experts,
    expert_components,
    experts_used,
    get_act_patch_experts,
)
from tl_attnonly.hooks import decomposition_names_filter

ATOL = 1e-5  # float32


def _metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1].log_softmax(-1)[:, 3].sum()


@hooked_only("NeuronHeadMoE")
@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_hooked_moe_heads_and_expert_components_equal_transformer_lens(norm_topk_prob):
    from transformer_lens import patching

    original = make_model(
        "silu", torch.float32, 0, normalization_type="RMS", num_experts=4, experts_per_token=2,
        norm_topk_prob=norm_topk_prob,
    )  # fmt: skip
    clean, corrupted = make_tokens(), make_tokens(seed=3)
    with torch.no_grad():
        _, ref_cache = original.run_with_cache(clean)
        ref_heads = patching.get_act_patch_attn_head_out_all_pos(
            original, corrupted, ref_cache, _metric
        )
    converted = tl_attnonly.convert(original)
    with torch.no_grad():
        _, cache = converted.run_with_cache(clean)
    scores, labels = get_act_patch_all_heads(converted, corrupted, cache, _metric, progress=False)
    assert len(labels) == ref_heads.numel() and all("H" in label for label in labels)
    torch.testing.assert_close(scores, ref_heads.flatten().double(), atol=ATOL, rtol=0)
    used = experts_used(cache)
    for layer in range(original.cfg.n_layers):
        stack, _ = expert_components(cache, layer)
        expected = ref_cache[f"blocks.{layer}.hook_mlp_out"]
        torch.testing.assert_close(stack.sum(0), expected, atol=ATOL, rtol=0)
        for e in range(4):
            assert (stack[e][~(used[layer] == e).any(-1)] == 0).all()
    stack, _ = decompose_resid_experts(cache)
    resid = ref_cache[f"blocks.{original.cfg.n_layers - 1}.hook_resid_post"]
    torch.testing.assert_close(stack.sum(0), resid, atol=ATOL, rtol=0)
    # the dense decomposition, from a cache of only what it needs, reads the experts the same way
    with torch.no_grad():
        _, small = converted.run_with_cache(clean, names_filter=decomposition_names_filter())
    dense = decompose_resid_heads(small)
    torch.testing.assert_close(dense.sum(0), resid, atol=ATOL, rtol=0)
    together = get_act_patch_experts(converted, corrupted, cache, _metric, layer=0, together=True)
    clean_out = ref_cache["blocks.0.hook_mlp_out"]
    with torch.no_grad():
        logits = original.run_with_hooks(
            corrupted, fwd_hooks=[("blocks.0.hook_mlp_out", lambda act, hook: clean_out)]
        )
    assert together["metric"][0] == pytest.approx(float(_metric(logits)), abs=ATOL)


@hooked_only("NeuronHeadMoE")
def test_hooked_moe_neuron_head_patching_sweeps_the_experts():
    """``get_act_patch_neuron_heads`` on an ``AttnOnlyTransformer`` of ``NeuronHeadMoE`` layers
    sweeps each layer's experts' neuron-heads end to end, as the expert tool patches them (from a
    cache made with ``neuron_names_filter("z")``: the experts' ``hook_z`` and TL's
    ``hook_expert_indices``)."""
    from tl_attnonly.analysis import get_act_patch_neuron_heads
    from tl_attnonly.analysis.experts import get_act_patch_expert_neuron_heads
    from tl_attnonly.hooks import neuron_names_filter

    original = make_model(
        "silu", torch.float32, 0, normalization_type="RMS", num_experts=4, experts_per_token=2
    )
    converted = tl_attnonly.convert(original)
    clean, corrupted = make_tokens(), make_tokens(seed=3)
    with torch.no_grad():
        _, cache = converted.run_with_cache(clean, names_filter=neuron_names_filter("z"))
    heads = [0, 5, 70]
    out = get_act_patch_neuron_heads(converted, corrupted, cache, _metric, heads=heads)
    for layer in range(converted.cfg.n_layers):
        table = get_act_patch_expert_neuron_heads(converted, corrupted, cache, _metric, layer=layer)
        expected = torch.tensor(table.metric.values[heads], dtype=torch.float64)
        torch.testing.assert_close(out[layer], expected)
    with torch.no_grad():
        baseline = float(_metric(converted(corrupted)))
    assert (out - baseline).abs().max() > 1e-5
