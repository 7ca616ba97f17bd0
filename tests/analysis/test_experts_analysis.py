"""Expert neuron-heads in token space and their activation patching (tl_attnonly.analysis.experts).

Tiny random Mixtral (``tests/bridge/zoo.py``), converted bridge on TransformerLens 3.9 and 4.x in
float32 (Hugging Face's experts kernel has no float64); on TL 3.9 also an ``AttnOnlyTransformer``
Mixtral of the same weights. Shared experts: the zoo's Qwen2-MoE (``shared_expert``, tokens
flattened before it) and DeepSeek-V3 (``shared_experts``, ``[batch, pos]`` kept) bridges.
References are written here independently: the expert's gate from the MoE block's input and the
expert's weights, and patches made with plain ``run_with_hooks`` that read the corrupted routing
in the same pass.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bridge"))

from zoo import build_bridge, build_hf_model, convert_zoo_bridge, tokens  # noqa: E402

from tl_attnonly.analysis.experts import (  # noqa: E402
    ExpertNeuronHeadSummaries,
    expert_activation,
    get_act_patch_expert_neuron_heads,
    routing_hook_name,
    summarize_expert_neuron_heads,
)

LAYER = 1
N_EXPERTS = 4  # the zoo Mixtral's, Qwen2-MoE's and DeepSeek-V3's
#: The zoo's MoE models with a shared expert, and the name their converted block holds it under.
SHARED_MODELS = {"qwen2_moe": "shared_expert", "deepseek_v3": "shared_experts"}
#: float32: the bridge and the AttnOnlyTransformer differ by Hugging Face's RMSNorm rounding.
TOL = 1e-5


@pytest.fixture(scope="module")
def bridge() -> Any:
    return convert_zoo_bridge(build_bridge("mixtral", torch.float32))


def _block_input(model: Any, cache: Any, layer: int) -> torch.Tensor:
    """The MoE block's input ``[batch, pos, d_model]`` (the normalised residual stream)."""
    name = f"blocks.{layer}.mlp.hook_in"  # a bridge's
    if name in cache.cache_dict:
        return cache[name]
    # an AttnOnlyTransformer's RMSNorm: hook_normalized is before the weight
    return cache[f"blocks.{layer}.ln2.hook_normalized"] * model.blocks[layer].ln2.w


def _experts(model: Any, layer: int) -> list[Any]:
    from tl_attnonly.adapt import analysis_model

    return analysis_model(model, allow_experts=True).neuron_heads[layer].expert_list()


def _check_token_space(model: Any, toks: torch.Tensor) -> None:
    with torch.no_grad():
        _, cache = model.run_with_cache(toks)
    x = _block_input(model, cache, LAYER)
    top_k = cache[routing_hook_name(LAYER)].reshape(*toks.shape, -1)  # [batch, pos, top_k]
    seen = torch.zeros(toks.shape, dtype=torch.long)
    for e, expert in enumerate(_experts(model, LAYER)):
        routed = (top_k == e).any(-1)  # [batch, pos]
        seen += routed.long()
        gate = expert_activation(cache, LAYER, e, "gate")
        expected = x @ expert._gate_matrix  # [batch, pos, d_mlp], every token
        assert torch.isnan(gate[~routed]).all()
        torch.testing.assert_close(gate[routed], expected[routed], rtol=TOL, atol=TOL)
        # the neuron-heads of each neuron sum to its post-activation, token by token
        z = expert_activation(cache, LAYER, e, "z", fill=0.0)  # [batch, pos, n_neuron_heads]
        post = expert_activation(cache, LAYER, e, "post", fill=0.0)
        k = expert.n_heads_per_neuron
        summed = z.reshape(*z.shape[:2], -1, k).sum(-1)
        torch.testing.assert_close(summed, post, rtol=TOL, atol=TOL)
        assert z.shape[-1] == expert.n_neuron_heads
        assert bool((z[~routed] == 0).all()) and bool((z[routed] != 0).any())
    assert bool((seen == top_k.shape[-1]).all()), "every token reaches top_k experts"


