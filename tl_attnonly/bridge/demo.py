"""Verify a converted TransformerBridge against the unconverted one, and a small HTML report.

What ``tl-attnonly demo`` runs on TransformerLens 4.x (and on 3.x with ``--bridge``): the
HookedTransformer-based checks (:mod:`tl_attnonly.verify`) and report (:mod:`tl_attnonly.report`)
need an ``AttnOnlyTransformer``; these take a bridge and need only the bridge's hooks, pandas and
plotly, so they work on both TransformerLens versions.

* :func:`verify_bridge_conversion`: per dtype, a fresh bridge is run unconverted, converted in
  place and run again; logits and every shared hook group are compared (a PASS/FAIL verdict on the
  logits, as :func:`tl_attnonly.verify.verify_conversion` gives for a HookedTransformer).
* :func:`write_bridge_report`: one self-contained HTML page: the equivalence tables and, per
  layer, the (self, bias) attention weights of the most active neuron-heads over the prompt's
  tokens (plotly, from ``blocks.{l}.mlp.hook_pattern``). The circuitsvis views, attribution
  patching and GELU-fit sections of the full report are TransformerLens 3.x only (they read an
  ``AttnOnlyTransformer``).
"""

from __future__ import annotations

import html
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go
import torch
from jaxtyping import Float

from tl_attnonly.activations import NeuronHeadCoefficients
from tl_attnonly.bridge.convert import convert_bridge, neuron_head_layers, unconvert_bridge
from tl_attnonly.bridge.modules import BridgeGatedNeuronHeadMLP
from tl_attnonly.options import ConversionOptions
from tl_attnonly.verify import Verdict

#: Shared hook groups compared (name -> regex on the bridge's hook names); the same groups as
#: :data:`tl_attnonly.verify.HOOK_GROUPS`.
BRIDGE_HOOK_GROUPS = {
    "resid_pre": r"blocks\.\d+\.hook_resid_pre$",
    "attn_out": r"blocks\.\d+\.hook_attn_out$",
    "resid_mid": r"blocks\.\d+\.hook_resid_mid$",
    "mlp pre": r"blocks\.\d+\.mlp\.hook_pre$",
    "mlp post": r"blocks\.\d+\.mlp\.hook_post$",
    "mlp_out": r"blocks\.\d+\.hook_mlp_out$",
    "resid_post": r"blocks\.\d+\.hook_resid_post$",
}
#: Default tolerance on ``max |Δlogits|``, relative to ``max(1, max |logits|)``, per dtype (as
#: :data:`tl_attnonly.verify.RELATIVE_TOLERANCE`).
RELATIVE_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10}
#: Neuron-head hooks cached in the converted run: caching them makes every layer evaluate its
#: heads one by one (the path the hooks see), and proves the heads ran.
HEAD_HOOKS = ("pattern", "z")
#: Neuron-heads per layer in the report's (self, bias) heatmaps.
REPORT_TOP_K = 32


@dataclass
class BridgeVerdict(Verdict):
    """One dtype's result of :func:`verify_bridge_conversion`: a
    :class:`~tl_attnonly.verify.Verdict` whose reference is ``"unconverted bridge"`` (exact
    activations) or ``"unconverted bridge with the heads' activation"`` (approximate ones: each
    neuron's activation replaced by the sum of its heads, through ``hook_post``), whose
    ``approximation_diff`` is against the unconverted bridge itself and whose ``table`` is
    :func:`bridge_equivalence_table`'s.

    Attributes:
        coefficients: The neuron-heads' coefficients (layer 0's).
    """

    coefficients: NeuronHeadCoefficients


def _names(name: str) -> bool:
    return any(re.search(pattern, name) for pattern in BRIDGE_HOOK_GROUPS.values())


