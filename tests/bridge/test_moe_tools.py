"""The analysis tools on mixtures of experts (Mixtral; Qwen2-MoE, with a shared expert), on
TransformerLens 3.9 and 4.x bridges, in float32 (Hugging Face's grouped experts have no float64
kernel everywhere).

Attention heads are analysed as on a dense model: activation patching and direct logit
attribution equal TransformerLens's own (``transformer_lens.patching``'s head sweep, the cache's
``stack_head_results`` / ``apply_ln_to_stack``) on the unconverted bridge. The expert layer
decomposes into each expert's weighted contribution and the shared expert's, summing to the
unconverted bridge's ``hook_mlp_out``; the residual decomposition sums to its residual stream
and the logit attribution to its logits. The routing a run used is read back and equals the
router's own top-k. Tools that need a dense neuron-head layer refuse before any work, naming
what works.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from zoo import build_bridge, convert_zoo_bridge, tokens
from zoo_tools import expert_patch_by_hand

from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis import (
    attribution_patch,
    get_act_patch_all_heads,
    get_act_patch_neuron_heads,
    get_act_patch_outputs,
    head_logit_attrs,
)
from tl_attnonly.analysis.experts import (
    decompose_resid_experts,
    expert_components,
    expert_logit_attrs,
    experts_used,
    get_act_patch_experts,
)
from tl_attnonly.bridge import unconvert_bridge
from tl_attnonly.hooks import decomposition_names_filter

NAMES = ["mixtral", "qwen2_moe"]
ATOL = 1e-5  # float32


def _metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1].log_softmax(-1)[:, 3].sum()


@pytest.fixture(scope="module", params=NAMES)
def moe(request) -> dict[str, Any]:
    """A zoo MoE bridge: references computed unconverted, then converted in place."""
    from transformer_lens import patching

    torch.manual_seed(0)
    bridge = build_bridge(request.param, torch.float32)
    clean, corrupted = tokens(), tokens(seed=5)
    with torch.no_grad():
        ref_logits, ref_cache = bridge.run_with_cache(clean)
        ref_heads = patching.get_act_patch_attn_head_out_all_pos(
            bridge, corrupted, ref_cache, _metric
        )
    unconverted = analysis_model(bridge, neuron_heads=False)
    convert_zoo_bridge(bridge)
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(clean)
    return {
        "name": request.param,
        "bridge": bridge,
        "clean": clean,
        "corrupted": corrupted,
        "ref_logits": ref_logits,
        "ref_cache": ref_cache,
        "ref_heads": ref_heads,
        "unconverted": unconverted,
        "logits": logits,
        "cache": cache,
    }


def test_analysis_model_takes_expert_models(moe):
    """Converted and unconverted: accepted; an expert layer's dense members refuse by name."""
    assert moe["unconverted"].blocks[0].mlp.is_mixture_of_experts
    adapted = analysis_model(moe["bridge"])
    mlp = adapted.blocks[0].mlp
    assert mlp.converted and mlp.is_mixture_of_experts
    assert len(mlp.expert_list()) == 4
    assert not hasattr(mlp, "W_O")
    with pytest.raises(NotImplementedError, match="get_act_patch_expert_neuron_heads"):
        _ = mlp.W_in


def test_attention_head_patching_equals_transformer_lens(moe):
    """Every head sweep's default on an all-MoE model is its attention heads: the values of
    ``transformer_lens.patching``'s head sweep on the unconverted bridge."""
    bridge, corrupted, cache = moe["bridge"], moe["corrupted"], moe["cache"]
    expected = moe["ref_heads"].flatten().double()
    n_layers, n_heads = moe["ref_heads"].shape
    labels = [f"L{li}H{h}" for li in range(n_layers) for h in range(n_heads)]
    scores, got = get_act_patch_all_heads(bridge, corrupted, cache, _metric, progress=False)
    assert got == labels
    torch.testing.assert_close(scores, expected, atol=ATOL, rtol=0)
    scores, got = get_act_patch_outputs(bridge, corrupted, cache, _metric, progress=False)
    assert got == labels
    torch.testing.assert_close(scores.flatten(), expected, atol=ATOL, rtol=0)
    estimate, got = attribution_patch(bridge, cache, corrupted, _metric)
    assert got == labels and estimate.shape == (len(labels),)


