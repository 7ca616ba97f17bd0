"""The atlas's state merges exactly and resumes exactly; gated layers' sign quadrants; the site
and the Jupyter object."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from helpers import BATCH, KINDS, MAX_LEN, bundled, corpus_rows, hooked_acts  # noqa: E402

from tl_attnonly.atlas import Atlas, AtlasOptions, AtlasState, build_atlas, collect_atlas  # noqa: E402
from tl_attnonly.atlas.site import read_js_data, read_record  # noqa: E402
from tl_attnonly.atlas.state import flatten_state  # noqa: E402

OPTS = AtlasOptions(k=5, before=3, after=2, samples=2, max_len=MAX_LEN)


def assert_same(a: AtlasState, b: AtlasState) -> None:
    fa, fb = flatten_state(a.layers), flatten_state(b.layers)
    assert fa.keys() == fb.keys()
    for key in fa:
        assert torch.equal(fa[key].cpu(), fb[key].cpu()), key
    assert int(a.n_tokens) == int(b.n_tokens) and a.n_rows == b.n_rows


@pytest.fixture(scope="module", params=KINDS)
def model_rows(request):
    model = bundled(request.param)
    return model, corpus_rows(model)


def test_two_halves_merge_to_one_pass(model_rows):
    model, rows = model_rows
    whole = collect_atlas(model, rows, options=OPTS, batch_size=BATCH)
    first = collect_atlas(model, rows, options=OPTS, batch_size=BATCH, max_rows=BATCH)
    second = collect_atlas(model, rows, options=OPTS, batch_size=BATCH, first_row=BATCH)
    assert_same(first.merge(second), whole)
    assert_same(second.merge(first), whole)


def test_resume_equals_no_stop(model_rows, tmp_path):
    model, rows = model_rows
    whole = build_atlas(
        model, rows, tmp_path / "whole", options=OPTS, batch_size=BATCH, progress=False
    )

    def stopping():
        yield from rows[: BATCH + 1]
        raise KeyboardInterrupt  # stopped in the second batch

    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        build_atlas(
            model,
            stopping(),
            out,
            options=OPTS,
            batch_size=BATCH,
            checkpoint_every=1,
            progress=False,
        )
    assert sorted(p.name for p in out.iterdir()) == [".checkpoint.safetensors"]  # no site yet
    assert AtlasState.load(out / ".checkpoint.safetensors").n_rows == BATCH
    resumed = build_atlas(
        model, rows, out, options=OPTS, batch_size=BATCH, checkpoint_every=1, progress=False
    )
    assert_same(resumed, whole)
    assert_same(AtlasState.load(out / "state.safetensors"), whole)
    assert not (out / ".checkpoint.safetensors").exists()


def test_site_files_and_jupyter(model_rows, tmp_path, monkeypatch):
    model, rows = model_rows
    state = build_atlas(
        model, rows, tmp_path, options=OPTS, batch_size=BATCH, progress=False, model_name="tiny"
    )
    for name in ("index.html", "neuron.html", "layer_0.html", "layer_1.html", "atlas.json"):
        assert (tmp_path / name).is_file()
    assert "http" not in (tmp_path / "neuron.html").read_text()  # nothing from the network
    meta = json.loads((tmp_path / "atlas.json").read_text())
    assert meta["manifest"]["d_mlp"] == 512 and meta["n_tokens"] == int(state.n_tokens)
    index = read_js_data(tmp_path / "index.js")
    assert len(index["neurons"]) == 2 * 512
    record = read_record(tmp_path, 1, 34)
    layer = state.layers[1]
    assert record["index"] == "L1N34"
    assert record["act_max"] == pytest.approx(float(layer["act_max"][34]), abs=1e-4)
    assert record["activation_frequency"] == int(layer["fire"][34]) / int(state.n_tokens)
    assert [e["act"] for e in record["top_examples"]] == pytest.approx(
        layer["top"]["rank"][34].tolist(), abs=1e-4
    )
    for field in ("examples_quantiles", "top_logits", "bottom_logits", "histogram"):
        assert record[field]
    atlas = Atlas.load(tmp_path)
    page = atlas["L1N34"]
    assert "L1N34" in page._repr_html_() and page["index"] == "L1N34"
    token = atlas.vocab[record["top_examples"][0]["tokens"][OPTS.before]]
    found = atlas.search(token)
    assert "L1N34" in set(found["label"]) and list(found.columns)[:3] == [
        "label",
        "layer",
        "neuron",
    ]
    with pytest.raises(KeyError):
        atlas["L9N0"]
    _search_reads_one_file_and_finds_what_the_records_say(atlas, tmp_path, monkeypatch)


def _search_reads_one_file_and_finds_what_the_records_say(atlas, directory, monkeypatch) -> None:
    """``Atlas.search`` against every neuron's record: the neurons whose top contexts centre on
    the token, how many, their largest centre activation; without opening a neuron's file."""
    import tl_attnonly.atlas.notebook as notebook

    records = [read_record(directory, li, i) for li in range(2) for i in range(512)]
    centres = [r["top_examples"][0]["tokens"][OPTS.before] for r in records[::97]]

    def no_neuron_files(*args, **kwargs):
        raise AssertionError("Atlas.search opened a neuron's file")

    monkeypatch.setattr(notebook, "read_record", no_neuron_files)
    for token_id in sorted(set(centres))[:4]:
        text = atlas.vocab[token_id]
        ids = {i for i, t in enumerate(atlas.vocab) if t == text or t.strip() == text.strip()}
        want = {}
        for r in records:
            acts = [e["act"] for e in r["top_examples"] if e["tokens"][OPTS.before] in ids]
            if acts:
                want[r["index"]] = (len(acts), max(acts))
        found = atlas.search(text)
        assert want and {row.label: (row.count, row.max_act) for row in found.itertuples()} == want
        assert list(found["count"]) == sorted(found["count"], reverse=True)


