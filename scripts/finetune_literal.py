"""Fine-tune the literal form (omega pseudo-masks) of the bundled model; watch the masks and loss.

The paper's open question (2): can an attention-only model with pseudo-masking be trained, and
what do regularisers do to the masks? The literal form writes every mask into ``W_Q``/``W_K`` as a
``-omega`` score (Theorem 9), so nothing but the weights keeps a neuron-head off other tokens.

For each omega and each regime (plain; attention-pattern dropout; L2 on every head's ``W_QK =
W_Q W_K^T``; both) this fine-tunes all parameters with Adam on Python stdlib source (offline) and
prints, before and after: held-out loss, and the leaked attention: the attention mass a query gives
to keys its head must not see, its maximum and its mean over sublayers, heads and queries (the
maximum is :func:`tl_attnonly.literal.omega.max_masked_attention`).

Usage::

    python scripts/finetune_literal.py [--steps 150] [--omegas 10000 16] [--regimes plain l2]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from tl_attnonly.analysis.summaries import stdlib_corpus
from tl_attnonly.bundled import load_bundled_model
from tl_attnonly.literal import to_literal

TRAIN_MODULES = ("textwrap", "string", "shlex", "fnmatch", "glob", "bisect")
VAL_MODULES = ("heapq", "colorsys")


def rows(model, modules, length: int) -> torch.Tensor:
    """Token rows ``[n, length]`` of the modules' source, each starting with BOS."""
    stream = torch.cat(
        [model.to_tokens(t, prepend_bos=False)[0] for t in stdlib_corpus(modules, lines_per_doc=40)]
    )
    n = stream.shape[0] // (length - 1)
    body = stream[: n * (length - 1)].view(n, length - 1)
    bos = torch.full((n, 1), model.tokenizer.bos_token_id)
    return torch.cat([bos, body], dim=1)


def loss_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def wqk_l2(literal) -> torch.Tensor:
    """``sum over heads ||W_Q W_K^T||_F^2`` (= trace((W_Q^T W_Q)(W_K^T W_K)), cheap)."""
    total = 0.0
    for _, module in literal.sublayers():
        gq = module.W_Q.transpose(1, 2) @ module.W_Q
        gk = module.W_K.transpose(1, 2) @ module.W_K
        total = total + (gq * gk).sum()
    return total


def leaks(literal, tokens: torch.Tensor) -> tuple[float, float]:
    """(max, mean) over sublayers, heads and queries of the attention mass on masked keys."""
    worst, total, count = 0.0, 0.0, 0

    def make_hook(module):
        def hook(pattern, hook):
            nonlocal worst, total, count
            allowed = module.allowed_pattern(pattern.shape[-1]).to(pattern.device)
            leak = (pattern.double() * (~allowed).double()).sum(-1)  # [batch, head, query]
            worst = max(worst, float(leak.max()))
            total += float(leak.sum())
            count += leak.numel()

        return hook

    hooks = [(f"{name}.hook_pattern", make_hook(module)) for name, module in literal.sublayers()]
    with torch.no_grad():
        literal.run_with_hooks(tokens, fwd_hooks=hooks)
    return worst, total / max(count, 1)


def run(base, train, val, omega: float, regime: str, steps: int, batch: int, lr: float) -> dict:
    literal = to_literal(base, omega=omega, max_len=train.shape[1])
    literal.train()
    dropout = "dropout" in regime
    l2 = 1e-6 if "l2" in regime else 0.0
    hooks = []
    if dropout:
        names = [f"{name}.hook_pattern" for name, _ in literal.sublayers()]
        hooks = [(name, lambda p, hook: F.dropout(p, 0.1, training=True)) for name in names]
    with torch.no_grad():
        before_loss = loss_of(literal(val), val).item()
    before_leak = leaks(literal, val[:8])
    opt = torch.optim.Adam(literal.parameters(), lr=lr)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(0, train.shape[0], (batch,), generator=g)
        tokens = train[idx]
        logits = literal.run_with_hooks(tokens, fwd_hooks=hooks) if hooks else literal(tokens)
        loss = loss_of(logits, tokens)
        if l2:
            loss = loss + l2 * wqk_l2(literal)
        opt.zero_grad()
        loss.backward()
        opt.step()
    literal.eval()
    with torch.no_grad():
        after_loss = loss_of(literal(val), val).item()
    after_leak = leaks(literal, val[:8])
    return dict(
        omega=omega, regime=regime, loss_before=before_loss, loss_after=after_loss,
        leak_before=before_leak, leak_after=after_leak,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--omegas", type=float, nargs="*", default=[1e4, 16.0])
    parser.add_argument("--regimes", nargs="*", default=["plain", "dropout", "l2", "dropout+l2"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    start = time.perf_counter()
    base = load_bundled_model()
    train, val = rows(base, TRAIN_MODULES, args.length), rows(base, VAL_MODULES, args.length)[:32]
    with torch.no_grad():
        original = loss_of(base(val), val).item()
    print(
        f"bundled model (fp32), literal form (layout='neuron'), {args.steps} Adam steps, lr "
        f"{args.lr}, batch {args.batch} x {args.length} tokens, {train.shape[0]} training rows; "
        f"held-out: {val.shape[0]} rows; original model's held-out loss {original:.4f}"
    )
    print(
        "| omega | regime | held-out loss before | after | leaked attention, max before | after "
        "| mean before | mean after |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for omega in args.omegas:
        for regime in args.regimes:
            r = run(base, train, val, omega, regime, args.steps, args.batch, args.lr)
            print(
                f"| {omega:g} | {regime} | {r['loss_before']:.4f} | {r['loss_after']:.4f} | "
                f"{r['leak_before'][0]:.3g} | {r['leak_after'][0]:.3g} | "
                f"{r['leak_before'][1]:.3g} | {r['leak_after'][1]:.3g} |"
            )
    print(f"total time {time.perf_counter() - start:.0f} s ({args.threads} threads)")


if __name__ == "__main__":
    main()
