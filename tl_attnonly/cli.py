"""Command line: ``tl-attnonly demo | convert | verify``.

Everything heavy (torch, TransformerLens) is imported inside the commands, so that ``--help`` and
usage errors answer at once.
"""

from __future__ import annotations

import time

_START = time.perf_counter()  # the demo reports its time from here, imports included

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

DEFAULT_PROMPT = (
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n"
)
#: Exit codes: 0 PASS / done, 1 FAIL (verification), 2 usage or input error (as argparse).
EXIT_FAIL, EXIT_USAGE = 1, 2
#: Seconds to wait for the Hugging Face hub before calling it unreachable.
HUB_TIMEOUT = 1.0
#: Models every subcommand loads by name, offline (package data or an installed extra).
LOCAL_MODELS = {
    "bundled": "the bundled tiny-stdlib-silu decoder (package data)",
    "smollm2": "SmolLM2-135M-Instruct, a gated decoder (the [smollm2] extra)",
    "minilm": "all-MiniLM-L6-v2, a BERT encoder (the [minilm] extra)",
}
#: The file that marks a directory written by ``save_pretrained`` (as in ``neuron_head_model``;
#: repeated here so that a wrong directory is reported before torch is imported).
CONVERSION_FILE = "conversion.json"


class CommandError(Exception):
    """An input the command cannot use; the message says what to do. Exits with code 2."""


def _print_table(df: Any) -> None:
    print(df.to_string(index=False, float_format=lambda v: f"{v:.3g}"))


def _print_verdicts(verdicts: Sequence[Any]) -> bool:
    """Print one PASS/FAIL line per dtype; return whether all passed."""
    for v in verdicts:
        name = str(v.dtype).removeprefix("torch.")
        status = "PASS" if v.passed else "FAIL"
        line = (
            f"  {status}  {name:<8} max |Δlogits| = {v.max_abs_diff:.3g} "
            f"(tolerance {v.tolerance:.3g}, against the {v.reference})"
        )
        if v.reference not in ("original", "unconverted bridge"):
            line += f"; against the original: {v.approximation_diff:.3g}"
        print(line)
    return all(v.passed for v in verdicts)


# ------------------------------------------------------------------------------------------------
# demo
# ------------------------------------------------------------------------------------------------
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


