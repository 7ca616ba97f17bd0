"""Every analysis tool on both model kinds: a converted ``TransformerBridge`` gives the numbers of
the ``AttnOnlyTransformer`` of the same weights.

Families (``tests/kinds.py``): LLaMA with grouped-query attention and rotary positions (SwiGLU),
Qwen2 (biases on q, k, v), GPT-2 (learned positions, LayerNorm, plain MLP), GPT-NeoX (parallel
blocks, partial rotary) and Gemma (GeGLU: K = 4 fitted heads per neuron). On TransformerLens 3.x
each tool runs on both kinds and the results are compared in float64; the bridges of the rotary
families compute their attention softmax in float32 (Hugging Face's ``eager_attention_forward``,
mirrored by the bridge), so there the two kinds agree to ``RTOL_ROTARY`` rather than to float64
rounding. On both lines (4.x has no ``HookedTransformer``) each tool's bridge result is also checked
against a reference built from the bridge's own hooks: one patch per forward pass, the clean and
corrupted runs for the full and empty circuits, the residual stream for the decomposition.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))

from kinds import D_VOCAB, FAMILIES, make_bridge, make_pair, make_tokens  # noqa: E402

import tl_attnonly.analysis as A  # noqa: E402
from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER  # noqa: E402
from tl_attnonly.adapt import analysis_model  # noqa: E402
from tl_attnonly.hooks import (  # noqa: E402
    decomposition_names_filter,
    head_names_filter,
    neuron_act_name,
)

#: Relative agreement of the two kinds where the bridge's attention softmax runs in float32.
RTOL_ROTARY = 1e-5
#: Relative agreement in float64 otherwise.
RTOL_EXACT = 1e-10
FLOAT32_SOFTMAX = ("llama_gqa", "qwen2", "gemma")

TARGETS = torch.tensor([3, 17, 42])


def patch_metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[..., TARGETS].mean()


def last_metric(logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Batch-additive: the mean over the dataset of the targets' last-position logits."""
    return logits[:, -1, TARGETS].sum() / 2 / len(TARGETS)


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    clean = make_tokens(batch=2, pos=8, seed=0)
    corrupted = clean.clone()
    corrupted[:, 2] = (clean[:, 2] + 11) % D_VOCAB
    corrupted[:, 5] = (clean[:, 5] + 5) % D_VOCAB
    return clean, corrupted


def z_cache(model):
    """The clean run's cache of every head's ``z``."""
    return model.run_with_cache(tokens()[0], names_filter=head_names_filter("z"))[1]


def close(a, b, family: str, what: str) -> None:
    """``a`` (bridge) equals ``b`` (HookedTransformer) to the family's tolerance (``"float32"``:
    float32 models, the bundled one)."""
    rtol = RTOL_ROTARY if family in (*FLOAT32_SOFTMAX, "float32") else RTOL_EXACT
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    a, b = a.detach(), b.detach()
    scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
    torch.testing.assert_close(a, b, rtol=0, atol=rtol * scale, msg=lambda m: f"{what}: {m}")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request):
    """``(family, AttnOnlyTransformer or None on TL 4.x, converted bridge)``."""
    hooked, bridge = make_pair(request.param)
    return request.param, hooked, bridge


def both(pair, fn):
    """``fn(bridge)`` and ``fn(hooked)`` (``None`` on TransformerLens 4.x)."""
    family, hooked, bridge = pair
    return fn(bridge), (fn(hooked) if hooked is not None else None)


def agree(pair, fn, what: str):
    """``fn(bridge)``, checked against ``fn(hooked)`` where there is one (tensors, numbers, or
    tuples of them)."""
    ours, theirs = both(pair, fn)
    if theirs is not None:
        pairs = zip(ours, theirs) if isinstance(ours, tuple) else [(ours, theirs)]
        for a, b in pairs:
            close(a, b, pair[0], what)
    return ours


# ---------------------------------------------------------------------------------------------
# the adapter itself
# ---------------------------------------------------------------------------------------------


