"""Links from the circuit figures' node labels to a neuron atlas's pages (``atlas=`` of
:func:`~tl_attnonly.vis.circuit.circuit_figure` and
:func:`~tl_attnonly.vis.neuron_circuit.neuron_circuit_figure`).

Each node with an atlas page (:func:`~tl_attnonly.analysis.discovery.atlas_links.atlas_page`: a
named neuron its ``neuron.html#L{l}N{i}``, an MLP layer node its ``layer_{l}.html``) gets its
label drawn as ``<a href="URL">L1N34</a>`` (placed as the plain label is: the markup takes no
room, :func:`~tl_attnonly.vis.circuit.text_size`), a hover line ``atlas page: URL``, and an entry
in the figure's ``layout.meta["atlas_links"]`` (label -> URL).

plotly.js draws the ``<a>`` but keeps its ``href`` only for ``http:``, ``https:`` and ``mailto:``
URLs (its ``sanitizeHref``), so a link to an atlas on disk (a ``file://`` URL, or a relative one
in a page opened from ``file://``) is dropped by plotly itself. :func:`link_script` is the
figure's own handler: clicking a linked label, or the node's marker (also where the label had no
room), opens the page in a new tab. :func:`~tl_attnonly.vis.save_figure` and the demo report add
it to the HTML they write; with plotly's own ``fig.write_html(path,
post_script=link_script(fig))`` too.
"""

from __future__ import annotations

import html
from typing import Any

import plotly.graph_objects as go

from tl_attnonly.analysis.discovery.atlas_links import AtlasLocation, atlas_pages

#: The key of ``layout.meta`` that holds a figure's links (label -> URL).
LINKS_META = "atlas_links"
#: The handler :func:`link_script` gives (``{plot_id}``: the figure's ``div``, as plotly's
#: ``post_script`` substitutes it).
LINK_SCRIPT = """(function () {
  var gd = document.getElementById("{plot_id}");
  var links = (gd.layout.meta || {}).atlas_links || {};
  function open(label) {
    var url = links[label];
    if (url) { window.open(url, "_blank"); }
    return Boolean(url);
  }
  gd.addEventListener("click", function (event) {
    var a = event.target.closest ? event.target.closest(".textpoint a") : null;
    if (a && open(a.textContent)) { event.preventDefault(); event.stopPropagation(); }
  }, true);
  gd.on("plotly_click", function (data) {
    var point = data.points && data.points[0];
    if (point) { open(point.customdata); }
  });
})();"""


def link_nodes(
    placed: dict[str, tuple[str, str]],
    marker: dict[str, tuple[float, float, str]],
    atlas: AtlasLocation | None,
) -> dict[str, str]:
    """Link the nodes that have an atlas page, in place: each one's placed label (``placed``:
    label -> ``(text, position)``, the text starting with the label, ``""`` when on hover only)
    becomes ``<a href="URL">label</a>`` and the rest of the text, and its hover text (the third
    of ``marker``'s ``(size, opacity, hover)``) gains a line ``atlas page: URL``.

    Args:
        placed: What :func:`~tl_attnonly.vis.circuit.place_labels` chose per node.
        marker: Each node's marker size, opacity and hover text.
        atlas: Where the atlas is (:func:`~tl_attnonly.analysis.discovery.atlas_links.atlas_url`);
            None links nothing.

    Returns:
        ``{label: URL}`` of the nodes linked.
    """
    pages = {} if atlas is None else atlas_pages(placed, atlas)
    for label, url in pages.items():
        text, position = placed[label]
        if text:
            text = f'<a href="{html.escape(url)}">{label}</a>{text.removeprefix(label)}'
        placed[label] = (text, position)
        size, opacity, hover = marker[label]
        marker[label] = (size, opacity, f"{hover}<br>atlas page: {html.escape(url)}")
    return pages


def set_links(fig: go.Figure, pages: dict[str, str]) -> go.Figure:
    """``fig`` with ``pages`` (label -> URL) in ``layout.meta["atlas_links"]`` (none: unchanged)."""
    if pages:
        meta = dict(fig.layout.meta or {})
        fig.update_layout(meta={**meta, LINKS_META: pages})
    return fig


def link_script(fig: Any) -> str | None:
    """The JavaScript that opens a linked node's atlas page on a click of its label or marker, as
    plotly's ``to_html`` / ``write_html`` take it (``post_script=``); None for a figure without
    links (module docstring)."""
    meta = getattr(getattr(fig, "layout", None), "meta", None)
    return LINK_SCRIPT if isinstance(meta, dict) and meta.get(LINKS_META) else None


__all__ = ["LINKS_META", "LINK_SCRIPT", "link_nodes", "link_script", "set_links"]
