"""Hook names, labels and pattern helpers for neuron-heads.

TransformerLens's :func:`~transformer_lens.utils.get_act_name` sends ``"pattern"``, ``"z"``, ...
to the attention layer (``blocks.{l}.attn``); neuron-heads live at ``blocks.{l}.mlp``, so they are
reached by full name. These helpers build those names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Literal, NamedTuple, Protocol

import torch
from jaxtyping import Float
from transformer_lens import HookedRootModule

from tl_attnonly._types import Kinds, check_kinds
from tl_attnonly.components.neuron_heads import NEURON_HEAD_HOOKS

#: Neuron-head hook -> shape, for docs and checks.
NEURON_HOOK_SHAPES = {
    "pre": "[batch, pos, d_mlp]  (gated MLPs: the gate g)",
    "pre_linear": "[batch, pos, d_mlp]  (gated MLPs only: the linear branch u)",
    "q": "[batch, pos, n_neuron_heads, 1]",
    "k": "[batch, pos, n_neuron_heads, 1]",
    "v": "[batch, pos, n_neuron_heads, 1]",
    "attn_scores": "[batch, n_neuron_heads, query_pos, 2]  (self, bias)",
    "pattern": "[batch, n_neuron_heads, query_pos, 2]  (self, bias)",
    "z": "[batch, pos, n_neuron_heads, 1]",
    "result": "[batch, pos, n_neuron_heads, d_model]  (after set_use_neuron_result(True))",
    "post": "[batch, pos, d_mlp]",
}

_ALIASES = {"scores": "attn_scores", "attn": "pattern", "queries": "q", "keys": "k", "values": "v"}

#: Default memory budget for dense patterns (bytes).
DENSE_PATTERN_BUDGET = 2**30


def neuron_act_name(kind: str, layer: int) -> str:
    """Full hook name of a neuron-head activation.

    Args:
        kind: One of ``pre, pre_linear (gated MLPs), q, k, v, attn_scores (or scores), pattern,
            z, result, post``.
        layer: Layer index.

    Returns:
        E.g. ``neuron_act_name("pattern", 3) == "blocks.3.mlp.hook_pattern"``.
    """
    return _hook_name(layer, "mlp", neuron_hook_kind(kind))


def neuron_hook_kind(kind: str) -> str:
    """The neuron-head hook that ``kind`` names, aliases resolved (``"scores"``: ``attn_scores``).

    Raises:
        ValueError: For a kind that no neuron-head hook has.
    """
    kind = _ALIASES.get(kind, kind)
    if kind not in NEURON_HOOK_SHAPES:
        raise ValueError(
            f"Unknown neuron-head activation {kind!r}; expected one of "
            f"{sorted(NEURON_HOOK_SHAPES)}."
        )
    return kind


def head_act_name(kind: str, layer: int, head_kind: str) -> str:
    """Hook name of a per-head activation of either kind of head.

    Args:
        kind: The activation (``"z"``, ``"q"``, ``"v"``, ``"pattern"``, ...).
        layer: Layer index.
        head_kind: ``"attn"`` (``blocks.{layer}.attn``) or ``"neuron"`` (``blocks.{layer}.mlp``).

    Returns:
        E.g. ``head_act_name("z", 2, "neuron") == "blocks.2.mlp.hook_z"``.
    """
    if head_kind == "neuron":
        return neuron_act_name(kind, layer)
    if head_kind != "attn":
        raise ValueError(f"head_kind must be 'attn' or 'neuron', got {head_kind!r}.")
    return _hook_name(layer, "attn", _ALIASES.get(kind, kind))


def block_act_name(kind: str, layer: int) -> str:
    """Hook name of a block-level activation: ``block_act_name("resid_post", 3)``."""
    return _hook_name(layer, "", kind)


def hook_kind(name: str) -> str:
    """The activation a per-layer hook name holds: ``hook_kind("blocks.3.mlp.hook_z") == "z"``.

    Raises:
        ValueError: For a name that is not ``blocks.{l}[.{sublayer}].hook_{kind}``.
    """
    match = _HOOK_RE.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a per-layer hook name (blocks.{{l}}...hook_{{kind}}).")
    return match.group(3)


def _hook_name(layer: int, sublayer: str, kind: str) -> str:
    """``blocks.{layer}.{sublayer}.hook_{kind}`` (no sublayer: ``blocks.{layer}.hook_{kind}``)."""
    return f"blocks.{layer}.{sublayer + '.' if sublayer else ''}hook_{kind}"


def neuron_head_hook_names(layer: int) -> list[str]:
    """Every neuron-head hook name of one layer (``q, k, v, attn_scores, pattern, z, result``)."""
    return [neuron_act_name(kind, layer) for kind in NEURON_HEAD_HOOKS]


def neuron_head_label(layer: int, head: int, n_heads_per_neuron: int = 1) -> str:
    """Label of a neuron-head: ``L3N1024``, or ``L3N1024.2`` when neurons have several heads."""
    neuron, k = divmod(head, n_heads_per_neuron)
    return f"L{layer}N{neuron}" if n_heads_per_neuron == 1 else f"L{layer}N{neuron}.{k}"


def dense_neuron_pattern(
    pattern: Float[torch.Tensor, "batch n_neuron_heads query_pos 2"],
    heads: Sequence[int] | torch.Tensor | slice | None = None,
    max_bytes: int = DENSE_PATTERN_BUDGET,
) -> Float[torch.Tensor, "batch head query_pos key_pos_plus_1"]:
    """Expand compact neuron-head patterns to TransformerLens's dense layout.

    The bias token is key position 0; real key ``j`` is position ``1 + j``. Each query row has its
    weight on itself at ``1 + query_pos`` and its weight on the bias token at 0; every other entry
    is 0 (the mask of Theorem 3).

    Not for circuitsvis: its rows are the ``query_pos`` real tokens but its keys are
    ``1 + query_pos``, so every self weight lies above the diagonal, which circuitsvis's views mask
    (they would draw no self weight, mislabelled, without an error). Draw neuron-heads with
    :func:`tl_attnonly.vis.neuron_head_attention_view`, or pass
    :func:`tl_attnonly.vis.circuitsvis_pattern_args` to circuitsvis's own views (square
    ``[head, 1 + pos, 1 + pos]`` patterns with the bias token as a first query row too).

    Args:
        pattern: Compact pattern from ``blocks.{l}.mlp.hook_pattern``, last axis (self, bias).
        heads: Which neuron-heads to expand (indices, a slice, or a bool/long tensor); default all.
        max_bytes: Refuse to allocate more than this; pass a subset of ``heads`` or raise it.

    Returns:
        ``[batch, len(heads), query_pos, 1 + query_pos]``.
    """
    if pattern.shape[-1] != 2:
        raise ValueError(
            f"Expected a compact neuron-head pattern [batch, head, query_pos, 2], got "
            f"{tuple(pattern.shape)}."
        )
    if heads is not None:
        pattern = pattern[:, heads]
    batch, n_heads, n_pos, _ = pattern.shape
    size = batch * n_heads * n_pos * (n_pos + 1) * pattern.element_size()
    if size > max_bytes:
        raise MemoryError(
            f"A dense pattern for {n_heads} neuron-heads x {n_pos} positions needs "
            f"{size / 2**30:.2f} GiB (budget {max_bytes / 2**30:.2f} GiB). Pass heads=[...] for "
            "a subset, or max_bytes=... to raise the budget."
        )
    dense = pattern.new_zeros(batch, n_heads, n_pos, n_pos + 1)
    dense[..., 0] = pattern[..., 1]
    dense[..., 1:].diagonal(dim1=-2, dim2=-1).copy_(pattern[..., 0])
    return dense


# ---------------------------------------------------------------------------------------------
# Head labels
# ---------------------------------------------------------------------------------------------

#: Hook names of TransformerLens attention heads (``blocks.{l}.attn.hook_{kind}``).
ATTN_HEAD_HOOKS = ("q", "k", "v", "attn_scores", "pattern", "z", "result")

_LABEL_RE = re.compile(r"^L(\d+)(H|N)(\d+)(?:\.(\d+))?$")
#: ``blocks.{l}.{sublayer}.hook_{kind}``; block-level hooks (``hook_resid_post``) have sublayer "".
#: ``blocks.{l}[.{sublayer}].hook_{kind}``; a sublayer may be dotted (``mlp.experts.3``).
_HOOK_RE = re.compile(r"^blocks\.(\d+)\.(?:([\w.]+?)\.)?hook_(\w+)$")


def _sublayer_matches(sublayer: str, rule: str) -> bool:
    """Whether a hook's sublayer (``mlp``, ``mlp.experts.3``) is a rule's: equal, or matched by
    the rule's ``*`` wildcards, each standing for one name without dots (``mlp.experts.*``)."""
    if "*" not in rule:
        return sublayer == rule
    return re.fullmatch(re.escape(rule).replace(r"\*", r"[^.]*"), sublayer) is not None