def test_the_bridge_adapter_reads_what_the_bridge_runs(pair):
    """Norms (called without hooks) give the bridge's ln outputs; the weights are the layers'
    inputs' projections; the facts are the structure's."""
    family, hooked, bridge = pair
    model = analysis_model(bridge)
    clean, _ = tokens()
    _, cache = bridge.run_with_cache(clean)
    facts = model.cfg
    assert facts.n_layers == 2 and facts.n_heads == 4
    assert facts.parallel_attn_mlp == (family == "neox")
    assert (facts.n_key_value_heads == 2) == (family in ("llama_gqa", "qwen2", "gemma"))
    for layer, block in enumerate(model.blocks):
        resid = cache[f"blocks.{layer}.hook_resid_pre"]
        torch.testing.assert_close(
            block.ln1(resid), cache[f"blocks.{layer}.ln1.hook_out"], rtol=0, atol=1e-12
        )
        x = cache[f"blocks.{layer}.ln1.hook_out"]
        q = torch.einsum("bpd,hde->bphe", x, block.attn.W_Q) + block.attn.b_Q
        torch.testing.assert_close(q, cache[f"blocks.{layer}.attn.hook_q"], rtol=0, atol=1e-12)
        v = torch.einsum("bpd,hde->bphe", x, block.attn.W_V) + block.attn.b_V
        v_kv = cache[f"blocks.{layer}.attn.hook_v"]  # per key/value head
        group = facts.n_heads // v_kv.shape[2]
        torch.testing.assert_close(v, v_kv.repeat_interleave(group, dim=2), rtol=0, atol=1e-12)
    if hooked is not None:
        other = analysis_model(hooked)
        for name in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O"):
            for ours, theirs in zip(model.blocks, other.blocks):
                close(getattr(ours.attn, name), getattr(theirs.attn, name), "gpt2", name)
        close(model.W_U, other.W_U, "gpt2", "W_U")
        close(model.b_U, other.b_U, "gpt2", "b_U")


