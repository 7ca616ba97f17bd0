"""IOI prompts and the head roles of Wang et al. (2022), read from attention patterns.

Indirect object identification (IOI): in "When Mary and John went to the store, John gave a drink
to" a model should say " Mary". Wang et al. (2022, *Interpretability in the Wild*) found the
circuit in GPT-2 small and named its heads by what they attend to at four positions: **IO** (the
indirect object, " Mary"), **S1** and **S2** (the two mentions of the subject, " John"), and
**END** (the last token, " to"), with **S1+1** the token after S1:

=====================  ============================================  ==========================
role                   pattern (query -> key)                        direct logit attribution
=====================  ============================================  ==========================
name mover             END -> IO (more than to S1 and S2 together)   on ``IO - S``: > 0
negative name mover    END -> IO (likewise)                          < 0
S suppression          END -> S1 + S2 (more than to IO)              > 0 (writes against S)
S mover                END -> S1 + S2 (likewise)                     < 0 (writes S)
S-inhibition           END -> S2 (more than to IO)                   small
duplicate token        S2 -> S1
induction              S2 -> S1+1
previous token         S1+1 -> S1
=====================  ============================================  ==========================

Name movers, negative name movers, S-inhibition, duplicate-token, induction and previous-token
heads are Wang et al.'s classes; the two S roles are the same patterns with the answer written
through S (a negative name mover and an S suppressor both write against the name they attend to:
copy suppression, McDougall et al. 2023). Patterns and direct effects are necessary signs of a
role, not proof of it: Wang et al. confirm S-inhibition heads by path patching into the name
movers' queries.

:func:`make_ioi_dataset` writes such prompts from templates (names, places and objects of one
token each), in both orders (ABBA: "When Mary and John ..., John ..."; BABA: "When John and Mary
..., John ..."), with corrupted twins of the same length: ``"abc"`` (Wang et al.'s ABC
distribution: three new names, so nothing is duplicated), ``"swap"`` (IO and S exchanged
everywhere: the answer flips) or ``"s2"`` (only S2 replaced by a third name).
:meth:`IOIDataset.from_tokens` builds a dataset from token ids and positions, for models without
a tokenizer. :func:`ioi_head_scores` reads every attention head's scores from one cached run per
batch; :meth:`IOIHeadScores.roles` assigns the roles above by thresholds.

Everything works on any ``HookedTransformer`` (original or converted: a converted model keeps the
attention layers, so its scores are the original's to rounding) with causal attention.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pandas as pd
import torch
from jaxtyping import Float, Int
from tqdm.auto import tqdm
from transformer_lens.components import LayerNorm, LayerNormPre

from tl_attnonly._types import require_additive_residual
from tl_attnonly.hooks import attn_names_filter, exact_names_filter

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

#: Attention scores: column -> (query position, key position).
ATTENTION_SCORES: dict[str, tuple[str, str]] = {
    "end_to_io": ("end", "io"),
    "end_to_s1": ("end", "s1"),
    "end_to_s2": ("end", "s2"),
    "s2_to_s1": ("s2", "s1"),
    "s2_to_s1_plus1": ("s2", "s1_plus1"),
    "s1_plus1_to_s1": ("s1_plus1", "s1"),
    "end_to_end": ("end", "end"),
    "end_to_first": ("end", "first"),
}

#: Roles :meth:`IOIHeadScores.roles` assigns, in this order.
ROLES = (
    "name mover",
    "negative name mover",
    "S suppression",
    "S mover",
    "S-inhibition",
    "duplicate token",
    "induction",
    "previous token",
)


@dataclass(frozen=True)
class IOIDataset:
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
        if self.tokens.ndim != 2 or self.corrupted_tokens.shape != self.tokens.shape:
            raise ValueError(
                f"tokens {tuple(self.tokens.shape)} and corrupted_tokens "
                f"{tuple(self.corrupted_tokens.shape)} must be [batch, pos] of one shape."
            )
        n, pos = self.tokens.shape
        for name in ("io_token", "s_token", "io_pos", "s1_pos", "s2_pos", "end_pos"):
            value = getattr(self, name)
            if value.shape != (n,):
                raise ValueError(
                    f"{name} must have shape [batch] = ({n},), got {tuple(value.shape)}."
                )
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

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def select(self, index: slice | Sequence[int] | torch.Tensor) -> IOIDataset:
        """The rows ``index`` (a slice, a list of rows or a tensor of them), as a dataset."""
        rows = torch.arange(len(self))[index]
        texts = [
            tuple(values[i] for i in rows.tolist()) if values else ()
            for values in (self.prompts, self.corrupted_prompts, self.orders)
        ]
        return IOIDataset(
            self.tokens[rows],
            self.corrupted_tokens[rows],
            self.io_token[rows],
            self.s_token[rows],
            self.io_pos[rows],
            self.s1_pos[rows],
            self.s2_pos[rows],
            self.end_pos[rows],
            *texts,
        )

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

    def logit_diff(self, logits: Float[torch.Tensor, "batch pos d_vocab"]) -> torch.Tensor:
        """``logit(IO) - logit(S)`` at END, per row: ``[batch]``."""
        if logits.shape[:2] != self.tokens.shape:
            raise ValueError(
                f"logits {tuple(logits.shape)} do not match the dataset's tokens "
                f"{tuple(self.tokens.shape)}: run the model on dataset.tokens (or a select())."
            )
        rows = torch.arange(len(self), device=logits.device)
        last = logits[rows, self.end_pos.to(logits.device)]
        return (
            last[rows, self.io_token.to(logits.device)] - last[rows, self.s_token.to(logits.device)]
        )

    def metric(self, logits: Float[torch.Tensor, "batch pos d_vocab"], *_: object) -> torch.Tensor:
        """Mean ``logit(IO) - logit(S)`` at END: a scalar (a patching or circuit metric).

        Extra arguments (a node-circuit metric's inputs) are ignored.
        """
        return self.logit_diff(logits).mean()

    def additive_metric(
        self,
    ) -> Callable[
        [Float[torch.Tensor, "batch pos d_vocab"], Int[torch.Tensor, " batch"]], torch.Tensor
    ]:
        """The mean ``logit(IO) - logit(S)`` at END as a batch-additive ``metric(logits, indices)``.

        For circuit discovery in batches (:func:`~tl_attnonly.analysis.discover_circuit`,
        ``batch_size=``): ``logits`` are those of the rows ``indices`` of this dataset, and the
        metric is their summed logit difference divided by ``len(self)``, so the sum over batches
        is the dataset mean.
        """
        n = len(self)

        def metric(logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
            return self.select(indices.cpu()).logit_diff(logits).sum() / n

        return metric


def _single_token(model, word: str) -> int:
    ids = model.to_tokens(" " + word, prepend_bos=False)[0]
    if ids.numel() != 1:
        raise ValueError(
            f"{word!r} is {ids.numel()} tokens after a space in this model's tokenizer; IOI "
            f"names must be one token each. Pass names= with single-token names."
        )
    return int(ids[0])


def _tokenize(model, prompt: str, prepend_bos: bool | None) -> torch.Tensor:
    return model.to_tokens(prompt, prepend_bos=prepend_bos, move_to_device=False)[0]


def _find(row: torch.Tensor, token: int, count: int, what: str, prompt: str) -> list[int]:
    where = (row == token).nonzero().flatten().tolist()
    if len(where) != count:
        raise ValueError(
            f"Expected {what} {count} time(s) in {prompt!r}, found it {len(where)} time(s): a "
            f"template word or a place/object tokenizes like a name. Change the templates or names."
        )
    return where


def make_ioi_dataset(
    model,
    n_prompts: int,
    *,
    corruption: str = "abc",
    templates: Sequence[str] = IOI_TEMPLATES,
    names: Sequence[str] = IOI_NAMES,
    places: Sequence[str] = IOI_PLACES,
    objects: Sequence[str] = IOI_OBJECTS,
    orders: Sequence[str] = ("ABBA", "BABA"),
    prepend_bos: bool | None = None,
    seed: int = 0,
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
        templates: Strings with ``{A}``, ``{B}``, ``{C}`` and optionally ``{PLACE}``,
            ``{OBJECT}`` (see :data:`IOI_TEMPLATES`); every name must follow a space.
        names: At least 5 names, each one token after a space.
        places, objects: Words for ``{PLACE}`` and ``{OBJECT}``.
        orders: A non-empty subset of ``("ABBA", "BABA")``.
        prepend_bos: Passed to ``model.to_tokens`` (default: the model's own default).
        seed: Seed of the draws.

    Returns:
        The :class:`IOIDataset`, right-padded with the tokenizer's pad token.

    Raises:
        ValueError: For an unknown corruption or order, too few names, a name of several tokens,
            or a template whose names cannot be found in the tokens.
    """
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
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    pad = 0 if pad is None else int(pad)
    tokens = torch.full((n_prompts, length), pad, dtype=torch.long)
    corrupted_tokens = tokens.clone()
    for i, (clean_ids, corrupted_ids, *_) in enumerate(rows):
        tokens[i, : clean_ids.shape[0]] = clean_ids
        corrupted_tokens[i, : corrupted_ids.shape[0]] = corrupted_ids

    def column(j: int) -> torch.Tensor:
        return torch.tensor([r[j] for r in rows], dtype=torch.long)

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


@dataclass
class IOIHeadScores:
    """Every attention head's IOI scores, per prompt; :attr:`table` averages them.

    Attributes:
        attention: Column of :data:`ATTENTION_SCORES` -> ``[batch, n_layers, n_heads]``: the
            pattern's weight from the query position on the key position.
        dla_io, dla_s: ``[batch, n_layers, n_heads]`` direct logit attribution of each head at
            END on ``logit(IO)`` and on ``logit(S)``: the head's output through the final norm
            (its cached scale, its weight; centred for a LayerNorm) onto ``W_U[:, IO]`` and
            ``W_U[:, S]``, before any output soft cap.
        logit_diff: ``[batch]`` the model's ``logit(IO) - logit(S)`` at END.
    """

    attention: dict[str, Float[torch.Tensor, "batch n_layers n_heads"]]
    dla_io: Float[torch.Tensor, "batch n_layers n_heads"]
    dla_s: Float[torch.Tensor, "batch n_layers n_heads"]
    logit_diff: Float[torch.Tensor, " batch"]

    @property
    def dla(self) -> Float[torch.Tensor, "batch n_layers n_heads"]:
        """``[batch, n_layers, n_heads]`` direct logit attribution on ``logit(IO) - logit(S)``."""
        return self.dla_io - self.dla_s

    @property
    def table(self) -> pd.DataFrame:
        """One row per head (index ``L{l}H{h}``): ``layer, head``, the mean of every attention
        score, ``end_to_s`` (``end_to_s1 + end_to_s2``), ``dla``, ``dla_io`` and ``dla_s``."""
        n_layers, n_heads = self.dla_io.shape[1:]
        index = [f"L{li}H{h}" for li in range(n_layers) for h in range(n_heads)]
        data: dict[str, list] = {
            "layer": [li for li in range(n_layers) for _ in range(n_heads)],
            "head": [h for _ in range(n_layers) for h in range(n_heads)],
        }
        for name, values in self.attention.items():
            data[name] = values.mean(0).flatten().tolist()
        end_to_s = (self.attention["end_to_s1"] + self.attention["end_to_s2"]).mean(0)
        data["end_to_s"] = end_to_s.flatten().tolist()
        for name in ("dla", "dla_io", "dla_s"):
            data[name] = getattr(self, name).mean(0).flatten().tolist()
        return pd.DataFrame(data, index=index)

    def roles(
        self, attention_threshold: float = 0.3, dla_threshold: float | None = None
    ) -> pd.DataFrame:
        """Heads with each role of :data:`ROLES`, by thresholds on the mean scores.

        With ``a = attention_threshold`` and ``d = dla_threshold``:

        * name mover: ``end_to_io >= a``, ``end_to_io > end_to_s`` and ``dla >= d`` (attends to
          IO and writes it, Wang et al.); negative name mover: the same with ``dla <= -d``;
        * S suppression: ``end_to_s >= a``, ``end_to_s > end_to_io`` and ``dla >= d`` (attends
          to S and writes against it: copy suppression of S, McDougall et al. 2023); S mover:
          the same with ``dla <= -d`` (writes S);
        * S-inhibition: ``end_to_s2 >= a``, ``end_to_s2 > end_to_io`` and ``|dla| < d`` (attends
          to S2 from END and writes little to the answer directly; Wang et al. confirm such heads
          by their effect on the name movers' queries, which patterns alone cannot show);
        * duplicate token: ``s2_to_s1 >= a``; induction: ``s2_to_s1_plus1 >= a``; previous
          token: ``s1_plus1_to_s1 >= a``.

        Args:
            attention_threshold: Minimum mean attention weight.
            dla_threshold: The ``|dla|`` that counts as writing the answer; default 10% of the
                largest ``|dla|`` of any head.

        Returns:
            One row per (head, role): ``label, role, score`` (the score the role is defined by:
            ``dla`` for movers and suppressors, else the attention weight) and every column of
            :attr:`table`; sorted by role (in :data:`ROLES` order), then by ``|score|``.
        """
        table = self.table
        if dla_threshold is None:
            dla_threshold = 0.1 * float(table["dla"].abs().max())
        a, d, dla = attention_threshold, dla_threshold, table["dla"]
        to_io = (table["end_to_io"] >= a) & (table["end_to_io"] > table["end_to_s"])
        to_s = (table["end_to_s"] >= a) & (table["end_to_s"] > table["end_to_io"])
        to_s2 = (table["end_to_s2"] >= a) & (table["end_to_s2"] > table["end_to_io"])
        rules = {
            "name mover": (to_io & (dla >= d), "dla"),
            "negative name mover": (to_io & (dla <= -d), "dla"),
            "S suppression": (to_s & (dla >= d), "dla"),
            "S mover": (to_s & (dla <= -d), "dla"),
            "S-inhibition": (to_s2 & (dla.abs() < d), "end_to_s2"),
            "duplicate token": (table["s2_to_s1"] >= a, "s2_to_s1"),
            "induction": (table["s2_to_s1_plus1"] >= a, "s2_to_s1_plus1"),
            "previous token": (table["s1_plus1_to_s1"] >= a, "s1_plus1_to_s1"),
        }
        parts = []
        for role in ROLES:
            mask, column = rules[role]
            part = table[mask].copy()
            part.insert(0, "score", part[column])
            part.insert(0, "role", role)
            part.insert(0, "label", part.index)
            parts.append(part.sort_values("score", key=abs, ascending=False, kind="stable"))
        return pd.concat(parts, ignore_index=True)

    def roles_of(
        self,
        heads: Sequence[str],
        attention_threshold: float = 0.3,
        dla_threshold: float | None = None,
    ) -> dict[str, list[str]]:
        """``head -> [roles]`` for the labels ``heads`` (``[]`` for a head with none).

        Args:
            heads: Attention-head labels ``L{l}H{h}``.
            attention_threshold, dla_threshold: As in :meth:`roles`.
        """
        roles = self.roles(attention_threshold, dla_threshold)
        out: dict[str, list[str]] = {head: [] for head in heads}
        for head, role in zip(roles["label"], roles["role"], strict=True):
            if head in out:
                out[head].append(role)
        return out


def ioi_head_scores(
    model,
    dataset: IOIDataset,
    *,
    corrupted: bool = False,
    batch_size: int = 32,
    progress: bool = False,
) -> IOIHeadScores:
    """Every attention head's IOI attention scores and direct logit attribution.

    One ``run_with_cache`` per batch, caching only the attention patterns, ``z`` and the final
    norm's scale. ``attention[name][b, l, h]`` is ``pattern[l][b, h, q, k]`` at the query and key
    positions of :data:`ATTENTION_SCORES`; ``dla_io[b, l, h]`` is the head's output at END
    (``z[l][b, END, h] @ W_O[l, h]``, centred if the final norm is a LayerNorm, divided by its
    cached scale, times its weight) dotted with ``W_U[:, IO]``, and ``dla_s`` the same with
    ``W_U[:, S]``.

    Args:
        model: A ``HookedTransformer`` (original or converted) with causal attention.
        dataset: The prompts (:func:`make_ioi_dataset` or :meth:`IOIDataset.from_tokens`).
        corrupted: Score the corrupted prompts instead (positions as in the clean ones).
        batch_size: Prompts per forward pass.
        progress: Show a progress bar over batches.

    Returns:
        The :class:`IOIHeadScores`.

    Raises:
        ValueError: For bidirectional attention (the padding after END would be attended to).
        NotImplementedError: For a model whose residual stream is not a sum of head outputs
            (post-norm): direct logit attribution is undefined there.
    """
    if model.cfg.attention_dir != "causal":
        raise ValueError(
            "IOI head scores need causal attention (a next-token task; right padding would be "
            f"attended to); this model has attention_dir={model.cfg.attention_dir!r}."
        )
    require_additive_residual(model, "ioi_head_scores (direct logit attribution)")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}.")
    names_filter = attn_names_filter("pattern", "z") | exact_names_filter("ln_final.hook_scale")
    device = model.W_U.device
    parts: list[tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]] = []
    starts = range(0, len(dataset), batch_size)
    for start in tqdm(starts, desc="IOI head scores", disable=not progress):
        part = dataset.select(slice(start, start + batch_size))
        tokens = (part.corrupted_tokens if corrupted else part.tokens).to(device)
        with torch.inference_mode():
            parts.append(_batch_scores(model, part, tokens, names_filter))
    return IOIHeadScores(
        attention={name: torch.cat([p[1][name] for p in parts]) for name in ATTENTION_SCORES},
        dla_io=torch.cat([p[2] for p in parts]),
        dla_s=torch.cat([p[3] for p in parts]),
        logit_diff=torch.cat([p[0] for p in parts]),
    )