def test_attention_logit_attrs_equal_transformer_lens(moe):
    """``head_logit_attrs(kinds=("attn",))``: TransformerLens's ``stack_head_results`` of the
    unconverted bridge, scaled by its cached final norm, times ``ln_final.w``, on the unembed."""
    clean, ref_cache = moe["clean"], moe["ref_cache"]
    stack = ref_cache.stack_head_results(layer=-1, pos_slice=-1)
    scaled = ref_cache.apply_ln_to_stack(stack, layer=-1, pos_slice=-1)
    unconverted = moe["unconverted"]
    directions = unconverted.W_U[:, clean[:, -1]].T * unconverted.ln_final.w
    expected = (scaled * directions).sum(-1)
    got = head_logit_attrs(moe["cache"], clean[:, -1], pos_slice=-1, kinds=("attn",))
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_dense_neuron_head_tools_refuse_before_work(moe):
    """Naming a dense neuron-head (``L0N3``) of an expert layer in the head and output sweeps
    refuses before a forward pass, naming the expert tools."""
    calls = []

    def metric(logits):
        calls.append(1)
        return _metric(logits)

    bridge, corrupted, cache = moe["bridge"], moe["corrupted"], moe["cache"]
    for run in (
        lambda: get_act_patch_all_heads(bridge, corrupted, cache, metric, heads=["L0N3"]),
        lambda: get_act_patch_outputs(bridge, corrupted, cache, metric, heads=["L1N0"]),
    ):
        with pytest.raises(NotImplementedError, match="get_act_patch_expert_neuron_heads"):
            run()
    assert not calls


def test_neuron_head_patching_reaches_expert_layers(moe):
    """``get_act_patch_neuron_heads`` sweeps an expert layer as its experts' neuron-heads end to
    end (routed experts, then shared): each cell equals a plain-hook patch of that expert's
    ``hook_z`` at the tokens routed to it in both runs, from a cache made with
    ``neuron_names_filter("z")``; the index frame labels the cells."""
    from tl_attnonly.analysis.experts import get_act_patch_expert_neuron_heads
    from tl_attnonly.hooks import neuron_names_filter

    bridge, corrupted = moe["bridge"], moe["corrupted"]
    with torch.no_grad():
        _, cache = bridge.run_with_cache(moe["clean"], names_filter=neuron_names_filter("z"))
    out, frame = get_act_patch_neuron_heads(
        bridge, corrupted, cache, _metric, return_index_df=True, progress=False
    )
    n_layers = bridge.cfg.n_layers
    expected = [
        get_act_patch_expert_neuron_heads(bridge, corrupted, moe["cache"], _metric, layer=layer)
        for layer in range(n_layers)
    ]
    width = max(len(table) for table in expected)
    assert out.shape == (n_layers, width) and out.dtype == torch.float64
    for layer, table in enumerate(expected):
        torch.testing.assert_close(
            out[layer, : len(table)], torch.tensor(table.metric.values, dtype=torch.float64)
        )
        assert out[layer, len(table) :].isnan().all()
        labels = frame[frame.layer == layer].label.tolist()[: len(table)]
        assert labels == table.label.tolist()
    n_first = int((expected[1].expert == 0).sum())
    with torch.no_grad():
        logits = expert_patch_by_hand(bridge, corrupted, moe["cache"], 1, 1, 2)
    by_hand = float(_metric(logits))
    assert float(out[1, n_first + 2]) == pytest.approx(by_hand, abs=ATOL)
    assert frame.label[(frame.layer == 1) & (frame["head"] == n_first + 2)].item() == "L1E1N2"
    with torch.no_grad():
        baseline = float(_metric(bridge(corrupted)))
    assert (out[~out.isnan()] - baseline).abs().max() > 1e-5
    one = get_act_patch_neuron_heads(
        bridge, corrupted, cache, _metric, layers=[1], heads=[n_first + 2], progress=False
    )
    assert float(one.item()) == pytest.approx(by_hand, abs=ATOL)