def test_runs_from_a_layer_are_the_bridges_own_runs(pair):
    """``layer_runs`` (4.x: ``start_at_layer``; 3.x: the residual stream replaced in a full
    pass) gives the logits of the bridge's run, from every block and from the final norm."""
    family, _, bridge = pair
    _, corrupted = tokens()
    runs = A.patching.resume.LayerRuns(bridge, corrupted)
    with torch.no_grad():
        logits = bridge(corrupted)
    for layer in range(3):
        resid = runs.resid(layer).repeat(2, 1, 1)
        out = runs.run(resid, layer)
        torch.testing.assert_close(out, logits.repeat(2, 1, 1), rtol=0, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# patching
# ---------------------------------------------------------------------------------------------


def test_neuron_head_patching_agrees_and_matches_one_patch_per_pass(pair):
    family, _, _ = pair
    _, corrupted = tokens()
    clean, _ = tokens()

    def sweep(model, **kw):
        cache = z_cache(model)
        return A.get_act_patch_neuron_heads(
            model, corrupted, cache, patch_metric, progress=False, **kw
        )

    batched, hooked = both(pair, sweep)
    one_by_one, _ = both(pair, lambda m: sweep(m, patches_per_pass=1, layers=[1]))
    # TransformerLens's generic_activation_patch (one patch per pass) stores results in float32
    torch.testing.assert_close(batched[1], one_by_one[0].double(), rtol=1e-6, atol=1e-7)
    if hooked is not None:
        close(batched, hooked, family, "get_act_patch_neuron_heads")


def test_head_and_output_patching_agree(pair):
    family, _, bridge = pair
    clean, corrupted = tokens()

    def heads(model):
        return A.get_act_patch_all_heads(
            model, corrupted, z_cache(model), patch_metric, progress=False
        )

    (scores, labels), hooked = both(pair, heads)
    # reference: patch one attention head's z at a time with plain hooks on the bridge
    cache = z_cache(bridge)
    for index in (0, 5):
        layer, head = divmod(index, 4)
        name = f"blocks.{layer}.attn.hook_z"

        def patch(z, hook, head=head, name=name):
            z = z.clone()
            z[:, :, head] = cache[name][:, :, head]
            return z

        with torch.no_grad():
            expected = patch_metric(bridge.run_with_hooks(corrupted, fwd_hooks=[(name, patch)]))
        assert labels[index] == f"L{layer}H{head}"
        close(scores[index], expected, "gpt2", f"patching {labels[index]}")
    if hooked is not None:
        assert hooked[1] == labels
        close(scores, hooked[0], family, "get_act_patch_all_heads")

    def outputs(model):
        return A.get_act_patch_outputs(
            model, corrupted, z_cache(model), patch_metric, level="neuron", progress=False
        )[0]

    agree(pair, outputs, "get_act_patch_outputs")


def test_attribution_and_path_patching_agree(pair):
    family, _, _ = pair
    clean, corrupted = tokens()

    def attribution(model):
        cache = model.run_with_cache(clean)[1]
        return A.attribution_patch(model, cache, corrupted, patch_metric)[0]

    def paths(model):
        k = "" if analysis_model(model).n_heads_per_neuron == 1 else ".1"
        return torch.tensor(
            [
                A.path_patch(model, clean, corrupted, ["L0H1"], ["L1H0"], patch_metric),
                A.path_patch(
                    model, clean, corrupted, [f"L0N3{k}"], [f"L1N2{k}", "L1H0"], patch_metric
                ),
                A.path_patch(model, clean, corrupted, ["L0H2", f"L0N1{k}"], "logits", patch_metric),
            ]
        )

    def sweep(model):
        return A.path_patch_sweep(model, clean, corrupted, "logits", patch_metric, progress=False)[
            0
        ]

    for fn, what in ((attribution, "attribution_patch"), (paths, "path_patch"), (sweep, "sweep")):
        assert torch.isfinite(torch.as_tensor(agree(pair, fn, what))).all()


# ---------------------------------------------------------------------------------------------
# caches, decomposition, circuits
# ---------------------------------------------------------------------------------------------


def test_decomposition_sums_to_the_residual_stream_and_agrees(pair):
    family, _, bridge = pair
    clean, corrupted = tokens()
    _, cache = bridge.run_with_cache(clean, names_filter=decomposition_names_filter())
    stack = A.stack_all_head_results(cache, layer=-1, incl_remainder=True)
    resid = bridge.run_with_cache(clean)[1]["blocks.1.hook_resid_post"]
    close(stack.sum(0), resid, "gpt2", "decomposition sums to resid_post")

    def decompose(model):
        cache = model.run_with_cache(clean, names_filter=decomposition_names_filter())[1]
        dla = A.head_logit_attrs(cache, clean[:, -1], corrupted[:, -1], pos_slice=-1)
        return A.stack_all_head_results(cache, layer=-1), dla

    agree(pair, decompose, "stack_all_head_results, head_logit_attrs")


def test_ov_qk_and_composition_agree(pair):
    family, _, _ = pair

    def circuits(model):
        gated = analysis_model(model).cfg.gated_mlp
        return (
            A.neuron_ov_circuit(model, 0, per_unit_u=gated).AB,
            A.neuron_qk_circuit(model, 1).AB,
            A.composition_scores(model, "Q", per_unit_u=gated).scores,
            A.composition_scores(model, "V", per_unit_u=gated).scores,
        )

    ours, theirs = both(pair, circuits)
    if theirs is not None:
        for a, b, what in zip(ours, theirs, ("OV", "QK", "Q-composition", "V-composition")):
            close(a, b, "gpt2", what)  # weights only: the same to float64 rounding


# ---------------------------------------------------------------------------------------------
# edge scores, exact circuit runs, discovery
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["eap", "eap-ig"])
def test_edge_scores_agree(pair, method):
    family, _, _ = pair
    clean, corrupted = tokens()

    def scores(model):
        return A.edge_attribution_scores(
            model, clean, corrupted, last_metric, method=method, progress=False
        )

    ours, theirs = both(pair, scores)
    assert set(ours.scores) == set(ours.graph.block_keys())
    if theirs is not None:
        assert ours.graph.block_keys() == theirs.graph.block_keys()
        for key in ours.scores:
            close(ours.scores[key], theirs.scores[key], family, f"{method} {key}")
        close(ours.metric_clean, theirs.metric_clean, family, "clean metric")


def test_exact_circuit_runs_agree_and_bound_the_runs(pair):
    """The full graph gives the clean run, the empty graph the corrupted one, on the bridge; a
    random circuit's metric is the same on both kinds."""
    family, _, bridge = pair
    clean, corrupted = tokens()
    graph = A.HeadGraph(bridge)
    full = graph.full_mask()
    empty = {key: torch.zeros_like(block) for key, block in full.items()}
    generator = torch.Generator().manual_seed(1)
    random = {
        key: torch.rand(block.shape, generator=generator) < 0.4 for key, block in full.items()
    }
    with torch.no_grad():
        m_clean = float(last_metric(bridge(clean), torch.arange(2)))
        m_corrupted = float(last_metric(bridge(corrupted), torch.arange(2)))
    runs = A.circuit_metrics(bridge, [full, empty], clean, corrupted, last_metric)
    close(runs[0], m_clean, "gpt2", "full graph = clean run")
    close(runs[1], m_corrupted, "gpt2", "empty graph = corrupted run")

    def metric_of(model):
        return A.circuit_metric(model, random, clean, corrupted, last_metric)

    agree(pair, metric_of, "random circuit")


