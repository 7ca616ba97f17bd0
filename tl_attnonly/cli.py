"""Command line: ``tl-attnonly demo | convert | verify``."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

DEFAULT_PROMPT = (
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n"
)


def _print_table(df) -> None:
    print(df.to_string(index=False, float_format=lambda v: f"{v:.3g}"))


def demo(args: argparse.Namespace) -> int:
    """Convert the bundled model offline, verify it, and write the HTML report."""
    import time

    start = time.perf_counter()
    import torch
    from tqdm.auto import tqdm

    with tqdm(total=4, desc="demo", unit="step", disable=args.no_progress) as bar:
        bar.set_postfix_str("importing")
        from tl_attnonly import convert
        from tl_attnonly.bundled import BUNDLED_MODEL_NAME, load_bundled_model
        from tl_attnonly.verify import equivalence_table

        bar.set_postfix_str(f"loading {BUNDLED_MODEL_NAME} (offline)")
        model = load_bundled_model()
        bar.update(1)
        bar.set_postfix_str("converting")
        converted = convert(model)
        bar.update(1)
        tables = {}
        for dtype in (torch.float32, torch.float64):
            name = str(dtype).removeprefix("torch.")
            bar.set_postfix_str(f"verifying in {name}")
            original = model.to(dtype, print_details=False)
            conv = converted.to(dtype, print_details=False)
            tables[name] = equivalence_table(original, conv, args.prompt)
            bar.update(1)
    model.to(torch.float32, print_details=False)
    converted.to(torch.float32, print_details=False)
    print(
        f"Bundled model {BUNDLED_MODEL_NAME!r} converted: {model.cfg.n_layers} layers x "
        f"{converted.n_neuron_heads} neuron-heads ({converted.coefficients.activation}, "
        f"{converted.n_heads_per_neuron} head(s)/neuron, method "
        f"{converted.coefficients.method!r}) + {model.cfg.n_heads} attention heads/layer."
    )
    for name, table in tables.items():
        print(f"\nEquivalence with the original on the prompt, {name}:")
        _print_table(table)
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
    print(f"Done in {time.perf_counter() - start:.1f} s.")
    return 0


def convert_cmd(args: argparse.Namespace) -> int:
    """Load a model by TransformerLens name, convert it, save it."""
    from tl_attnonly import AttnOnlyTransformer

    model = AttnOnlyTransformer.from_pretrained(
        args.model,
        n_heads_per_neuron=args.heads_per_neuron,
        relu_k=args.relu_k,
        gelu_method=args.gelu_method,
    )
    path = model.save_pretrained(args.out)
    print(f"Saved the converted {args.model} to {path}")
    return 0


def verify_cmd(args: argparse.Namespace) -> int:
    """Compare a converted model against its original (a TL model name or a saved directory)."""
    from transformer_lens import HookedTransformer

    from tl_attnonly import AttnOnlyTransformer, convert
    from tl_attnonly.verify import equivalence_table

    if Path(args.model).is_dir():
        converted = AttnOnlyTransformer.load(args.model)
        original = converted.to_hooked_transformer()
    else:
        original = HookedTransformer.from_pretrained(args.model)
        converted = convert(original)
    if original.tokenizer is None:
        print("The model has no tokenizer: pass token ids through the Python API.")
        return 2
    _print_table(equivalence_table(original, converted, args.prompt))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tl-attnonly", description="See every MLP neuron as an attention head."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="convert the bundled model offline, verify, write a report")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument(
        "--report",
        default="tl_attnonly_demo.html",
        help="HTML report path (default: %(default)s); pass '' to skip",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=16,
        help="neuron-heads per layer in the report's pattern views (default: %(default)s)",
    )
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    p.set_defaults(func=demo)
    p = sub.add_parser("convert", help="convert a TransformerLens model and save it")
    p.add_argument("model", help="a HookedTransformer.from_pretrained name")
    p.add_argument("out", help="output directory")
    p.add_argument("--heads-per-neuron", type=int, default=None)
    p.add_argument("--relu-k", type=float, default=None)
    p.add_argument("--gelu-method", choices=["fit", "paper"], default=None)
    p.set_defaults(func=convert_cmd)
    p = sub.add_parser("verify", help="compare a converted model with its original")
    p.add_argument("model", help="a TransformerLens model name, or a directory from `convert`")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.set_defaults(func=verify_cmd)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message="HookedTransformer is deprecated")
    args = build_parser().parse_args(argv)
    if getattr(args, "report", None) == "":
        args.report = None
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "DEFAULT_PROMPT",
    "build_parser",
    "convert_cmd",
    "demo",
    "main",
    "verify_cmd",
]