def test_expert_activation_in_token_space_bridge(bridge):
    """A converted bridge (TL 3.9 and 4.x): each expert's activations land on the tokens the
    router sent to it (gate = block input @ the expert's gate weights there), NaN elsewhere."""
    _check_token_space(bridge, tokens())


def _patch_by_hand(
    model: Any, corrupted: torch.Tensor, clean_cache: Any, expert: int, head: int
) -> tuple[torch.Tensor, int]:
    """Patch ``head`` of ``expert`` with plain hooks: the corrupted routing is read in the same
    pass; a position is patched where its token was routed to the expert in the clean run too."""
    clean_index = clean_cache[routing_hook_name(LAYER)]
    clean_order = [t for s in range(clean_index.shape[1]) for t in range(clean_index.shape[0])
                   if int(clean_index[t, s]) == expert]  # fmt: skip
    clean_z = clean_cache[f"blocks.{LAYER}.mlp.experts.{expert}.hook_z"]
    seen: dict[str, Any] = {}
    patched = []

    def read_routing(index: torch.Tensor, hook: Any) -> None:
        seen["order"] = [t for s in range(index.shape[1]) for t in range(index.shape[0])
                         if int(index[t, s]) == expert]  # fmt: skip

    def patch(z: torch.Tensor, hook: Any) -> torch.Tensor:
        z = z.clone()
        for i, token in enumerate(seen["order"]):
            if token in clean_order:
                z[0, i, head] = clean_z[0, clean_order.index(token), head]
                patched.append(token)
        return z

    with torch.no_grad():
        logits = model.run_with_hooks(
            corrupted,
            fwd_hooks=[
                (routing_hook_name(LAYER), read_routing),
                (f"blocks.{LAYER}.mlp.experts.{expert}.hook_z", patch),
            ],
        )
    return logits, len(patched)


def _metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 3].sum() - logits[:, -1, 5].sum()


def _patch_table(model: Any, clean: torch.Tensor, corrupted: torch.Tensor) -> Any:
    with torch.no_grad():
        _, clean_cache = model.run_with_cache(clean)
    table = get_act_patch_expert_neuron_heads(
        model, corrupted, clean_cache, _metric, layer=LAYER, heads=[0, 7, 20]
    )
    assert len(table) == N_EXPERTS * 3
    with torch.no_grad():
        baseline = float(_metric(model(corrupted)))
    for row in table.itertuples():
        logits, n_patched = _patch_by_hand(model, corrupted, clean_cache, row.expert, row.head)
        assert row.patched_tokens == n_patched
        assert row.metric == pytest.approx(float(_metric(logits)), abs=1e-6)
        assert row.label == f"L{LAYER}E{row.expert}N{row.head}"
    assert (table.only_clean + table.only_corrupted).sum() > 0, "routing differs somewhere"
    assert (table.metric - baseline).abs().max() > 1e-4, "some patch moves the metric"
    return table


def test_expert_patching_against_plain_hooks_bridge(bridge):
    """Patches of expert neuron-heads' z equal hand-written run_with_hooks patches; tokens
    routed in one run only are counted and not patched."""
    clean = tokens(seed=1)
    corrupted = clean.clone()
    corrupted[:, :4] = tokens(seed=2)[:, :4]  # a different prefix: some routing changes
    _patch_table(bridge, clean, corrupted)


def test_expert_tools_refuse_bad_arguments(bridge):
    """The expert tools refuse an unknown expert, kind, head or option before any work."""
    toks = tokens()
    with pytest.raises(ValueError, match="has 4 experts"):
        summarize_expert_neuron_heads(bridge, [toks[0]], layer=LAYER, experts=[4])
    with pytest.raises(NotImplementedError, match="token_stats"):
        summarize_expert_neuron_heads(bridge, [toks[0]], layer=LAYER, token_stats=True)
    with pytest.raises(MemoryError, match="4 experts"):
        summarize_expert_neuron_heads(bridge, [toks[0]], layer=LAYER, max_bytes=1)
    with torch.no_grad():
        _, cache = bridge.run_with_cache(toks)
    with pytest.raises(ValueError, match="has 4 experts"):
        expert_activation(cache, LAYER, 4)
    with pytest.raises(ValueError, match=r"has 4 experts \(0 to 3\) and no shared expert"):
        expert_activation(cache, LAYER, "shared")
    with pytest.raises(ValueError, match="no shared expert"):
        get_act_patch_expert_neuron_heads(
            bridge, toks, cache, _metric, layer=LAYER, experts=["shared"]
        )
    with pytest.raises(ValueError, match="no shared expert"):
        summarize_expert_neuron_heads(bridge, [toks[0]], layer=LAYER, experts=["shared_expert"])
    with pytest.raises(ValueError, match="pattern"):
        expert_activation(cache, LAYER, 0, "pattern")
    with pytest.raises(ValueError, match="neuron-heads"):
        get_act_patch_expert_neuron_heads(bridge, toks, cache, _metric, layer=LAYER, heads=[10**6])