def test_discovered_circuits_agree(pair):
    family, _, _ = pair
    if family in FLOAT32_SOFTMAX:
        pytest.skip("ranks of near-equal scores may swap at float32 rounding")
    clean, corrupted = tokens()

    def discover(model):
        return A.discover_circuit(model, clean, corrupted, last_metric, progress=False)

    ours, theirs = both(pair, discover)
    assert 0 < sum(int(b.sum()) for b in ours.mask.values())
    if theirs is not None:
        for key in ours.mask:
            assert torch.equal(ours.mask[key], theirs.mask[key]), key
        close(ours.faithfulness, theirs.faithfulness, family, "faithfulness")


def test_node_circuits_and_summaries_agree(pair):
    family, _, _ = pair
    clean, corrupted = tokens()

    def nodes(model):
        result = A.node_attribution_scores(
            model,
            A.ModelInputs(clean),
            A.ModelInputs(corrupted),
            lambda logits, _: patch_metric(logits),
        )
        return torch.tensor(result.scores.to_numpy()), result.gate, result.value

    def summaries(model):
        result = A.summarize_neuron_heads(model, [clean[0], clean[1]], max_len=8, progress=False)
        assert result.n_positions == clean.numel()
        return result.fire_count.double(), result.post_sum_by_token

    agree(pair, nodes, "node attribution")
    agree(pair, summaries, "summaries")


# ---------------------------------------------------------------------------------------------
# refused before any work, on a bridge as on a HookedTransformer
# ---------------------------------------------------------------------------------------------


def test_an_unconverted_bridge_is_refused_with_directions():
    bridge = make_bridge("gpt2", convert=False)
    clean, corrupted = tokens()
    with pytest.raises(TypeError, match=r"convert it first .*in place for a bridge"):
        A.edge_attribution_scores(bridge, clean, corrupted, last_metric)


