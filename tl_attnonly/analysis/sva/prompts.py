"""Subject-verb agreement prompts: templates, word lists, :class:`SVADataset` and its metric.

See :mod:`tl_attnonly.analysis.sva` for the task and the corruption.
"""

from __future__ import annotations

import json
import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib.resources import files
from typing import TYPE_CHECKING

import torch
from jaxtyping import Float, Int
from torch.nn.utils.rnn import pad_sequence

from tl_attnonly._types import replace_options, tokens_on_model_device
from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.discovery.positions import PositionClasses
from tl_attnonly.analysis.prompt_pairs import PromptPairs, padding_id

if TYPE_CHECKING:
    from tl_attnonly.protocol import ModelLike

#: A ``[singular, plural]`` pair of words.
Pair = tuple[str, str]

#: Templates: ``{SUBJ}`` (the subject, whose number the verb must agree with) and ``{ATTR}`` (an
#: attractor noun between subject and verb); the verb comes next.
SVA_TEMPLATES: tuple[str, ...] = (
    "The {SUBJ} near the {ATTR}",
    "The {SUBJ} behind the {ATTR}",
    "The {SUBJ} next to the {ATTR}",
    "The {SUBJ} beside the {ATTR}",
    "The {SUBJ} in front of the {ATTR}",
    "The {SUBJ} across from the {ATTR}",
)

#: A second template set, written apart from :data:`SVA_TEMPLATES` (other prepositions, a
#: relative clause, an opening phrase), to check that a circuit found on one holds on the other.
SVA_TEMPLATES_HELDOUT: tuple[str, ...] = (
    "The {SUBJ} that watched the {ATTR}",
    "Today the {SUBJ} outside the {ATTR}",
    "The {SUBJ} who liked the {ATTR}",
    "The old {SUBJ} above the {ATTR}",
)

#: How an attractor's number is chosen: unlike the subject's (the hard case), like it, or at random.
ATTRACTORS = ("opposite", "same", "random")
NUMBERS = ("singular", "plural")


@cache
def _shipped() -> dict[str, tuple[Pair, ...]]:
    text = (files("tl_attnonly") / "data" / "sva_words.json").read_text(encoding="utf-8")
    data = json.loads(text)
    return {k: tuple((s, p) for s, p in data[k]) for k in ("subjects", "attractors", "verbs")}


def sva_word_lists() -> dict[str, tuple[Pair, ...]]:
    """The shipped word lists (``tl_attnonly/data/sva_words.json``): ``"subjects"``,
    ``"attractors"`` and ``"verbs"``, each ``((singular, plural), ...)``."""
    return dict(_shipped())


@dataclass(frozen=True)
class SVAWords:
    """What :func:`make_sva_dataset` fills its prompts with (default: the shipped lists).

    Attributes:
        templates: Strings with one ``{SUBJ}`` and one ``{ATTR}`` after it (see
            :data:`SVA_TEMPLATES`); the verb is the next token.
        subjects: ``(singular, plural)`` nouns; the corruption swaps one for the other, so both
            must be the same number of tokens (after a space) in the model's tokenizer.
        attractors: ``(singular, plural)`` nouns for ``{ATTR}`` (left as they are by the
            corruption).
        verbs: ``(singular, plural)`` verb forms, each one token after a space.
    """

    templates: Sequence[str] = SVA_TEMPLATES
    subjects: Sequence[Pair] = field(default_factory=lambda: _shipped()["subjects"])
    attractors: Sequence[Pair] = field(default_factory=lambda: _shipped()["attractors"])
    verbs: Sequence[Pair] = field(default_factory=lambda: _shipped()["verbs"])

    def with_overrides(self, **changes: Sequence) -> SVAWords:
        """A copy with the given fields replaced.

        Raises:
            TypeError: For a name that is not a field, listing the fields.
        """
        return replace_options(
            self,
            changes,
            "make_sva_dataset() got unexpected keyword argument(s) {unknown}; the word lists "
            "are {names} (tl_attnonly.analysis.SVAWords).",
        )