def _has_hooked_transformer() -> bool:
    """Whether the installed TransformerLens has HookedTransformer (3.x; 4.x removed it), read
    from the package's metadata: no import of torch or TransformerLens, so the commands that
    fail fast (no hub, bad arguments) stay fast."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return int(version("transformer-lens").split(".")[0]) < 4
    except (PackageNotFoundError, ValueError):  # not installed, or an unreadable version
        from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER

        return HAS_HOOKED_TRANSFORMER


def demo(args: argparse.Namespace) -> int:
    """Convert a model offline (the bundled one or SmolLM2), verify it, write the HTML report.

    With ``--bridge``, or on TransformerLens 4.x (no HookedTransformer), the bundled model runs as
    a TransformerBridge instead (:func:`demo_bridge`)."""
    from tqdm.auto import tqdm

    if args.model == "minilm":
        raise CommandError(
            "minilm is an encoder; the demo shows a decoder (bundled or smollm2). Convert "
            "minilm with `tl-attnonly convert minilm OUT_DIR`."
        )
    has_hooked_transformer = _has_hooked_transformer()
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
        _print_table(table)
    print("\nVerdict (logits, converted vs original):")
    passed = _print_verdicts(verdicts)
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
    print(f"Done in {time.perf_counter() - _START:.1f} s (imports included).")
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
        _print_table(table)
    print("\nVerdict (logits, converted vs unconverted bridge):")
    passed = _print_verdicts(verdicts)
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
    print(f"Done in {time.perf_counter() - _START:.1f} s (imports included).")
    return 0 if passed else EXIT_FAIL


# ------------------------------------------------------------------------------------------------
# convert
# ------------------------------------------------------------------------------------------------
def _offline() -> bool:
    from tl_attnonly.hub import offline_mode

    return offline_mode()


def _hub_unreachable(timeout: float = HUB_TIMEOUT) -> str | None:
    """Why the Hugging Face hub cannot be reached (``None`` if it answers), within ``timeout``."""
    from tl_attnonly.hub import hub_unreachable

    return hub_unreachable(timeout)


def _local_names() -> str:
    return ", ".join(LOCAL_MODELS)


def _offline_advice(model: str, why: str) -> str:
    """Three lines: what was asked, why the hub cannot be used, what to do offline."""
    why = why.rstrip(".")
    return (
        f"Cannot load {model!r}: it comes from the Hugging Face hub and is not in the cache.\n"
        f"{why[:1].upper() + why[1:]}.\n"
        f"Work offline: a local model by name ({_local_names()}), `tl-attnonly verify DIR` "
        "(a saved conversion), `tl-attnonly demo`; or, with the model in your Hugging Face "
        "cache, set HF_HUB_OFFLINE=1."
    )


def _official_name(name: str) -> str:
    """TransformerLens's official name for ``name`` (or an alias), or a CommandError."""
    import difflib

    from tl_attnonly._compat import make_model_alias_map

    aliases = make_model_alias_map()
    official = aliases.get(name.lower())
    if official is not None:
        return official
    close = difflib.get_close_matches(name.lower(), list(aliases), n=3, cutoff=0.6)
    hint = f" Did you mean {', '.join(repr(aliases[c]) for c in close)}?" if close else ""
    raise CommandError(
        f"{name!r} is not a directory, a local model ({_local_names()}), nor a model name "
        f"TransformerLens knows.{hint} "
        'Names: `python -c "from transformer_lens.supported_models import OFFICIAL_MODEL_NAMES; '
        'print(*OFFICIAL_MODEL_NAMES, sep=chr(10))"`.'
    )


def _require_hub(name: str) -> None:
    """Fail within about a second when ``name`` needs the hub and the hub does not answer.

    Called before TransformerLens is imported, so that no access is reported at once. A model
    in the local Hugging Face cache (under the name given), or offline mode, skips the probe:
    ``from_pretrained`` then checks the cache under TransformerLens's official name itself.
    """
    from tl_attnonly.hub import in_local_cache

    if _offline() or in_local_cache(name):
        return
    why = _hub_unreachable()
    if why is not None:
        raise CommandError(_offline_advice(name, f"the Hugging Face hub is unreachable: {why}"))


def _load_by_name(name: str, loader: Any, **kwargs: Any) -> Any:
    """``loader(official_name, **kwargs)``, failing clearly on an unknown name or a model missing
    from the cache under ``HF_HUB_OFFLINE``. Call :func:`_require_hub` first."""
    from tl_attnonly.hub import HubUnavailableError

    official = _official_name(name)
    try:
        return loader(official, **kwargs)
    except HubUnavailableError as exc:
        raise CommandError(_offline_advice(name, exc.why)) from exc
    except OSError as exc:
        if _offline():
            raise CommandError(
                _offline_advice(name, f"HF_HUB_OFFLINE is set and it is not in the cache ({exc})")
            ) from exc
        raise


def _load_local(name: str) -> Any:
    """The (unconverted) local model ``name`` (a key of :data:`LOCAL_MODELS`), with its
    tokenizer; a CommandError naming the extra if it is not installed."""
    try:
        if name == "smollm2":
            from tl_attnonly.smollm2 import load_smollm2, smollm2_path

            smollm2_path()  # fails fast, naming the extra, before anything heavy
            return load_smollm2()
        if name == "minilm":
            from tl_attnonly.minilm import load_minilm

            model, tokenizer = load_minilm()
            if model.tokenizer is None:
                model.tokenizer = tokenizer
            return model
    except ImportError as err:
        raise CommandError(f"{name}: {err}") from err
    from tl_attnonly.bundled import load_bundled_model

    return load_bundled_model()


def _is_local_name(name: str) -> bool:
    """``name`` is a local model's name, and no directory of that name is meant."""
    return name in LOCAL_MODELS and not Path(name).exists()


