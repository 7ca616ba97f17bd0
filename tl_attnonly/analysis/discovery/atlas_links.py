"""The page of a circuit's node in a neuron atlas (:mod:`tl_attnonly.atlas`'s site), the one rule
every link from a circuit uses: :meth:`~.circuit.Circuit.to_graph_json`'s ``vis_link``,
:meth:`~.circuit.Circuit.report`'s list of pages and the circuit figures' labels
(:mod:`tl_attnonly.vis`).

A named neuron ``L{l}N{i}`` (and each of its neuron-heads ``L{l}N{i}.{k}``) links to
``{atlas}/neuron.html#L{l}N{i}``; every other MLP node of layer ``l`` (its remainder or whole layer
``L{l}MLP``, a mixture of experts' ``L{l}E{e}`` / ``L{l}S``) to ``{atlas}/layer_{l}.html``;
attention nodes, the embeddings and the logits to nothing.

``atlas`` is what the page should link to: a string is used as it is (a URL, or a path relative to
where the page that holds the link is opened from), a :class:`~pathlib.Path` (any
``os.PathLike``) becomes the absolute ``file://`` URI of that folder, which works from wherever
the page is saved on the same machine.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from tl_attnonly.analysis.discovery.counts import kind_layer
from tl_attnonly.analysis.discovery.graph import EMBED, LOGITS

#: A neuron's or neuron-head's label: ``L{l}N{i}`` or ``L{l}N{i}.{k}``.
_NEURON = re.compile(r"^L(\d+)N(\d+)(?:\.\d+)?$")

#: What ``atlas=`` takes: a URL or relative path (``str``) or a folder (``os.PathLike``).
AtlasLocation = str | os.PathLike


def atlas_url(atlas: AtlasLocation) -> str:
    """The base URL of an atlas site, without a trailing ``/``.

    Args:
        atlas: A URL or a path relative to the linking page (a ``str``, kept as it is), or the
            site's folder (an ``os.PathLike``: its absolute ``file://`` URI).

    Returns:
        The URL the pages' names are appended to.
    """
    if isinstance(atlas, os.PathLike):
        return Path(atlas).resolve().as_uri().rstrip("/")
    return str(atlas).rstrip("/")


def atlas_page(label: str, atlas: AtlasLocation) -> str | None:
    """The URL of node ``label``'s page in the atlas ``atlas`` (module docstring), or ``None``
    for a node with no page (an attention node, the embeddings, the logits).

    Args:
        label: A circuit node's label (``L1N34``, ``L1N34.2``, ``L1MLP``, ``L1H0``, ...).
        atlas: Where the atlas is (:func:`atlas_url`).

    Raises:
        ValueError: For a string that is not a node label.
    """
    if label in (EMBED, LOGITS) or kind_layer(label)[0] != "neuron":
        return None
    layer = kind_layer(label)[1]
    neuron = _NEURON.match(label)
    page = f"neuron.html#L{layer}N{neuron.group(2)}" if neuron else f"layer_{layer}.html"
    return f"{atlas_url(atlas)}/{page}"


def atlas_pages(labels: Iterable[str], atlas: AtlasLocation) -> dict[str, str]:
    """``{label: page URL}`` of the labels that have an atlas page (:func:`atlas_page`), in the
    order given."""
    pages = {label: atlas_page(label, atlas) for label in labels}
    return {label: url for label, url in pages.items() if url is not None}


__all__ = ["AtlasLocation", "atlas_page", "atlas_pages", "atlas_url"]