def test_neuron_head_patching_of_expert_layers_refuses_what_it_cannot_do(moe):
    """Options an expert layer's sweep cannot take, a head it does not have and a cache without
    the experts' hooks are refused before any forward pass, naming the option."""
    from tl_attnonly.hooks import attn_names_filter

    calls = []

    def metric(logits):
        calls.append(1)
        return _metric(logits)

    bridge, corrupted, cache = moe["bridge"], moe["corrupted"], moe["cache"]
    with pytest.raises(ValueError, match="activation_name='v'"):
        get_act_patch_neuron_heads(bridge, corrupted, cache, metric, "v")
    with pytest.raises(ValueError, match="per_position=True"):
        get_act_patch_neuron_heads(bridge, corrupted, cache, metric, per_position=True)
    with pytest.raises(IndexError, match="blocks.0.mlp has"):
        get_act_patch_neuron_heads(bridge, corrupted, cache, metric, heads=[10**6])
    with torch.no_grad():
        _, attn_only = bridge.run_with_cache(moe["clean"], names_filter=attn_names_filter("z"))
    with pytest.raises(KeyError, match="neuron_names_filter"):
        get_act_patch_neuron_heads(bridge, corrupted, attn_only, metric)
    assert not calls


def test_neuron_head_views_show_an_expert_layer_as_its_experts_heads(moe):
    """The attention view and the strips draw an expert layer's neuron-heads, its experts' end to
    end (from the model or a cache): ranked by max |z| over each head's routed tokens, labelled
    by expert, each row the head's self weight at a routed token and empty elsewhere."""
    from tl_attnonly.analysis.experts import expert_activation, layer_heads
    from tl_attnonly.analysis.experts.routing import (
        cached_routing,
        expert_hook_name,
        expert_tokens,
        hook_rows,
    )
    from tl_attnonly.vis import neuron_head_attention_view, neuron_head_strips

    bridge, clean, cache, layer = moe["bridge"], moe["clean"], moe["cache"], 1
    numbered = layer_heads(analysis_model(bridge), layer)
    experts = list(dict.fromkeys(e for e, _ in numbered))
    z = torch.cat([expert_activation(cache, layer, e, "z")[0] for e in experts], dim=-1)
    order = torch.argsort(z.abs().nan_to_num(0.0).amax(0), descending=True, stable=True)
    n_pos, empty_rows = clean.shape[1], 0
    for source in (bridge, cache):
        view = neuron_head_attention_view(source, layer, clean[0], top_k=6, page_size=6)
        assert view.heads == order[:6].tolist()
        assert "mixture of experts" in view.caption
        attention = torch.tensor(json.loads(view.props)["attention"])
        for i, head in enumerate(view.heads):
            expert, h = numbered[head]
            tag = f"E{expert}" if isinstance(expert, int) else "S"
            assert view.labels[i] == f"L{layer}{tag}N{h}"
            rows = hook_rows(cache[expert_hook_name(layer, expert, "pattern")], "pattern")[:, h]
            routing = cached_routing(cache, layer) if isinstance(expert, int) else None
            tokens = expert_tokens(routing, expert, rows.shape[0] if routing is None else 2 * n_pos)
            expected = torch.zeros(n_pos)
            mine = tokens < n_pos  # prompt 0's tokens
            expected[tokens[mine]] = rows[mine].float()
            torch.testing.assert_close(attention[i, 1:, 1:].diagonal(), expected, atol=1e-4, rtol=0)
            ran = expected > 0
            assert (attention[i, 1:, 0][~ran] == 0).all()
            empty_rows += int((~ran).sum())
    assert empty_rows > 0, "some shown head's expert skipped a token"
    strips = neuron_head_strips(bridge, layer, clean[0], top_k=3)
    assert list(strips.layout.yaxis.ticktext) == [
        label for label in neuron_head_attention_view(bridge, layer, clean[0], top_k=3).labels
    ]


def test_path_patching_and_node_circuits_refuse_before_work(moe):
    """Path patching (which freezes every neuron-head's ``z``), node-level circuits, the
    gate/value split and composition scores of an expert layer's neuron-heads refuse before a
    forward pass, naming the expert tools (the summaries take expert layers:
    tests/analysis/test_moe_summaries.py; node attribution takes an expert layer whole:
    tests/analysis/discovery/test_moe_discovery.py)."""
    from tl_attnonly.analysis import (
        ModelInputs,
        circuit_gate_value_split,
        composition_scores,
        composition_top_k,
        discover_node_circuit,
        path_gate_value_split,
        path_patch,
        path_patch_sweep,
    )

    bridge, clean = moe["bridge"], moe["clean"]
    ran: list[int] = []
    handle = bridge.blocks[0].register_forward_pre_hook(lambda module, args: ran.append(1))
    try:
        for run in (
            lambda: path_patch_sweep(bridge, clean, moe["corrupted"], "logits", _metric),
            lambda: path_patch(bridge, clean, moe["corrupted"], ["L0H0"], "logits", _metric),
            lambda: path_gate_value_split(
                bridge, clean, moe["corrupted"], ["L0H0"], ["L1N0"], _metric
            ),
            lambda: discover_node_circuit(
                bridge, ModelInputs(clean), ModelInputs(moe["corrupted"]), _metric, top_n=4
            ),
            lambda: circuit_gate_value_split(
                bridge, {}, clean, moe["corrupted"], _metric, neurons=["L0N0"]
            ),
            lambda: composition_scores(bridge, "Q", senders=["L0N0"]),
            lambda: composition_top_k(bridge, "V", receivers=["L1N3"]),
        ):
            with pytest.raises(NotImplementedError, match="summarize_expert_neuron_heads"):
                run()
    finally:
        handle.remove()
    assert not ran