def _require_hooked_transformer(command: str) -> None:
    """A CommandError for ``convert`` / ``verify`` on TransformerLens 4.x (no HookedTransformer),
    before anything is loaded."""
    if not _has_hooked_transformer():
        raise CommandError(
            f"tl-attnonly {command} converts and saves HookedTransformer models, which "
            "TransformerLens 4.x removed. On 4.x: `tl-attnonly demo` (the bundled model as a "
            "TransformerBridge) or tl_attnonly.convert(bridge) in Python (docs/bridge.md); or "
            "install transformer-lens>=3,<4."
        )


def convert_cmd(args: argparse.Namespace) -> int:
    """Load a model by TransformerLens name, convert it, save it."""
    _require_hooked_transformer("convert")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CommandError(f"OUT_DIR {str(out)!r} exists and is not a directory.")
    options = {
        "n_heads_per_neuron": args.heads_per_neuron,
        "relu_k": args.relu_k,
        "gelu_method": args.gelu_method,
    }
    if _is_local_name(args.model):
        original = _load_local(args.model)
        if args.model == "minilm":
            from tl_attnonly.encoder import convert_encoder

            model = convert_encoder(original, **options)
        else:
            from tl_attnonly import convert

            model = convert(original, **options)
        path = model.save_pretrained(out)
        print(f"Saved the converted {args.model} to {path}.")
        return 0
    _require_hub(args.model)
    from tl_attnonly import AttnOnlyTransformer

    model = _load_by_name(args.model, AttnOnlyTransformer.from_pretrained, **options)
    path = model.save_pretrained(out)
    print(f"Saved the converted {args.model} to {path}; check it with `tl-attnonly verify {path}`.")
    return 0


# ------------------------------------------------------------------------------------------------
# verify
# ------------------------------------------------------------------------------------------------
def _load_converted_dir(directory: Path) -> tuple[Any, Any, str]:
    conversion = directory / CONVERSION_FILE
    if not conversion.is_file():
        raise CommandError(
            f"{str(directory)!r} is a directory but not a converted model: it has no "
            f"{CONVERSION_FILE}. `verify` takes a directory written by `tl-attnonly convert` (or "
            "AttnOnlyTransformer.save_pretrained), or a TransformerLens model name. To convert a "
            "model: `tl-attnonly convert NAME OUT_DIR`."
        )
    from tl_attnonly.conversion_record import SavedModelError, read_json

    try:
        record = read_json(conversion)
    except SavedModelError as exc:
        raise CommandError(str(exc)) from exc
    saved_class = (
        record.get("model_class", "AttnOnlyTransformer")
        if isinstance(record, dict)
        else "AttnOnlyTransformer"  # load() names what is wrong
    )
    if saved_class != "AttnOnlyTransformer":
        raise CommandError(
            f"{str(directory)!r} holds a {saved_class}; `verify` checks decoder models "
            "(AttnOnlyTransformer). Check an encoder with tl_attnonly.verify in Python."
        )
    from tl_attnonly import AttnOnlyTransformer

    try:
        converted = AttnOnlyTransformer.load(directory)
    except SavedModelError as exc:
        raise CommandError(str(exc)) from exc
    original = converted.to_hooked_transformer()
    return original, converted, "the MLP model rebuilt from the saved weights"


