"""Path patching between heads (attention heads and neuron-heads), as in the IOI paper.

Wang et al. (2022), "Interpretability in the Wild", path patching from a set of *sender* heads to
a set of *receivers*, measured on the output:

1. Run the corrupted input with every head's output (``z``) frozen to its corrupted value, except
   the senders, whose ``z`` is their clean value. Record each receiver's input there: an
   attention head's ``q``, ``k``, ``v`` (``blocks.{l}.attn.hook_{q,k,v}``); a neuron-head's query
   and value (``blocks.{l}.mlp.hook_{q,v}``; its key is the constant 1); or, for ``"logits"``, the
   final residual stream.
2. Run the corrupted input again, free, with only the receivers' inputs replaced by those
   recorded values (for ``"logits"``: the senders' direct change to the final residual stream is
   added to it). Return ``patching_metric`` of the logits.

So only paths sender -> receiver count (through the residual stream, not through other heads).
Direction follows TransformerLens's patching: the corrupted run receives clean sender values;
for the IOI paper's direction (corrupted senders in the clean run) swap the two token tensors.

Receivers are written as labels with an optional input suffix: ``"L2H3"`` (q, k and v),
``"L2H3:q"``, ``"L2H3:kv"``, ``"L2N17"`` (q and v), ``"L2N17.1:v"``, or ``"logits"``. In models with
grouped-query attention a ``k``/``v`` receiver is its key/value head, shared by its group.

Sweeps over many senders or receivers, and the grid, are in
:mod:`tl_attnonly.analysis.patching.sweeps`. :func:`path_gate_value_split` splits the paths into
neurons by the inputs they reach (gate, value, both).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Int
from transformer_lens import ActivationCache

from tl_attnonly._types import FwdHooks, Metric, check_token_pair, tokens_on_model_device
from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.patching.dense_layers import refuse_path_patching_experts
from tl_attnonly.hooks import (
    HeadRef,
    block_act_name,
    exact_names_filter,
    head_act_name,
    head_names_filter,
    parse_head_label,
)
from tl_attnonly.protocol import ModelLike

LOGITS = "logits"


@dataclass(frozen=True)
class Receiver:
    """A receiver of path patching.

    Attributes:
        head: The receiving head, or None for the logits (the final residual stream).
        inputs: Which of its inputs receive the senders' paths: a subset of ``"qkv"`` for an
            attention head, of ``"qv"`` for a neuron-head, ``""`` for the logits.
    """

    head: HeadRef | None
    inputs: str


def parse_receiver(
    spec: str | HeadRef | tuple[str | HeadRef, str] | Receiver, n_heads_per_neuron: int = 1
) -> Receiver:
    """A :class:`Receiver` from ``"L2H3"``, ``"L2H3:q"``, ``"L2N17.1:v"``, ``"logits"``, ...

    Also accepts a :class:`HeadRef` (all its inputs) or a ``(label_or_ref, inputs)`` tuple.
    """
    if isinstance(spec, Receiver):
        return spec
    head: str | HeadRef
    inputs: str | None
    if isinstance(spec, HeadRef):  # before tuple: a HeadRef is a NamedTuple
        head, inputs = spec, None
    elif isinstance(spec, tuple):
        head, inputs = spec
    elif spec == LOGITS:
        return Receiver(None, "")
    else:
        head, _, given = spec.partition(":")
        inputs = given or None
    ref = parse_head_label(head, n_heads_per_neuron)
    allowed = "qkv" if ref.kind == "attn" else "qv"
    inputs = allowed if inputs is None else inputs
    if not inputs or set(inputs) - set(allowed):
        what = "an attention head" if ref.kind == "attn" else "a neuron-head (its key is constant)"
        raise ValueError(
            f"Receiver {spec!r}: inputs must be a non-empty subset of {allowed!r} for {what}, got "
            f"{inputs!r}."
        )
    return Receiver(ref, "".join(c for c in allowed if c in inputs))


def receiver_hooks(model: ModelLike, receivers: Sequence[Receiver]) -> dict[str, list[int]]:
    """hook name -> head indices (in that hook's head axis) to patch."""
    model = analysis_model(model)
    n_kv = model.cfg.n_key_value_heads or model.cfg.n_heads
    group = model.cfg.n_heads // n_kv
    out: dict[str, list[int]] = {}
    for rec in receivers:
        if rec.head is None:
            out.setdefault(block_act_name("resid_post", model.cfg.n_layers - 1), [])
            continue
        for inp in rec.inputs:
            head = rec.head.head
            if rec.head.kind == "attn" and inp in "kv":
                head //= group
            heads = out.setdefault(rec.head.act_name(inp), [])
            if head not in heads:
                heads.append(head)
    return out


def path_patch_caches(
    model: ModelLike,
    clean_tokens: Int[torch.Tensor, "batch pos"],
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
) -> tuple[ActivationCache, ActivationCache]:
    """The clean and corrupted caches path patching needs: every head's ``z``, the final resid."""
    model = analysis_model(model)
    refuse_path_patching_experts(model, "path_patch_caches")
    names = head_names_filter("z") | exact_names_filter(
        block_act_name("resid_post", model.cfg.n_layers - 1)
    )
    with torch.no_grad():
        _, clean = model.run_with_cache(clean_tokens, names_filter=names)
        _, corrupted = model.run_with_cache(corrupted_tokens, names_filter=names)
    return clean, corrupted


def record_receiver_inputs(
    model: ModelLike,
    corrupted_tokens: torch.Tensor,
    clean_cache: ActivationCache,
    corrupted_cache: ActivationCache,
    sender_sets: Sequence[Sequence[HeadRef]],
    names: Iterable[str],
) -> dict[str, torch.Tensor]:
    """Step 1 for several sender sets at once (one batch copy each): the corrupted run with
    every head's ``z`` frozen to its corrupted value except the senders' (clean); returns the
    activations of the hooks ``names`` (receivers' inputs), ``[copies * batch, ...]``."""
    model = analysis_model(model)
    copies = len(sender_sets)
    n_layers, n_heads, n_neuron = model.cfg.n_layers, model.cfg.n_heads, model.n_neuron_heads
    device = corrupted_tokens.device
    masks = {
        "attn": torch.zeros(copies, n_layers, n_heads, dtype=torch.bool, device=device),
        "neuron": torch.zeros(copies, n_layers, n_neuron, dtype=torch.bool, device=device),
    }
    for c, senders in enumerate(sender_sets):
        for ref in senders:
            masks[ref.kind][c, ref.layer, ref.head] = True
    tokens = corrupted_tokens.repeat(copies, 1)

    def freeze(kind: str, layer: int):
        mask = masks[kind][:, layer]  # [copies, heads]
        name = head_act_name("z", layer, kind)
        clean, corrupted = clean_cache[name], corrupted_cache[name]

        def hook(z, hook):
            m = mask[:, None, None, :, None]  # [copies, 1(batch), 1(pos), heads, 1(d_head)]
            frozen = torch.where(m, clean[None], corrupted[None])
            return frozen.reshape(z.shape).to(z.dtype)

        return name, hook

    recorded: dict[str, torch.Tensor] = {}

    def record(act, hook):
        recorded[hook.name] = act.detach().clone()

    step1 = [freeze(kind, li) for li in range(n_layers) for kind in ("attn", "neuron")]
    step1 += [(name, record) for name in names]
    with torch.no_grad():
        model.run_with_hooks(tokens, fwd_hooks=step1)
    return recorded


def path_patch_runs(
    model: ModelLike,
    corrupted_tokens: torch.Tensor,
    clean_cache: ActivationCache,
    corrupted_cache: ActivationCache,
    sender_sets: Sequence[Sequence[HeadRef]],
    receivers: Sequence[Receiver],
    patching_metric: Metric,
) -> list[float]:
    """Path patching for several sender sets at once, one batch copy per sender set."""
    model = analysis_model(model)
    copies, batch = len(sender_sets), corrupted_tokens.shape[0]
    n_layers = model.cfg.n_layers
    tokens = corrupted_tokens.repeat(copies, 1)
    # step 1: senders clean, everything else frozen; record the receivers' inputs
    targets = receiver_hooks(model, receivers)
    recorded = record_receiver_inputs(
        model, corrupted_tokens, clean_cache, corrupted_cache, sender_sets, targets
    )

    # step 2: free run, receivers' inputs replaced
    final = block_act_name("resid_post", n_layers - 1)

    def patch(name: str, heads: list[int]):
        def hook(act, hook):
            act = act.clone()  # the neuron-heads' q, v and pre may share storage
            if name == final and not heads:  # the logits: add the senders' direct effect
                return act + recorded[name] - corrupted_cache[name].repeat(copies, 1, 1)
            act[:, :, heads] = recorded[name][:, :, heads]
            return act

        return hook

    step2: FwdHooks = [(name, patch(name, heads)) for name, heads in targets.items()]
    with torch.no_grad():
        logits = model.run_with_hooks(tokens, fwd_hooks=step2)
    return [patching_metric(logits[c * batch : (c + 1) * batch]).item() for c in range(copies)]


def prepare_path_patch(
    model: ModelLike,
    clean_tokens,
    corrupted_tokens,
    receivers,
    clean_cache,
    corrupted_cache,
):
    model = analysis_model(model)
    refuse_path_patching_experts(model, "path_patch")
    clean_tokens, corrupted_tokens = tokens_on_model_device(model, clean_tokens, corrupted_tokens)
    check_token_pair(clean_tokens, corrupted_tokens)
    K = model.n_heads_per_neuron
    if isinstance(receivers, (str, HeadRef, Receiver)):
        receivers = [receivers]
    parsed = [parse_receiver(r, K) for r in receivers]
    if not parsed:
        raise ValueError("Give at least one receiver (a head label, or 'logits').")
    if clean_cache is None or corrupted_cache is None:
        clean_cache, corrupted_cache = path_patch_caches(model, clean_tokens, corrupted_tokens)
    return parsed, clean_cache, corrupted_cache


def path_patch(
    model: ModelLike,
    clean_tokens: Int[torch.Tensor, "batch pos"],
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    senders: Iterable[str | HeadRef],
    receivers: str | Iterable[str | HeadRef | tuple | Receiver],
    patching_metric: Metric,
    *,
    clean_cache: ActivationCache | None = None,
    corrupted_cache: ActivationCache | None = None,
) -> float:
    """Path patching from ``senders`` to ``receivers`` (see the module docstring).

    Args:
        model: An :class:`~tl_attnonly.AttnOnlyTransformer` or a ``TransformerBridge``
            converted with :func:`tl_attnonly.convert` (in place).
        clean_tokens: ``[batch, pos]``; the senders' values come from this run.
        corrupted_tokens: ``[batch, pos]``, same shape; the run that is patched.
        senders: Head labels (``"L0H1"``, ``"L0N5"``, ``"L0N5.1"``) or :class:`HeadRef`s.
        receivers: Receiver specs (``"L1H0:q"``, ``"L1N3"``, ``"logits"``, ...) or one spec.
        patching_metric: Logits ``[batch, pos, d_vocab]`` -> scalar.
        clean_cache, corrupted_cache: Caches from :func:`path_patch_caches`, to reuse them.

    Returns:
        ``patching_metric`` of the path-patched run.
    """
    model = analysis_model(model)
    clean_tokens, corrupted_tokens = tokens_on_model_device(model, clean_tokens, corrupted_tokens)
    parsed, clean_cache, corrupted_cache = prepare_path_patch(
        model, clean_tokens, corrupted_tokens, receivers, clean_cache, corrupted_cache
    )
    K = model.n_heads_per_neuron
    sender_refs = [parse_head_label(s, K) for s in senders]
    return path_patch_runs(
        model, corrupted_tokens, clean_cache, corrupted_cache, [sender_refs], parsed,
        patching_metric,
    )[0]  # fmt: skip


def receiver_label(receiver: Receiver, n_heads_per_neuron: int = 1) -> str:
    """``"logits"``, or the head's label and its inputs: ``"L1H0:qkv"``, ``"L1N3.2:v"``."""
    if receiver.head is None:
        return LOGITS
    return f"{receiver.head.label(n_heads_per_neuron)}:{receiver.inputs}"


def path_gate_value_split(
    model: ModelLike,
    clean_tokens: Int[torch.Tensor, "batch pos"],
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    senders: Sequence[str],
    neurons: Sequence[str],
    metric: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, float]:
    """Gate/value split of the paths ``senders -> neurons`` by exact path patching.

    With :func:`~tl_attnonly.analysis.path_patch` (clean senders into the corrupted run, effect
    measured against the corrupted run's metric):

    - ``gate``: only the neurons' queries (hence patterns) receive the paths;
    - ``value``: only their values do;
    - ``both``: both do;
    - ``interaction = both - gate - value``.

    On gated MLPs this patches the neuron-heads' ``q`` and ``v`` as path patching does: ``gate`` is
    the pattern alone and ``value`` the product ``(f_k g + e_k - g_k) u`` (its ``g`` factor
    included), not the ``g`` / ``u`` split of
    :func:`~tl_attnonly.analysis.circuit_gate_value_split`.

    Args:
        senders: Head labels (``"L0H1"``, ``"L0N5"``, ``"L0N5.1"``).
        neurons: Receiving neurons (``"L1N3"``: all its heads) or neuron-heads (``"L1N3.2"``).
        metric: Logits -> scalar.

    Returns:
        ``{"gate", "value", "both", "interaction", "corrupted"}`` (metric units).
    """
    model = analysis_model(model)
    refuse_path_patching_experts(model, "path_gate_value_split")
    clean_tokens, corrupted_tokens = tokens_on_model_device(model, clean_tokens, corrupted_tokens)
    K = model.n_heads_per_neuron
    heads = []
    for label in neurons:
        if K > 1 and "." not in label:
            heads += [f"{label}.{k}" for k in range(K)]
        else:
            heads.append(label)
    if K > 1:
        senders = (
            [f"{s}.{k}" for s in senders for k in range(K)]
            if all("N" in s and "." not in s for s in senders)
            else list(senders)
        )
    caches = dict(
        zip(
            ("clean_cache", "corrupted_cache"),
            path_patch_caches(model, clean_tokens, corrupted_tokens),
            strict=True,
        )
    )
    with torch.no_grad():
        base = metric(model(corrupted_tokens)).item()
    out = {}
    for name, inputs in (("gate", "q"), ("value", "v"), ("both", "qv")):
        receivers = [f"{h}:{inputs}" for h in heads]
        out[name] = (
            path_patch(model, clean_tokens, corrupted_tokens, senders, receivers, metric, **caches)
            - base
        )
    out["interaction"] = out["both"] - out["gate"] - out["value"]
    out["corrupted"] = base
    return out


__all__ = [
    "LOGITS",
    "Receiver",
    "parse_receiver",
    "path_gate_value_split",
    "path_patch",
    "path_patch_caches",
    "path_patch_runs",
    "prepare_path_patch",
    "receiver_hooks",
    "receiver_label",
    "record_receiver_inputs",
]