def _row(name: str, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    diffs = [(a.double() - b.double()).abs() for a, b in pairs]
    return {
        "activation": name,
        "n_hooks": len(pairs),
        "max_abs_diff": max(d.max().item() for d in diffs),
        "mean_abs_diff": sum(d.mean().item() for d in diffs) / len(diffs),
        "max_abs_value": max(a.abs().max().item() for a, _ in pairs),
    }


def bridge_equivalence_table(
    reference: tuple[torch.Tensor, Any], converted: tuple[torch.Tensor, Any]
) -> pd.DataFrame:
    """Max and mean absolute difference, converted vs reference, per activation group.

    Args:
        reference: ``(logits, cache)`` of the unconverted bridge (``run_with_cache``).
        converted: ``(logits, cache)`` of the converted bridge, same tokens.

    Returns:
        One row per group (logits first, then the groups of :data:`BRIDGE_HOOK_GROUPS` the
        caches hold), columns ``activation, n_hooks, max_abs_diff, mean_abs_diff,
        max_abs_value``.
    """
    (logits_a, cache_a), (logits_b, cache_b) = reference, converted
    rows = [_row("logits", [(logits_a, logits_b)])]
    for group, pattern in BRIDGE_HOOK_GROUPS.items():
        pairs = [(cache_a[n], cache_b[n]) for n in cache_a.keys() if re.search(pattern, n)]
        if pairs:
            rows.append(_row(group, pairs))
    return pd.DataFrame(rows)


def _head_activation_hooks(
    n_layers: int, coefficients: NeuronHeadCoefficients, gated: bool
) -> list[tuple[str, Callable[..., Any]]]:
    """Hooks that make an unconverted bridge's MLPs use the heads' activation: ``hook_post``
    gains ``heads(pre) - act(pre)`` (times ``hook_pre_linear`` for a gated MLP). Each hook knows
    its layer by closure (a bridge's aliased hooks carry their target's name, e.g.
    ``blocks.0.mlp.out.hook_in`` for ``blocks.0.mlp.hook_post`` on TransformerLens 4.x)."""
    saved: dict[tuple[int, str], torch.Tensor] = {}

    def save(layer: int, kind: str) -> Callable[..., None]:
        def hook(act: torch.Tensor, hook: Any) -> None:
            saved[layer, kind] = act

        return hook

    def replace_post(layer: int) -> Callable[..., torch.Tensor]:
        def hook(post: torch.Tensor, hook: Any) -> torch.Tensor:
            pre = saved[layer, "pre"]
            delta = coefficients.evaluate(pre) - coefficients.reference(pre)
            if gated:
                delta = delta * saved[layer, "pre_linear"]
            return post + delta

        return hook

    hooks: list[tuple[str, Callable[..., Any]]] = []
    for layer in range(n_layers):
        mlp = f"blocks.{layer}.mlp."
        hooks.append((mlp + "hook_pre", save(layer, "pre")))
        if gated:
            hooks.append((mlp + "hook_pre_linear", save(layer, "pre_linear")))
        hooks.append((mlp + "hook_post", replace_post(layer)))
    return hooks


def verify_bridge_conversion(
    load: Callable[[torch.dtype], Any],
    tokens: torch.Tensor | str,
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.float64),
    options: ConversionOptions | None = None,
    tolerance: float | None = None,
) -> list[BridgeVerdict]:
    """Check that a converted bridge computes what the unconverted one does, per dtype.

    For each dtype, ``load(dtype)`` builds a fresh bridge; it runs unconverted, is converted in
    place (:func:`~tl_attnonly.bridge.convert_bridge`) and runs again on the same tokens, caching
    the neuron-head hooks (:data:`HEAD_HOOKS`; so the heads run one by one, and a conversion that
    did not take raises instead of passing). For an
    exact activation (SiLU) the reference is the unconverted bridge; for an approximate one
    (ReLU, GELU) it is the unconverted bridge with each neuron's activation replaced by the sum
    of its heads (so the verdict checks the conversion itself; the approximation's own cost is
    ``approximation_diff``).

    Args:
        load: ``dtype -> TransformerBridge`` (unconverted), e.g.
            ``lambda dtype: load_bundled_bridge(dtype=dtype)``.
        tokens: Token ids ``[batch, pos]`` or text (tokenised by the bridge).
        dtypes: The dtypes to check in.
        options: Conversion options.
        tolerance: Bound on ``max |Δlogits|``; default ``RELATIVE_TOLERANCE[dtype] * max(1, max
            |logits|)``.

    Returns:
        One :class:`BridgeVerdict` per dtype.
    """
    verdicts = []
    for dtype in dtypes:
        bridge = load(dtype)
        toks = bridge.to_tokens(tokens) if isinstance(tokens, str) else tokens
        with torch.inference_mode():
            reference = bridge.run_with_cache(toks, names_filter=_names)
        convert_bridge(bridge, options, progress=False)
        layers = neuron_head_layers(bridge)
        coefficients = layers[0].coefficients
        heads = [f"blocks.{i}.mlp.hook_{kind}" for i in range(len(layers)) for kind in HEAD_HOOKS]
        with torch.inference_mode():
            converted = bridge.run_with_cache(
                toks, names_filter=lambda name, heads=heads: _names(name) or name in heads
            )
        missing = [name for name in heads if name not in converted[1]]
        if missing:  # the neuron-heads did not run: never report a PASS for that
            raise RuntimeError(
                f"The converted bridge's neuron-head hooks did not fire ({', '.join(missing)}): "
                "its MLPs did not run as neuron-heads. Please report this."
            )
        table = bridge_equivalence_table(reference, converted)
        ref_logits = reference[0]
        what = "unconverted bridge"
        if coefficients.method != "exact":
            what = "unconverted bridge with the heads' activation"
            gated = isinstance(layers[0], BridgeGatedNeuronHeadMLP)
            unconvert_bridge(bridge)
            hooks = _head_activation_hooks(len(layers), coefficients, gated)
            with torch.inference_mode():
                ref_logits = bridge.run_with_hooks(toks, fwd_hooks=hooks)
            convert_bridge(bridge, options, progress=False)
        diff = (converted[0].double() - ref_logits.double()).abs().max().item()
        if tolerance is None:
            scale = max(1.0, ref_logits.abs().max().item())
            bound = RELATIVE_TOLERANCE.get(dtype, 1e-2) * scale
        else:
            bound = float(tolerance)
        approx = float(table.loc[table["activation"] == "logits", "max_abs_diff"].iloc[0])
        verdicts.append(BridgeVerdict(dtype, diff, bound, what, approx, table, coefficients))
    return verdicts


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------
def neuron_head_self_weights(
    cache: Any, layer: int, top_k: int
) -> tuple[Float[torch.Tensor, "top_k pos"], list[int]]:
    """The weight on self (``hook_pattern[..., 0]``, batch 0) of a layer's ``top_k`` most active
    neuron-heads (largest ``max |hook_z|`` over positions), most active first, and their
    indices."""
    pattern = cache[f"blocks.{layer}.mlp.hook_pattern"][0]  # [n_neuron_heads, pos, 2]
    z = cache[f"blocks.{layer}.mlp.hook_z"][0, ..., 0]  # [pos, n_neuron_heads]
    k = min(top_k, z.shape[-1])
    heads = z.abs().amax(0).topk(k).indices.tolist()
    return pattern[heads, :, 0].float().cpu(), heads