class HeadRef(NamedTuple):
    """One head of the attention-only model.

    Attributes:
        kind: ``"attn"`` for the model's own attention heads (``blocks.{l}.attn``), ``"neuron"``
            for neuron-heads (``blocks.{l}.mlp``).
        layer: Layer index.
        head: Head index within its layer: ``0 .. n_heads - 1`` for attention heads,
            ``0 .. n_neuron_heads - 1`` (``= neuron * K + k``) for neuron-heads.
    """

    kind: Literal["attn", "neuron"]
    layer: int
    head: int

    def label(self, n_heads_per_neuron: int = 1) -> str:
        """``L{l}H{h}`` for attention heads, :func:`neuron_head_label` for neuron-heads."""
        if self.kind == "attn":
            return attn_head_label(self.layer, self.head)
        return neuron_head_label(self.layer, self.head, n_heads_per_neuron)

    def act_name(self, kind: str) -> str:
        """Hook name of this head's activation ``kind``: ``HeadRef("neuron", 2, 7).act_name("z")``
        is ``"blocks.2.mlp.hook_z"`` (index the head axis with ``self.head``)."""
        return head_act_name(kind, self.layer, self.kind)


def attn_head_label(layer: int, head: int) -> str:
    """Label of an attention head, TransformerLens's style: ``L3H7``."""
    return f"L{layer}H{head}"


