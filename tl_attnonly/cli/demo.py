"""``tl-attnonly demo``: convert a model offline, verify it, write the HTML report.

One path for both model kinds: a ``HookedTransformer`` (TransformerLens 3.x, the default there)
or a ``TransformerBridge`` (``--bridge`` on 3.x; the only kind on 4.x). Either way the model is
converted, checked against the model before conversion in float32 and float64
(:func:`tl_attnonly.verify.verify_conversion`) and drawn in the full report
(:func:`tl_attnonly.report.write_demo_report`). A bridge converts in place, so its reference is a
second, unconverted bridge of the same weights.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tl_attnonly.cli.common import (
    ATLAS_MANIFEST,
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
#: Each decoder's name as its atlas records it (``tl_attnonly.bundled.BUNDLED_MODEL_NAME``,
#: ``tl_attnonly.smollm2.SMOLLM2_NAME``; repeated here so that ``--atlas`` is checked before torch
#: is imported).
DEMO_MODEL_NAMES = {"bundled": "tiny-stdlib-silu", "smollm2": "SmolLM2-135M-Instruct"}


def _demo_loader(name: str, bridge: bool) -> tuple[Callable[[], Any], str]:
    """``(load, display name)`` for ``--model``: ``load()`` gives a fresh, unconverted model of
    the kind asked. ImportError (naming the extra) if the model's package is not installed."""
    if name == "smollm2":
        from tl_attnonly.smollm2 import SMOLLM2_NAME, smollm2_path

        smollm2_path()  # fails fast, naming the extra, before anything heavy
        if bridge:
            from tl_attnonly.smollm2 import load_smollm2_hf, smollm2_bridge_from_hf

            hf_model, tokenizer = load_smollm2_hf()  # read once; each bridge wraps a copy
            return lambda: smollm2_bridge_from_hf(hf_model, tokenizer), SMOLLM2_NAME
        from tl_attnonly.smollm2 import load_smollm2

        return load_smollm2, SMOLLM2_NAME
    from tl_attnonly.bundled import BUNDLED_MODEL_NAME, load_bundled_bridge, load_bundled_model

    return (load_bundled_bridge if bridge else load_bundled_model), BUNDLED_MODEL_NAME


def check_atlas_dir(directory: str, model: str) -> Path:
    """``--atlas``'s folder, checked before any work: it must hold a finished neuron atlas site
    (its ``index.html`` and manifest, ``atlas.json``) of the demo's model ``model`` (one of
    :data:`DEMO_MODELS`) by the name its manifest records. Reads no torch.

    Raises:
        CommandError: Naming ``--atlas`` and what is wrong.
    """
    path = Path(directory)
    write = f"`tl-attnonly atlas{'' if model == 'bundled' else ' ' + model} --out {directory}`"
    if not path.is_dir():
        raise CommandError(f"--atlas {directory}: no such folder; write the atlas with {write}.")
    missing = [name for name in (ATLAS_MANIFEST, "index.html") if not (path / name).is_file()]
    if missing:
        raise CommandError(
            f"--atlas {directory} is not a neuron atlas site (no {' or '.join(missing)}: "
            f"{ATLAS_MANIFEST} is written last, when a site is complete); write one with {write}."
        )
    try:
        there = json.loads((path / ATLAS_MANIFEST).read_text("utf-8"))["manifest"]
        name = there["model_name"]
    except (ValueError, KeyError, TypeError) as err:
        raise CommandError(
            f"--atlas {directory}: its {ATLAS_MANIFEST} is not an atlas manifest ({err!r})."
        ) from err
    want = DEMO_MODEL_NAMES.get(model, model)
    if name != want:
        raise CommandError(
            f"--atlas {directory} is the atlas of {name} ({there.get('n_layers')} layers x "
            f"{there.get('d_mlp')} neurons), not of {want}, the model the demo draws: pass "
            f"{want}'s atlas, or write one with {write}."
        )
    return path


