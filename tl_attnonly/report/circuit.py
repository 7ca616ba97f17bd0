"""The report's circuit section: ``discover_circuit`` on the report's prompt pair, its figure and
its faithfulness against size on MIB's grid of sizes, with CPR and CMD.

The task is the report's attribution-patching task: the prompt against its corrupted version
(by default its tokens reversed), the metric the mean log-probability of the prompt's own next
tokens. The circuit is found with ``discover_circuit``'s defaults.
"""

from __future__ import annotations

import html
import os
import warnings
from pathlib import Path

import pandas as pd
import torch

from tl_attnonly.analysis import Circuit, discover_circuit
from tl_attnonly.analysis.discovery.atlas_links import AtlasLocation, atlas_url
from tl_attnonly.analysis.discovery.counts import circuit_counts, counts_text
from tl_attnonly.protocol import AttnOnlyModel
from tl_attnonly.report.page import df_html, plotly_html
from tl_attnonly.vis import circuit_figure, faithfulness_curve_figure

#: The curve's columns the report's table shows.
CURVE_COLUMNS = ["fraction", "edges", "metric", "faithfulness"]


def next_token_metric(tokens: torch.Tensor):
    """``metric(logits)``: the mean log-probability of ``tokens``' own next tokens
    (``tokens [1, pos]``; the report's attribution-patching metric)."""
    clean_ids = tokens[:, 1:]

    def metric(logits: torch.Tensor) -> torch.Tensor:
        logprobs = logits[:, :-1].log_softmax(-1)
        return logprobs.gather(-1, clean_ids.to(logits.device).unsqueeze(-1)).mean()

    return metric


def check_atlas(atlas: AtlasLocation | None, model: AttnOnlyModel) -> None:
    """Refuse an atlas folder (an ``os.PathLike``) that holds no finished atlas site (its
    ``index.html`` and manifest ``atlas.json``), or the atlas of a model of another shape than
    ``model`` (every field of :func:`~tl_attnonly.atlas.build.model_manifest` but the name); a
    string (a URL) is linked to unchecked.

    Raises:
        ValueError: Naming the option ``atlas`` and what is wrong.
    """
    if not isinstance(atlas, os.PathLike):
        return
    from tl_attnonly.atlas.build import model_manifest
    from tl_attnonly.atlas.site import read_manifest

    folder = Path(atlas)
    if not (folder / "index.html").is_file():
        raise ValueError(f"atlas={str(folder)!r}: no neuron atlas site there (no index.html).")
    try:
        there = read_manifest(folder)["manifest"]
    except FileNotFoundError as err:
        raise ValueError(
            f"atlas={str(folder)!r}: {err} Write one with tl_attnonly.atlas.build_atlas."
        ) from err
    mine = model_manifest(model)
    differ = [key for key in mine if key != "model_name" and there.get(key) != mine[key]]
    if differ:
        raise ValueError(
            f"atlas={str(folder)!r} is the atlas of another model ({there.get('model_name')}: "
            + ", ".join(f"{key} {there.get(key)} here {mine[key]}" for key in differ)
            + "); pass this model's atlas."
        )


def circuit_section(
    model: AttnOnlyModel,
    tokens: torch.Tensor,
    corrupted: torch.Tensor,
    how: str,
    atlas: AtlasLocation | None = None,
) -> str:
    """The section's HTML: the circuit ``discover_circuit`` finds for the prompt pair, or the
    refusal's reason where the model cannot be discovered (a post-LN residual stream).

    Args:
        model: The adapted model (:func:`~tl_attnonly.adapt.analysis_model`).
        tokens, corrupted: ``[1, pos]``, the prompt and its corrupted version.
        how: How ``corrupted`` was made, in words.
        atlas: Where a neuron atlas of the model is (a URL or relative path as a string, a
            folder as a ``Path``: its ``file://`` URI): the figure's MLP nodes (named neurons
            and whole layers) and a list of them under it link to their atlas pages
            (:meth:`~tl_attnonly.analysis.Circuit.atlas_pages`), and the circuit's report lists
            them.
    """
    metric = next_token_metric(tokens)
    if torch.equal(tokens, corrupted):  # e.g. one token after BOS, reversed: the same prompt
        return (
            '<p class="note">Skipped: the corrupted run is the prompt itself '
            f"({html.escape(how)}), so there is no behaviour for a circuit to carry.</p>"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its warnings are in its report, shown below
            circuit = discover_circuit(model, tokens, corrupted, metric, progress=False)
    except NotImplementedError as refusal:  # what the maths rules out, said by the refusal
        reason = html.escape(str(refusal).split(". ")[0])
        return f'<p class="note">discover_circuit does not run on this model: {reason}.</p>'
    except ZeroDivisionError as same:  # the metric does not tell the two runs apart
        return f'<p class="note">Skipped: {html.escape(str(same))}</p>'
    intro = (
        '<p class="note">The circuit <code>tl_attnonly.analysis.discover_circuit</code> finds, '
        "with its defaults, for the prompt against a corrupted run "
        f"({html.escape(how)}), the metric being the mean log-probability of the prompt's own "
        f"next tokens: {html.escape(counts_text(circuit_counts(circuit)))}; faithfulness "
        f"{circuit.faithfulness:.3f} (exact run: 1 is the model, 0 the corrupted run). Its "
        "nodes are attention heads and whole MLP layers, each layer a group of neuron-heads of "
        "the attention-only model (the circuit's report says how to name neurons in them).</p>"
    )
    parts = [intro, plotly_html(circuit_figure(circuit, atlas=atlas))]
    if atlas is not None:
        parts.append(_atlas_note(circuit, atlas))
    if "mib_curve" in circuit.extra:
        cpr, cmd = circuit.extra["mib_cpr"], circuit.extra["mib_cmd"]
        parts += [
            "<h3>Faithfulness against size (MIB's grid)</h3>",
            '<p class="note">The top-k circuits of the same edge ranking at MIB\'s edge '
            f"fractions, each by an exact run: CPR {cpr:.3f} (the area under the faithfulness "
            f"curve; higher recovers more), CMD {cmd:.3f} (the area under |1 - faithfulness|; "
            "lower is closer to the model).</p>",
            plotly_html(faithfulness_curve_figure(circuit)),
            df_html(pd.DataFrame(circuit.extra["mib_curve"])[CURVE_COLUMNS]),
        ]
    parts.append(
        "<details><summary>The circuit's report (<code>circuit.report()</code>)</summary>"
        f'<pre class="prompt">{html.escape(circuit.report(atlas=atlas))}</pre></details>'
    )
    return "\n".join(parts)


def _atlas_note(circuit: Circuit, atlas: AtlasLocation) -> str:
    """A paragraph of links to the circuit's nodes' atlas pages."""
    pages = circuit.atlas_pages(atlas)
    links = ", ".join(
        f'<a href="{html.escape(url)}">{html.escape(label)}</a>' for label, url in pages.items()
    )
    where = f"the neuron atlas (<code>{html.escape(atlas_url(atlas))}</code>)"
    if not links:
        return f'<p class="note">No node of this circuit has a page in {where}: no MLP node.</p>'
    return (
        f'<p class="note">Pages of its MLP nodes in {where}: {links}. In the figure, click a '
        "node's label or marker to open its page.</p>"
    )


__all__ = ["CURVE_COLUMNS", "check_atlas", "circuit_section", "next_token_metric"]