def test_both_kinds_agree_on_experts():
    """TL 3.x: an AttnOnlyTransformer Mixtral of the same weights gives the same token-space
    activations and the same patching table as the converted bridge (float32 rounding of
    Hugging Face's RMSNorm)."""
    from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER

    if not HAS_HOOKED_TRANSFORMER:
        pytest.skip("TransformerLens 4.x has no HookedTransformer")
    from test_moe_bridge import _hooked_mixtral
    from transformer_lens.model_bridge.sources import build_bridge_from_module

    import tl_attnonly

    hf, config = build_hf_model("mixtral", torch.float64)
    hooked = tl_attnonly.convert(_hooked_mixtral(hf, config, torch.float64))
    bridge = convert_zoo_bridge(
        build_bridge_from_module(hf, "MixtralForCausalLM", hf_config=config)
    )
    clean = tokens(seed=1)
    corrupted = clean.clone()
    corrupted[:, :4] = tokens(seed=2)[:, :4]
    _check_token_space(hooked, clean)
    with torch.no_grad():
        _, cache_h = hooked.run_with_cache(clean)
        _, cache_b = bridge.run_with_cache(clean)
    for e in range(N_EXPERTS):
        torch.testing.assert_close(
            expert_activation(cache_b, LAYER, e, "z"),
            expert_activation(cache_h, LAYER, e, "z"),
            rtol=TOL, atol=TOL, equal_nan=True,
        )  # fmt: skip
    summ_h, summary_h = _check_summaries(hooked)
    summ_b, summary_b = _check_summaries(bridge)
    assert summary_h[["expert", "head", "label", "routed"]].equals(
        summary_b[["expert", "head", "label", "routed"]]
    )
    for ranking in ("self", "abs_z"):
        for e in range(N_EXPERTS):
            top_h, top_b = summ_h.top[ranking][e], summ_b.top[ranking][e]
            assert torch.equal(top_h.document, top_b.document)
            assert torch.equal(top_h.position, top_b.position)
    table_h = _patch_table(hooked, clean, corrupted)
    table_b = _patch_table(bridge, clean, corrupted)
    counts = ["expert", "head", "patched_tokens", "only_clean", "only_corrupted"]
    assert table_h[counts].equals(table_b[counts])
    torch.testing.assert_close(
        torch.tensor(table_b.metric.values), torch.tensor(table_h.metric.values),
        rtol=TOL, atol=TOL,
    )  # fmt: skip


#: A corpus of rows of several lengths: batches of 2 are right-padded.
def _corpus() -> list[torch.Tensor]:
    return [tokens(batch=1, pos=n, seed=10 + i)[0] for i, n in enumerate((9, 4, 7, 9, 3))]


def _hook(expert: Any, kind: str) -> str:
    """The expert's hook: ``experts.{e}`` (routed) or the shared expert's name."""
    where = f"experts.{expert}" if isinstance(expert, int) else expert
    return f"blocks.{LAYER}.mlp.{where}.hook_{kind}"