@pytest.mark.parametrize("mode", ["Q", "K", "V"])
def test_composition_scores_of_attention_heads_equal_transformer_lens(moe, mode):
    """On an all-MoE model the default heads are the attention heads (an expert layer has no
    neuron-heads of its own), and their scores are TransformerLens's ``composition_scores`` of
    the unconverted bridge's OV and QK circuits (pairs whose receiver reads first: 0)."""
    from transformer_lens import FactoredMatrix
    from transformer_lens.utilities.matrix import composition_scores as tl_composition_scores

    from tl_attnonly.analysis import composition_scores, composition_top_k

    unconverted = moe["unconverted"]
    n_layers, n_heads = unconverted.cfg.n_layers, unconverted.cfg.n_heads
    attn = [block.attn for block in unconverted.blocks]
    OV = [FactoredMatrix(a.W_V, a.W_O) for a in attn]  # [head, d_model, d_model]
    right = {
        "Q": [FactoredMatrix(a.W_Q, a.W_K.transpose(-2, -1)) for a in attn],
        "K": [FactoredMatrix(a.W_K, a.W_Q.transpose(-2, -1)) for a in attn],
        "V": OV,
    }[mode]
    scores = composition_scores(moe["bridge"], mode)
    labels = [f"L{li}H{h}" for li in range(n_layers) for h in range(n_heads)]
    assert scores.senders == labels and scores.receivers == labels
    for l1 in range(n_layers):
        for l2 in range(n_layers):
            rows, cols = slice(l1 * n_heads, (l1 + 1) * n_heads), slice(l2 * n_heads, None)
            got = scores.scores[rows, cols][:, :n_heads]
            if l2 <= l1:
                assert (got == 0).all()
                continue
            want = tl_composition_scores(OV[l1], right[l2])  # broadcast: [sender, receiver]
            assert want.abs().min() > 0
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    top = composition_top_k(moe["bridge"], mode, k=3)
    torch.testing.assert_close(
        torch.tensor(top["score"].to_numpy()), scores.scores.flatten().topk(3).values
    )


def test_expert_components_sum_to_the_layer_output(moe):
    """Each expert's routing weight x output, zero at tokens not routed to it, plus the shared
    expert's gated output: they sum to the unconverted bridge's ``hook_mlp_out``."""
    cache, ref_cache = moe["cache"], moe["ref_cache"]
    used = experts_used(cache)
    for layer in range(moe["bridge"].cfg.n_layers):
        stack, labels = expert_components(cache, layer)
        shared = [f"L{layer}S"] if moe["name"] == "qwen2_moe" else []
        assert labels == [f"L{layer}E{e}" for e in range(4)] + shared
        torch.testing.assert_close(
            stack.sum(0), ref_cache[f"blocks.{layer}.hook_mlp_out"], atol=ATOL, rtol=0
        )
        for e in range(4):
            not_routed = ~(used[layer] == e).any(-1)  # [batch, pos]
            assert (stack[e][not_routed] == 0).all()
            assert stack[e][~not_routed].abs().amax(-1).gt(0).all()


