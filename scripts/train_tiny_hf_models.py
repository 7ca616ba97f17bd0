"""Train the tiny bundled Hugging Face models: a Gemma-2-like and a Qwen3-MoE-like decoder.

The recipe of ``scripts/train_tiny_model.py`` (the bundled SiLU model) with two differences: the
models are Hugging Face models (so TransformerLens 3.x and 4.x load them as TransformerBridges,
``tl_attnonly.bundled.load_bundled_bridge(name)``), and half of each batch is synthetic induction
data, so that both models learn an induction circuit worth finding:

* **Data.** The same Python standard-library sources and the bundled model's own tokenizer
  (``tiny-stdlib-silu``'s byte-level BPE, 3072 tokens; copied into each model's directory).
  Each batch of ``BATCH_SIZE = 16`` sequences of ``N_CTX = 128`` tokens holds 4 corpus windows
  (``<|endoftext|>`` + 127 stream tokens, as the SiLU model saw) and 12 repeated random sequences
  (``<|endoftext|>``, then ``h`` tokens drawn uniformly from the induction pool repeated, ``h``
  uniform in 8..63, then corpus tokens up to 128). The pool is
  :func:`tl_attnonly.analysis.induction.induction_token_pool`'s: the 919 distinct tokens of the
  package's bundled prompts (the pool ``make_induction_dataset`` draws from by default). A first
  recipe (8 rows of tokens drawn from the whole vocabulary) learned no induction in 2000 steps.
* **Models** (``MODELS``): 2 layers, d_model 128, 4 query heads of d_head 32 and 2 key/value
  heads, untied embeddings, eager attention.

  * ``tiny-stdlib-gemma2``: ``Gemma2ForCausalLM``: GeGLU (``gelu_pytorch_tanh``) MLP of 512,
    RMSNorms before and after each sublayer, attention-logit soft-capping 50 and final-logit
    soft-capping 30, layer 0 local (sliding window 32), layer 1 global.
  * ``tiny-stdlib-qwen3moe``: ``Qwen3MoeForCausalLM``: q/k RMSNorm per head, 4 SwiGLU experts of
    128 per layer, 2 routed per token (normalised top-k weights), the load-balancing loss at
    coefficient 0.01.
* **Optimisation.** As the SiLU model: ``SEED = 0``, 2000 AdamW steps, peak LR 2e-3, betas (0.9,
  0.95), weight decay 0.1 on matrices (not norms, biases or embeddings' positions), warm-up 100
  steps then cosine to 10%, gradient clipping 1.0, fp32, one thread.

Usage (from the repository root; the recipe module imports TransformerLens 3.x)::

    python scripts/train_tiny_hf_models.py                       # both models
    python scripts/train_tiny_hf_models.py --models tiny-stdlib-gemma2 --steps 200 --out-root out

Each model's directory gets ``config.json`` (the Hugging Face config), ``model.safetensors``,
the tokenizer files and ``training.json`` (recipe, losses, versions, wall time).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import platform
import shutil
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
import transformers

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT_ROOT = REPO_ROOT / "tl_attnonly" / "data" / "models"
TOKENIZER_SOURCE = DEFAULT_OUT_ROOT / "tiny-stdlib-silu"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

SEED = 0
N_CTX = 128
BATCH_SIZE = 16
INDUCTION_ROWS = 12
INDUCTION_HALF = (8, 63)
STEPS = 2000
EVAL_EVERY = 500

_COMMON: dict[str, Any] = dict(
    vocab_size=3072, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=N_CTX, tie_word_embeddings=False,
    bos_token_id=0, eos_token_id=0, pad_token_id=0,
)  # fmt: skip

#: name -> (config class, Hugging Face architecture, config fields)
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "tiny-stdlib-gemma2": (
        "Gemma2Config", "Gemma2ForCausalLM",
        dict(_COMMON, intermediate_size=512, hidden_activation="gelu_pytorch_tanh",
             query_pre_attn_scalar=32, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
             sliding_window=32, layer_types=["sliding_attention", "full_attention"]),
    ),
    "tiny-stdlib-qwen3moe": (
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        dict(_COMMON, intermediate_size=512, moe_intermediate_size=128, num_experts=4,
             num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
             output_router_logits=True, router_aux_loss_coef=0.01, hidden_act="silu"),
    ),
}  # fmt: skip


def _recipe():
    """``scripts/train_tiny_model.py`` as a module (its data, schedule and loss helpers)."""
    spec = importlib.util.spec_from_file_location(
        "train_tiny_model", Path(__file__).with_name("train_tiny_model.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_model(name: str) -> Any:
    """The untrained Hugging Face model ``name`` (seeded), eager attention."""
    config_class, _, fields = MODELS[name]
    config = getattr(transformers, config_class)(**fields)
    config._attn_implementation = "eager"
    torch.manual_seed(SEED)
    return getattr(transformers, MODELS[name][1])(config)


def induction_pool(tokenizer: Any) -> torch.Tensor:
    """The distinct non-special tokens of the package's bundled prompts (as
    :func:`tl_attnonly.analysis.induction.induction_token_pool`), ``[n]``."""
    from tl_attnonly.fidelity_lm import load_prompts

    ids: set[int] = set()
    for text in load_prompts():
        ids.update(tokenizer(text, add_special_tokens=False)["input_ids"])
    return torch.tensor(sorted(ids - set(tokenizer.all_special_ids)))


def induction_rows(
    stream: torch.Tensor, gen: torch.Generator, n: int, bos: int, pool: torch.Tensor
) -> torch.Tensor:
    """``n`` rows: BOS, ``h`` random pool tokens twice, then corpus tokens up to ``N_CTX``."""
    rows = []
    for _ in range(n):
        h = int(torch.randint(INDUCTION_HALF[0], INDUCTION_HALF[1] + 1, (1,), generator=gen))
        half = pool[torch.randint(0, len(pool), (h,), generator=gen)]
        rest = N_CTX - 1 - 2 * h
        start = int(torch.randint(0, len(stream) - rest, (1,), generator=gen))
        rows.append(torch.cat([torch.tensor([bos]), half, half, stream[start : start + rest]]))
    return torch.stack(rows)


def mean_loss(model: Any, batches: torch.Tensor, batch_size: int = 32) -> float:
    """Mean next-token loss (the language-model loss only) over ``batches`` ``[n, N_CTX]``."""
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(batches), batch_size):
            chunk = batches[i : i + batch_size]
            logits = model(chunk).logits
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum"
            )
            total += loss.item()
            count += chunk[:, 1:].numel()
    return total / count


def train(name: str, out_dir: Path, steps: int) -> dict[str, Any]:
    """Train model ``name`` for ``steps`` steps and write it to ``out_dir``; returns the record."""
    recipe = _recipe()
    torch.set_num_threads(1)
    t_start = time.time()
    out_dir.mkdir(parents=True, exist_ok=True)
    for file in TOKENIZER_FILES:
        shutil.copy(TOKENIZER_SOURCE / file, out_dir / file)
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(
        str(out_dir), local_files_only=True
    )
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train_texts, train_files = recipe.load_texts(stdlib, recipe.TRAIN_MODULES)
    val_texts, _ = recipe.load_texts(stdlib, recipe.VAL_MODULES)
    train_stream = recipe.encode_stream(tokenizer, train_texts)
    val_stream = recipe.encode_stream(tokenizer, val_texts)
    bos = tokenizer.bos_token_id
    val_starts = torch.arange(0, len(val_stream) - (N_CTX - 1) + 1, N_CTX - 1)
    val_batches = recipe.windows_with_bos(val_stream, val_starts, bos)
    gen = torch.Generator().manual_seed(SEED)
    n_starts = len(train_stream) - (N_CTX - 1) + 1
    pool = induction_pool(tokenizer)
    induction_val = induction_rows(
        val_stream, torch.Generator().manual_seed(SEED + 1), 64, bos, pool
    )

    model = make_model(name)
    decay, no_decay = [], []
    for param_name, param in model.named_parameters():
        is_matrix = param.ndim >= 2 and "norm" not in param_name
        (decay if is_matrix else no_decay).append(param)
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": recipe.WEIGHT_DECAY},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=recipe.PEAK_LR,
        betas=recipe.BETAS,
    )
    history, recent = [], []
    model.train()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = recipe.lr_at(step) if steps == recipe.STEPS else _lr(recipe, step, steps)
        starts = torch.randint(0, n_starts, (BATCH_SIZE - INDUCTION_ROWS,), generator=gen)
        corpus = recipe.windows_with_bos(train_stream, starts, bos)
        tokens = torch.cat([corpus, induction_rows(train_stream, gen, INDUCTION_ROWS, bos, pool)])
        loss = model(tokens, labels=tokens).loss  # + the router's load-balancing loss (MoE)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.GRAD_CLIP)
        optimizer.step()
        recent = (recent + [loss.item()])[-100:]
        if (step + 1) % EVAL_EVERY == 0 or step + 1 == steps:
            model.eval()
            entry = {
                "step": step + 1,
                "train_loss_last100": sum(recent) / len(recent),
                "val_loss": mean_loss(model, val_batches),
                "induction_val_loss": mean_loss(model, induction_val),
                "elapsed_s": round(time.time() - t_start, 1),
            }
            model.train()
            history.append(entry)
            print(name, entry, flush=True)
    model.eval()
    if hasattr(model.config, "output_router_logits"):  # inference: no router loss
        model.config.output_router_logits = False
    model.save_pretrained(str(out_dir), safe_serialization=True)
    record = {
        "model_name": name,
        "architecture": MODELS[name][1],
        "description": f"Tiny 2-layer {MODELS[name][1]} trained by scripts/train_tiny_hf_models.py",
        "seed": SEED,
        "steps": steps,
        "batch": {"size": BATCH_SIZE, "n_ctx": N_CTX, "induction_rows": INDUCTION_ROWS,
                  "induction_half": list(INDUCTION_HALF)},
        "data": {"train_files": len(train_files), "train_tokens": len(train_stream),
                 "val_tokens": len(val_stream), "tokenizer": "tiny-stdlib-silu's"},
        "results": {"final_val_loss": mean_loss(model, val_batches),
                    "final_induction_val_loss": mean_loss(model, induction_val),
                    "history": history},
        "wall_time_s": round(time.time() - t_start, 1),
        "machine": {"python": platform.python_version(), "threads": 1},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }  # fmt: skip
    (out_dir / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def _lr(recipe: Any, step: int, steps: int) -> float:
    """The recipe's schedule stretched to ``steps`` (a short run keeps its shape)."""
    warmup = max(1, recipe.WARMUP_STEPS * steps // recipe.STEPS)
    if step < warmup:
        return recipe.PEAK_LR * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    floor = recipe.MIN_LR_FRACTION
    return recipe.PEAK_LR * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--out-root", type=Path, default=DEFAULT_OUT_ROOT)
    args = parser.parse_args(argv)
    for name in args.models:
        record = train(name, args.out_root / name, args.steps)
        print(name, "saved;", json.dumps(record["results"]["history"][-1]), file=sys.stderr)


if __name__ == "__main__":
    main()