def _reference(model: Any, corpus: list[torch.Tensor], experts: list[Any]) -> dict[Any, list]:
    """Per expert, ``(row, pos, self [H], z [H])`` of every token routed to it: one plain
    ``run_with_hooks`` per row, the expert's hook positions mapped to tokens by hand from the
    routing indices read in the same pass (a shared expert: every token, in order)."""
    found: dict[Any, list[tuple]] = {e: [] for e in experts}
    for r, row in enumerate(corpus):
        seen: dict[str, Any] = {}

        def keeper(name: str, seen: dict[str, Any] = seen) -> Any:
            def keep(act: torch.Tensor, hook: Any) -> None:
                seen[name] = act.detach().clone()

            return keep

        names = [routing_hook_name(LAYER)] + [
            _hook(e, kind) for e in experts for kind in ("pattern", "z")
        ]  # fmt: skip
        with torch.no_grad():
            model.run_with_hooks(row[None], fwd_hooks=[(name, keeper(name)) for name in names])
        index = seen[routing_hook_name(LAYER)]  # [pos, top_k]
        for e in experts:
            order = list(range(len(row))) if isinstance(e, str) else [
                t for s in range(index.shape[1]) for t in range(index.shape[0])
                if int(index[t, s]) == e
            ]  # fmt: skip
            pattern = seen[_hook(e, "pattern")]  # [1, H, routed, 2] (one row: [1, ...] for all)
            z = seen[_hook(e, "z")]  # [1, routed, H, 1]
            for i, t in enumerate(order):
                found[e].append((r, t, pattern[0, :, i, 0].double(), z[0, i, :, 0].double()))
    return found


def _check_summaries(model: Any, shared: str | None = None) -> Any:
    corpus = _corpus()
    k, before, after = 3, 2, 1
    summ = summarize_expert_neuron_heads(
        model, corpus, layer=LAYER, k=k, before=before, after=after, batch_size=2, progress=False
    )
    experts = [*range(N_EXPERTS), *([shared] if shared else [])]
    assert summ.experts == experts  # default: the routed experts, then the shared one
    ref = _reference(model, corpus, experts)
    n_tokens = sum(len(row) for row in corpus)
    assert summ.n_positions == n_tokens and summ.n_rows == len(corpus)
    # top_k = 2: padding never counted; a shared expert counts every token
    assert int(summ.routed_count[:N_EXPERTS].sum()) == 2 * n_tokens
    if shared:
        assert int(summ.routed_count[N_EXPERTS]) == n_tokens
    table = summ.table()
    assert len(table) == sum(summ.n_neuron_heads)
    for i, e in enumerate(experts):
        routed = ref[e]
        H = summ.n_neuron_heads[i]
        assert int(summ.routed_count[i]) == len(routed)
        self_w = torch.stack([s for _, _, s, _ in routed])  # [routed, H]
        z = torch.stack([z for _, _, _, z in routed])
        assert self_w.shape[-1] == H
        rows = table[table.expert == e]
        assert list(rows.routed) == [len(routed)] * H
        tag = f"E{e}" if isinstance(e, int) else "S"
        assert list(rows.label[:2]) == [f"L{LAYER}{tag}N0", f"L{LAYER}{tag}N1"]
        for column, expected in (
            ("firing_fraction", (self_w > 0.5).double().mean(0)),
            ("mean_self", self_w.mean(0)),
            ("mean_z", z.mean(0)),
            ("max_z", z.max(0).values),
        ):
            torch.testing.assert_close(
                torch.tensor(rows[column].values), expected, rtol=TOL, atol=TOL
            )
        for ranking, score in (("self", self_w), ("abs_z", z.abs())):
            top = summ.top[ranking][i]
            best = score.topk(k, dim=0)  # [k, H]
            torch.testing.assert_close(top.values.double(), best.values.T, rtol=TOL, atol=TOL)
            for h in (0, H - 1):
                r, t, _, _ = routed[int(best.indices[0, h])]
                assert (int(top.document[h, 0]), int(top.position[h, 0])) == (r, t)
                # the context window: the row's tokens, the head's self weight where routed
                by_pos = {p: s[h] for rr, p, s, _ in routed if rr == r}
                for j, p in enumerate(range(t - before, t + after + 1)):
                    inside = 0 <= p < len(corpus[r])
                    assert int(top.tokens[h, 0, j]) == (int(corpus[r][p]) if inside else -1)
                    got = float(top.self_weight[h, 0, j])
                    if p in by_pos:
                        assert got == pytest.approx(float(by_pos[p]), abs=TOL)
                    else:  # not routed to the expert, or outside the row
                        assert (got != got) if inside else got == 0.0
    return summ, table


