"""IOI prompts: templates, names, corruptions, and :class:`IOIDataset` with its positions.

See :mod:`tl_attnonly.analysis.ioi` for the task, the roles and the corruptions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tl_attnonly.protocol import ModelLike

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from jaxtyping import Float, Int

from tl_attnonly._types import replace_options, tokens_on_model_device
from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.discovery.positions import PositionClasses
from tl_attnonly.analysis.prompt_pairs import PromptPairs, padding_id

if TYPE_CHECKING:
    from transformer_lens import HookedTransformer


#: Templates with ``{A} {B}`` (the two names introduced), ``{C}`` (the one who gives: S2),
#: ``{PLACE}`` and ``{OBJECT}``; after Wang et al. (2022), Appendix E.
IOI_TEMPLATES: tuple[str, ...] = (
    "When {A} and {B} went to the {PLACE}, {C} gave a {OBJECT} to",
    "When {A} and {B} got a {OBJECT} at the {PLACE}, {C} decided to give it to",
    "While {A} and {B} were working at the {PLACE}, {C} gave a {OBJECT} to",
    "While {A} and {B} were commuting to the {PLACE}, {C} gave a {OBJECT} to",
    "After {A} and {B} went to the {PLACE}, {C} gave a {OBJECT} to",
    "Then, {A} and {B} went to the {PLACE}. {C} gave a {OBJECT} to",
    "Friends {A} and {B} found a {OBJECT} at the {PLACE}. {C} gave it to",
    "Afterwards, {A} and {B} went to the {PLACE}. {C} gave a {OBJECT} to",
)

#: A second template set, written apart from :data:`IOI_TEMPLATES` (other verbs, clause orders
#: and sentence breaks), to check that a circuit found or tuned on one set holds on the other.
IOI_TEMPLATES_HELDOUT: tuple[str, ...] = (
    "Yesterday {A} and {B} had lunch at the {PLACE}, and {C} handed the {OBJECT} to",
    "At the {PLACE}, {A} and {B} were talking. Later {C} passed the {OBJECT} to",
    "Later that day, {A} and {B} walked to the {PLACE}. {C} offered the {OBJECT} to",
    "The {PLACE} was quiet when {A} and {B} arrived, so {C} showed the {OBJECT} to",
    "After lunch, {A} and {B} met at the {PLACE}, where {C} sold a {OBJECT} to",
    "On Sunday {A} and {B} cleaned the {PLACE}, and afterwards {C} lent the {OBJECT} to",
)

#: First names; each must be one token after a space in the model's tokenizer (checked).
IOI_NAMES: tuple[str, ...] = (
    "Mary", "John", "Anna", "Tom", "Sarah", "James", "Emma", "David", "Alice", "Bob",
    "Michael", "Jessica", "Paul", "Lisa", "Daniel", "Laura", "Mark", "Kate", "Peter", "Jane",
    "Robert", "Linda", "George", "Susan", "Kevin", "Rachel", "Brian", "Helen", "Jack", "Rose",
    "Eric", "Anne", "Adam", "Lucy", "Andrew", "Grace", "Richard", "Emily", "Thomas", "Sophie",
)  # fmt: skip


#: Places and objects (one token after a space in the tokenizers we use; not checked).
IOI_PLACES: tuple[str, ...] = (
    "store", "park", "school", "garden", "restaurant", "office", "hospital", "station", "beach",
    "house",
)  # fmt: skip


IOI_OBJECTS: tuple[str, ...] = (
    "drink", "ball", "book", "bone", "snack", "necklace", "computer", "ring", "basketball",
    "kiss",
)  # fmt: skip


#: Corruptions: ``abc`` (three new names), ``swap`` (IO <-> S everywhere), ``s2`` (new S2 only).
CORRUPTIONS = ("abc", "swap", "s2")


@dataclass(frozen=True)
class IOIDataset(PromptPairs):
    """IOI prompts as tokens, with their corrupted twins and the positions of IO, S1, S2, END.

    Rows are right-padded to one length; ``end_pos`` is each row's last real token (for causal
    models the padding after it changes nothing before it).

    Attributes:
        tokens: ``[batch, pos]`` clean prompts.
        corrupted_tokens: ``[batch, pos]`` corrupted twins (same positions, same length).
        io_token, s_token: ``[batch]`` the indirect object's and the subject's token.
        io_pos, s1_pos, s2_pos, end_pos: ``[batch]`` positions in ``tokens``.
        prompts, corrupted_prompts: The text, if the dataset was written from text.
        orders: ``"ABBA"`` or ``"BABA"`` per row (empty if built from tokens).
    """

    tokens: Int[torch.Tensor, "batch pos"]
    corrupted_tokens: Int[torch.Tensor, "batch pos"]
    io_token: Int[torch.Tensor, " batch"]
    s_token: Int[torch.Tensor, " batch"]
    io_pos: Int[torch.Tensor, " batch"]
    s1_pos: Int[torch.Tensor, " batch"]
    s2_pos: Int[torch.Tensor, " batch"]
    end_pos: Int[torch.Tensor, " batch"]
    prompts: tuple[str, ...] = field(default=())
    corrupted_prompts: tuple[str, ...] = field(default=())
    orders: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        self._check_rows(("io_token", "s_token", "io_pos", "s1_pos", "s2_pos", "end_pos"))
        pos = self.tokens.shape[1]
        if ((self.end_pos >= pos) | (self.io_pos < 0) | (self.s1_pos < 0)).any():
            raise ValueError(f"Positions must lie in [0, {pos}) (the tokens' length).")
        if not (self.s1_pos + 1 < self.s2_pos).all() or not (self.s2_pos < self.end_pos).all():
            raise ValueError(
                "Each row needs S1 + 1 < S2 < END (S2 after the token following S1, END last)."
            )
        if (self.io_pos == self.s1_pos).any() or (self.io_pos >= self.s2_pos).any():
            raise ValueError("IO must differ from S1 and come before S2.")

    @classmethod
    def from_tokens(
        cls,
        tokens: Int[torch.Tensor, "batch pos"],
        corrupted_tokens: Int[torch.Tensor, "batch pos"],
        io_pos: Int[torch.Tensor, " batch"],
        s1_pos: Int[torch.Tensor, " batch"],
        s2_pos: Int[torch.Tensor, " batch"],
        end_pos: Int[torch.Tensor, " batch"] | None = None,
    ) -> IOIDataset:
        """A dataset from token ids and positions (e.g. for a model without a tokenizer).

        Args:
            tokens, corrupted_tokens: ``[batch, pos]``.
            io_pos, s1_pos, s2_pos: ``[batch]`` positions; the IO and S tokens are read there.
            end_pos: ``[batch]``; default the last position of every row.

        Raises:
            ValueError: If the tokens at S1 and S2 differ, or IO's token equals S's.
        """
        rows = torch.arange(tokens.shape[0])
        if end_pos is None:
            end_pos = torch.full_like(io_pos, tokens.shape[1] - 1)
        io_token, s_token = tokens[rows, io_pos], tokens[rows, s1_pos]
        if (tokens[rows, s2_pos] != s_token).any():
            raise ValueError("The tokens at S1 and S2 must be the same name (the subject).")
        if (io_token == s_token).any():
            raise ValueError("The IO token must differ from the subject's.")
        return cls(tokens, corrupted_tokens, io_token, s_token, io_pos, s1_pos, s2_pos, end_pos)

    def positions(self, name: str) -> Int[torch.Tensor, " batch"]:
        """``"io"``, ``"s1"``, ``"s2"``, ``"end"``, ``"s1_plus1"`` or ``"first"`` (position 0):
        ``[batch]`` positions."""
        if name == "s1_plus1":
            return self.s1_pos + 1
        if name == "first":
            return torch.zeros_like(self.end_pos)
        if name not in ("io", "s1", "s2", "end"):
            raise ValueError(
                f"Unknown position {name!r}; expected io, s1, s2, end, s1_plus1 or first."
            )
        return getattr(self, f"{name}_pos")

    def position_classes(
        self, names: Sequence[str] = ("io", "s1", "s1_plus1", "s2", "end")
    ) -> PositionClasses:
        """Each token position's IOI role, for a circuit resolved by position
        (``discover_circuit(..., positions=data.position_classes())``).

        Args:
            names: Roles with a class of their own (as :meth:`positions` names them); every
                other position (the template's words, padding) is class ``"other"``.

        Returns:
            :class:`~tl_attnonly.analysis.discovery.positions.PositionClasses` over ``tokens``.
        """
        return super().position_classes(names)

    def logit_diff(self, logits: Float[torch.Tensor, "batch pos d_vocab"]) -> torch.Tensor:
        """``logit(IO) - logit(S)`` at END, per row: ``[batch]``.

        :meth:`~PromptPairs.metric` is its mean (a scalar patching or circuit metric) and
        :meth:`~PromptPairs.additive_metric` the same mean as a batch-additive
        ``metric(logits, indices)`` for ``discover_circuit(..., batch_size=...)``.
        """
        last = self._at_end(logits, self.end_pos)
        rows = torch.arange(len(self), device=logits.device)
        return (
            last[rows, self.io_token.to(logits.device)] - last[rows, self.s_token.to(logits.device)]
        )


def _single_token(model: HookedTransformer, word: str) -> int:
    ids = model.to_tokens(" " + word, prepend_bos=False)[0]
    if ids.numel() != 1:
        raise ValueError(
            f"{word!r} is {ids.numel()} tokens after a space in this model's tokenizer; IOI "
            f"names must be one token each. Pass names= with single-token names."
        )
    return int(ids[0])


def _tokenize(model: HookedTransformer, prompt: str, prepend_bos: bool | None) -> torch.Tensor:
    return model.to_tokens(prompt, prepend_bos=prepend_bos, move_to_device=False)[0]


def _find(row: torch.Tensor, token: int, count: int, what: str, prompt: str) -> list[int]:
    where = (row == token).nonzero().flatten().tolist()
    if len(where) != count:
        raise ValueError(
            f"Expected {what} {count} time(s) in {prompt!r}, found it {len(where)} time(s): a "
            f"template word or a place/object tokenizes like a name. Change the templates or names."
        )
    return where


@dataclass(frozen=True)
class IOIWords:
    """What :func:`make_ioi_dataset` fills its prompts with.

    Attributes:
        templates: Strings with ``{A}``, ``{B}``, ``{C}`` and optionally ``{PLACE}``,
            ``{OBJECT}`` (see :data:`IOI_TEMPLATES`); every name must follow a space.
        names: At least 5 names, each one token after a space.
        places: Words for ``{PLACE}``.
        objects: Words for ``{OBJECT}``.
    """

    templates: Sequence[str] = IOI_TEMPLATES
    names: Sequence[str] = IOI_NAMES
    places: Sequence[str] = IOI_PLACES
    objects: Sequence[str] = IOI_OBJECTS

    def with_overrides(self, **changes: Sequence[str]) -> IOIWords:
        """A copy with the given fields replaced.

        Raises:
            TypeError: For a name that is not a field, listing the fields.
        """
        return replace_options(
            self,
            changes,
            "make_ioi_dataset() got unexpected keyword argument(s) {unknown}; the word "
            "lists are {names} (tl_attnonly.analysis.IOIWords).",
        )


def make_ioi_dataset(
    model: ModelLike,
    n_prompts: int,
    *,
    corruption: str = "abc",
    orders: Sequence[str] = ("ABBA", "BABA"),
    prepend_bos: bool | None = None,
    seed: int = 0,
    words: IOIWords | None = None,
    **word_lists: Sequence[str],
) -> IOIDataset:
    """IOI prompts and corrupted twins, tokenized by ``model``'s tokenizer.

    Row ``i`` uses order ``orders[i % len(orders)]`` and template ``templates[(i // len(orders))
    % len(templates)]``; names, place and object are drawn at random (``seed``). ABBA puts IO first
    ("When Mary and John ..., John gave ... to"), BABA puts S first ("When John and Mary ...,
    John gave ... to"); either way S2 gives and the answer is IO.

    Args:
        model: A ``HookedTransformer`` with a tokenizer.
        n_prompts: Number of rows.
        corruption: ``"abc"`` (A, B, C replaced by three new distinct names: no name repeats, so
            nothing says which is IO), ``"swap"`` (IO and S exchanged everywhere: the answer is
            S), or ``"s2"`` (only S2 replaced by a third name).
        orders: A non-empty subset of ``("ABBA", "BABA")``.
        prepend_bos: Passed to ``model.to_tokens`` (default: the model's own default).
        seed: Seed of the draws.
        words: The templates, names, places and objects (:class:`IOIWords`; default: the
            module's lists).
        **word_lists: ``templates``, ``names``, ``places`` or ``objects`` by keyword; each
            replaces the one in ``words``.

    Returns:
        The :class:`IOIDataset`, right-padded with the tokenizer's pad token.

    Raises:
        ValueError: For an unknown corruption or order, too few names, a name of several tokens,
            or a template whose names cannot be found in the tokens.
    """
    model = analysis_model(model, neuron_heads=False)
    if words is not None and not isinstance(words, IOIWords):
        raise TypeError(
            f"make_ioi_dataset(..., words=...) takes a tl_attnonly.analysis.IOIWords, got "
            f"{type(words).__name__}."
        )
    chosen = (words or IOIWords()).with_overrides(**word_lists)
    templates, names = chosen.templates, chosen.names
    places, objects = chosen.places, chosen.objects
    if corruption not in CORRUPTIONS:
        raise ValueError(f"corruption={corruption!r}; expected one of {CORRUPTIONS}.")
    if not orders or set(orders) - {"ABBA", "BABA"}:
        raise ValueError(f"orders must be a non-empty subset of ('ABBA', 'BABA'), got {orders!r}.")
    if n_prompts < 1:
        raise ValueError(f"n_prompts must be at least 1, got {n_prompts}.")
    names = list(dict.fromkeys(names))
    if len(names) < 5:
        raise ValueError(
            f"Need at least 5 distinct names (IO, S and three new ones), got {len(names)}."
        )
    for template in templates:
        if any(f"{{{slot}}}" not in template for slot in "ABC"):
            raise ValueError(f"Template {template!r} needs {{A}}, {{B}} and {{C}}.")
    if getattr(model, "tokenizer", None) is None:
        raise ValueError(
            "This model has no tokenizer; build the dataset with IOIDataset.from_tokens(tokens, "
            "corrupted_tokens, io_pos, s1_pos, s2_pos)."
        )
    ids = {name: _single_token(model, name) for name in names}
    rng = random.Random(seed)
    rows, prompts, corrupted_prompts, row_orders = [], [], [], []
    for i in range(n_prompts):
        order = orders[i % len(orders)]
        template = templates[(i // len(orders)) % len(templates)]
        io, s, x, y, z = rng.sample(names, 5)
        fill = {"PLACE": rng.choice(places), "OBJECT": rng.choice(objects)}
        a, b = (io, s) if order == "ABBA" else (s, io)
        prompt = template.format(A=a, B=b, C=s, **fill)
        if corruption == "abc":
            corrupted = template.format(A=x, B=y, C=z, **fill)
        elif corruption == "swap":
            swap = {io: s, s: io}
            corrupted = template.format(A=swap[a], B=swap[b], C=io, **fill)
        else:
            corrupted = template.format(A=a, B=b, C=x, **fill)
        clean_ids = _tokenize(model, prompt, prepend_bos)
        corrupted_ids = _tokenize(model, corrupted, prepend_bos)
        if clean_ids.shape != corrupted_ids.shape:
            raise ValueError(
                f"{prompt!r} and its corruption {corrupted!r} tokenize to different lengths; "
                "use names of one token each."
            )
        (io_pos,) = _find(clean_ids, ids[io], 1, f"IO {io!r}", prompt)
        s1_pos, s2_pos = _find(clean_ids, ids[s], 2, f"S {s!r}", prompt)
        rows.append((clean_ids, corrupted_ids, ids[io], ids[s], io_pos, s1_pos, s2_pos))
        prompts.append(prompt)
        corrupted_prompts.append(corrupted)
        row_orders.append(order)
    length = max(r[0].shape[0] for r in rows)
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise ValueError("make_ioi_dataset needs a model with a tokenizer (model.tokenizer).")
    pad = padding_id(tokenizer)
    tokens = torch.full((n_prompts, length), pad, dtype=torch.long)
    corrupted_tokens = tokens.clone()
    for i, (clean_ids, corrupted_ids, *_) in enumerate(rows):
        tokens[i, : clean_ids.shape[0]] = clean_ids
        corrupted_tokens[i, : corrupted_ids.shape[0]] = corrupted_ids

    def column(j: int) -> torch.Tensor:
        return torch.tensor([r[j] for r in rows], dtype=torch.long)

    # on the model's device, as model.to_tokens puts them
    tokens, corrupted_tokens = tokens_on_model_device(model, tokens, corrupted_tokens)
    return IOIDataset(
        tokens,
        corrupted_tokens,
        io_token=column(2),
        s_token=column(3),
        io_pos=column(4),
        s1_pos=column(5),
        s2_pos=column(6),
        end_pos=torch.tensor([r[0].shape[0] - 1 for r in rows], dtype=torch.long),
        prompts=tuple(prompts),
        corrupted_prompts=tuple(corrupted_prompts),
        orders=tuple(row_orders),
    )


__all__ = [
    "CORRUPTIONS",
    "IOI_NAMES",
    "IOI_OBJECTS",
    "IOI_PLACES",
    "IOI_TEMPLATES",
    "IOI_TEMPLATES_HELDOUT",
    "IOIDataset",
    "IOIWords",
    "make_ioi_dataset",
]