def parse_head_label(label: str | HeadRef, n_heads_per_neuron: int = 1) -> HeadRef:
    """The :class:`HeadRef` a label names: ``"L3H7"``, ``"L3N1024"`` or ``"L3N1024.2"``.

    Args:
        label: A label (or a :class:`HeadRef`, returned unchanged).
        n_heads_per_neuron: ``K`` of the model; ``"L3N1024.2"`` is head ``1024 * K + 2``.

    Raises:
        ValueError: For a malformed label, ``k >= K``, or a bare neuron label (``"L3N1024"``) when
            ``K > 1`` (it names a neuron, i.e. ``K`` heads: use :func:`neuron_head_refs`).
    """
    if isinstance(label, HeadRef):
        return label
    match = _LABEL_RE.match(label)
    if match is None:
        raise ValueError(
            f"Cannot parse head label {label!r}: expected 'L{{layer}}H{{head}}' (attention head), "
            "'L{layer}N{neuron}' or 'L{layer}N{neuron}.{k}' (neuron-head)."
        )
    layer, kind, index, k = match.groups()
    if kind == "H":
        if k is not None:
            raise ValueError(f"Attention-head labels have no '.k' suffix: {label!r}.")
        return HeadRef("attn", int(layer), int(index))
    if k is None:
        if n_heads_per_neuron != 1:
            raise ValueError(
                f"{label!r} names a neuron with {n_heads_per_neuron} heads; name one head as "
                f"'{label}.k' (k < {n_heads_per_neuron}) or expand the neuron with "
                "neuron_head_refs()."
            )
        return HeadRef("neuron", int(layer), int(index))
    if int(k) >= n_heads_per_neuron:
        raise ValueError(
            f"{label!r}: head {k} of a neuron, but the model has {n_heads_per_neuron} heads per "
            "neuron."
        )
    return HeadRef("neuron", int(layer), int(index) * n_heads_per_neuron + int(k))


def neuron_head_refs(layer: int, neuron: int, n_heads_per_neuron: int = 1) -> list[HeadRef]:
    """The ``K`` neuron-heads of one MLP neuron."""
    start = neuron * n_heads_per_neuron
    return [HeadRef("neuron", layer, h) for h in range(start, start + n_heads_per_neuron)]