def test_expert_summaries_against_plain_hooks_bridge(bridge):
    """Expert summaries (TL 3.9 and 4.x bridge) equal statistics gathered by hand from plain
    run_with_hooks per row: each expert's hooks mapped to tokens through the routing indices,
    padding excluded."""
    _check_summaries(bridge)


# ---------------------------------------------------------------------------------- shared experts
@pytest.fixture(scope="module", params=sorted(SHARED_MODELS))
def shared_bridge(request) -> tuple[str, Any]:
    """``(zoo name, converted float32 bridge)`` of a MoE model with a shared expert."""
    return request.param, convert_zoo_bridge(build_bridge(request.param, torch.float32))


def test_shared_expert_activation_at_every_token(shared_bridge):
    """``expert="shared"`` (and the converted block's own name) reads the shared expert at every
    token: its post-activation equals ``silu(x W_gate) * (x W_up)`` computed from the Hugging
    Face weights at each token's block input, and its neuron-heads sum to it, neuron by neuron
    (Qwen2-MoE hooks the flattened tokens, DeepSeek-V3 ``[batch, pos]``)."""
    name, bridge = shared_bridge
    shared = SHARED_MODELS[name]
    toks = tokens()
    with torch.no_grad():
        _, cache = bridge.run_with_cache(toks)
    hf_layer = getattr(build_hf_model(name, torch.float32)[0].model.layers[LAYER].mlp, shared)
    x = cache[f"blocks.{LAYER}.mlp.hook_in"].double()  # [batch, pos, d_model]
    gate = x @ hf_layer.gate_proj.weight.double().T
    expected = torch.nn.functional.silu(gate) * (x @ hf_layer.up_proj.weight.double().T)
    post = expert_activation(cache, LAYER, "shared", "post")  # [batch, pos, d_mlp]
    assert post.shape == (*toks.shape, hf_layer.gate_proj.weight.shape[0])
    torch.testing.assert_close(post.double(), expected, rtol=TOL, atol=TOL)
    torch.testing.assert_close(
        expert_activation(cache, LAYER, shared, "pre").double(), gate, rtol=TOL, atol=TOL
    )
    z = expert_activation(cache, LAYER, shared, "z")  # [batch, pos, n_neuron_heads]
    assert not bool(z.isnan().any()), "a shared expert runs on every token"
    k = z.shape[-1] // post.shape[-1]
    summed = z.reshape(*z.shape[:2], -1, k).sum(-1)
    torch.testing.assert_close(summed, post, rtol=TOL, atol=TOL)
    assert torch.equal(z, expert_activation(cache, LAYER, "shared", "z"))
    with pytest.raises(ValueError, match=f"the shared expert '{shared}'"):
        expert_activation(cache, LAYER, "shared_mlp")
    with pytest.raises(ValueError, match="for a shared expert"):
        expert_activation(cache, LAYER, "shared", "gate")


def test_shared_expert_patching_equals_a_hook_patch(shared_bridge):
    """Patching the shared expert's neuron-heads gives exactly the metric of a hand-written
    ``run_with_hooks`` patch of ``blocks.{l}.mlp.{name}.hook_z`` (every token), counts every
    token patched, and comes after the routed experts by default."""
    name, bridge = shared_bridge
    shared = SHARED_MODELS[name]
    clean = tokens(seed=1)
    corrupted = clean.clone()
    corrupted[:, :4] = tokens(seed=2)[:, :4]
    with torch.no_grad():
        _, clean_cache = bridge.run_with_cache(clean)
    heads = [0, 5, 40]
    table = get_act_patch_expert_neuron_heads(
        bridge, corrupted, clean_cache, _metric, layer=LAYER, experts=["shared"], heads=heads
    )
    name_z = f"blocks.{LAYER}.mlp.{shared}.hook_z"
    clean_z = clean_cache[name_z]
    for row, head in zip(table.itertuples(), heads, strict=True):

        def patch(z: torch.Tensor, hook: Any, head: int = head) -> torch.Tensor:
            z = z.clone()
            z[..., head, :] = clean_z[..., head, :]
            return z

        with torch.no_grad():
            logits = bridge.run_with_hooks(corrupted, fwd_hooks=[(name_z, patch)])
        assert (row.expert, row.head, row.label) == (shared, head, f"L{LAYER}SN{head}")
        assert row.metric == float(_metric(logits))
        assert (row.patched_tokens, row.only_clean, row.only_corrupted) == (clean.numel(), 0, 0)
    with torch.no_grad():
        baseline = float(_metric(bridge(corrupted)))
    assert (table.metric - baseline).abs().max() > 1e-5, "some patch moves the metric"
    every = get_act_patch_expert_neuron_heads(
        bridge, corrupted, clean_cache, _metric, layer=LAYER, heads=[0]
    )
    assert list(every.expert) == [0, 1, 2, 3, shared]
    assert every.metric.iloc[-1] == table.metric.iloc[0]