@dataclass(frozen=True)
class SVADataset(PromptPairs):
    """Agreement prompts as tokens, with corrupted twins (the subject's number flipped).

    Rows are right-padded to one length; ``end_pos`` is each row's last real token, where the
    verb is predicted.

    Attributes:
        tokens: ``[batch, pos]`` clean prompts.
        corrupted_tokens: ``[batch, pos]`` the same prompts with the subject in the other number
            (same length; only the subject's tokens differ).
        correct_token, wrong_token: ``[batch]`` the verb form that agrees with the clean
            subject, and the other form.
        subject_pos, attractor_pos, end_pos: ``[batch]`` the last token of the subject, of the
            attractor, and of the prompt (the attractor's is END when the template ends with
            it, as every shipped one does).
        prompts, corrupted_prompts: The text.
        numbers: ``"singular"`` or ``"plural"``: the clean subject's number, per row.
        attractor_numbers: The attractor's number, per row.
    """

    tokens: Int[torch.Tensor, "batch pos"]
    corrupted_tokens: Int[torch.Tensor, "batch pos"]
    correct_token: Int[torch.Tensor, " batch"]
    wrong_token: Int[torch.Tensor, " batch"]
    subject_pos: Int[torch.Tensor, " batch"]
    attractor_pos: Int[torch.Tensor, " batch"]
    end_pos: Int[torch.Tensor, " batch"]
    prompts: tuple[str, ...] = ()
    corrupted_prompts: tuple[str, ...] = ()
    numbers: tuple[str, ...] = ()
    attractor_numbers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self._check_rows(
            ("correct_token", "wrong_token", "subject_pos", "attractor_pos", "end_pos")
        )
        pos = self.tokens.shape[1]
        if not ((0 <= self.subject_pos) & (self.subject_pos < self.attractor_pos)).all():
            raise ValueError("Each row needs 0 <= subject_pos < attractor_pos.")
        if not ((self.attractor_pos <= self.end_pos) & (self.end_pos < pos)).all():
            raise ValueError(f"Each row needs attractor_pos <= end_pos < {pos}.")
        if (self.correct_token == self.wrong_token).any():
            raise ValueError("The correct and wrong verb tokens must differ in every row.")

    def positions(self, name: str) -> Int[torch.Tensor, " batch"]:
        """``"subject"``, ``"attractor"``, ``"end"`` or ``"first"`` (position 0): ``[batch]``."""
        if name == "first":
            return torch.zeros_like(self.end_pos)
        if name not in ("subject", "attractor", "end"):
            raise ValueError(
                f"Unknown position {name!r}; expected subject, attractor, end or first."
            )
        return getattr(self, f"{name}_pos")

    def position_classes(self, names: Sequence[str] = ("subject", "end")) -> PositionClasses:
        """As :meth:`PromptPairs.position_classes`. In templates that end with the attractor
        (all shipped ones) its last token is END, so ``"attractor"`` adds a class only for
        other templates."""
        return super().position_classes(names)

    def logit_diff(self, logits: Float[torch.Tensor, "batch pos d_vocab"]) -> torch.Tensor:
        """``logit(correct verb) - logit(wrong verb)`` at END, per row: ``[batch]``."""
        at_end = self._at_end(logits, self.end_pos)
        correct = at_end.gather(-1, self.correct_token.to(logits.device)[:, None])
        wrong = at_end.gather(-1, self.wrong_token.to(logits.device)[:, None])
        return (correct - wrong)[:, 0]


def _n_tokens(model, word: str) -> int:
    return int(model.to_tokens(" " + word, prepend_bos=False, move_to_device=False).shape[-1])


def aligned_pairs(model: ModelLike, pairs: Sequence[Pair]) -> list[Pair]:
    """The pairs whose singular and plural are the same number of tokens (after a space) in
    ``model``'s tokenizer: subjects a corruption can flip without moving any later token.

    ``make_sva_dataset(model, n, subjects=aligned_pairs(model, sva_word_lists()["subjects"]))``
    keeps only those, explicitly.
    """
    model = analysis_model(model, neuron_heads=False)
    return [(s, p) for s, p in pairs if _n_tokens(model, s) == _n_tokens(model, p)]