def test_residual_decomposition_and_logit_attrs_sum_to_the_model(moe):
    """Attention heads, expert components, embed and bias sum to the unconverted bridge's
    residual stream; their direct logit attributions to its logits less ``b_U``."""
    cache, ref_cache, clean = moe["cache"], moe["ref_cache"], moe["clean"]
    n_layers = moe["bridge"].cfg.n_layers
    stack, labels = decompose_resid_experts(cache)
    assert labels[:4] == ["L0H0", "L0H1", "L0H2", "L0H3"] and labels[-2:] == ["embed", "bias"]
    resid = ref_cache[f"blocks.{n_layers - 1}.hook_resid_post"]
    torch.testing.assert_close(stack.sum(0), resid, atol=ATOL, rtol=0)
    stack, _ = decompose_resid_experts(cache, 1, mlp_input=True)
    resid_mid = ref_cache["blocks.1.hook_resid_mid"]
    torch.testing.assert_close(stack.sum(0), resid_mid, atol=ATOL, rtol=0)
    attrs, labels = expert_logit_attrs(cache, clean[:, -1], pos_slice=-1)
    unconverted = moe["unconverted"]
    target = clean[:, -1]
    logits = moe["ref_logits"][:, -1].gather(-1, target[:, None])[:, 0] - unconverted.b_U[target]
    torch.testing.assert_close(attrs.sum(0), logits, atol=ATOL, rtol=0)


def test_the_dense_decompositions_read_expert_layers_as_their_experts(moe):
    """``head_logit_attrs`` and ``decompose_resid_heads`` give an expert layer's rows as its
    experts' weighted contributions (``expert_components``): the same rows as
    ``expert_logit_attrs`` / ``decompose_resid_experts``, summing to the model."""
    from tl_attnonly.analysis import decompose_resid_heads

    cache, ref_cache, clean = moe["cache"], moe["ref_cache"], moe["clean"]
    n_layers = moe["bridge"].cfg.n_layers
    attrs, labels = head_logit_attrs(
        cache, clean[:, -1], pos_slice=-1, incl_embeds_and_bias=True, return_labels=True
    )
    ref, ref_labels = expert_logit_attrs(cache, clean[:, -1], pos_slice=-1)
    assert labels == ref_labels
    torch.testing.assert_close(attrs, ref, atol=ATOL, rtol=0)
    stack, labels = decompose_resid_heads(cache, return_labels=True)
    assert any(label.startswith("L0E") for label in labels)
    resid = ref_cache[f"blocks.{n_layers - 1}.hook_resid_post"]
    torch.testing.assert_close(stack.sum(0), resid, atol=ATOL, rtol=0)
    # the same from a cache of decomposition_names_filter(): it keeps the experts' hooks
    _, small = moe["bridge"].run_with_cache(clean, names_filter=decomposition_names_filter())
    assert len(small.cache_dict) < len(cache.cache_dict)
    small_stack, small_labels = decompose_resid_heads(small, return_labels=True)
    assert small_labels == labels
    torch.testing.assert_close(small_stack, stack, atol=ATOL, rtol=0)


def test_experts_used_is_the_routers_top_k_of_each_run(moe):
    """The experts a run used: the router's top-k of its own logits (unconverted bridge's
    ``gate.hook_out``); another input (a corrupted or patched run) routes anew."""
    cache, ref_cache = moe["cache"], moe["ref_cache"]
    used = experts_used(cache)
    batch, pos = moe["clean"].shape
    for layer, indices in used.items():
        router_logits = ref_cache[f"blocks.{layer}.mlp.gate.hook_out"]  # [tokens, n_experts]
        expected = router_logits.topk(indices.shape[-1], dim=-1).indices.reshape(batch, pos, -1)
        assert torch.equal(indices.sort(-1).values, expected.sort(-1).values)
    run = experts_used(moe["bridge"], moe["clean"])
    assert all(torch.equal(run[layer], used[layer]) for layer in used)
    corrupted = experts_used(moe["bridge"], moe["corrupted"])
    assert any(not torch.equal(corrupted[layer], used[layer]) for layer in used)


def test_unconvert_removes_the_routing_weights_hook():
    """The routing weights' hook exists after conversion only."""
    bridge = build_bridge("mixtral", torch.float32)
    names = set(bridge.hook_dict)
    convert_zoo_bridge(bridge)
    assert "blocks.0.mlp.hook_routing_weights" in bridge.hook_dict
    unconvert_bridge(bridge)
    assert set(bridge.hook_dict) == names