def test_shared_expert_summaries_against_plain_hooks(shared_bridge):
    """The shared expert is one more row group of the expert summaries, counted over every
    (non-padding) token, equal to statistics gathered by hand per row."""
    name, bridge = shared_bridge
    _check_summaries(bridge, SHARED_MODELS[name])


def test_expert_summaries_rank_save_load_and_labels(shared_bridge, tmp_path):
    """ExpertNeuronHeadSummaries as NeuronHeadSummaries: rank() orders each expert's heads as a
    hand sort of its table does, save() then load() gives back equal summaries, labels name the
    expert."""
    name, bridge = shared_bridge
    shared = SHARED_MODELS[name]
    summ = summarize_expert_neuron_heads(
        bridge, _corpus(), layer=LAYER, k=3, before=1, after=1, batch_size=2, progress=False
    )
    table = summ.table()
    for expert in (0, 3, shared):
        rows = table[table.expert == expert]
        for by in ("max_self", "max_abs_z"):
            values = list(rows[by])
            by_hand = sorted(range(len(values)), key=lambda h: -values[h])
            assert summ.rank(expert, by, level="head") == by_hand
            assert summ.rank(expert, by, top=4) == by_hand[:4]  # K = 1: neurons are heads
        fraction = summ.firing_fraction(expert)
        ranked = summ.rank(expert)  # firing fraction, largest first
        assert sorted(ranked) == list(range(len(rows)))
        assert bool((fraction[ranked].diff() <= 0).all())
    assert summ.rank("shared", "max_abs_z") == summ.rank(shared, "max_abs_z")
    assert summ.label("shared", 7) == f"L{LAYER}SN7" and summ.label(2, 7) == f"L{LAYER}E2N7"
    with pytest.raises(ValueError, match="per-token statistics"):
        summ.rank(0, "selectivity")
    with pytest.raises(ValueError, match="by must be"):
        summ.rank(0, "mean_z")
    loaded = ExpertNeuronHeadSummaries.load(summ.save(tmp_path / "experts"))
    assert loaded.experts == summ.experts and loaded.n_neuron_heads == summ.n_neuron_heads
    for attr in ("layer", "n_heads_per_neuron", "before", "after", "n_positions", "n_rows", "meta"):
        assert getattr(loaded, attr) == getattr(summ, attr)
    assert torch.equal(loaded.routed_count, summ.routed_count)
    for attr in ("fire_count", "self_sum", "z_sum", "z_max"):
        for got, want in zip(getattr(loaded, attr), getattr(summ, attr), strict=True):
            assert torch.equal(got, want) and got.dtype == want.dtype
    for ranking in summ.top:
        for got, want in zip(loaded.top[ranking], summ.top[ranking], strict=True):
            for field in ("values", "tokens", "self_weight", "z", "document", "position"):
                got_t, want_t = getattr(got, field), getattr(want, field)
                assert got_t.dtype == want_t.dtype  # NaN: context tokens not routed
                torch.testing.assert_close(got_t, want_t, rtol=0, atol=0, equal_nan=True)
    assert loaded.table().equals(table)
    with pytest.raises(FileNotFoundError, match="ExpertNeuronHeadSummaries.save"):
        ExpertNeuronHeadSummaries.load(tmp_path / "nothing")