def _check_words(model, words: SVAWords) -> None:
    """Refuse, before any prompt is built, what would make clean and corrupted tokens differ
    in length or a verb form several tokens."""
    for name in ("subjects", "attractors", "verbs"):
        pairs = getattr(words, name)
        if not pairs:
            raise ValueError(f"{name} is empty.")
        bad = [pair for pair in pairs if len(pair) != 2 or pair[0] == pair[1]]
        if bad:
            raise ValueError(
                f"{name} must be (singular, plural) pairs of two words; got {bad[:3]}."
            )
    misaligned = [
        (s, p, _n_tokens(model, s), _n_tokens(model, p))
        for s, p in words.subjects
        if _n_tokens(model, s) != _n_tokens(model, p)
    ]
    if misaligned:
        shown = ", ".join(f"{s!r} ({a}) / {p!r} ({b})" for s, p, a, b in misaligned[:5])
        raise ValueError(
            f"{len(misaligned)} subject pair(s) tokenize to different lengths in this model's "
            f"tokenizer, so the corruption would shift every later token: {shown}. Pass "
            "subjects=aligned_pairs(model, pairs) to keep the aligned ones."
        )
    long = [v for pair in words.verbs for v in pair if _n_tokens(model, v) != 1]
    if long:
        raise ValueError(
            f"Verb forms must be one token after a space in this model's tokenizer; {long[:5]} "
            "are not. Pass verbs= with one-token forms."
        )
    for template in words.templates:
        if template.count("{SUBJ}") != 1 or template.count("{ATTR}") != 1:
            raise ValueError(f"Template {template!r} needs one {{SUBJ}} and one {{ATTR}}.")
        if template.index("{SUBJ}") > template.index("{ATTR}"):
            raise ValueError(f"Template {template!r}: {{SUBJ}} must come before {{ATTR}}.")
        if template.rstrip() != template:
            raise ValueError(f"Template {template!r} must not end with a space.")


def _last_token_of(model, prefix: str, full: torch.Tensor, prepend_bos, prompt: str) -> int:
    """Position of the last token of ``prefix`` inside ``full`` (checked to be a prefix)."""
    ids = model.to_tokens(prefix, prepend_bos=prepend_bos, move_to_device=False)[0]
    if ids.shape[0] > full.shape[0] or not torch.equal(full[: ids.shape[0]], ids):
        raise ValueError(
            f"{prefix!r} does not tokenize as a prefix of {prompt!r}: the tokenizer merges across "
            "the word boundary; change the template or the words."
        )
    return ids.shape[0] - 1