@pytest.mark.parametrize("name", ["qwen3_moe", "olmoe", "granitemoe", "phimoe", "gpt_oss"])
def test_expert_components_of_the_other_families(name):
    """The expert components sum to the unconverted bridge's ``hook_mlp_out`` on every zoo MoE
    family with standard attention, each nonzero exactly at the tokens ``experts_used`` routes to
    its expert (Granite-MoE: TL 4's ``hook_expert_indices`` alias is not its top-k; the experts'
    own ``hook_routing_indices`` is)."""
    bridge = build_bridge(name, torch.float32)
    clean = tokens()
    with torch.no_grad():
        _, ref_cache = bridge.run_with_cache(clean)
    convert_zoo_bridge(bridge, **({"clamp": "check"} if name == "gpt_oss" else {}))
    with torch.no_grad():
        _, cache = bridge.run_with_cache(clean)
    used = experts_used(cache)
    assert sorted(used) == list(range(bridge.cfg.n_layers))
    for layer, indices in used.items():
        stack, labels = expert_components(cache, layer)
        expected = ref_cache[f"blocks.{layer}.hook_mlp_out"]
        torch.testing.assert_close(stack.sum(0), expected, atol=ATOL, rtol=0)
        assert labels == [f"L{layer}E{e}" for e in range(len(labels))]  # no shared experts
        for e in range(len(labels)):
            routed = (indices == e).any(-1)
            assert (stack[e][~routed] == 0).all() and stack[e][routed].abs().amax(-1).gt(0).all()


def test_expert_patching_patches_each_experts_weighted_contribution(moe):
    """Whole-expert patches: every expert (and the shared one) together is the clean layer output
    (the unconverted bridge's ``hook_mlp_out``) in the corrupted run; one row per expert, with
    the tokens routed to it in each run."""
    bridge, corrupted, cache = moe["bridge"], moe["corrupted"], moe["cache"]
    table = get_act_patch_experts(bridge, corrupted, cache, _metric, layer=0)
    shared = ["L0S"] if moe["name"] == "qwen2_moe" else []
    assert list(table["label"]) == [f"L0E{e}" for e in range(4)] + shared
    used = experts_used(cache)[0]
    for e in range(4):
        assert table["routed_clean"][e] == int((used == e).sum())
    together = get_act_patch_experts(bridge, corrupted, cache, _metric, layer=0, together=True)
    clean_out = moe["ref_cache"]["blocks.0.hook_mlp_out"]
    with torch.no_grad():
        logits = bridge.run_with_hooks(
            corrupted, fwd_hooks=[("blocks.0.hook_mlp_out", lambda act, hook: clean_out)]
        )
    assert together["metric"][0] == pytest.approx(float(_metric(logits)), abs=ATOL)
    with torch.no_grad():
        base = float(_metric(bridge(corrupted)))
    assert (table["metric"] - base).abs().max() > 1e-4  # the patches act


def test_neuron_head_patching_of_dense_and_expert_layers_together():
    """DeepSeek-V3 (a dense layer 0, experts in layer 1): one sweep gives layer 0's dense
    neuron-heads as the dense sweep does and layer 1's experts' as the expert tool does, NaN past
    the narrower layer's heads."""
    from tl_attnonly.analysis.experts import get_act_patch_expert_neuron_heads
    from tl_attnonly.hooks import neuron_names_filter

    torch.manual_seed(0)
    bridge = build_bridge("deepseek_v3", torch.float32)
    convert_zoo_bridge(bridge)
    clean, corrupted = tokens(), tokens(seed=5)
    with torch.no_grad():
        _, cache = bridge.run_with_cache(clean, names_filter=neuron_names_filter("z"))
    out, frame = get_act_patch_neuron_heads(
        bridge, corrupted, cache, _metric, return_index_df=True, progress=False
    )
    dense = get_act_patch_neuron_heads(bridge, corrupted, cache, _metric, layers=[0])
    experts = get_act_patch_expert_neuron_heads(bridge, corrupted, cache, _metric, layer=1)
    n_dense, n_experts = dense.shape[-1], len(experts)
    assert n_dense != n_experts and out.shape == (2, max(n_dense, n_experts))
    torch.testing.assert_close(out[0, :n_dense], dense[0])
    torch.testing.assert_close(out[1, :n_experts], torch.tensor(experts.metric.values).double())
    assert out[0, n_dense:].isnan().all() and out[1, n_experts:].isnan().all()
    assert frame[frame.layer == 0].label.tolist()[:2] == ["L0N0", "L0N1"]
    assert frame[frame.layer == 1].label.tolist()[:n_experts] == experts.label.tolist()