def self_weight_figure(
    cache: Any,
    layer: int,
    str_tokens: Sequence[str],
    top_k: int = REPORT_TOP_K,
    n_heads_per_neuron: int = 1,
) -> go.Figure:
    """A plotly heatmap of one layer's most active neuron-heads (rows, most active first) over
    the tokens (columns): each cell is the head's weight on its own token (its weight on the bias
    token is 1 minus that). Read from a converted bridge's cache (``hook_pattern``, ``hook_z``;
    batch 0).

    Args:
        cache: ``run_with_cache`` of a converted bridge (or any model with the neuron-head hooks).
        layer: The layer.
        str_tokens: The prompt's tokens (labels).
        top_k: Heads drawn (see :func:`neuron_head_self_weights`).
        n_heads_per_neuron: For the labels: ``L{layer}N{neuron}`` (1) or
            ``L{layer}N{neuron}.{k}``.
    """
    weights, heads = neuron_head_self_weights(cache, layer, top_k)
    k = n_heads_per_neuron
    labels = [f"L{layer}N{h}" if k == 1 else f"L{layer}N{h // k}.{h % k}" for h in heads]
    columns = [f"{i}: {t!r}" for i, t in enumerate(str_tokens)]
    fig = go.Figure(
        go.Heatmap(
            z=weights.numpy(),
            x=columns,
            y=labels,
            zmin=0,
            zmax=1,
            colorscale="Reds",
            colorbar=dict(title="on self"),
            hovertemplate="%{y} at %{x}<br>weight on self %{z:.3f}<extra></extra>",
        )
    )
    fig.update_layout(
        title=f"Layer {layer}: weight on self of the {len(heads)} most active neuron-heads "
        "(1 - weight on the bias token)",
        height=max(300, 16 * len(heads) + 150),
        xaxis=dict(showticklabels=False, title="token"),
        yaxis=dict(autorange="reversed", title="neuron-head"),
    )
    return fig


def _df_html(df: pd.DataFrame) -> str:
    return df.to_html(index=False, border=0, classes="df", float_format=lambda v: f"{v:.3g}")


_CSS = """
body { font-family: -apple-system, "Segoe UI", Roboto, sans-serif; margin: 24px auto;
       max-width: 1200px; color: #222; line-height: 1.45; padding: 0 16px; }
table.df { border-collapse: collapse; font-size: 13px; margin: 8px 0 16px; }
table.df th, table.df td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
pre.prompt { background: #f7f7f7; padding: 8px; border-radius: 4px; overflow-x: auto; }
.note { color: #555; font-size: 14px; }
"""