def test_gated_quadrants():
    from kinds import D_VOCAB, make_bridge

    model = make_bridge("llama_gqa", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, D_VOCAB, (n,), generator=g) for n in (9, 14, 5, 12, 7)]
    opts = AtlasOptions(k=4, before=2, after=1, quadrant_k=3, max_len=16)
    state = collect_atlas(model, rows, options=opts, batch_size=2)
    acts = hooked_acts_len(model, rows, 16)
    for li, (layer, ref) in enumerate(zip(state.layers, acts)):
        quadrant = (ref["pre"] <= 0).long() * 2 + (ref["lin"] <= 0).long()
        counts = torch.stack([(quadrant == q).sum(0) for q in range(4)], 1)
        assert torch.equal(layer["quad_count"], counts)
        bias = model.blocks[li].mlp.b_in  # None: the layer has no bias (Llama)
        b_in = torch.zeros(()) if bias is None else bias.detach().float()
        mag = (ref["post"] - b_in).abs()
        for n in range(ref["post"].shape[1]):
            for q in range(4):
                members = mag[:, n][quadrant[:, n] == q]
                expect = members.topk(min(3, members.numel())).values
                got = layer["quad"]["rank"][n * 4 + q][: expect.numel()].float()
                torch.testing.assert_close(got, expect, atol=1e-5, rtol=0)


def hooked_acts_len(model, rows, max_len):
    import helpers

    old, helpers.MAX_LEN = helpers.MAX_LEN, max_len
    try:
        return hooked_acts(model, rows)
    finally:
        helpers.MAX_LEN = old


def test_activation_sum_is_exact_in_any_order():
    """The fixed-point sum of any split of the values is the same bits (float64 sums are not:
    (a + b) + c != a + (b + c) in general), and within 2**-40 per value of the exact sum."""
    from tl_attnonly.atlas.state import carry, fixed_point, fixed_value

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(4096, 3, generator=gen) * torch.logspace(-6, 3, 4096)[:, None]).float()
    whole = carry(fixed_point(x).sum(0))
    parts = [carry(fixed_point(part).sum(0)) for part in x.split([7, 1000, 2000, 1089])]
    interleaved = carry(carry(parts[0] + parts[2]) + carry(parts[1] + parts[3]))
    assert torch.equal(interleaved, whole)
    exact = x.double().sum(0)
    torch.testing.assert_close(fixed_value(whole), exact, atol=4096 * 2.0**-40, rtol=0)


def test_atlas_runs_each_layers_fused_path(model_rows, monkeypatch):
    """The atlas hooks no head quantity: every MLP runs its fused path (no per-head queries,
    scores, patterns) and the self weights come from ``hook_pre`` (``mlp.self_weight``)."""
    from tl_attnonly.adapt import analysis_model

    model, rows = model_rows

    def head_path(*args, **kwargs):
        raise AssertionError("the atlas ran an MLP's head path")

    for block in analysis_model(model).blocks:
        monkeypatch.setattr(block.mlp, "_head_z", head_path)
    state = collect_atlas(model, rows[:BATCH], options=OPTS, batch_size=BATCH)
    assert int(state.n_tokens) > 0