class LayerCounts(Protocol):
    """A config's ``n_layers`` and ``n_heads`` (TransformerLens's config, or
    :class:`~tl_attnonly.protocol.ModelFacts`)."""

    @property
    def n_layers(self) -> int: ...
    @property
    def n_heads(self) -> int: ...


class HeadCounts(Protocol):
    """What :func:`all_head_refs` reads of a model: ``cfg.n_layers``, ``cfg.n_heads`` and
    ``n_neuron_heads``. An :class:`~tl_attnonly.protocol.AttnOnlyModel` and a converted
    ``HookedTransformer`` or ``HookedEncoder`` have them; this module names neither class (the
    converted models' modules import this one)."""

    @property
    def cfg(self) -> LayerCounts: ...
    @property
    def n_neuron_heads(self) -> int: ...


def all_head_refs(
    model: HeadCounts,
    kinds: Kinds = ("attn", "neuron"),
    layers: Iterable[int] | None = None,
) -> list[HeadRef]:
    """Every head of ``model``: attention heads of all layers first, then neuron-heads.

    This is the order used throughout :mod:`tl_attnonly.analysis` (it extends TransformerLens's
    ``get_full_resid_decomposition``, which lists attention heads before neurons).

    Args:
        model: An :class:`~tl_attnonly.AttnOnlyTransformer`, an analysis adapter
            (:func:`tl_attnonly.adapt.analysis_model`) or a converted ``TransformerBridge``.
        kinds: Which kinds of head, ``"attn"`` and/or ``"neuron"``.
        layers: Which layers; default all.

    Raises:
        TypeError: For a model without neuron-heads (not converted), with ``"neuron"`` in
            ``kinds``.
    """
    check_kinds(kinds)
    layer_list = list(range(model.cfg.n_layers)) if layers is None else list(layers)
    refs: list[HeadRef] = []
    if "attn" in kinds:
        refs += [HeadRef("attn", li, h) for li in layer_list for h in range(model.cfg.n_heads)]
    if "neuron" in kinds:
        n = _n_neuron_heads(model)
        refs += [HeadRef("neuron", li, h) for li in layer_list for h in range(n)]
    return refs


def _n_neuron_heads(model: HeadCounts) -> int:
    """``model.n_neuron_heads``; a converted ``TransformerBridge`` has none of its own, and its
    blocks' MLPs (the neuron-head layers, which the bridge's components forward to) say it."""
    n = getattr(model, "n_neuron_heads", None)
    if n is None:
        blocks = getattr(model, "blocks", None)
        n = getattr(blocks[0].mlp, "n_neuron_heads", None) if blocks else None
    if n is None:
        raise TypeError(
            f"This {type(model).__name__} has no neuron-heads: convert it first "
            "(tl_attnonly.convert(model); in place for a TransformerBridge)."
        )
    return int(n)


def head_labels(refs: Iterable[HeadRef], n_heads_per_neuron: int = 1) -> list[str]:
    """Labels of many heads (see :meth:`HeadRef.label`)."""
    return [ref.label(n_heads_per_neuron) for ref in refs]


# ---------------------------------------------------------------------------------------------
# names_filter presets
# ---------------------------------------------------------------------------------------------


def _layer_set(layers: None | int | Iterable[int]) -> frozenset[int] | None:
    if layers is None:
        return None
    if isinstance(layers, int):
        return frozenset([layers])
    return frozenset(int(layer) for layer in layers)


