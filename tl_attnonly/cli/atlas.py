"""``tl-attnonly atlas``: write a model's neuron atlas (an offline site) from a corpus.

With no arguments: the bundled model (a ``HookedTransformer`` on TransformerLens 3.x, a
``TransformerBridge`` with ``--bridge`` or on 4.x), converted, over the corpus it was trained on
(Python standard-library source, :func:`~tl_attnonly.analysis.summaries.stdlib_corpus`; a few
thousand tokens by default), into ``tl_attnonly_atlas/``. ``smollm2`` is SmolLM2-135M-Instruct
(the ``[smollm2]`` extra, offline). ``--corpus PATH`` reads a text file (one document per line,
or the whole file with ``--whole-file``) or a ``.jsonl`` file (each line's ``"text"``). Bad
input is refused before anything is written to ``--out``. Under ``torchrun`` the ranks split the
corpus (:mod:`tl_attnonly.atlas.distributed`): gloo on CPU, NCCL with ``--device cuda``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path
from typing import Any

from tl_attnonly.cli.common import CommandError, Probes

#: ``--out``'s default.
DEFAULT_OUT = "tl_attnonly_atlas"
#: The models the command loads.
MODELS = ("bundled", "smollm2")


def add_atlas_parser(sub: Any) -> None:
    """Add the ``atlas`` subcommand to the subparsers ``sub``."""
    p = sub.add_parser(
        "atlas",
        help="write a neuron atlas: every neuron's top contexts, logit effect, ... as a site",
        description="Stream a corpus through the converted bundled model and write an offline "
        "site with a page per neuron (open OUT/index.html in a browser).",
    )
    p.add_argument(
        "model",
        nargs="?",
        default="bundled",
        choices=MODELS,
        help="the model: bundled (default) or smollm2 (SmolLM2-135M-Instruct, the [smollm2] extra)",
    )
    p.add_argument(
        "--corpus",
        default=None,
        help="a text file (one document per line), a .jsonl file (a 'text' field per line), or "
        "an offline corpus: python-docs (Python's help topics, English), python-source (the "
        "standard library's source) or python (both), or hf:NAME[:CONFIG][@SPLIT] (a Hugging "
        "Face dataset's 'text', streamed); default: the standard-library modules the bundled "
        "model was trained on",
    )
    p.add_argument("--whole-file", action="store_true", help="the text file is one document")
    p.add_argument("--out", default=DEFAULT_OUT, help="output directory (default: %(default)s)")
    p.add_argument("--max-rows", type=int, default=32, help="rows to read (default: %(default)s)")
    p.add_argument("--max-len", type=int, default=128, help="tokens per row (default: 128)")
    p.add_argument("--batch-size", type=int, default=16, help="rows per forward pass")
    p.add_argument("--k", type=int, default=20, help="top contexts per neuron (default: 20)")
    p.add_argument("--checkpoint-every", type=int, default=None, help="batches per checkpoint")
    p.add_argument("--bridge", action="store_true", help="run the model as a TransformerBridge")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=atlas_cmd)


def read_corpus(path: str, whole_file: bool = False) -> list[str]:
    """The documents of the corpus file ``path``.

    Raises:
        CommandError: For a missing or empty file, or a JSONL line without a ``"text"`` string.
    """
    file = Path(path)
    if not file.is_file():
        raise CommandError(f"--corpus {path}: no such file.")
    text = file.read_text("utf-8", errors="replace")
    if file.suffix == ".jsonl":
        docs = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as err:
                raise CommandError(f"--corpus {path}, line {number}: not JSON ({err}).") from err
            if not isinstance(item, dict) or not isinstance(item.get("text"), str):
                raise CommandError(f'--corpus {path}, line {number}: no "text" string.')
            docs.append(item["text"])
    elif whole_file:
        docs = [text]
    else:
        docs = text.splitlines()
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise CommandError(f"--corpus {path} is empty: no text to run.")
    return docs


def _corpus(name: str | None, whole_file: bool) -> Any:
    """The documents ``--corpus`` names (``None``: the bundled model's training modules)."""
    from tl_attnonly.atlas.corpora import CORPORA, hf_dataset

    if name is None:
        return None
    if name in CORPORA and not Path(name).exists():
        return CORPORA[name]()
    if name.startswith("hf:"):
        try:
            docs = hf_dataset(name[3:])
            first = next(docs, None)  # fails now, before anything is written
        except (ImportError, ValueError) as err:
            raise CommandError(f"--corpus {name}: {err}") from err
        if first is None:
            raise CommandError(f"--corpus {name} is empty: no text to run.")
        return itertools.chain([first], docs)
    return read_corpus(name, whole_file)


def atlas_cmd(args: argparse.Namespace, probes: Probes | None = None) -> int:
    """Build the atlas (module docstring); returns the exit code."""
    for name in ("max_rows", "max_len", "batch_size", "k"):
        if getattr(args, name) < 1:
            raise CommandError(f"--{name.replace('_', '-')} must be >= 1.")
    corpus = _corpus(args.corpus, args.whole_file)
    bridge = args.bridge or not (probes or Probes()).has_hooked_transformer()
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CommandError(f"--out {out} is a file, not a directory.")
    start = time.perf_counter()
    from tl_attnonly.adapt import analysis_model
    from tl_attnonly.atlas.build import model_manifest
    from tl_attnonly.atlas.distributed import init_from_env, rank_device
    from tl_attnonly.atlas.run import build_atlas, check_out_dir

    rank, world_size = init_from_env(args.device)
    name, model = _load(args.model, bridge, rank_device(args.device))
    try:
        check_out_dir(out, model_manifest(analysis_model(model), name))
    except FileExistsError as err:
        raise CommandError(str(err)) from err
    state = build_atlas(
        model,
        corpus,
        out,
        checkpoint_every=args.checkpoint_every,
        progress=not args.no_progress,
        model_name=name,
        k=args.k,
        max_rows=args.max_rows,
        max_len=args.max_len,
        batch_size=args.batch_size,
    )
    seconds = time.perf_counter() - start
    tokens = int(state.n_tokens)
    kind = "TransformerBridge" if bridge else "HookedTransformer"
    ranks = f", {world_size} ranks" if world_size > 1 else ""
    if rank == 0:
        print(
            f"Atlas of {name} ({kind}{ranks}, {state.manifest['n_layers']} layers x "
            f"{state.manifest['d_mlp']} neurons) over {tokens} tokens in {seconds:.1f} s "
            f"({tokens / seconds:,.0f} tokens/s): {out / 'index.html'} (open it in a browser, "
            "offline)."
        )
    return 0


def _load(model: str, bridge: bool, device: str) -> tuple[str, Any]:
    """``(name, converted model)`` of ``model`` (one of :data:`MODELS`) on ``device``.

    Raises:
        CommandError: If the model's extra is not installed.
    """
    from tl_attnonly import convert

    if model == "smollm2":
        try:
            from tl_attnonly.smollm2 import (
                SMOLLM2_NAME,
                load_smollm2,
                load_smollm2_bridge,
                smollm2_path,
            )

            smollm2_path()  # fails fast, naming the extra, before anything heavy
        except ImportError as err:
            raise CommandError(f"smollm2: {err}") from err
        loaded = (load_smollm2_bridge if bridge else load_smollm2)(device=device)
        return SMOLLM2_NAME, convert(loaded)
    from tl_attnonly.bundled import BUNDLED_MODEL_NAME, load_bundled_bridge, load_bundled_model

    loaded = (load_bundled_bridge if bridge else load_bundled_model)(device=device)
    return BUNDLED_MODEL_NAME, convert(loaded)


__all__ = ["DEFAULT_OUT", "add_atlas_parser", "atlas_cmd", "read_corpus"]
