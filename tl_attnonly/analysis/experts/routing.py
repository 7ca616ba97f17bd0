"""Expert neuron-heads in token space: hook names, the experts a block has, routing, activations.

How a routed expert's hooks see only its tokens (the experts' gather order, given back by the
router's top-k indices) and how a shared expert sees every token is told in
:mod:`tl_attnonly.analysis.experts`. Here: the hook names (:func:`routing_hook_name`,
:func:`expert_hook_name`), labels (:func:`expert_neuron_head_label`), the experts of a block
(:func:`moe_layer`, :func:`shared_experts`, :func:`resolve_expert`), the routing order
(:func:`routed_tokens`), an expert hook's rows back at their tokens (:func:`hook_rows`,
:func:`scatter_rows`), :func:`expert_activation`, and a layer's neuron-heads numbered
layer-wide, experts end to end (:func:`layer_heads`, :func:`layer_head_labels`,
:func:`expert_heads_as_dense`). Activation patching
(:mod:`.patching`) and dataset summaries (:mod:`tl_attnonly.analysis.summaries.experts`) read
experts through these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float, Int

from tl_attnonly.adapt import model_of_cache
from tl_attnonly.components.expert_facts import routed_slots
from tl_attnonly.protocol import AttnOnlyModel

#: The router's top-k expert indices under ``blocks.{l}.mlp``: ``[batch * pos, top_k]``.
ROUTING_HOOK = "hook_expert_indices"

#: What the ``expert`` arguments accept for a block's only shared expert.
SHARED = "shared"

#: An expert: a routed expert's index, or a shared expert's name (or :data:`SHARED`).
Expert = int | str

#: Hooks with the tokens first (``[tokens, d_mlp]``; a shared expert's may be ``[batch, pos,
#: d_mlp]``): a routed expert's (TransformerLens's MoE names: ``gate`` g, ``pre`` the linear
#: branch u) and a shared expert's (a dense layer's: ``pre`` the (gate) pre-activation,
#: ``pre_linear`` the linear branch of a gated one).
_TOKEN_FIRST = {"routed": ("gate", "pre", "post"), "shared": ("pre", "pre_linear", "post")}
#: Neuron-head hooks ``[1, routed, n_neuron_heads, d]`` (a shared expert's: every token).
_BATCHED = ("q", "k", "v", "z", "result")


#: The top-k indices the experts of a converted bridge get (mounted by the conversion on every
#: TransformerLens version; read first where present: TL 4's ``hook_expert_indices`` alias is not
#: the top-k indices on every family, e.g. Granite-MoE).
ROUTING_INDICES_HOOK = "hook_routing_indices"


def routing_hook_name(layer: int, model: AttnOnlyModel | None = None) -> str:
    """The hook of the top-k indices the experts of ``layer`` get: ``blocks.{layer}.mlp.
    hook_routing_indices`` where ``model`` has it (a converted bridge), else TransformerLens's
    ``blocks.{layer}.mlp.hook_expert_indices``."""
    indices = f"blocks.{layer}.mlp.{ROUTING_INDICES_HOOK}"
    if model is not None and indices in model.hook_dict:
        return indices
    return f"blocks.{layer}.mlp.{ROUTING_HOOK}"


def expert_hook_name(layer: int, expert: Expert, kind: str) -> str:
    """``blocks.{layer}.mlp.experts.{expert}.hook_{kind}`` (a routed expert) or
    ``blocks.{layer}.mlp.{expert}.hook_{kind}`` (a shared expert, by its name)."""
    where = f"experts.{expert}" if isinstance(expert, int) else expert
    return f"blocks.{layer}.mlp.{where}.hook_{kind}"


def expert_neuron_head_label(layer: int, expert: Expert, head: int, n_heads_per_neuron: int) -> str:
    """Label of an expert's neuron-head: ``L1E3N17`` (routed expert 3), ``L1SN17`` (the block's
    shared expert), ``L1E3N17.2`` with several heads per neuron."""
    neuron, k = divmod(head, n_heads_per_neuron)
    suffix = "" if n_heads_per_neuron == 1 else f".{k}"
    tag = f"E{expert}" if isinstance(expert, int) else "S"
    return f"L{layer}{tag}N{neuron}{suffix}"


def routed_tokens(
    top_k_index: Int[torch.Tensor, "tokens top_k"], expert: int
) -> Int[torch.Tensor, " routed"]:
    """The flattened token indices routed to ``expert``, in the experts' gather order.

    Both kinds gather ``torch.where(one_hot(top_k_index).permute(2, 1, 0)[expert])``: by top-k
    slot, then by token; position ``i`` of the expert's hooks is token ``routed_tokens(...)[i]``
    (``batch = token // pos``, ``pos = token % pos``).
    """
    return routed_slots(top_k_index, expert)[1]


def moe_layer(model: AttnOnlyModel, layer: int) -> Any:
    """The mixture-of-experts container of ``layer``, or ``ValueError`` naming what is there."""
    if not 0 <= layer < len(model.neuron_heads):
        raise ValueError(f"layer {layer} is out of range (the model has {model.cfg.n_layers}).")
    moe = model.neuron_heads[layer]
    if not getattr(moe, "is_mixture_of_experts", False):
        raise ValueError(
            f"blocks.{layer}.mlp is not a mixture of experts ({type(moe).__name__}): use "
            "the dense tools (get_act_patch_neuron_heads, the cache's blocks.{l}.mlp.hook_z)."
        )
    return moe


def shared_experts(moe: Any) -> dict[str, Any]:
    """A mixture of experts' shared experts' neuron-head layers, by the name the converted block
    holds them under (``blocks.{l}.mlp.{name}``): a bridge's ``BridgeNeuronHeadExperts.shared``
    (Qwen2-MoE ``shared_expert``, DeepSeek ``shared_experts``); none for TransformerLens's MoE."""
    return dict(getattr(moe, "shared", None) or {})


def resolve_expert(moe: Any, layer: int, expert: Expert) -> Expert:
    """``expert`` as the tools key it: a routed expert's index, or a shared expert's name
    (:data:`SHARED` resolved to the block's only one).

    Raises:
        ValueError: For an index out of range or a name the block has no shared expert under,
            naming the routed and shared experts it has.
    """
    n_routed = len(moe.expert_list())
    shared = shared_experts(moe)
    if isinstance(expert, str):
        if expert in shared:
            return expert
        if expert == SHARED and len(shared) == 1:
            return next(iter(shared))
    elif 0 <= expert < n_routed:
        return int(expert)
    names = ", ".join(repr(name) for name in shared)
    has_shared = (
        "no shared expert"
        if not shared
        else f"the shared expert {names} (also {SHARED!r})"
        if len(shared) == 1
        else f"the shared experts {names} (name one)"
    )
    raise ValueError(
        f"blocks.{layer}.mlp has {n_routed} experts (0 to {n_routed - 1}) and {has_shared}; got "
        f"expert {expert!r}."
    )


def resolve_experts(moe: Any, layer: int, experts: Sequence[Expert] | None) -> list[Expert]:
    """``experts`` resolved; ``None``: the routed experts, then the shared ones."""
    if experts is None:
        return [*range(len(moe.expert_list())), *shared_experts(moe)]
    return [resolve_expert(moe, layer, expert) for expert in experts]


def expert_layer(moe: Any, expert: Expert) -> Any:
    """The neuron-head layer of a resolved expert."""
    return moe.expert_list()[expert] if isinstance(expert, int) else shared_experts(moe)[expert]


def cached_routing(cache: Any, layer: int) -> Int[torch.Tensor, "tokens top_k"]:
    """The top-k indices the experts of ``layer`` got in the cache's run, ``[tokens, top_k]``
    (``hook_routing_indices`` where cached, else ``hook_expert_indices``)."""
    indices = f"blocks.{layer}.mlp.{ROUTING_INDICES_HOOK}"
    if indices in cache.cache_dict:
        return cache[indices]
    name = routing_hook_name(layer)
    if name not in cache.cache_dict:
        raise KeyError(
            f"The cache has no {name} (the router's top-k indices): cache it too "
            "(run_with_cache without a names_filter, or one that keeps it)."
        )
    return cache[name]


def expert_tokens(
    top_k_index: Int[torch.Tensor, "tokens top_k"] | None, expert: Expert, n_tokens: int
) -> Int[torch.Tensor, " rows"]:
    """The flattened tokens an expert's hook rows are: the routed tokens in gather order, or
    every token (a shared expert; ``top_k_index`` is then not read)."""
    if isinstance(expert, int):
        assert top_k_index is not None
        return routed_tokens(top_k_index, expert)
    return torch.arange(n_tokens)


def hook_rows(act: torch.Tensor, kind: str) -> torch.Tensor:
    """An expert hook's value with one row per token it saw, in the order it saw them:
    ``pattern`` gives the self weight ``[rows, n_neuron_heads]``; ``q, k, v, z``
    ``[rows, n_neuron_heads]``; ``result`` ``[rows, n_neuron_heads, d_model]``; the others
    ``[rows, d_mlp]``. A routed expert's leading 1 and a shared expert's ``[batch, pos]`` (or
    flattened tokens) are both flattened."""
    if kind == "pattern":  # [lead, n_neuron_heads, query_pos, 2]: self weight per query
        return act[..., 0].transpose(-1, -2).reshape(-1, act.shape[1])
    if kind in _BATCHED:  # [lead, pos, n_neuron_heads, d_head or d_model]
        rows = act.reshape(-1, *act.shape[-2:])
        return rows if kind == "result" else rows.squeeze(-1)
    return act.reshape(-1, act.shape[-1])  # [tokens, d_mlp]


def expert_activation(
    cache: Any,
    layer: int,
    expert: Expert,
    kind: str = "z",
    *,
    fill: float = float("nan"),
) -> Float[torch.Tensor, "batch pos ..."]:
    """An expert's activation from a ``run_with_cache`` cache, in token space.

    Args:
        cache: The ``ActivationCache`` of a converted model with mixtures of experts (both
            kinds); it must hold the expert's hook (and, for a routed expert,
            ``blocks.{l}.mlp.hook_expert_indices``).
        layer: The MoE layer.
        expert: A routed expert's index, or a shared expert's name (``"shared_expert"``,
            ``"shared_experts"``) or ``"shared"`` (the block's only shared expert).
        kind: ``z``, ``v``, ``q``, ``k`` (``[batch, pos, n_neuron_heads]``), ``result``
            (``[batch, pos, n_neuron_heads, d_model]``), or ``[batch, pos, d_mlp]``: for a routed
            expert ``gate``, ``pre`` (the linear branch), ``post`` (TransformerLens's MoE
            names); for a shared expert its own hooks' names ``pre`` (the gate's
            pre-activation), ``pre_linear`` (the linear branch, gated layers), ``post``.
        fill: The value at tokens not routed to a routed expert (NaN by default: the expert did
            not run there; use 0.0 for its contribution before the routing weight). A shared
            expert runs on every token.

    Returns:
        The activation at every ``(batch, pos)``; ``fill`` where the token is not routed to
        ``expert``.

    Raises:
        ValueError: For a layer that is not a mixture of experts, an unknown expert or kind.
        KeyError: If the cache lacks the expert's hook or the routing hook.
    """
    model = model_of_cache(cache, allow_experts=True)
    expert = resolve_expert(moe_layer(model, layer), layer, expert)
    group = "routed" if isinstance(expert, int) else "shared"
    kinds = (*_TOKEN_FIRST[group], *_BATCHED)
    if kind not in kinds:
        raise ValueError(
            f"kind={kind!r} is not supported for a {group} expert; supported: {sorted(kinds)} "
            "(a pattern has no token axis of its own: read hook_pattern's rows with "
            "routed_tokens)."
        )
    batch, pos = cache["hook_embed"].shape[:2]
    top_k_index = None
    if isinstance(expert, int):
        top_k_index = cached_routing(cache, layer)
        if batch * pos != top_k_index.shape[0]:
            raise ValueError(
                f"{routing_hook_name(layer)} has {top_k_index.shape[0]} tokens, hook_embed "
                f"{batch} x {pos}."
            )
    act = hook_rows(cache[expert_hook_name(layer, expert, kind)], kind)
    rows = expert_tokens(top_k_index, expert, batch * pos).to(act.device)
    if len(rows) != act.shape[0]:
        raise ValueError(
            f"{expert_hook_name(layer, expert, kind)} has {act.shape[0]} token rows; expected "
            f"{len(rows)} (hook_embed {batch} x {pos})."
        )
    return scatter_rows(act, rows, batch, pos, fill)


def experts_used(
    source: Any,
    tokens: Int[torch.Tensor, "batch pos"] | None = None,
    *,
    layers: Sequence[int] | None = None,
) -> dict[int, Int[torch.Tensor, "batch pos top_k"]]:
    """The experts each token was routed to, per mixture-of-experts layer, in a run.

    Routing is recomputed from each run's own input: a run on other tokens, or a patched run
    (its hooks change the residual stream the router reads), can route a token to other experts
    than the clean run did. Read the clean run's from its cache, and a patched run's from a
    cache of that run (``run_with_cache`` with the patch's hooks added, e.g. under
    ``model.hooks(fwd_hooks=...)``).

    Args:
        source: A ``run_with_cache`` cache holding ``blocks.{l}.mlp.hook_expert_indices``, or a
            converted model with mixtures of experts (then run on ``tokens``, caching only those
            hooks).
        tokens: The prompts ``[batch, pos]`` (with a model; with a cache, only to shape the
            result when the cache has no ``hook_embed``).
        layers: The MoE layers (default: every one).

    Returns:
        ``{layer: [batch, pos, top_k]}``: the router's top-k expert indices of every token, in
        the router's order (slot 0 first).

    Raises:
        ValueError: For a layer that is not a mixture of experts.
        KeyError: If the cache lacks a routing hook.
    """
    from tl_attnonly.adapt import analysis_model

    is_cache = hasattr(source, "cache_dict")
    model = model_of_cache(source) if is_cache else analysis_model(source)
    if layers is None:
        layers = [i for i, b in enumerate(model.blocks) if b.mlp.is_mixture_of_experts]
    for layer in layers:
        moe_layer(model, layer)
    if is_cache:
        cache = source
        if tokens is None:
            tokens = cache["hook_embed"][..., 0]
    else:
        if tokens is None:
            raise ValueError("experts_used(model, ...) needs the tokens to run.")
        names = {routing_hook_name(layer, model) for layer in layers}
        with torch.no_grad():
            _, cache = model.run_with_cache(tokens, names_filter=lambda name: name in names)
    shape = tuple(tokens.shape[:2])
    return {layer: cached_routing(cache, layer).reshape(*shape, -1) for layer in layers}


def layer_heads(model: AttnOnlyModel, layer: int) -> list[tuple[Expert | None, int]]:
    """A layer's neuron-heads in the order the layer-wide tools number them: ``(None, h)`` for a
    dense layer's; for a mixture of experts, its experts' end to end, ``(expert, h)`` with ``h``
    counted within the expert (routed experts in index order, then the shared ones by name)."""
    mlp = model.neuron_heads[layer]
    if not getattr(mlp, "is_mixture_of_experts", False):
        return [(None, h) for h in range(mlp.n_neuron_heads)]
    moe = moe_layer(model, layer)
    return [
        (expert, h)
        for expert in resolve_experts(moe, layer, None)
        for h in range(expert_layer(moe, expert).n_neuron_heads)
    ]


def layer_head_labels(model: AttnOnlyModel, layer: int, heads: Sequence[int]) -> list[str]:
    """The labels of heads ``heads`` of :func:`layer_heads`: ``L1N17`` (a dense layer's),
    ``L1E3N17`` (routed expert 3's), ``L1SN17`` (the shared expert's)."""
    from tl_attnonly.hooks import neuron_head_label

    numbered, K = layer_heads(model, layer), model.n_heads_per_neuron
    labels = []
    for head in heads:
        expert, h = numbered[head]
        labels.append(
            neuron_head_label(layer, h, K)
            if expert is None
            else expert_neuron_head_label(layer, expert, h, K)
        )
    return labels


def expert_heads_as_dense(
    cache: Any, layer: int, kind: str, n_pos: int
) -> Float[torch.Tensor, "batch ..."]:
    """A mixture-of-experts layer's neuron-heads (:func:`layer_heads`) in a dense layer's hook
    layout, in token space: ``pattern`` ``[batch, n_heads, pos, 2]``, ``z`` ``[batch, pos,
    n_heads, 1]``, ``post`` ``[batch, pos, n_neurons]`` (the experts' neurons end to end, in the
    same order), NaN where a token was not routed to the head's expert (it did not run there).

    Args:
        cache: A cache of the converted model holding every expert's (and shared expert's)
            ``hook_{kind}`` of ``layer`` and, for routed experts, the router's top-k indices.
        layer: The MoE layer.
        kind: ``"pattern"``, ``"z"`` or ``"post"``.
        n_pos: Positions per prompt (the batch is the cached tokens over ``n_pos``).

    Raises:
        ValueError: For another kind, or tokens that are not a multiple of ``n_pos``.
        KeyError: If the cache lacks a hook.
    """
    if kind not in ("pattern", "z", "post"):
        raise ValueError(f"kind must be 'pattern', 'z' or 'post', got {kind!r}.")
    model = model_of_cache(cache, allow_experts=True)
    experts = resolve_experts(moe_layer(model, layer), layer, None)  # layer_heads's order
    routing = cached_routing(cache, layer) if any(isinstance(e, int) for e in experts) else None
    columns = []
    for expert in experts:
        act = cache[expert_hook_name(layer, expert, kind)]
        if kind == "pattern":  # [lead, heads, query, 2] -> rows [lead * query, heads, 2]
            rows = act.transpose(1, 2).reshape(-1, act.shape[1], 2)
        elif kind == "post":  # [tokens, d_mlp] (a shared expert's: maybe [batch, pos, d_mlp])
            rows = hook_rows(act, kind)
        else:  # [lead, query, heads, 1]
            rows = act.reshape(-1, *act.shape[-2:])
        columns.append((expert, rows))
    n_tokens = routing.shape[0] if routing is not None else columns[0][1].shape[0]
    if n_tokens % n_pos:
        raise ValueError(f"{n_tokens} cached tokens are not whole prompts of {n_pos} positions.")
    batch = n_tokens // n_pos
    out = []
    for expert, rows in columns:
        tokens = expert_tokens(routing, expert, n_tokens).to(rows.device)
        out.append(scatter_rows(rows, tokens, batch, n_pos, float("nan")))  # [batch, pos, h, .]
    dense = torch.cat(out, dim=2)
    return dense.permute(0, 2, 1, 3) if kind == "pattern" else dense


def scatter_rows(
    act: Float[torch.Tensor, "rows ..."],
    rows: Int[torch.Tensor, " rows"],
    batch: int,
    pos: int,
    fill: float,
) -> Float[torch.Tensor, "batch pos ..."]:
    """Rows of ``act`` (an expert's hook rows, in its order) at their tokens ``rows``."""
    out = act.new_full((batch * pos, *act.shape[1:]), fill)
    out[rows] = act
    return out.reshape(batch, pos, *act.shape[1:])


__all__ = [
    "ROUTING_HOOK",
    "ROUTING_INDICES_HOOK",
    "SHARED",
    "Expert",
    "cached_routing",
    "expert_activation",
    "expert_heads_as_dense",
    "expert_hook_name",
    "expert_layer",
    "expert_neuron_head_label",
    "expert_tokens",
    "experts_used",
    "hook_rows",
    "layer_head_labels",
    "layer_heads",
    "moe_layer",
    "resolve_expert",
    "resolve_experts",
    "routed_tokens",
    "routing_hook_name",
    "scatter_rows",
    "shared_experts",
]