class NamesFilter:
    """A ``names_filter`` for ``run_with_cache`` that caches exactly the hooks it names.

    A filter is a union of *rules*: ``(sublayer, kind, layers)`` for per-layer hooks
    (``blocks.{l}.{sublayer}.hook_{kind}``; ``layers=None`` means every layer; a ``*`` in the
    sublayer stands for one name without dots: ``("mlp.experts.*", "post", None)`` is every
    expert's ``hook_post``) and exact names for
    anything else (``hook_embed``, ``ln_final.hook_scale``, ...). Filters combine with ``|``.
    Build them with the preset functions (:func:`neuron_names_filter`, :func:`head_names_filter`,
    :func:`decomposition_names_filter`, ...), never hand-write regexes.

    Example:
        >>> only = neuron_names_filter("pattern", layers=range(2, 4))  # patterns of layers 2-3
        >>> _, cache = model.run_with_cache(tokens, names_filter=only)
        >>> sorted(cache.keys())
        ['blocks.2.mlp.hook_pattern', 'blocks.3.mlp.hook_pattern']
    """

    def __init__(
        self,
        rules: Iterable[tuple[str, str, frozenset[int] | None]] = (),
        names: Iterable[str] = (),
    ):
        self.rules = tuple(rules)
        self.names = frozenset(names)

    def __call__(self, name: str) -> bool:
        if name in self.names:
            return True
        match = _HOOK_RE.match(name)
        if match is None:
            return False
        layer, sublayer, kind = int(match.group(1)), match.group(2) or "", match.group(3)
        return any(
            kind == r_kind
            and (r_layers is None or layer in r_layers)
            and _sublayer_matches(sublayer, r_sub)
            for r_sub, r_kind, r_layers in self.rules
        )

    def __or__(self, other: NamesFilter) -> NamesFilter:
        if not isinstance(other, NamesFilter):
            return NotImplemented
        return NamesFilter(self.rules + other.rules, self.names | other.names)

    def resolve(self, model: HookedRootModule) -> list[str]:
        """The hook names of ``model`` this filter selects, in the model's order."""
        return [name for name in model.hook_dict if self(name)]

    def __repr__(self) -> str:
        parts = [
            f"blocks.{'*' if layers is None else sorted(layers)}.{sub + '.' if sub else ''}"
            f"hook_{kind}"
            for sub, kind, layers in self.rules
        ] + sorted(self.names)
        return f"NamesFilter({', '.join(parts)})"


def neuron_names_filter(*kinds: str, layers: None | int | Iterable[int] = None) -> NamesFilter:
    """Neuron-head hooks only: ``blocks.{l}.mlp.hook_{kind}`` for ``l`` in ``layers``.

    On a model with mixtures of experts (no such hooks on a dense model), also each expert's and
    shared expert's ``hook_{kind}`` (``blocks.{l}.mlp.experts.{e}.hook_z``, ``[1, routed_tokens,
    ...]``) and the router's top-k indices (``hook_routing_indices`` or ``hook_expert_indices``,
    ``[tokens, top_k]``), which say which token each expert row is.

    Args:
        *kinds: Neuron-head hook kinds (``pre, q, k, v, attn_scores, pattern, z, result, post``;
            aliases as in :func:`neuron_act_name`).
        layers: A layer, an iterable of layers (``range(2, 4)``), or None for all layers.
    """
    if not kinds:
        raise ValueError("Name at least one kind, e.g. neuron_names_filter('pattern').")
    kinds_full = [neuron_hook_kind(kind) for kind in kinds]
    layer_set = _layer_set(layers)
    rules = [
        (sublayer, kind, layer_set)
        for kind in kinds_full
        for sublayer in ("mlp", "mlp.experts.*", "mlp.shared*")
    ]
    routers = [("mlp", kind, layer_set) for kind in ("routing_indices", "expert_indices")]
    return NamesFilter(rules + routers)


def attn_names_filter(*kinds: str, layers: None | int | Iterable[int] = None) -> NamesFilter:
    """Attention-head hooks only: ``blocks.{l}.attn.hook_{kind}`` (TransformerLens's names)."""
    if not kinds:
        raise ValueError("Name at least one kind, e.g. attn_names_filter('pattern').")
    kinds_full = [_ALIASES.get(kind, kind) for kind in kinds]
    bad = [kind for kind in kinds_full if kind not in ATTN_HEAD_HOOKS]
    if bad:
        raise ValueError(f"Unknown attention-head hooks {bad}; expected some of {ATTN_HEAD_HOOKS}.")
    layer_set = _layer_set(layers)
    return NamesFilter([("attn", kind, layer_set) for kind in kinds_full])


def head_names_filter(*kinds: str, layers: None | int | Iterable[int] = None) -> NamesFilter:
    """The same hooks of attention heads and neuron-heads: e.g. ``head_names_filter("z")``."""
    return attn_names_filter(*kinds, layers=layers) | neuron_names_filter(*kinds, layers=layers)