def write_bridge_report(
    bridge: Any,
    prompt: str,
    path: str | Path,
    *,
    equivalence: dict[str, pd.DataFrame],
    model_name: str,
    top_k: int = REPORT_TOP_K,
) -> Path:
    """Write a self-contained HTML report of a converted bridge on ``prompt`` (plotly.js
    inlined, opens offline): the equivalence tables and, per layer, the (self, bias) weights of
    the ``top_k`` most active neuron-heads over the prompt's tokens.

    Args:
        bridge: A converted TransformerBridge with a tokenizer.
        prompt: Text to run it on.
        path: Where to write the ``.html`` file (parent directories are created).
        equivalence: Title -> :func:`bridge_equivalence_table` (e.g. one per dtype).
        model_name: Shown in the title.
        top_k: Neuron-heads per layer in the heatmaps.

    Returns:
        The path written.
    """
    from plotly.offline import get_plotlyjs

    layers = neuron_head_layers(bridge)  # raises for an unconverted bridge
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens = bridge.to_tokens(prompt)
    str_tokens = [str(t) for t in bridge.to_str_tokens(prompt)]
    names = {f"blocks.{i}.mlp.hook_{kind}" for kind in ("pattern", "z") for i in range(len(layers))}
    with torch.inference_mode():
        _, cache = bridge.run_with_cache(tokens, names_filter=lambda n: n in names)
    figures = [
        self_weight_figure(cache, index, str_tokens, top_k, layer.n_heads_per_neuron)
        for index, layer in enumerate(layers)
    ]
    coefs = layers[0].coefficients
    # "</script" can only occur inside JavaScript strings, comments or regexes, where "<\/" is
    # the same text: escaped so that the inline script cannot end early.
    plotly_js = get_plotlyjs().replace("</script", "<\\/script")
    tables = "".join(
        f"<h3>{html.escape(title)}</h3>{_df_html(df)}" for title, df in equivalence.items()
    )
    plots = "".join(
        fig.to_html(full_html=False, include_plotlyjs=False, config={"displaylogo": False})
        for fig in figures
    )
    page = (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8">\n'
        f"<title>tl-attnonly bridge report: {html.escape(model_name)}</title>\n"
        f"<style>{_CSS}</style>\n<script>{plotly_js}</script>\n</head><body>\n"
        f"<h1>Every MLP neuron as an attention head (TransformerBridge): "
        f"{html.escape(model_name)}</h1>\n"
        f"<p>{len(layers)} layers, {layers[0].n_neuron_heads} neuron-heads per layer "
        f"({html.escape(coefs.activation)}, {coefs.n_heads} head(s) per neuron, method "
        f"{html.escape(coefs.method)}). Prompt ({len(str_tokens)} tokens):</p>"
        f'<pre class="prompt">{html.escape(prompt)}</pre>\n'
        "<h2>Equivalence with the unconverted bridge</h2>\n"
        '<p class="note">Maximum and mean absolute difference between the converted bridge and '
        "the same bridge unconverted, on the prompt, for the logits and the bridge's own hooks."
        f"</p>{tables}\n"
        "<h2>Neuron-head attention over the prompt</h2>\n"
        '<p class="note">Each neuron-head attends to its own token and a bias token; its pattern '
        "is two numbers per token, weight on self and weight on the bias token (they sum to 1). "
        "Drawn: weight on self, from <code>blocks.{l}.mlp.hook_pattern</code>, for the most "
        "active heads (largest |<code>hook_z</code>|).</p>\n"
        f"{plots}\n"
        "<h2>Not in this report</h2>\n"
        '<p class="note">The circuitsvis pattern views, attribution patching over every head and '
        "the GELU-fit curves of the full report read an <code>AttnOnlyTransformer</code>: they "
        "need TransformerLens 3.x (<code>tl-attnonly demo</code> without "
        "<code>--bridge</code>).</p>\n"
        f'<p class="note">Generated by tl-attnonly on {time.strftime("%Y-%m-%d %H:%M")}. After '
        "Huben &amp; Morris (2023), arXiv 2309.08593.</p>\n</body></html>\n"
    )
    path.write_text(page, encoding="utf-8")
    return path


__all__ = [
    "BRIDGE_HOOK_GROUPS",
    "BridgeVerdict",
    "RELATIVE_TOLERANCE",
    "bridge_equivalence_table",
    "neuron_head_self_weights",
    "self_weight_figure",
    "verify_bridge_conversion",
    "write_bridge_report",
]
