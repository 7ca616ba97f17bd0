"""``tl-attnonly demo``: convert a model offline, verify it, write the HTML report."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from tl_attnonly.cli_common import (
    DEFAULT_PROMPT,
    EXIT_FAIL,
    EXIT_USAGE,
    START,
    CommandError,
    Probes,
    print_table,
    print_verdicts,
)

#: The demo's prompt for the real SmolLM2 (an IOI sentence: the model answers " Mary").
SMOLLM2_PROMPT = "When Mary and John went to the store, John gave a drink to"
#: ``tl-attnonly demo --model ...`` choices.
DEMO_MODELS = ("bundled", "smollm2", "minilm")


def _load_demo_model(name: str) -> tuple[Any, str]:
    """``(model, display name)`` for ``--model``; ImportError (with the extra) if not installed."""
    if name == "smollm2":
        from tl_attnonly.smollm2 import SMOLLM2_NAME, load_smollm2, smollm2_path

        smollm2_path()  # fails fast, naming the extra, before anything heavy
        return load_smollm2(), SMOLLM2_NAME
    from tl_attnonly.bundled import BUNDLED_MODEL_NAME, load_bundled_model

    return load_bundled_model(), BUNDLED_MODEL_NAME


def demo(args: argparse.Namespace, probes: Probes | None = None) -> int:
    """Convert a model offline (the bundled one or SmolLM2), verify it, write the HTML report.

    With ``--bridge``, or on TransformerLens 4.x (no HookedTransformer), the bundled model runs as
    a TransformerBridge instead (:func:`demo_bridge`)."""
    from tqdm.auto import tqdm

    if args.model == "minilm":
        raise CommandError(
            "minilm is an encoder; the demo shows a decoder (bundled or smollm2). Convert "
            "minilm with `tl-attnonly convert minilm OUT_DIR`."
        )
    has_hooked_transformer = (probes or Probes()).has_hooked_transformer()
    if args.bridge or not has_hooked_transformer:
        return demo_bridge(args, tl4=not has_hooked_transformer)
    if args.prompt is None:
        args.prompt = SMOLLM2_PROMPT if args.model == "smollm2" else DEFAULT_PROMPT
    with tqdm(total=3, desc="demo", unit="step", disable=args.no_progress) as bar:
        bar.set_postfix_str("importing torch and TransformerLens")
        from tl_attnonly import convert
        from tl_attnonly.verify import verify_conversion

        bar.set_postfix_str(f"loading {args.model} (offline)")
        try:
            model, model_name = _load_demo_model(args.model)
        except ImportError as err:
            bar.close()
            print(f"tl-attnonly demo --model {args.model}: {err}", file=sys.stderr)
            return EXIT_USAGE
        bar.update(1)
        bar.set_postfix_str("converting")
        converted = convert(model)
        bar.update(1)
        bar.set_postfix_str("verifying in float32 and float64")
        verdicts = verify_conversion(model, converted, args.prompt)
        bar.update(1)
    print(
        f"Model {model_name!r} converted: {model.cfg.n_layers} layers x "
        f"{converted.n_neuron_heads} neuron-heads ({converted.coefficients.activation}, "
        f"{converted.n_heads_per_neuron} head(s)/neuron, method "
        f"{converted.coefficients.method!r}) + {model.cfg.n_heads} attention heads/layer."
    )
    tables = {str(v.dtype).removeprefix("torch."): v.table for v in verdicts}
    for name, table in tables.items():
        print(f"\nEquivalence with the original on the prompt, {name}:")
        print_table(table)
    print("\nVerdict (logits, converted vs original):")
    passed = print_verdicts(verdicts)
    if args.report is not None:
        from tl_attnonly.report import write_demo_report

        path = write_demo_report(
            model,
            converted,
            args.prompt,
            Path(args.report),
            equivalence=tables,
            top_k=args.top_k,
            progress=not args.no_progress,
        )
        print(f"\nReport written to {path} (self-contained: open it in a browser, offline).")
    print(f"Done in {time.perf_counter() - START:.1f} s (imports included).")
    return 0 if passed else EXIT_FAIL


def demo_bridge(args: argparse.Namespace, tl4: bool) -> int:
    """The demo on a TransformerBridge (TransformerLens 3.x with ``--bridge``, and 4.x): the
    bundled model as a Hugging Face GPT-2 in a bridge, converted in place, verified in float32 and
    float64 against the unconverted bridge, and a smaller HTML report
    (:func:`tl_attnonly.bridge.demo.write_bridge_report`)."""
    from tqdm.auto import tqdm

    why = "TransformerLens 4.x has no HookedTransformer" if tl4 else "--bridge"
    if args.model != "bundled":
        print(
            f"tl-attnonly demo --model {args.model}: the TransformerBridge demo ({why}) runs the "
            "bundled model only. On TransformerLens 4.x convert a bridge of your model in Python: "
            "bridge = TransformerBridge.boot_transformers(name); tl_attnonly.convert(bridge) "
            "(docs/bridge.md); --model smollm2 needs TransformerLens 3.x without --bridge.",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.prompt is None:
        args.prompt = DEFAULT_PROMPT
    with tqdm(total=3, desc="demo", unit="step", disable=args.no_progress) as bar:
        bar.set_postfix_str("importing torch and TransformerLens")
        import importlib.metadata

        from tl_attnonly import convert
        from tl_attnonly.bridge.demo import verify_bridge_conversion
        from tl_attnonly.bundled import BUNDLED_MODEL_NAME, load_bundled_bridge

        bar.update(1)
        bar.set_postfix_str("verifying a converted bridge in float32 and float64")
        verdicts = verify_bridge_conversion(
            lambda dtype: load_bundled_bridge(dtype=dtype), args.prompt
        )
        bar.update(1)
        bar.set_postfix_str("converting (float32)")
        bridge = convert(load_bundled_bridge())
        bar.update(1)
    from tl_attnonly.bridge import neuron_head_layers

    layers = neuron_head_layers(bridge)
    coefs = layers[0].coefficients
    version = importlib.metadata.version("transformer-lens")
    print(
        f"Model {BUNDLED_MODEL_NAME!r} as a TransformerBridge (TransformerLens {version}; {why}) "
        f"converted in place: {len(layers)} layers x {layers[0].n_neuron_heads} neuron-heads "
        f"({coefs.activation}, {coefs.n_heads} head(s)/neuron, method {coefs.method!r}) + "
        f"{bridge.cfg.n_heads} attention heads/layer."
    )
    tables = {str(v.dtype).removeprefix("torch."): v.table for v in verdicts}
    for name, table in tables.items():
        print(f"\nEquivalence with the unconverted bridge on the prompt, {name}:")
        print_table(table)
    print("\nVerdict (logits, converted vs unconverted bridge):")
    passed = print_verdicts(verdicts)
    if args.report is not None:
        from tl_attnonly.bridge.demo import write_bridge_report

        path = write_bridge_report(
            bridge,
            args.prompt,
            Path(args.report),
            equivalence=tables,
            model_name=BUNDLED_MODEL_NAME,
            top_k=args.top_k,
        )
        print(
            f"\nReport written to {path} (self-contained, offline; the bridge report: equivalence "
            "and neuron-head patterns. The circuitsvis views, attribution patching and GELU "
            "curves need TransformerLens 3.x without --bridge)."
        )
    print(f"Done in {time.perf_counter() - START:.1f} s (imports included).")
    return 0 if passed else EXIT_FAIL


__all__ = ["DEMO_MODELS", "SMOLLM2_PROMPT", "demo", "demo_bridge"]