def test_atlas_stops_after_the_last_block(model_rows):
    """The final norm and the unembedding never run (the atlas reads only block hooks). Not on
    a TransformerBridge: its ``stop_at_layer`` stops before a block, never after the last."""
    model, rows = model_rows
    if type(model).__name__ == "TransformerBridge":
        pytest.skip("TransformerBridge.run_with_cache cannot stop after its last block")
    after = [name for name in model.hook_dict if name.startswith(("ln_final", "unembed"))]
    assert after
    fired: list[str] = []
    hooks = [(name, lambda x, hook: fired.append(hook.name)) for name in after]
    with model.hooks(fwd_hooks=hooks):
        collect_atlas(model, rows[:BATCH], options=OPTS, batch_size=BATCH)
        assert fired == []
        model(rows[0][None])  # the same hooks fire in a plain forward pass
    assert fired


def test_packed_records_round_trip(model_rows, tmp_path):
    """The site stores each distinct context once, packed; reading it back gives the record
    neuron_record made, its windows' activations to half a step of ``as`` (1/127 of the
    largest |activation| in its windows) and self weights to 1/255; token ids compressed."""
    from tl_attnonly.atlas.build import logit_effect
    from tl_attnonly.atlas.records import neuron_record, vocabulary

    model, rows = model_rows
    state = build_atlas(model, rows, tmp_path, options=OPTS, batch_size=BATCH, progress=False)
    cpu = {k: ({f: t.cpu() for f, t in v.items()} if isinstance(v, dict) else v.cpu())
           for k, v in state.layers[0].items()}  # fmt: skip
    vocab = vocabulary(model.tokenizer, model.cfg.d_vocab)
    for neuron in (0, 5, 300):
        logits = [t.cpu() for t in logit_effect(model)[0]]
        made = neuron_record(cpu, 0, neuron, opts=OPTS, max_len=MAX_LEN, vocab=vocab,
                             n_tokens=int(state.n_tokens), logits=logits)  # fmt: skip
        read = read_record(tmp_path, 0, neuron)
        lists = [("top_examples", made["top_examples"], read["top_examples"])]
        pairs = zip(made["examples_quantiles"], read["examples_quantiles"])
        lists += [("quantile", a["examples"], b["examples"]) for a, b in pairs]
        quads = zip((made["quadrants"] or {}).values(), (read["quadrants"] or {}).values())
        lists += [("quadrant", a["examples"], b["examples"]) for a, b in quads]
        stored = read_js_data(tmp_path / "neurons" / "L0" / f"S{neuron // 16}.js")[str(neuron)]
        pool = stored["pool"]
        assert isinstance(pool["tokz"], str) and "edges" not in stored["histogram"]
        peak = max(abs(a) for _, want, _ in lists for c in want for a in c["acts"])
        assert pool["as"] == pytest.approx(peak / 127, rel=1e-3)  # acts as stored: 4 digits
        for name, want, got in lists:
            assert len(want) == len(got), name
            for a, b in zip(want, got):
                assert (a["tokens"], a["row"], a["pos"], a["act"]) == (
                    b["tokens"], b["row"], b["pos"], b["act"])  # fmt: skip
                torch.testing.assert_close(torch.tensor(b["acts"]), torch.tensor(a["acts"]),
                                           rtol=0, atol=pool["as"] / 2 + 1e-4)  # fmt: skip
                torch.testing.assert_close(torch.tensor(b["self"]), torch.tensor(a["self"]),
                                           rtol=0, atol=0.5 / 255 + 1e-4)  # fmt: skip
        assert read["histogram"]["edges"] == made["histogram"]["edges"]


def test_write_atlas_rerenders_from_the_saved_state(model_rows, tmp_path):
    from tl_attnonly.atlas import write_atlas

    model, rows = model_rows
    first = tmp_path / "first"
    build_atlas(model, rows, first, options=OPTS, batch_size=BATCH, progress=False)
    again = tmp_path / "again"
    write_atlas(model, AtlasState.load(first / "state.safetensors"), again)
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert all((first / f).read_bytes() == (again / f).read_bytes() for f in files)
    other = AtlasState.load(first / "state.safetensors")
    other.manifest = {**other.manifest, "d_mlp": 7}
    with pytest.raises(ValueError, match="the model is not"):
        write_atlas(model, other, tmp_path / "wrong")