def test_a_post_norm_bridge_is_read_from_its_blocks_and_analysed():
    """Gemma 2 normalises each sublayer's output (``ln1_post``, ``ln2_post``), which its bridge's
    config does not say: the adapter reads it from the blocks. Discovery and the decomposition
    take each norm's scale from the run (tests/analysis/test_post_norm_decomposition.py,
    tests/analysis/discovery/test_post_norm_discovery.py check them)."""
    import transformers
    from transformer_lens.model_bridge.sources._bridge_builder import build_bridge_from_module

    import tl_attnonly

    config = transformers.Gemma2Config(
        vocab_size=D_VOCAB, num_hidden_layers=2, hidden_size=32, intermediate_size=24,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    hf = transformers.Gemma2ForCausalLM(config).double().eval()
    bridge = tl_attnonly.convert(
        build_bridge_from_module(hf, "Gemma2ForCausalLM", hf_config=config)
    )
    clean, corrupted = tokens()
    assert analysis_model(bridge).cfg.post_norm
    scores = A.edge_attribution_scores(bridge, clean, corrupted, last_metric)
    assert scores.metric_clean != scores.metric_corrupted
    _, cache = bridge.run_with_cache(clean, names_filter=decomposition_names_filter())
    assert A.decompose_resid_heads(cache).shape[0] > 0  # linear in a run: not refused
    # what works on it: neuron-head patching
    _, cache = bridge.run_with_cache(clean, names_filter=head_names_filter("z"))
    out = A.get_act_patch_neuron_heads(
        bridge, corrupted, cache, patch_metric, layers=[1], level="head"
    )
    assert out.shape == (1, analysis_model(bridge).n_neuron_heads)
    assert neuron_act_name("z", 1) in cache.cache_dict


@pytest.mark.skipif(not HAS_HOOKED_TRANSFORMER, reason="compares with HookedTransformer")
def test_the_pairs_compute_the_same_function(pair):
    family, hooked, bridge = pair
    clean, _ = tokens()
    with torch.no_grad():
        close(bridge(clean), hooked(clean), family, "logits")


# ---------------------------------------------------------------------------------------------
# datasets, head roles and views: the bundled model (it has a tokenizer) as both kinds
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundled_pair():
    """``(AttnOnlyTransformer or None on TL 4.x, converted bridge)`` of the bundled model."""
    import tl_attnonly
    from tl_attnonly.bundled import load_bundled_bridge, load_bundled_model

    hooked = tl_attnonly.convert(load_bundled_model()) if HAS_HOOKED_TRANSFORMER else None
    return hooked, tl_attnonly.convert(load_bundled_bridge())


def test_ioi_and_induction_datasets_and_roles_agree(bundled_pair):
    hooked, bridge = bundled_pair
    words = dict(
        names=["self", "key", "value", "name", "data", "item", "text", "line", "path", "node"],
        places=["store", "file"],
        objects=["list", "code"],
    )  # one-token words of the bundled tokenizer, standing in for names
    data = A.make_ioi_dataset(bridge, 6, seed=1, **words)
    induction = A.make_induction_dataset(bridge, 4, half_len=6, seed=2)
    scores = A.ioi_head_scores(bridge, data)
    assert scores.logit_diff.shape == (6,)
    if hooked is None:
        return
    other = A.make_ioi_dataset(hooked, 6, seed=1, **words)
    assert torch.equal(data.tokens, other.tokens)
    assert torch.equal(data.corrupted_tokens, other.corrupted_tokens)
    other_induction = A.make_induction_dataset(hooked, 4, half_len=6, seed=2)
    assert torch.equal(induction.tokens, other_induction.tokens)
    theirs = A.ioi_head_scores(hooked, other)
    close(scores.logit_diff, theirs.logit_diff, "float32", "IOI logit difference")
    for name in ("dla_io", "dla_s"):
        close(getattr(scores, name), getattr(theirs, name), "float32", name)


def test_views_show_the_same_data(bundled_pair):
    from tl_attnonly.vis import (
        neuron_activity_heatmap,
        neuron_head_attention_view,
        neuron_head_strips,
        rank_neuron_heads,
    )

    hooked, bridge = bundled_pair
    prompt = "for k, v in d.items():"

    def views(model):
        view = neuron_head_attention_view(model, 1, prompt, top_k=6)
        _, cache = model.run_with_cache(prompt)
        tokens = model.to_str_tokens(prompt)
        heat = neuron_activity_heatmap(cache, 0, tokens, top_k=5)
        strips = neuron_head_strips(model, 0, prompt, top_k=4)
        return (
            view.heads,
            torch.tensor(json.loads(view.props)["attention"]),
            rank_neuron_heads(cache, 1, top_k=8),
            torch.tensor(heat.data[0].z),
            len(strips.data),
        )

    ours = views(bridge)
    assert ours[0] and ours[1].numel() > 0
    if hooked is not None:
        theirs = views(hooked)
        assert ours[0] == theirs[0] and ours[2] == theirs[2] and ours[4] == theirs[4]
        close(ours[1], theirs[1], "float32", "pattern view")
        close(ours[3], theirs[3], "float32", "activity heatmap")


@pytest.mark.parametrize("family", ["gpt2", "llama_gqa", "neox"])
def test_compatibility_mode_bridges_are_read_as_they_run(family):
    """``enable_compatibility_mode()`` then ``convert``: the weights are the processed ones (folded
    norms, centred weights), and the adapter reads those: norms and projections give the hooks'
    values, the full circuit is the clean run, the decomposition sums to the residual stream."""
    import tl_attnonly

    bridge = make_bridge(family, convert=False)
    bridge.enable_compatibility_mode()
    tl_attnonly.convert(bridge)
    model = analysis_model(bridge)
    clean, corrupted = tokens()
    _, cache = bridge.run_with_cache(clean)
    for layer, block in enumerate(model.blocks):
        x = block.ln1(cache[f"blocks.{layer}.hook_resid_pre"])
        torch.testing.assert_close(x, cache[f"blocks.{layer}.ln1.hook_out"], rtol=0, atol=1e-12)
        q = torch.einsum("bpd,hde->bphe", x, block.attn.W_Q) + block.attn.b_Q
        torch.testing.assert_close(q, cache[f"blocks.{layer}.attn.hook_q"], rtol=0, atol=1e-12)
    full = A.HeadGraph(bridge).full_mask()
    with torch.no_grad():
        m_clean = float(last_metric(bridge(clean), torch.arange(2)))
    close(A.circuit_metric(bridge, full, clean, corrupted, last_metric), m_clean, "gpt2", "full")
    _, cache = bridge.run_with_cache(clean, names_filter=decomposition_names_filter())
    stack = A.stack_all_head_results(cache, layer=-1, incl_remainder=True)
    resid = bridge.run_with_cache(clean)[1]["blocks.1.hook_resid_post"]
    close(stack.sum(0), resid, "gpt2", "decomposition")
