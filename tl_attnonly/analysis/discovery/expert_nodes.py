"""A mixture-of-experts layer as nodes of its experts (:data:`~.graph.EXPERT`).

By default an expert layer is one node ``L{l}MLP`` (:data:`~.graph.EXPERTS`). Named in a graph's
``nodes`` (``coarse_nodes(model, experts=True)``, ``discover_circuit(..., expert_nodes=True)``),
its components are source nodes of their own: each routed expert ``L{l}E{e}`` writes its routing
weight times its output at the tokens routed to it (0 elsewhere), and each shared expert
``L{l}S`` its (gated) output; they sum to the layer's output ``hook_mlp_out``
(:func:`~tl_attnonly.analysis.experts.expert_components`). The layer keeps one input, ``L{l}MLP``
(its normalised input, which the router and every expert read), so every expert of the layer
reads the same edges, and the routing of a circuit's run is that run's own, as for the whole
layer.

**Expert neurons.** Named in ``nodes`` too, a component's neuron ``j`` is a source node of its
own (:data:`~.graph.EXPERT_NEURON`): ``L{l}E{e}N{j}`` (routed expert ``e``'s) or ``L{l}SN{j}``
(the shared expert's; ``L{l}S{k}N{j}`` where there are several), the labels
:func:`~tl_attnonly.analysis.summarize_neuron_heads` gives them. It writes its routing weight
times ``hook_post - b_post`` times its row of ``W_out`` at the tokens routed to its expert (a
shared expert's: its gated contribution at every token;
:func:`~tl_attnonly.analysis.experts.components.expert_neuron_activations`), and its expert's node
``L{l}E{e}`` becomes the expert's remainder (its weighted output less its named neurons'), as
``L{l}MLP`` is a dense layer's: the components still sum to ``hook_mlp_out``. The neurons read
the layer's one input ``L{l}MLP`` with its experts.

A component's value in a run is its weighted output vector (``[batch, pos, n, d_model]``), its
writing matrix the identity: the components write along any direction, and an expert's hidden
width is often as large as ``d_model`` (Mixtral: 14,336 against 4,096), so a run costs one
``[d_model, d_model]`` product per component and position, as the embeddings and a whole expert
layer do. An expert neuron's value is its coefficient (``[batch, pos, n, 1]``), its writing matrix
its row of ``W_out``, as a dense layer's neuron.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float

if TYPE_CHECKING:
    from tl_attnonly.protocol import AttnOnlyModel


#: An expert node's label: ``L{l}E{e}``, ``L{l}S``, ``L{l}S{j}`` (groups: the layer, the suffix).
EXPERT_LABEL = re.compile(r"^L(\d+)(E\d+|S\d*)$")
#: An expert neuron's label: ``L{l}E{e}N{j}``, ``L{l}SN{j}``, ``L{l}S{k}N{j}`` (groups: the
#: layer, its expert's suffix, the neuron).
EXPERT_NEURON_LABEL = re.compile(r"^L(\d+)(E\d+|S\d*)N(\d+)$")


class _Acts:
    """A run's recorded activations, read as :func:`~tl_attnonly.analysis.experts.
    expert_components` reads a cache (``cache_dict``, ``cache[name]``, ``cache.model``)."""

    def __init__(self, acts: dict[str, torch.Tensor], model: AttnOnlyModel) -> None:
        self.cache_dict, self.model = acts, model

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.cache_dict[name]


def expert_parts(model: AttnOnlyModel, layers: Any) -> tuple[tuple[str, ...], ...]:
    """Per expert layer of ``layers`` (in order), its components' label suffixes (``E0``, ...,
    ``S``)."""
    from tl_attnonly.analysis.experts.components import component_suffixes
    from tl_attnonly.analysis.experts.routing import moe_layer

    return tuple(tuple(component_suffixes(moe_layer(model, li))) for li in layers)


def expert_widths(model: AttnOnlyModel, layers: Any) -> tuple[tuple[int, ...], ...]:
    """Per expert layer of ``layers`` (in order), its components' neurons (:func:`expert_parts`'
    order)."""
    from tl_attnonly.analysis.experts.components import component_layer, component_suffixes
    from tl_attnonly.analysis.experts.routing import moe_layer

    out = []
    for li in layers:
        moe = moe_layer(model, li)
        n = len(component_suffixes(moe))
        out.append(tuple(int(component_layer(moe, c)[1].d_mlp) for c in range(n)))
    return tuple(out)


def expert_neuron_nodes(
    keep: Collection[str] | None,
    parts: Mapping[int, tuple[str, ...]],
    widths: Mapping[int, tuple[int, ...]],
) -> dict[int, tuple[str, ...]]:
    """Per expert layer, the expert neurons of ``keep`` it has (``parts``: layer -> its
    components' labels; ``widths``: layer -> their neurons), by component, then neuron; labels
    of neurons it does not have are left out."""
    found: dict[int, list[tuple[int, int, str]]] = {}
    for label in keep or ():
        match = EXPERT_NEURON_LABEL.match(label)
        if match is None:
            continue
        layer, j = int(match.group(1)), int(match.group(3))
        owner = f"L{layer}{match.group(2)}"
        if owner not in parts.get(layer, ()) or label != f"{owner}N{j}":
            continue
        c = parts[layer].index(owner)
        if c < len(widths.get(layer, ())) and j < widths[layer][c]:
            found.setdefault(layer, []).append((c, j, label))
    return {li: tuple(label for *_, label in sorted(v)) for li, v in sorted(found.items())}


def _neuron_of(model: AttnOnlyModel, layer: int, labels: Sequence[str]) -> list[tuple[int, int]]:
    """``(component, neuron)`` of each expert neuron label of ``layer``.

    Raises:
        ValueError: For a label that is not a neuron of one of the layer's experts.
    """
    (suffixes,) = expert_parts(model, [layer])
    (widths,) = expert_widths(model, [layer])
    out = []
    for label in labels:
        match = EXPERT_NEURON_LABEL.match(label)
        c, j = -1, -1
        if match is not None and int(match.group(1)) == layer and match.group(2) in suffixes:
            c, j = suffixes.index(match.group(2)), int(match.group(3))
        if c < 0 or j >= widths[c]:
            raise ValueError(
                f"{label!r} is not a neuron of layer {layer}'s experts "
                f"{[f'L{layer}{p}' for p in suffixes]} (with {list(widths)} neurons: "
                f"'L{layer}E0N5', 'L{layer}SN5')."
            )
        out.append((c, j))
    return out


def component_neuron_values(
    acts: dict[str, torch.Tensor], model: AttnOnlyModel, layer: int, component: int
) -> Float[torch.Tensor, "batch pos n"]:
    """Every neuron's coefficient on its row of ``W_out`` of one component of ``layer`` (index in
    :func:`expert_parts`' order) in the run of ``acts`` (its hooks: :func:`expert_source_hooks`
    with ``neurons``)."""
    from tl_attnonly.analysis.experts.components import expert_neuron_activations

    return expert_neuron_activations(_Acts(acts, model), layer, component)


def expert_neuron_values(
    acts: dict[str, torch.Tensor], model: AttnOnlyModel, layer: int, labels: Sequence[str]
) -> Float[torch.Tensor, "batch pos n 1"]:
    """Each expert neuron's coefficient on its row of ``W_out`` (:func:`expert_neuron_writer`)
    in the run of ``acts`` (its hooks: :func:`expert_source_hooks` with ``neurons``)."""
    per_component: dict[int, torch.Tensor] = {}  # [batch, pos, d_mlp] each
    columns = []
    for c, j in _neuron_of(model, layer, labels):
        if c not in per_component:
            per_component[c] = component_neuron_values(acts, model, layer, c)
        columns.append(per_component[c][..., j])
    return torch.stack(columns, -1).unsqueeze(-1)


def expert_neuron_writer(
    model: AttnOnlyModel, layer: int, labels: Sequence[str], like: torch.Tensor
) -> Float[torch.Tensor, "n 1 d_model"]:
    """Each expert neuron's row of its expert's ``W_out`` (``out_matrix``)."""
    from tl_attnonly.analysis.experts.components import component_layer
    from tl_attnonly.analysis.experts.routing import moe_layer

    moe = moe_layer(model, layer)
    rows = [component_layer(moe, c)[1].out_matrix[j] for c, j in _neuron_of(model, layer, labels)]
    return torch.stack(rows).unsqueeze(1).to(dtype=like.dtype, device=like.device)


def _neuron_sums(
    acts: dict[str, torch.Tensor], model: AttnOnlyModel, layer: int, labels: Sequence[str]
) -> Float[torch.Tensor, "batch pos n_components d_model"]:
    """What the expert neurons ``labels`` write in the run of ``acts``, summed per component."""
    values = expert_neuron_values(acts, model, layer, labels)[..., 0]  # [batch, pos, n]
    U = expert_neuron_writer(model, layer, labels, values)[:, 0]  # [n, d_model]
    owner = torch.tensor([c for c, _ in _neuron_of(model, layer, labels)], device=values.device)
    n = len(expert_parts(model, [layer])[0])
    onehot = torch.nn.functional.one_hot(owner, n).to(values.dtype)  # [n_neurons, n]
    return torch.einsum("bpu,uc,ud->bpcd", values, onehot, U)


def expert_source_hooks(model: AttnOnlyModel, layer: int, neurons: bool = False) -> list[str]:
    """The hooks a run records to read ``layer``'s components' outputs (with ``neurons``, their
    neurons' too)."""
    from tl_attnonly.analysis.experts.components import expert_component_hooks

    return expert_component_hooks(model, layer, neurons=neurons)


def expert_source_values(
    acts: dict[str, torch.Tensor],
    model: AttnOnlyModel,
    layer: int,
    named: Sequence[str] = (),
) -> Float[torch.Tensor, "batch pos n_components d_model"]:
    """Each component's weighted output in the run of ``acts`` (its hooks:
    :func:`expert_source_hooks`), less what its named neurons ``named`` write (the remainder)."""
    from tl_attnonly.analysis.experts.components import expert_components

    parts, _ = expert_components(_Acts(acts, model), layer)  # [n, batch, pos, d_model]
    parts = parts.permute(1, 2, 0, 3)
    if named:
        parts = parts - _neuron_sums(acts, model, layer, named).to(parts.dtype)
    return parts


def component_index(model: AttnOnlyModel, label: str) -> tuple[int, int] | None:
    """``(layer, component)`` of an expert node label (``L1E3``, ``L1S``), or None for another
    label."""
    match = EXPERT_LABEL.match(label)
    if match is None:
        return None
    layer = int(match.group(1))
    (parts,) = expert_parts(model, [layer])
    if match.group(2) not in parts:
        raise ValueError(f"{label}: layer {layer}'s experts are {[f'L{layer}{p}' for p in parts]}.")
    return layer, parts.index(match.group(2))


def expert_neuron_layer(label: str) -> int | None:
    """The layer of an expert neuron label (``L1E3N5``, ``L1SN5``), or None for another label."""
    match = EXPERT_NEURON_LABEL.match(label)
    return None if match is None else int(match.group(1))


def _patched(
    acts: dict[str, torch.Tensor],
    model: AttnOnlyModel,
    layer: int,
    which: list[int],
    neurons: Sequence[str],
) -> Float[torch.Tensor, "batch pos d_model"]:
    """What components ``which`` and expert neurons ``neurons`` of ``layer`` write together in
    the run of ``acts`` (a neuron of a component in ``which`` is counted with it, not again)."""
    total = expert_source_values(acts, model, layer)[:, :, which].sum(2)
    owners = _neuron_of(model, layer, neurons)
    own = [n for n, (c, _) in zip(neurons, owners, strict=True) if c not in which]
    if own:
        total = total + _neuron_sums(acts, model, layer, own).sum(2).to(total.dtype)
    return total


def expert_patch_hooks(
    model: AttnOnlyModel,
    layer: int,
    which: list[int],
    clean: dict[str, torch.Tensor],
    neurons: Sequence[str] = (),
) -> list[tuple[str, Any]]:
    """Hooks that patch the clean outputs of components ``which`` and expert neurons ``neurons``
    of ``layer`` into a run: the layer's output becomes the run's own less what they write in
    the run plus what they write in the clean run (``clean``: the clean run's
    :func:`expert_source_hooks`, with ``neurons`` where there are some)."""
    names = expert_source_hooks(model, layer, neurons=bool(neurons))
    acts: dict[str, torch.Tensor] = {}
    want = _patched(clean, model, layer, which, neurons)

    def record(act: torch.Tensor, hook: Any) -> torch.Tensor:
        acts[hook.name] = act
        return act

    out_name = f"blocks.{layer}.hook_mlp_out"

    def patch(act: torch.Tensor, hook: Any) -> torch.Tensor:
        acts[out_name] = act
        own = _patched(acts, model, layer, which, neurons)
        return act - own.to(act.dtype) + want.to(act.dtype)

    return [(n, record) for n in names if n != out_name] + [(out_name, patch)]


def expert_writer(
    n: int, like: torch.Tensor, d_model: int
) -> Float[torch.Tensor, "n d_model d_model"]:
    """``[n, d_model, d_model]``: the identity for each of ``n`` components (a view)."""
    eye = torch.eye(d_model, dtype=like.dtype, device=like.device)
    return eye.unsqueeze(0).expand(n, d_model, d_model)


__all__ = [
    "EXPERT_LABEL",
    "EXPERT_NEURON_LABEL",
    "component_index",
    "component_neuron_values",
    "expert_neuron_layer",
    "expert_neuron_nodes",
    "expert_neuron_values",
    "expert_neuron_writer",
    "expert_parts",
    "expert_patch_hooks",
    "expert_source_hooks",
    "expert_source_values",
    "expert_widths",
    "expert_writer",
]
