"""One self-contained HTML report of a converted model on one prompt (``tl-attnonly demo``).

The page embeds its JavaScript (plotly.js and circuitsvis's bundle, once each), so it opens offline
from a file. Sections (:data:`REPORT_SECTIONS`): the equivalence table, the neuron-head attention
patterns of each layer (circuitsvis, the bias token drawn as the first token ``<bias>``; a
mixture-of-experts layer: its routing, :func:`~tl_attnonly.vis.expert_routing_heatmap`), the
neuron-head activity strips (dense layers), an attribution-patching heatmap over every head (the
attention heads and the dense layers' neuron-heads), the circuit ``discover_circuit`` finds for the
same task with its faithfulness against size on MIB's grid (:mod:`.circuit`; with ``atlas=``, its
MLP nodes linked to their pages in a neuron atlas of the model), and the GELU-fit error curves.

One report for both model kinds: an :class:`~tl_attnonly.AttnOnlyTransformer` (TransformerLens
3.x) and a ``TransformerBridge`` converted with :func:`tl_attnonly.convert` (3.x and 4.x). The
model is read through :func:`tl_attnonly.adapt.analysis_model`, and every figure comes from the
analysis and vis tools, which take either kind.
"""

from __future__ import annotations

import html
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.offline import get_plotlyjs

from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.discovery.atlas_links import AtlasLocation
from tl_attnonly.analysis.patching.dense_layers import expert_layers
from tl_attnonly.hooks import (
    NEURON_HOOK_SHAPES,
    head_names_filter,
    neuron_act_name,
    neuron_head_label,
)
from tl_attnonly.protocol import AttnOnlyModel
from tl_attnonly.report.circuit import check_atlas, circuit_section, next_token_metric
from tl_attnonly.report.page import (
    CSS,
    DEFERRED_TYPE,
    NO_DECOMPRESSION,
    PACKED_TYPE,
    Steps,
    deferred,
    df_html,
    packed,
    plotly_html,
)
from tl_attnonly.verify import REFERENCE_NAMES
from tl_attnonly.vis import (
    BIAS_TOKEN,
    NeuronHeadView,
    circuitsvis_js,
    expert_routing_heatmap,
    gelu_fit_error_figure,
    neuron_head_attention_view,
    neuron_head_strips,
    patching_heatmap,
    script_safe,
)

#: Neuron-heads per layer in the report's (self, bias) strips.
REPORT_TOP_K = 32
#: Neuron-heads per layer in the report's square circuitsvis views (a few: the strips show many).
REPORT_SQUARE_K = 4


#: The report's sections, in order (their ``<section id>``), the same for both model kinds.
REPORT_SECTIONS = ("equivalence", "patterns", "activity", "patching", "circuit", "gelu")