def exact_names_filter(*names: str) -> NamesFilter:
    """Exactly these hook names (e.g. ``"hook_embed"``, ``"ln_final.hook_scale"``)."""
    return NamesFilter(names=names)


#: An encoder's embedding hooks (token types) and embedding norm's scale: ``HookedEncoder``'s
#: ``BertEmbed`` and a BERT bridge's.
ENCODER_EMBEDDING_HOOKS = (
    "embed.hook_embed",
    "embed.hook_pos_embed",
    "embed.hook_token_type_embed",
    "embed.ln.hook_scale",
    "embed.hook_out",  # a BERT bridge's hook_embed is its embeddings' norm's output
    "pos_embed.hook_out",
    "token_type_embed.hook_out",
    "embed_ln.hook_scale",
)


def decomposition_names_filter(layers: None | int | Iterable[int] = None) -> NamesFilter:
    """What :func:`tl_attnonly.analysis.decompose_resid_heads` and head DLA need, nothing more.

    Embeddings (an encoder's token types too), the ``z`` of every attention head and
    neuron-head, the LayerNorm scales of every layer (to apply LN to a stack, as TransformerLens
    does; the scales of norms after each sublayer, and of a residual post-LN's norms and
    embedding norm, which the decomposition applies to the components written before them) and
    the residual stream after each block
    (for ``incl_remainder`` and checks) and block 0's input (the position embeddings where they have
    no hook: :attr:`~tl_attnonly.protocol.AttnOnlyModel.embed_hooks`): ``[batch, pos,
    n_neuron_heads, 1]`` per layer for the
    neuron-heads, never the ``[batch, pos, n_neuron_heads, d_model]`` results. On a model with
    mixtures of experts, what each expert's weighted contribution is read from: the experts'
    ``hook_post`` and ``hook_z`` (``[routed_tokens, ...]``), the routing hooks (``[tokens,
    top_k]``) and the shared experts' (and their gates') ``hook_out``.
    """
    layer_set = _layer_set(layers)
    rules = [
        # every layer's: a residual post-LN's norms (GPT-1, BERT) carry each earlier write
        ("ln1", "scale", None),
        ("ln2", "scale", None),
        ("ln1_post", "scale", None),  # norms after each sublayer: every earlier layer's
        ("ln2_post", "scale", None),
        # mixtures of experts (no such hooks on a dense model): experts, routing, shared experts
        ("mlp.experts.*", "post", layer_set),
        ("mlp.experts.*", "z", layer_set),
        ("mlp", "routing_indices", layer_set),
        ("mlp", "routing_weights", layer_set),
        ("mlp", "expert_indices", layer_set),
        ("mlp", "expert_weights", layer_set),
        ("mlp.shared*", "out", layer_set),
    ]
    return (
        head_names_filter("z", layers=layers)
        | NamesFilter(rules)
        | NamesFilter([("", "resid_post", layer_set)])
        | exact_names_filter("hook_embed", "hook_pos_embed", "ln_final.hook_scale")
        # an encoder's embeddings and their norm: HookedEncoder's BertEmbed, a BERT bridge's
        | exact_names_filter(*ENCODER_EMBEDDING_HOOKS)
        # positions without a hook of their own (XGLM on a bridge): block 0's input less embed
        | exact_names_filter("blocks.0.hook_resid_pre")
    )


__all__ = [
    "ATTN_HEAD_HOOKS",
    "DENSE_PATTERN_BUDGET",
    "NEURON_HOOK_SHAPES",
    "HeadCounts",
    "HeadRef",
    "LayerCounts",
    "NamesFilter",
    "all_head_refs",
    "attn_head_label",
    "attn_names_filter",
    "block_act_name",
    "decomposition_names_filter",
    "dense_neuron_pattern",
    "exact_names_filter",
    "head_act_name",
    "head_labels",
    "head_names_filter",
    "hook_kind",
    "neuron_act_name",
    "neuron_head_hook_names",
    "neuron_head_label",
    "neuron_head_refs",
    "neuron_hook_kind",
    "neuron_names_filter",
    "parse_head_label",
]