def verify_cmd(args: argparse.Namespace) -> int:
    """Compare a converted model against its original (a TL model name or a saved directory)."""
    _require_hooked_transformer("verify")
    target = Path(args.model).expanduser()
    looks_like_path = args.model.startswith((".", "/", "~", os.sep)) or args.model.endswith("/")
    if looks_like_path and not target.exists():
        raise CommandError(
            f"No such directory: {args.model!r}. `verify` takes a directory written by "
            "`tl-attnonly convert NAME OUT_DIR`, or a TransformerLens model name."
        )
    if _is_local_name(args.model):
        if args.model == "minilm":
            raise CommandError(
                "minilm is an encoder; `verify` compares decoder logits. Convert it with "
                "`tl-attnonly convert minilm OUT_DIR`, and compare it in Python "
                "(docs/saving.md). Decoders by name: bundled, smollm2."
            )
        from tl_attnonly import convert

        original = _load_local(args.model)
        converted = convert(original)
        what = f"the original ({LOCAL_MODELS[args.model]})"
    elif target.is_dir():
        original, converted, what = _load_converted_dir(target)
    elif target.exists():
        raise CommandError(
            f"{args.model!r} is a file; `verify` takes a directory written by "
            "`tl-attnonly convert`, or a TransformerLens model name."
        )
    else:
        _require_hub(args.model)
        from transformer_lens import HookedTransformer

        from tl_attnonly import convert

        original = _load_by_name(args.model, HookedTransformer.from_pretrained)
        converted = convert(original)
        what = "the TransformerLens model"
    if original.tokenizer is None:
        raise CommandError("The model has no tokenizer: verify it with token ids in Python.")
    from tl_attnonly.verify import verify_conversion

    coefs = converted.coefficients
    print(
        f"Verifying the converted {args.model} against {what}: {converted.cfg.n_layers} layers, "
        f"{converted.n_neuron_heads} neuron-heads/layer ({coefs.activation}, "
        f"{coefs.n_heads} head(s)/neuron, method {coefs.method!r}), "
        f"prompt of {original.to_tokens(args.prompt).shape[-1]} tokens."
    )
    verdicts = verify_conversion(original, converted, args.prompt, tolerance=args.tolerance)
    for v in verdicts:
        print(f"\n{str(v.dtype).removeprefix('torch.')}: max |converted - original|")
        _print_table(v.table)
    if coefs.method != "exact":
        print(
            f"\n{coefs.activation} is approximated ({coefs.method}, max error per neuron "
            f"{coefs.max_abs_error():.2g} on |x| <= 20): the verdict compares with the original "
            "using the heads' activation, so it checks the conversion itself."
        )
    tolerance = (
        "relative: 1e-4 (float32) / 1e-10 (float64) x max(1, max |logits|)"
        if args.tolerance is None
        else f"{args.tolerance:g}"
    )
    print(f"\nVerdict (tolerance {tolerance}):")
    if _print_verdicts(verdicts):
        print("PASS")
        return 0
    print("FAIL: the converted model does not compute what the original does.")
    return EXIT_FAIL


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
        help="run the bundled model as a TransformerBridge (what the demo does on "
        "TransformerLens 4.x, which has no HookedTransformer): converted in place, verified "
        "against the unconverted bridge, a smaller report",
    )
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    p.set_defaults(func=demo)

    p = sub.add_parser(
        "convert",
        help="convert a TransformerLens model (from the Hugging Face hub) and save it",
        description="Load MODEL (bundled, smollm2 or minilm: offline; any other name: with "
        "TransformerLens's from_pretrained, which needs the hub, or the model in the Hugging Face "
        "cache), convert it, save it to OUT_DIR.",
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
        help="ReLU is approximated by x*sigmoid(k*x); max error 0.2785/k (default k: 100)",
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
        "from its weights), a local decoder (bundled, smollm2; offline), or a TransformerLens "
        "model name (needs the hub)",
    )
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="text to run both models on")
    p.add_argument(
        "--tolerance",
        type=_tolerance,
        default=None,
        help="bound on max |Δlogits| (default: 1e-4 in float32, 1e-10 in float64, times "
        "max(1, max |logits|))",
    )
    p.set_defaults(func=verify_cmd)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    warnings.filterwarnings("ignore", message="HookedTransformer is deprecated")
    warnings.filterwarnings("ignore", message="HookedTransformer.from_pretrained is deprecated")
    args = build_parser().parse_args(argv)
    if getattr(args, "report", None) == "":
        args.report = None
    try:
        return args.func(args)
    except CommandError as exc:
        print(f"tl-attnonly {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


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
    "demo_bridge",
    "main",
    "verify_cmd",
]