def write_demo_report(
    model: Any,
    converted: Any,
    prompt: str,
    path: str | Path,
    *,
    equivalence: dict[str, pd.DataFrame] | None = None,
    top_k: int = REPORT_TOP_K,
    square_k: int = REPORT_SQUARE_K,
    corrupted_prompt: str | None = None,
    model_name: str | None = None,
    progress: bool = True,
    atlas: AtlasLocation | None = None,
) -> Path:
    """Write one self-contained HTML report of ``converted`` on ``prompt``.

    Args:
        model: The model before conversion (a ``HookedTransformer``, or an unconverted
            ``TransformerBridge`` of the same weights), for the equivalence table; may be
            ``None`` when ``equivalence`` is given.
        converted: Its :class:`~tl_attnonly.AttnOnlyTransformer`, or the converted bridge.
        prompt: Text to run the models on.
        path: Where to write the ``.html`` file (parent directories are created).
        equivalence: Equivalence tables already computed (title -> DataFrame of
            :func:`tl_attnonly.verify.equivalence_table`, e.g. each
            :class:`~tl_attnonly.verify.Verdict`'s ``table``); default: computed here in the
            models' dtype.
        top_k: Neurons per layer in the per-token (self, bias) strips (most active first).
        square_k: Neuron-heads per layer in the square circuitsvis pattern views.
        corrupted_prompt: Corrupted run for the attribution-patching and circuit sections;
            default: the prompt's tokens in reverse order (same length, BOS kept).
        model_name: The title's model name; default: ``converted.cfg.model_name``.
        progress: Show a progress bar over the report's steps.
        atlas: Where a neuron atlas of the model is (:mod:`tl_attnonly.atlas`): a URL or a path
            relative to the report's page (a string, linked to as it is), or the site's folder (a
            ``Path``: its ``file://`` URI; checked first). The circuit section's figure and text
            link its MLP nodes to their pages (:func:`~.circuit.circuit_section`).

    Returns:
        The path written.

    Raises:
        TypeError: If ``converted`` has no neuron-heads (with directions).
        ValueError: If ``converted`` has no tokenizer, neither ``model`` nor ``equivalence``
            is given, or ``atlas`` is a folder that holds no atlas site or the atlas of a model
            of another shape (:func:`~.circuit.check_atlas`).
    """
    adapted = analysis_model(converted)  # refuses, with directions, a model without neuron-heads
    if adapted.tokenizer is None:
        raise ValueError("The report needs a model with a tokenizer (to show the prompt's tokens).")
    if model is None and equivalence is None:
        raise ValueError(
            "Pass the model before conversion (model=...) or the equivalence tables "
            "(equivalence=...): the report's first section compares the two."
        )
    check_atlas(atlas, adapted)
    if model_name is None:
        model_name = str(getattr(converted.cfg, "model_name", None) or type(converted).__name__)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n_layers = adapted.cfg.n_layers
    experts = expert_layers(adapted)
    dense = [layer for layer in range(n_layers) if layer not in experts]
    steps = Steps(total=6 + n_layers, enabled=progress)
    sections: list[tuple[str, str, str]] = []  # (anchor, title, body html)
    reference = REFERENCE_NAMES.get(adapted.kind, "original")

    with steps.step("equivalence table"):
        if equivalence is None:
            from tl_attnonly.verify import equivalence_table

            dtype = str(adapted.cfg.dtype).removeprefix("torch.")
            equivalence = {dtype: equivalence_table(model, converted, prompt)}
        sections.append(
            (
                "equivalence",
                f"Equivalence with the {reference}",
                _equivalence(equivalence, reference),
            )
        )

    with steps.step("run with cache"):
        tokens = adapted.to_tokens(prompt)
        str_tokens = [str(t) for t in adapted.to_str_tokens(prompt)]  # one prompt: strings
        names = {neuron_act_name(kind, lay) for kind in ("pattern", "z") for lay in dense}
        names |= {name for layer in experts for name in _routing_names(adapted, layer)}
        with torch.inference_mode():
            _, cache = adapted.run_with_cache(tokens, names_filter=lambda n: n in names)

    views: list[NeuronHeadView | go.Figure] = []
    for layer in range(n_layers):
        with steps.step(f"circuitsvis view, layer {layer}"):
            if layer in experts:
                views.append(expert_routing_heatmap(cache, layer, str_tokens))
                continue
            views.append(
                neuron_head_attention_view(
                    cache, layer, str_tokens, top_k=square_k, page_size=square_k
                )
            )
    sections.append(
        ("patterns", "Neuron-head attention patterns (circuitsvis)", _views(views, adapted))
    )

    with steps.step("activity strips"):
        strips = [neuron_head_strips(cache, layer, str_tokens, top_k=top_k) for layer in dense]
        sections.append(
            (
                "activity",
                "Neuron-head activity over tokens",
                _activity_intro(sorted(experts)) + "".join(plotly_html(fig) for fig in strips),
            )
        )

    corrupted, how = _corrupted(adapted, tokens, corrupted_prompt)
    with steps.step("attribution patching"):
        patching = how if corrupted is None else _patching(adapted, tokens, corrupted, how, dense)
        sections.append(("patching", "Attribution patching of every head", patching))

    with steps.step("circuit discovery"):
        found = (
            how if corrupted is None else circuit_section(adapted, tokens, corrupted, how, atlas)
        )
        sections.append(("circuit", "A circuit of the prompt (discover_circuit)", found))

    with steps.step("GELU-fit curves"):
        sections.append(("gelu", "GELU as neuron-heads: fit error", _gelu(adapted)))
    steps.close()

    page = _page(adapted, model_name, prompt, str_tokens, sections)
    path.write_text(page, encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------------
# sections
# ------------------------------------------------------------------------------------------------
def _equivalence(tables: dict[str, pd.DataFrame], reference: str) -> str:
    parts = [
        '<p class="note">Maximum and mean absolute difference between the converted model and the '
        f"{html.escape(reference)}, on the prompt, for the logits and every activation the two "
        "models share. The converted model computes each MLP neuron as attention heads; the "
        "differences are floating-point rounding (for an approximated activation, GELU or ReLU, "
        "also the approximation's error).</p>"
    ]
    for title, df in tables.items():
        parts.append(f"<h3>{html.escape(str(title))}</h3>")
        parts.append(df_html(df))
    return "\n".join(parts)


def _routing_names(model: AttnOnlyModel, layer: int) -> tuple[str, ...]:
    """What :func:`~tl_attnonly.vis.expert_routing_heatmap` reads of a mixture of experts: the
    router's top-k indices (the model's own hook of them), the weights, the block's input."""
    from tl_attnonly.analysis.experts import routing_hook_name, routing_weights_hook_name

    return (
        routing_hook_name(layer, model),
        routing_weights_hook_name(layer),
        f"blocks.{layer}.hook_resid_pre",
    )


def _views(views: Sequence[NeuronHeadView | go.Figure], model: AttnOnlyModel) -> str:
    k = model.n_heads_per_neuron
    labels = (
        "Heads are labelled <code>L{layer}N{neuron}</code>."
        if k == 1
        else f"Each neuron is {k} heads, labelled <code>L{{layer}}N{{neuron}}.{{k}}</code>."
    )
    intro = (
        '<p class="note">Each MLP neuron is a neuron-head: an attention head of internal dimension '
        "1 that sees two keys, its own token and a <b>bias token</b>, drawn here as the first "
        f"token "
        f"<code>{html.escape(BIAS_TOKEN)}</code>. A query row puts <code>sigmoid(q)</code> on "
        "itself (the diagonal) and the rest on the bias token (column 0); for SiLU, "
        "<code>q = pre</code>, so <i>attends to itself</i> means <i>the neuron fires</i>. "
        f"{labels} "
        "Click a head to enlarge it; hover over a cell for its weight. Each view shows the few "
        "most active heads of the layer (largest |z|, the neuron's activation); the strips below "
        "show many more, and in a notebook "
        "<code>neuron_head_attention_view(..., page=...)</code> pages through all of them.</p>"
    )
    parts = [intro]
    for layer, view in enumerate(views):
        if isinstance(view, go.Figure):
            parts.append(f"<h3>Layer {layer}: a mixture of experts</h3>")
            parts.append(
                '<p class="note">Each expert\'s neurons are neuron-heads too, but an expert sees '
                "only the tokens routed to it, so the layer has no pattern over the whole prompt. "
                "Below: the weight each token gave each expert (blank: not routed there; routing "
                "is recomputed in every run from its own input). The experts' neuron-heads: "
                "<code>tl_attnonly.analysis.experts</code> (<code>expert_activation</code>, "
                "<code>summarize_expert_neuron_heads</code>, "
                "<code>get_act_patch_expert_neuron_heads</code>).</p>"
            )
            parts.append(plotly_html(view))
            continue
        div_id = f"cv-layer-{view.layer}"
        parts.append(f"<h3>Layer {view.layer}</h3>")
        parts.append(f'<p class="note">{html.escape(view.caption)}</p>')
        parts.append(f'<div id="{div_id}" class="circuitsvis"></div>')
        parts.append(f"<script>{view.render_call(div_id)}</script>")
    return "\n".join(parts)


def _activity_intro(experts: Sequence[int] = ()) -> str:
    skipped = (
        f" Layers {', '.join(map(str, experts))} are mixtures of experts (their routing is drawn "
        "above): not drawn here."
        if experts
        else ""
    )
    return (
        '<p class="note">A compact view of many neuron-heads: each head is a strip of two rows '
        "over the tokens, its weight on the token itself (red; 1: the neuron is on) and on the "
        "bias token (grey; 1: the neuron is off). These two numbers are all a neuron-head's "
        "pattern holds; the square views above draw the same numbers for a few heads. Most active "
        f"heads first; hover for <code>z</code>.{skipped}</p>"
    )


def _corrupted(
    model: AttnOnlyModel, tokens: torch.Tensor, corrupted_prompt: str | None
) -> tuple[torch.Tensor | None, str]:
    """The corrupted run's tokens and how they were made, or ``(None, why not)``."""
    if corrupted_prompt is None:
        corrupted = tokens.clone()
        start = 1 if model.cfg.default_prepend_bos else 0
        corrupted[:, start:] = tokens[:, start:].flip(-1)
        return corrupted, "the prompt's tokens in reverse order"
    corrupted = model.to_tokens(corrupted_prompt)
    if corrupted.shape != tokens.shape:
        return None, (
            f'<p class="note">Skipped: the corrupted prompt has {corrupted.shape[-1]} tokens, '
            f"the prompt {tokens.shape[-1]}; patching needs equal lengths.</p>"
        )
    return corrupted, "the corrupted prompt given"


def _patching(
    model: AttnOnlyModel,
    tokens: torch.Tensor,
    corrupted: torch.Tensor,
    how: str,
    dense: Sequence[int],
) -> str:
    from tl_attnonly.analysis.patching.attribution import attribution_patch

    metric = next_token_metric(tokens)
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    z_filter = head_names_filter("z")
    z_names = {name for name in model.hook_dict if z_filter(name)}  # the adapter's: read once
    with torch.inference_mode():
        _, clean_cache = model.run_with_cache(tokens, names_filter=lambda n: n in z_names)
    scores, _ = attribution_patch(model, clean_cache, corrupted, metric)
    scores = scores.detach().float().cpu()
    n_attn = n_layers * n_heads
    attn = scores[:n_attn].reshape(n_layers, n_heads)
    name = "est. change of mean log p(clean next token)"
    figures = plotly_html(patching_heatmap(attn, title="Attention heads", value_name="effect"))
    if dense:  # the dense layers' neuron-heads (an expert layer has none of its own)
        figures += _neuron_patching(model, scores[n_attn:], dense)
    else:
        figures += (
            '<p class="note">Every MLP is a mixture of experts: patch the experts\' '
            "neuron-heads with <code>tl_attnonly.analysis.experts."
            "get_act_patch_expert_neuron_heads</code>.</p>"
        )
    return (
        '<p class="note">Attribution patching (Nanda 2023): a first-order estimate, for every '
        f"head at once, of how much patching its clean <code>z</code> into a corrupted run ({how}) "
        f"changes the metric ({name}). Attention heads and neuron-heads are treated alike. "
        "Confirm the largest with <code>tl_attnonly.analysis.get_act_patch_all_heads</code> "
        "(exact).</p>" + figures
    )


def _neuron_patching(model: AttnOnlyModel, scores: torch.Tensor, dense: Sequence[int]) -> str:
    """The heatmap of the dense layers' neuron-heads' estimates ``scores`` (in
    :func:`~tl_attnonly.hooks.all_head_refs` order) and the largest of them."""
    width = model.neuron_heads[dense[0]].n_neuron_heads
    neuron = scores.reshape(len(dense), width)
    neuron_fig = patching_heatmap(
        neuron,
        layer_labels=list(dense),
        title="Neuron-heads (x axis: neuron-head index)",
        value_name="effect",
    )
    neuron_fig.update_xaxes(type="linear")
    top = neuron.abs().flatten().topk(min(10, neuron.numel()))
    k = model.n_heads_per_neuron
    rows = []
    for flat in top.indices.tolist():
        row, head = divmod(flat, width)
        label = neuron_head_label(dense[row], head, k)
        rows.append({"neuron-head": label, "effect": neuron[row, head].item()})
    return plotly_html(neuron_fig) + "<h3>Largest neuron-heads</h3>" + df_html(pd.DataFrame(rows))


def _gelu(model: AttnOnlyModel) -> str:
    from tl_attnonly.activations import SUPPORTED_ACTIVATIONS, activation_error_table

    ks = (1, 2, 3, 4)
    fig = gelu_fit_error_figure(ks=ks, n_points=241)  # steps of 0.05: smooth, and a smaller page
    # only the rows the page discusses: GELU at the K drawn, and this model's own activation
    # (one the table lists: GPT-OSS's scaled SiLU, x sigmoid(alpha x), is one exact head)
    gelu = activation_error_table("gelu", max_heads=max(ks))
    coefs = model.neuron_heads[0].coefficients
    act = coefs.activation  # identified by value on a bridge; the config's act_fn otherwise
    tables = [gelu]
    if act != "gelu" and act in SUPPORTED_ACTIVATIONS:
        tables.insert(0, activation_error_table(act, max_heads=max(ks)))
    table = pd.concat(tables, ignore_index=True)
    return (
        f'<p class="note">This model\'s activation is <code>{html.escape(str(act))}</code>: each '
        f"neuron is {coefs.n_heads} head(s) ({html.escape(str(coefs.method))}). SiLU is exactly "
        "one head (weight on self = sigmoid(x), value = x); GELU is not, and is approximated by a "
        "sum of K heads. Below: GELU and the K-head approximations the conversion uses, and their "
        "error (every activation: <code>tl_attnonly.activation_error_table()</code>).</p>"
        + plotly_html(fig)
        + "<h3>Error per activation and K</h3>"
        + df_html(table)
    )


# ------------------------------------------------------------------------------------------------
# page
# ------------------------------------------------------------------------------------------------
def _page(
    model: AttnOnlyModel,
    model_name: str,
    prompt: str,
    str_tokens: list[str],
    sections: list[tuple[str, str, str]],
) -> str:
    cfg = model.cfg
    act = model.neuron_heads[0].coefficients.activation
    hooks = "".join(
        f"<tr><td><code>blocks.{{l}}.mlp.hook_{html.escape(kind)}</code></td>"
        f"<td><code>{html.escape(shape)}</code></td></tr>"
        for kind, shape in NEURON_HOOK_SHAPES.items()
    )
    summary = (
        f"<p>A {html.escape(model.kind)}: {cfg.n_layers} layers, d_model {cfg.d_model}, "
        f"{cfg.n_heads} attention heads per layer, "
        f"d_mlp {cfg.d_mlp} neurons per layer ({html.escape(str(act))}) = "
        f"<b>{model.n_neuron_heads} neuron-heads per layer</b> "
        f"({model.n_heads_per_neuron} per neuron){_experts_note(model)}. Prompt "
        f"({len(str_tokens)} tokens):</p>"
        f'<pre class="prompt">{html.escape(prompt)}</pre>'
        '<details><summary>Neuron-head hooks</summary><table class="df"><tr><th>hook</th>'
        f"<th>shape</th></tr>{hooks}</table></details>"
    )
    nav = " ".join(f'<a href="#{a}">{html.escape(t)}</a>' for a, t, _ in sections)
    body = "\n".join(
        f'<section id="{a}"><h2>{html.escape(t)}</h2>\n{b}\n</section>' for a, t, b in sections
    )
    generated = time.strftime("%Y-%m-%d %H:%M")
    libraries = {
        "Plotly": script_safe(get_plotlyjs()),
        "CircuitsVis": circuitsvis_js() + "\n;window.CircuitsVis = CircuitsVis;",
    }
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8">\n'
        f"<title>tl-attnonly report: {html.escape(model_name)}</title>\n"
        f"<style>{CSS}</style>\n"
        "</head><body>\n"
        f"{NO_DECOMPRESSION}\n"
        f"<h1>Every MLP neuron as an attention head: {html.escape(model_name)}</h1>\n"
        f"{summary}\n<nav>{nav}</nav>\n{deferred(body)}\n"
        f'<p class="note">Generated by tl-attnonly on {generated}. After Huben &amp; Morris '
        "(2023), arXiv 2309.08593.</p>\n"
        f"{packed(libraries)}\n</body></html>\n"
    )


def _experts_note(model: AttnOnlyModel) -> str:
    """``"; layers 0, 1 are mixtures of experts"`` or ``""``."""
    experts = sorted(expert_layers(model))
    listed = ", ".join(map(str, experts))
    return f"; layers {listed} are mixtures of experts" if experts else ""


__all__ = [
    "DEFERRED_TYPE",
    "PACKED_TYPE",
    "REPORT_SECTIONS",
    "REPORT_SQUARE_K",
    "REPORT_TOP_K",
    "write_demo_report",
]
