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

A component's value in a run is its weighted output vector (``[batch, pos, n, d_model]``), its
writing matrix the identity: the components write along any direction, and an expert's hidden
width is often as large as ``d_model`` (Mixtral: 14,336 against 4,096), so a run costs one
``[d_model, d_model]`` product per component and position, as the embeddings and a whole expert
layer do.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tl_attnonly.protocol import AttnOnlyModel


#: An expert node's label: ``L{l}E{e}``, ``L{l}S``, ``L{l}S{j}`` (groups: the layer, the suffix).
EXPERT_LABEL = re.compile(r"^L(\d+)(E\d+|S\d*)$")


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


def expert_source_hooks(model: AttnOnlyModel, layer: int) -> list[str]:
    """The hooks a run records to read ``layer``'s components' outputs."""
    from tl_attnonly.analysis.experts.components import expert_component_hooks

    return expert_component_hooks(model, layer)


def expert_source_values(
    acts: dict[str, torch.Tensor], model: AttnOnlyModel, layer: int
) -> torch.Tensor:
    """``[batch, pos, n_components, d_model]``: each component's weighted output in the run of
    ``acts`` (its hooks: :func:`expert_source_hooks`)."""
    from tl_attnonly.analysis.experts.components import expert_components

    parts, _ = expert_components(_Acts(acts, model), layer)  # [n, batch, pos, d_model]
    return parts.permute(1, 2, 0, 3)


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


def expert_patch_hooks(
    model: AttnOnlyModel, layer: int, which: list[int], clean: dict[str, torch.Tensor]
) -> list[tuple[str, Any]]:
    """Hooks that patch the clean outputs of components ``which`` of ``layer`` into a run: the
    layer's output becomes the run's own less those components' outputs in the run plus theirs
    in the clean run (``clean``: the clean run's :func:`expert_source_hooks`)."""
    names = expert_source_hooks(model, layer)
    acts: dict[str, torch.Tensor] = {}
    want = expert_source_values(clean, model, layer)[:, :, which].sum(2)

    def record(act: torch.Tensor, hook: Any) -> torch.Tensor:
        acts[hook.name] = act
        return act

    out_name = f"blocks.{layer}.hook_mlp_out"

    def patch(act: torch.Tensor, hook: Any) -> torch.Tensor:
        acts[out_name] = act
        own = expert_source_values(acts, model, layer)[:, :, which].sum(2)
        return act - own.to(act.dtype) + want.to(act.dtype)

    return [(n, record) for n in names if n != out_name] + [(out_name, patch)]


def expert_writer(n: int, like: torch.Tensor, d_model: int) -> torch.Tensor:
    """``[n, d_model, d_model]``: the identity for each of ``n`` components (a view)."""
    eye = torch.eye(d_model, dtype=like.dtype, device=like.device)
    return eye.unsqueeze(0).expand(n, d_model, d_model)


__all__ = [
    "EXPERT_LABEL",
    "component_index",
    "expert_parts",
    "expert_patch_hooks",
    "expert_source_hooks",
    "expert_source_values",
    "expert_writer",
]