def demo(args: argparse.Namespace, probes: Probes | None = None) -> int:
    """Convert a model offline (the bundled one or SmolLM2), verify it, write the HTML report.

    The model is a ``HookedTransformer`` on TransformerLens 3.x, and a ``TransformerBridge`` with
    ``--bridge`` or on TransformerLens 4.x (which has no ``HookedTransformer``); the rest is the
    same path."""
    from tqdm.auto import tqdm

    if args.model == "minilm":
        raise CommandError(
            "minilm is an encoder; the demo shows a decoder (bundled or smollm2). Convert "
            "minilm with `tl-attnonly convert minilm OUT_DIR`."
        )
    atlas = None if args.atlas is None else check_atlas_dir(args.atlas, args.model)
    has_hooked_transformer = (probes or Probes()).has_hooked_transformer()
    bridge = args.bridge or not has_hooked_transformer
    if not bridge:
        why = ""
    elif has_hooked_transformer:
        why = "; --bridge"
    else:
        why = "; TransformerLens 4.x has no HookedTransformer"
    if args.prompt is None:
        args.prompt = SMOLLM2_PROMPT if args.model == "smollm2" else DEFAULT_PROMPT
    with tqdm(total=3, desc="demo", unit="step", disable=args.no_progress) as bar:
        bar.set_postfix_str("importing torch and TransformerLens")
        from tl_attnonly import convert
        from tl_attnonly.adapt import analysis_model
        from tl_attnonly.verify import REFERENCE_NAMES, verify_conversion

        bar.set_postfix_str(f"loading {args.model} (offline)")
        try:
            load, model_name = _demo_loader(args.model, bridge)
            original = load()
        except ImportError as err:
            bar.close()
            print(f"tl-attnonly demo --model {args.model}: {err}", file=sys.stderr)
            return EXIT_USAGE
        bar.update(1)
        bar.set_postfix_str("converting")
        converted = convert(original)
        if converted is original:  # converted in place (a bridge): the reference is a second one
            original = load()
        bar.update(1)
        bar.set_postfix_str("verifying in float32 and float64")
        verdicts = verify_conversion(original, converted, args.prompt)
        bar.update(1)
    adapted = analysis_model(converted)
    coefs = adapted.neuron_heads[0].coefficients
    version = importlib.metadata.version("transformer-lens")
    reference = REFERENCE_NAMES.get(adapted.kind, "original")
    print(
        f"Model {model_name!r} as a {adapted.kind} (TransformerLens {version}{why}) converted: "
        f"{adapted.cfg.n_layers} layers x {adapted.n_neuron_heads} neuron-heads "
        f"({coefs.activation}, {adapted.n_heads_per_neuron} head(s)/neuron, method "
        f"{coefs.method!r}) + {adapted.cfg.n_heads} attention heads/layer."
    )
    tables = {str(v.dtype).removeprefix("torch."): v.table for v in verdicts}
    for name, table in tables.items():
        print(f"\nEquivalence with the {reference} on the prompt, {name}:")
        print_table(table)
    print(f"\nVerdict (logits, converted vs {reference}):")
    passed = print_verdicts(verdicts)
    if args.report is not None:
        from tl_attnonly.report import write_demo_report

        path = write_demo_report(
            original,
            converted,
            args.prompt,
            Path(args.report),
            equivalence=tables,
            top_k=args.top_k,
            model_name=model_name,
            progress=not args.no_progress,
            atlas=atlas,
        )
        size = path.stat().st_size / 1e6
        print(
            f"\nReport written to {path} ({size:.2f} MB, self-contained: open it in a browser, "
            "offline)."
        )
    print(f"Done in {time.perf_counter() - START:.1f} s (imports included).")
    return 0 if passed else EXIT_FAIL


__all__ = ["DEMO_MODELS", "DEMO_MODEL_NAMES", "SMOLLM2_PROMPT", "check_atlas_dir", "demo"]