def make_sva_dataset(
    model: ModelLike,
    n_prompts: int,
    *,
    attractor: str = "opposite",
    prepend_bos: bool | None = None,
    seed: int = 0,
    exclude: Collection[str] = (),
    words: SVAWords | None = None,
    **word_lists: Sequence,
) -> SVADataset:
    """Agreement prompts and corrupted twins (subject number flipped), tokenized by ``model``.

    Row ``i`` uses template ``templates[i % len(templates)]`` and a subject in number
    ``("singular", "plural")[(i // len(templates)) % 2]`` (balanced); the subject, attractor and
    verb pair are drawn at random (``seed``). The corrupted prompt is the same text with the
    subject's other form, so its answer is the other verb form.

    Args:
        model: A model with a tokenizer.
        n_prompts: Number of rows.
        attractor: The attractor's number: ``"opposite"`` the subject's (default: the
            agreement-attraction case), ``"same"``, or ``"random"``.
        prepend_bos: Passed to ``model.to_tokens`` (default: the model's own).
        seed: Seed of the draws (another seed: fresh prompts).
        exclude: Clean prompts not to produce (e.g. ``search_data.prompts``): a drawn prompt
            among them is drawn again, so the dataset is disjoint from them.
        words: :class:`SVAWords` (default: the shipped lists and :data:`SVA_TEMPLATES`; for
            the held-out split ``templates=SVA_TEMPLATES_HELDOUT``).
        **word_lists: ``templates``, ``subjects``, ``attractors`` or ``verbs`` by keyword.

    Returns:
        The :class:`SVADataset`, right-padded with the tokenizer's pad token.

    Raises:
        ValueError: Before any prompt is built, for a subject pair whose forms tokenize to
            different lengths, a verb form of several tokens, a malformed template or pair, an
            unknown ``attractor``; while building, for a tokenizer that merges across a word
            boundary, or when ``exclude`` leaves too few prompts.
    """
    model = analysis_model(model, neuron_heads=False)
    if words is not None and not isinstance(words, SVAWords):
        raise TypeError(
            f"make_sva_dataset(..., words=...) takes a tl_attnonly.analysis.SVAWords, got "
            f"{type(words).__name__}."
        )
    chosen = (words or SVAWords()).with_overrides(**word_lists)
    if attractor not in ATTRACTORS:
        raise ValueError(f"attractor={attractor!r}; expected one of {ATTRACTORS}.")
    if n_prompts < 1:
        raise ValueError(f"n_prompts must be at least 1, got {n_prompts}.")
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise ValueError("make_sva_dataset needs a model with a tokenizer (model.tokenizer).")
    _check_words(model, chosen)
    verb_ids = {
        v: int(model.to_tokens(" " + v, prepend_bos=False)[0, 0]) for p in chosen.verbs for v in p
    }
    rng = random.Random(seed)
    excluded = frozenset(exclude)
    rows = []
    for i in range(n_prompts):
        template = chosen.templates[i % len(chosen.templates)]
        number = (i // len(chosen.templates)) % 2
        for _ in range(1000):
            subject = rng.choice(chosen.subjects)
            attr_pair = rng.choice(chosen.attractors)
            verb = rng.choice(chosen.verbs)
            a_num = {"opposite": 1 - number, "same": number}.get(attractor, rng.randrange(2))
            fill = {"ATTR": attr_pair[a_num]}
            prompt = template.format(SUBJ=subject[number], **fill)
            if prompt not in excluded:
                break
        else:
            raise ValueError(
                f"Could not draw a prompt outside exclude= for template {template!r} in 1000 "
                "tries; give more words, another template set or fewer excluded prompts."
            )
        corrupted = template.format(SUBJ=subject[1 - number], **fill)
        clean_ids = model.to_tokens(prompt, prepend_bos=prepend_bos, move_to_device=False)[0]
        corr_ids = model.to_tokens(corrupted, prepend_bos=prepend_bos, move_to_device=False)[0]
        if clean_ids.shape != corr_ids.shape:
            raise ValueError(
                f"{prompt!r} and its corruption {corrupted!r} tokenize to different lengths."
            )
        head = template.split("{SUBJ}")[0]
        subj_pos = _last_token_of(model, head + subject[number], clean_ids, prepend_bos, prompt)
        attr_head = template.split("{ATTR}")[0].format(SUBJ=subject[number])
        attr_pos = _last_token_of(model, attr_head + fill["ATTR"], clean_ids, prepend_bos, prompt)
        rows.append(
            (clean_ids, corr_ids, verb_ids[verb[number]], verb_ids[verb[1 - number]], subj_pos,
             attr_pos, prompt, corrupted, NUMBERS[number], NUMBERS[a_num])
        )  # fmt: skip
    fill_id = padding_id(tokenizer)
    clean_rows, corr_rows, correct, wrong, subj, attr, texts, corr_texts, nums, attr_nums = zip(
        *rows
    )

    def padded(seqs) -> torch.Tensor:
        return pad_sequence(list(seqs), batch_first=True, padding_value=fill_id)

    def longs(values) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.long)

    # on the model's device, as model.to_tokens puts them
    tokens, corrupted_tokens = tokens_on_model_device(model, padded(clean_rows), padded(corr_rows))
    return SVADataset(
        tokens, corrupted_tokens, longs(correct), longs(wrong), longs(subj),
        longs(attr), longs(len(t) - 1 for t in clean_rows), texts, corr_texts, nums, attr_nums,
    )  # fmt: skip


__all__ = [
    "ATTRACTORS",
    "SVA_TEMPLATES",
    "SVA_TEMPLATES_HELDOUT",
    "SVADataset",
    "SVAWords",
    "aligned_pairs",
    "make_sva_dataset",
    "sva_word_lists",
]
