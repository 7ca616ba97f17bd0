"""Train the tiny bundled decoder model ``tl_attnonly/data/models/tiny-stdlib-silu``.

This script is the complete, reproducible recipe for the small TransformerLens model that ships
with ``tl_attnonly`` (see :mod:`tl_attnonly.bundled`). It needs no network access: the training
text is the Python standard library's own source code, which exists on every machine that has a
Python interpreter.

Recipe (all values are also written to ``config.json`` / ``training.json`` in the output dir):

* **Data.** The ``.py`` sources of a fixed, sorted list of standard-library modules, located via
  ``sysconfig.get_paths()["stdlib"]`` (``TRAIN_MODULES``; a module is read from ``name.py`` or,
  if that does not exist, ``name/__init__.py``). Six further modules (``VAL_MODULES``) are held
  out for validation. Modules missing from the running Python are skipped and the exact list of
  files used, with their SHA-256, is recorded, because the stdlib sources differ between Python
  versions (the shipped model was trained on CPython 3.11; see ``training.json``).
* **Tokenizer.** Byte-level BPE (``tokenizers``; GPT-2 style pre-tokenizer, no prefix space)
  with ``VOCAB_SIZE = 3072`` entries, trained on the training files only. The single special
  token ``<|endoftext|>`` (id 0) is BOS, EOS and PAD. It is wrapped as a
  ``transformers.PreTrainedTokenizerFast`` and saved with ``save_pretrained``.
* **Token stream.** Every file is encoded separately; the stream is
  ``<|endoftext|> file_1 <|endoftext|> file_2 ...``. A training sequence is ``<|endoftext|>``
  followed by a uniformly random window of ``N_CTX - 1 = 127`` stream tokens, so that position 0
  always holds BOS, matching TransformerLens' default ``prepend_bos=True`` for string inputs.
* **Model.** ``HookedTransformer(HookedTransformerConfig(**MODEL_KWARGS))``: 2 layers,
  d_model 128, 4 heads of d_head 32, d_mlp 512 with SiLU, LayerNorm, learned absolute positions,
  n_ctx 128, untied embeddings, TransformerLens' default GPT-2 initialisation with seed 0.
* **Optimisation.** ``SEED = 0``; ``STEPS = 2000`` AdamW steps of batch ``BATCH_SIZE = 16``
  sequences (16 x 128 tokens), peak LR 2e-3, betas (0.9, 0.95), weight decay 0.1 on weight
  matrices only (not on biases, LayerNorm or the positional embedding), linear warm-up over 100
  steps then cosine decay to 10% of the peak, gradient-norm clipping at 1.0; fp32;
  ``torch.set_num_threads(1)``. The objective is ``model(tokens, return_type="loss")``.
* **Evaluation.** Validation loss is the mean next-token loss over all non-overlapping
  127-token windows of the held-out stream (each prefixed with BOS). Baselines: uniform
  ``log(d_vocab)``; the unigram entropy of the training tokens; and the cross-entropy of that
  unigram model (add-one smoothed) on the validation tokens.

Usage (from the repository root)::

    python scripts/train_tiny_model.py      # writes tl_attnonly/data/models/tiny-stdlib-silu
    python scripts/train_tiny_model.py --out-dir out/tiny   # somewhere else

Training takes about 10 minutes on one otherwise idle CPU thread (the shipped run took 12 minutes
on a busy shared 2-core machine; see ``wall_time_s`` in ``training.json``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import sysconfig
import time
from pathlib import Path

import safetensors
import safetensors.torch
import tokenizers
import torch
import transformer_lens
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformer_lens import HookedTransformer, HookedTransformerConfig
from transformers import PreTrainedTokenizerFast

REPO_ROOT = Path(__file__).resolve().parent.parent
# Package data, so that the model ships in the wheel (see tl_attnonly.bundled).
DEFAULT_OUT_DIR = REPO_ROOT / "tl_attnonly" / "data" / "models" / "tiny-stdlib-silu"

SEED = 0
VOCAB_SIZE = 3072
SPECIAL_TOKEN = "<|endoftext|>"
N_CTX = 128
BATCH_SIZE = 16
STEPS = 2000
PEAK_LR = 2e-3
MIN_LR_FRACTION = 0.1
WARMUP_STEPS = 100
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
EVAL_EVERY = 500
TRAIN_EVAL_WINDOWS = 256

MODEL_KWARGS: dict = {
    "model_name": "tiny-stdlib-silu",
    "n_layers": 2,
    "d_model": 128,
    "n_heads": 4,
    "d_head": 32,
    "d_mlp": 512,
    "n_ctx": N_CTX,
    "d_vocab": VOCAB_SIZE,
    "act_fn": "silu",
    "normalization_type": "LN",
    "positional_embedding_type": "standard",
    "attn_only": False,
    "attention_dir": "causal",
    "original_architecture": None,
    "tokenizer_name": None,
    "default_prepend_bos": True,
    "init_weights": True,
    "init_mode": "gpt2",
    "seed": SEED,
}

# Standard-library modules used for training (sorted; read from name.py or name/__init__.py).
TRAIN_MODULES: tuple[str, ...] = (
    "_collections_abc",
    "_pydecimal",
    "_pyio",
    "argparse",
    "ast",
    "asyncio/base_events",
    "asyncio/events",
    "asyncio/streams",
    "asyncio/tasks",
    "bdb",
    "calendar",
    "cmd",
    "codecs",
    "collections",
    "concurrent/futures/_base",
    "concurrent/futures/process",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "difflib",
    "dis",
    "doctest",
    "email/_header_value_parser",
    "email/message",
    "enum",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "gettext",
    "glob",
    "gzip",
    "heapq",
    "hmac",
    "http/client",
    "http/cookiejar",
    "http/server",
    "imaplib",
    "importlib/_bootstrap",
    "importlib/_bootstrap_external",
    "inspect",
    "ipaddress",
    "json/decoder",
    "json/encoder",
    "locale",
    "logging",
    "logging/handlers",
    "mailbox",
    "multiprocessing/connection",
    "multiprocessing/pool",
    "ntpath",
    "operator",
    "optparse",
    "os",
    "pathlib",
    "pdb",
    "pickle",
    "pickletools",
    "platform",
    "plistlib",
    "posixpath",
    "pprint",
    "pstats",
    "pydoc",
    "random",
    "selectors",
    "shutil",
    "smtplib",
    "socket",
    "socketserver",
    "ssl",
    "statistics",
    "subprocess",
    "tarfile",
    "tempfile",
    "threading",
    "tokenize",
    "trace",
    "traceback",
    "typing",
    "unittest/case",
    "unittest/mock",
    "urllib/parse",
    "urllib/request",
    "uuid",
    "warnings",
    "weakref",
    "xml/dom/minidom",
    "zipfile",
)

# Held-out standard-library modules used only for the validation loss.
VAL_MODULES: tuple[str, ...] = (
    "base64",
    "bisect",
    "numbers",
    "sched",
    "shlex",
    "textwrap",
)

# A fixed probe whose loss is stored in training.json so that loaders can verify the weights.
PROBE_TEXT = (
    "import os\n\n\n"
    "def read_lines(path):\n"
    '    """Return the lines of a text file."""\n'
    "    with open(path, encoding='utf-8') as f:\n"
    "        return [line.rstrip('\\n') for line in f]\n"
)


def resolve_module_file(stdlib: Path, name: str) -> Path | None:
    """Return the source file of a stdlib module, or None if it does not exist.

    Args:
        stdlib: The standard-library directory.
        name: Module path with ``/`` separators, e.g. ``"json/decoder"``.

    Returns:
        ``stdlib/name.py`` if it exists, else ``stdlib/name/__init__.py`` if it exists, else None.
    """
    for candidate in (stdlib / f"{name}.py", stdlib / name / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def load_texts(stdlib: Path, names: tuple[str, ...]) -> tuple[list[str], list[dict]]:
    """Read the source text of the given stdlib modules.

    Args:
        stdlib: The standard-library directory.
        names: Module names as in ``TRAIN_MODULES``.

    Returns:
        The texts and, for each file used, a record with its stdlib-relative path, byte size and
        SHA-256.
    """
    texts, records = [], []
    for name in names:
        path = resolve_module_file(stdlib, name)
        if path is None:
            print(f"warning: stdlib module {name!r} not found, skipped", file=sys.stderr)
            continue
        raw = path.read_bytes()
        texts.append(raw.decode("utf-8"))
        records.append(
            {
                "path": path.relative_to(stdlib).as_posix(),
                "bytes": len(raw),
                "sha256": hashlib.sha256(raw).hexdigest(),
            }
        )
    return texts, records


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer and wrap it for ``transformers``.

    Args:
        texts: Training documents.

    Returns:
        A fast tokenizer whose BOS, EOS and PAD token are ``<|endoftext|>`` (id 0).
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[SPECIAL_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKEN,
        eos_token=SPECIAL_TOKEN,
        pad_token=SPECIAL_TOKEN,
        model_max_length=N_CTX,
    )


def encode_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """Encode documents into one stream ``EOS doc_1 EOS doc_2 ...``.

    Args:
        tokenizer: The tokenizer.
        texts: Documents.

    Returns:
        A 1-D int64 tensor of token ids.
    """
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for text in texts:
        ids.append(eos)
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
    return torch.tensor(ids, dtype=torch.long)


def windows_with_bos(stream: torch.Tensor, starts: torch.Tensor, bos: int) -> torch.Tensor:
    """Cut ``N_CTX - 1``-token windows from a stream and prefix each with BOS.

    Args:
        stream: 1-D token stream.
        starts: 1-D tensor of window start offsets.
        bos: BOS token id.

    Returns:
        Tensor of shape ``(len(starts), N_CTX)``.
    """
    offsets = torch.arange(N_CTX - 1)
    body = stream[starts[:, None] + offsets[None, :]]
    return torch.cat([torch.full((len(starts), 1), bos, dtype=torch.long), body], dim=1)


@torch.no_grad()
def mean_loss(model: HookedTransformer, batches: torch.Tensor, batch_size: int = 32) -> float:
    """Mean next-token loss over sequences (all sequences have the same length).

    Args:
        model: The model.
        batches: Tensor of shape ``(n, N_CTX)``.
        batch_size: Evaluation batch size.

    Returns:
        The mean per-token loss in nats.
    """
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(batches), batch_size):
        chunk = batches[i : i + batch_size]
        loss = model(chunk, return_type="loss")
        n = chunk.shape[0] * (chunk.shape[1] - 1)
        total += loss.item() * n
        count += n
    model.train(was_training)
    return total / count


def unigram_baselines(train: torch.Tensor, val: torch.Tensor, vocab: int) -> dict:
    """Unigram entropy (train) and unigram cross-entropy on validation (add-one smoothed).

    Args:
        train: Training token stream.
        val: Validation token stream.
        vocab: Vocabulary size.

    Returns:
        Dict with ``unigram_train_entropy`` and ``unigram_val_cross_entropy`` in nats.
    """
    counts = torch.bincount(train, minlength=vocab).double()
    p = counts / counts.sum()
    nz = p > 0
    entropy = -(p[nz] * p[nz].log()).sum().item()
    p_smooth = (counts + 1) / (counts.sum() + vocab)
    val_ce = -p_smooth.log()[val].mean().item()
    return {"unigram_train_entropy": entropy, "unigram_val_cross_entropy": val_ce}


def lr_at(step: int) -> float:
    """Learning rate for a step: linear warm-up, then cosine decay to ``MIN_LR_FRACTION``.

    Args:
        step: Zero-based optimiser step.

    Returns:
        The learning rate.
    """
    if step < WARMUP_STEPS:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, STEPS - WARMUP_STEPS)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return PEAK_LR * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * cosine)


def main(argv: list[str] | None = None) -> None:
    """Train the model and write it to the output directory.

    Args:
        argv: Command-line arguments (default ``sys.argv[1:]``).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    args = parser.parse_args(argv)
    out_dir: Path = args.out_dir

    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    t_start = time.time()

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train_texts, train_files = load_texts(stdlib, TRAIN_MODULES)
    val_texts, val_files = load_texts(stdlib, VAL_MODULES)
    data_hash = hashlib.sha256(
        "".join(r["sha256"] for r in train_files + val_files).encode()
    ).hexdigest()
    print(f"train files: {len(train_files)}, val files: {len(val_files)}")

    # Save the tokenizer first and reload it, so that it loads from disk exactly as it will for
    # users (TransformerLens re-creates it from its ``name_or_path`` to enable BOS prepending).
    out_dir.mkdir(parents=True, exist_ok=True)
    train_tokenizer(train_texts).save_pretrained(str(out_dir))
    # Name the generic class (not transformers 5's alias "TokenizersBackend") so that
    # AutoTokenizer in older transformers releases can load the directory too.
    tok_cfg_path = out_dir / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2) + "\n")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out_dir), local_files_only=True)
    assert len(tokenizer) == VOCAB_SIZE, len(tokenizer)
    assert tokenizer.eos_token_id == 0
    train_stream = encode_stream(tokenizer, train_texts)
    val_stream = encode_stream(tokenizer, val_texts)
    train_bytes = sum(r["bytes"] for r in train_files)
    t_tok = time.time() - t_start
    print(
        f"tokenizer done in {t_tok:.1f}s; train tokens {len(train_stream)} "
        f"({train_bytes / len(train_stream):.2f} bytes/token), val tokens {len(val_stream)}"
    )

    bos = tokenizer.bos_token_id
    val_starts = torch.arange(0, len(val_stream) - (N_CTX - 1) + 1, N_CTX - 1)
    val_batches = windows_with_bos(val_stream, val_starts, bos)
    gen = torch.Generator().manual_seed(SEED)
    n_starts = len(train_stream) - (N_CTX - 1) + 1
    train_eval_starts = torch.randint(0, n_starts, (TRAIN_EVAL_WINDOWS,), generator=gen)
    train_eval_batches = windows_with_bos(train_stream, train_eval_starts, bos)
    baselines = unigram_baselines(train_stream, val_stream, VOCAB_SIZE)
    baselines["uniform"] = math.log(VOCAB_SIZE)
    print("baselines:", {k: round(v, 4) for k, v in baselines.items()})

    cfg = HookedTransformerConfig(**MODEL_KWARGS, dtype=torch.float32, device="cpu")
    model = HookedTransformer(cfg, tokenizer=tokenizer)
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        is_matrix = param.ndim >= 2 and name != "pos_embed.W_pos"
        (decay if is_matrix else no_decay).append(param)
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": WEIGHT_DECAY},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=PEAK_LR,
        betas=BETAS,
    )

    history = []
    recent: list[float] = []
    t_train = time.time()
    model.train()
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        starts = torch.randint(0, n_starts, (BATCH_SIZE,), generator=gen)
        tokens = windows_with_bos(train_stream, starts, bos)
        loss = model(tokens, return_type="loss")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        recent = (recent + [loss.item()])[-100:]
        if (step + 1) % EVAL_EVERY == 0 or step + 1 == STEPS:
            val_loss = mean_loss(model, val_batches)
            entry = {
                "step": step + 1,
                "train_loss_last100": sum(recent) / len(recent),
                "val_loss": val_loss,
                "elapsed_s": round(time.time() - t_train, 1),
            }
            history.append(entry)
            print(entry, flush=True)
    train_seconds = time.time() - t_train

    model.eval()
    final_val = mean_loss(model, val_batches)
    final_train = mean_loss(model, train_eval_batches)
    probe_loss = model(PROBE_TEXT, return_type="loss").item()
    print(f"final train loss {final_train:.4f}, val loss {final_val:.4f}, probe {probe_loss:.4f}")

    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    safetensors.torch.save_file(state, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(MODEL_KWARGS, indent=2) + "\n")
    metadata = {
        "model_name": MODEL_KWARGS["model_name"],
        "description": (
            "Tiny 2-layer SiLU decoder trained on Python standard-library source code by "
            "scripts/train_tiny_model.py"
        ),
        "saved_dtype": "float32",
        "seed": SEED,
        "hyperparameters": {
            "vocab_size": VOCAB_SIZE,
            "n_ctx": N_CTX,
            "batch_size": BATCH_SIZE,
            "steps": STEPS,
            "tokens_seen": STEPS * BATCH_SIZE * N_CTX,
            "optimizer": "AdamW",
            "peak_lr": PEAK_LR,
            "min_lr_fraction": MIN_LR_FRACTION,
            "warmup_steps": WARMUP_STEPS,
            "schedule": "linear warmup then cosine decay",
            "betas": list(BETAS),
            "weight_decay": WEIGHT_DECAY,
            "weight_decay_applies_to": "weight matrices except pos_embed.W_pos",
            "grad_clip": GRAD_CLIP,
            "torch_num_threads": 1,
        },
        "data": {
            "source": "Python standard library .py files (sysconfig.get_paths()['stdlib'])",
            "python_version": platform.python_version(),
            "python_implementation": platform.python_implementation(),
            "train_modules": list(TRAIN_MODULES),
            "val_modules": list(VAL_MODULES),
            "train_files": train_files,
            "val_files": val_files,
            "sha256_of_file_hashes": data_hash,
            "train_bytes": train_bytes,
            "train_tokens": len(train_stream),
            "val_tokens": len(val_stream),
            "val_windows": len(val_batches),
            "stream_format": "<|endoftext|> file_1 <|endoftext|> file_2 ...",
            "sequence_format": "<|endoftext|> + random window of n_ctx-1 stream tokens",
        },
        "results": {
            "final_train_loss": final_train,
            "final_train_loss_note": (
                f"mean loss over {TRAIN_EVAL_WINDOWS} fixed random training windows, eval mode"
            ),
            "final_val_loss": final_val,
            **baselines,
            "history": history,
        },
        "probe": {"text": PROBE_TEXT, "loss": probe_loss},
        "wall_time_s": {
            "data_and_tokenizer": round(t_tok, 1),
            "training": round(train_seconds, 1),
            "total": round(time.time() - t_start, 1),
        },
        "versions": {
            "torch": torch.__version__,
            "transformer_lens": _version("transformer_lens", transformer_lens),
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "safetensors": safetensors.__version__,
        },
    }
    (out_dir / "training.json").write_text(json.dumps(metadata, indent=2) + "\n")
    print(f"saved to {out_dir} in {time.time() - t_start:.1f}s total")


def _version(dist: str, module: object) -> str:
    """Best-effort version string of an installed distribution."""
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # pragma: no cover - metadata missing
        return str(getattr(module, "__version__", "unknown"))


if __name__ == "__main__":
    main()