def _batch_scores(
    model, part: IOIDataset, tokens: torch.Tensor, names_filter
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """One batch: ``logit_diff [batch]``, ``{score: [batch, n_layers, n_heads]}``, ``dla_io``
    and ``dla_s`` (``[batch, n_layers, n_heads]``), on the CPU."""
    device = tokens.device
    logits, cache = model.run_with_cache(tokens, names_filter=names_filter)
    rows = torch.arange(len(part), device=device)
    end = part.end_pos.to(device)
    attention = {}
    for name, (query, key) in ATTENTION_SCORES.items():
        q, k = part.positions(query).to(device), part.positions(key).to(device)
        per_layer = [cache["pattern", li][rows, :, q, k] for li in range(model.cfg.n_layers)]
        attention[name] = torch.stack(per_layer, 1).cpu()  # [batch, n_layers, n_heads]
    ln_final = getattr(model, "ln_final", None)
    if "ln_final.hook_scale" in cache.cache_dict:
        scale = cache["ln_final.hook_scale"][rows, end]  # [batch, 1]
    else:  # no final norm
        scale = torch.ones(len(part), 1, dtype=model.W_U.dtype, device=device)
    centre = isinstance(ln_final, LayerNorm | LayerNormPre)
    weight = getattr(ln_final, "w", None)
    directions = []
    for token in (part.io_token, part.s_token):
        direction = model.W_U[:, token.to(device)].T  # [batch, d_model]
        directions.append(direction if weight is None else direction * weight)
    dla_io, dla_s = [], []
    for li in range(model.cfg.n_layers):
        z = cache["z", li][rows, end]  # [batch, n_heads, d_head]
        out = torch.einsum("bhd,hdm->bhm", z, model.blocks[li].attn.W_O)
        if centre:
            out = out - out.mean(-1, keepdim=True)
        out = out / scale[:, None]
        dla_io.append(torch.einsum("bhm,bm->bh", out, directions[0]))
        dla_s.append(torch.einsum("bhm,bm->bh", out, directions[1]))
    return (
        part.logit_diff(logits).cpu(),
        attention,
        torch.stack(dla_io, 1).cpu(),
        torch.stack(dla_s, 1).cpu(),
    )


__all__ = [
    "ATTENTION_SCORES",
    "CORRUPTIONS",
    "IOI_NAMES",
    "IOI_OBJECTS",
    "IOI_PLACES",
    "IOI_TEMPLATES",
    "IOI_TEMPLATES_HELDOUT",
    "ROLES",
    "IOIDataset",
    "IOIHeadScores",
    "ioi_head_scores",
    "make_ioi_dataset",
]
