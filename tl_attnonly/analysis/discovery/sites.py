"""How the nodes of the head graph read and write the residual stream, and shared checks.

Used by :mod:`.edge_scores` (edge attribution patching) and :mod:`.runs` (exact circuit
runs): which hook holds what a source writes (and its writing matrix ``U``), which hook holds what
an input reads (and its reading matrix ``R``), and through which normalisation.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, cast

import torch
from jaxtyping import Int

from tl_attnonly._types import check_token_pair
from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.discovery.attention_support import (
    attention_problems,
    latent_attn_input_hook,
)
from tl_attnonly.analysis.discovery.expert_nodes import (
    expert_neuron_values,
    expert_neuron_writer,
    expert_source_hooks,
    expert_source_values,
    expert_writer,
)
from tl_attnonly.analysis.discovery.graph import (
    EMBED,
    EXPERT,
    EXPERT_NEURON,
    EXPERTS,
    LATENT_ATTN,
    LOGITS,
    MLP_REST,
    HeadGraph,
    InputGroup,
    SourceGroup,
)
from tl_attnonly.analysis.metric_reads import (  # re-exported: discovery's modules read them here
    DiscoveryMetric as DiscoveryMetric,
)
from tl_attnonly.analysis.metric_reads import call_metric as call_metric
from tl_attnonly.analysis.metric_reads import check_logit_positions as check_logit_positions
from tl_attnonly.analysis.metric_reads import logit_positions as logit_positions
from tl_attnonly.analysis.patching.dense_layers import expert_layers
from tl_attnonly.analysis.post_norm import has_post_norms, normed, post_norm, scale_hook
from tl_attnonly.hooks import block_act_name, head_act_name, neuron_act_name

if TYPE_CHECKING:
    from tl_attnonly.protocol import (
        AttnOnlyModel,
        GatedNeuronHeadLayerView,
        ModelLike,
        NeuronHeadLayerView,
        Norm,
    )

Mask = dict[tuple[str, str], torch.Tensor]

#: Default memory budget for one block of intermediate tensors (bytes).
BLOCK_BUDGET = 2**28


# ---------------------------------------------------------------------------------------------
# checks and small helpers
# ---------------------------------------------------------------------------------------------


def check_discoverable(model: ModelLike, neuron_level: bool = True) -> None:
    """Refuse, before any work, models whose residual stream is not a sum of node outputs.

    Args:
        model: The model to check (an :class:`~tl_attnonly.protocol.AttnOnlyModel`, or a model
            :func:`~tl_attnonly.adapt.analysis_model` takes).
        neuron_level: The graph's granularity (head level is refused for gated MLPs with K > 1).

    Raises:
        TypeError: If ``model`` is not converted.
        NotImplementedError: For encoders, mixtures of experts without a hook of their input
            (:func:`expert_problems`; a converted bridge's are one node each), a post-LN of the
            residual stream
            (norms after each sublayer are handled, unless their sublayer has an output bias:
            :func:`post_norm_problems`), positions other than learned, rotary or ALiBi (a bias
            inside the scores, which the model adds to rebuilt ``q``/``k``), attention-only
            models, and neuron-head level on gated MLPs with ``K > 1``. (Q/K norms are inside a
            head: its ``hook_q``/``hook_k`` hold ``W_Q ln1(x) + b_Q`` before the norm, so a run
            rebuilds them from the residual input as for any head and the model normalises
            them.)
    """
    model = analysis_model(model)
    if model.is_encoder:
        raise NotImplementedError(
            "Edge-level circuit discovery needs a pre-norm decoder; a BERT-style encoder "
            "normalises after each residual addition, so its residual stream is not a sum of node "
            "outputs. Use node-level circuits: tl_attnonly.analysis.discovery.node_circuits."
            "discover_node_circuit (same scores, exact runs and gate/value split, per node)."
        )
    cfg = model.cfg
    problems = []
    if cfg.positional_embedding_type not in ("standard", "rotary", "alibi"):
        problems.append(f"positional_embedding_type={cfg.positional_embedding_type!r}")
    problems += post_norm_problems(model)
    problems += attention_problems(model)  # multi-head latent attention without its input hook
    if cfg.attn_only:
        problems.append("attn_only=True (no neuron-heads)")
    problems += expert_problems(model)
    for li, block in enumerate(model.blocks):
        if not block.mlp.converted:
            problems.append(f"blocks.{li}.mlp is a {type(block.mlp).__name__}")
    gated = model.cfg.gated_mlp
    if gated and not neuron_level and model.n_heads_per_neuron > 1:
        problems.append(
            f"neuron_level=False on gated MLPs with K={model.n_heads_per_neuron} heads per neuron "
            "(the K heads share one gate read and one value read; use neuron_level=True)"
        )
    if problems:
        raise NotImplementedError(
            "Circuit discovery needs a pre-norm decoder whose residual stream is the sum of the "
            "embeddings and the nodes' outputs (LN, LNPre, RMS, RMSPre or no normalisation; "
            "learned, rotary or ALiBi positions; NeuronHeadMLP or GatedNeuronHeadMLP layers, or "
            "a converted bridge's mixtures of experts). Not supported here: "
            + ", ".join(problems)
            + "."
        )


def expert_problems(model: AttnOnlyModel) -> list[str]:
    """What of a model's mixtures of experts no exact run handles (``[]``: none).

    A mixture-of-experts layer is one node, ``L{l}MLP`` (:data:`~.graph.EXPERTS`): its output
    is ``hook_mlp_out`` and its input what its norm gives the router and the experts
    (``blocks.{l}.mlp.hook_in``), rebuilt from the residual input like any reader's; the layer
    routes that input itself, so a run's routing is its own. That input hook is a converted
    bridge's; an :class:`~tl_attnonly.AttnOnlyTransformer`'s MoE (TransformerLens's) has none
    and is refused, as are expert layers with a norm after them or none before them (none in
    the zoo).
    """
    problems = []
    hooks = model.hook_dict
    for li in sorted(expert_layers(model)):
        block = model.blocks[li]
        if experts_input_hook(li) not in hooks:
            problems.append(
                f"blocks.{li}.mlp ({type(getattr(block.mlp, 'module', block.mlp)).__name__}) "
                "has no hook of its normalised "
                "input, blocks.{l}.mlp.hook_in (TransformerLens's MoE on an AttnOnlyTransformer; "
                "analyse a converted TransformerBridge of the model)"
            )
        elif block.ln2 is None or block.ln2_post is not None:
            problems.append(
                f"blocks.{li}.mlp is a mixture of experts without a norm before it, or with one "
                "after it"
            )
    return problems


def experts_input_hook(layer: int) -> str:
    """``blocks.{layer}.mlp.hook_in``: what an expert layer's router and experts read, the
    layer's normalised input (a converted bridge's MLP component's hook)."""
    return f"blocks.{layer}.mlp.hook_in"


def post_norm_problems(model: AttnOnlyModel) -> list[str]:
    """What of a model's post-norms no exact run handles (``[]``: none).

    Norms after each sublayer (Gemma 2/3, OLMo 2/3, GLM-4) are handled: a node's output in a run
    is its share of its sublayer's normed output, the norm's scale the run's
    (:mod:`tl_attnonly.analysis.post_norm`). The sublayer's output bias would be a term of its
    own whose scale changes with the run, belonging to no node: such a sublayer is refused (the
    families above have none). A norm of the residual stream itself (OPT's post-LN) is refused.
    """
    if not model.cfg.post_norm:
        return []
    if not has_post_norms(model):
        return ["post-LN of the residual stream (LN(resid + sublayer_out))"]
    problems = []
    for li, block in enumerate(model.blocks):
        for sublayer, norm, b_O in (
            ("attn", block.ln1_post, block.attn.b_O),
            ("mlp", block.ln2_post, block.mlp.b_O),
        ):
            if norm is None:
                continue
            centred = b_O - b_O.mean() if norm.centred else b_O
            if bool(centred.detach().abs().max() > 0):
                problems.append(
                    f"blocks.{li}.{sublayer}'s output bias before its norm (a term whose scale "
                    "changes with the run and that belongs to no node)"
                )
    return problems


def check_scoring_args(
    model: ModelLike,
    clean_tokens,
    corrupted_tokens,
    method: str,
    ig_steps: int,
    neuron_level: bool,
) -> None:
    """Refuse, before any work, what edge attribution cannot score (model, tokens, method)."""
    model = analysis_model(model)
    check_discoverable(model, neuron_level)
    check_token_pair(clean_tokens, corrupted_tokens)
    if method not in ("eap", "eap-ig"):
        raise ValueError(f"method must be 'eap' or 'eap-ig', got {method!r}.")
    if method == "eap-ig" and ig_steps < 1:
        raise ValueError(f"ig_steps must be >= 1, got {ig_steps}.")


def check_additive(
    model: ModelLike,
    tokens: Int[torch.Tensor, "batch pos"],
    metric: DiscoveryMetric,
    batches: list,
) -> None:
    """Refuse, before any work, a metric that is not additive over examples when it is summed
    over several batches (a per-batch mean would scale the reported metrics by the batch count).

    Runs the first (up to) four clean examples once and compares the metric of all of them with
    the sum of the metric of their two halves.

    Raises:
        ValueError: If they differ (say ``metric_reduction="mean"``, or make the metric a sum).
    """
    model = analysis_model(model)
    if len(batches) < 2:
        return
    rows = torch.arange(min(tokens.shape[0], 4))
    half = len(rows) // 2
    try:
        with torch.no_grad():
            logits = model(tokens[rows])
            whole = call_metric(metric, logits, rows).item()
            parts = (
                call_metric(metric, logits[:half], rows[:half]).item()
                + call_metric(metric, logits[half:], rows[half:]).item()
            )
    except (IndexError, RuntimeError) as error:
        raise ValueError(
            "The metric fails on a batch of the examples; with batch_size it is called with the "
            "batch's logits and indices: write it as metric(logits, indices) "
            "(e.g. IOIDataset.additive_metric(), logit_diff_metric)."
        ) from error
    if not math.isclose(whole, parts, rel_tol=1e-3, abs_tol=1e-6):
        raise ValueError(
            f"The metric is not additive over examples: {whole:.6g} on the first {len(rows)} "
            f"examples, {parts:.6g} summed over their two halves (a per-batch mean gives half). "
            "Summed over batches it would scale the reported metrics by the number of batches. "
            "Make it a sum (a dataset mean as a sum divided by the dataset size: "
            "IOIDataset.additive_metric(), logit_diff_metric), or declare "
            "metric_reduction='mean' to discover_circuit."
        )


def logit_diff_metric(
    correct: Int[torch.Tensor, " batch"],
    wrong: Int[torch.Tensor, " batch"],
    position: int = -1,
) -> DiscoveryMetric:
    """``mean over the dataset of logit[correct] - logit[wrong]`` at ``position``, batch-additive.

    Args:
        correct, wrong: One token id per example, ``[n_examples]``.
        position: Which position's logits (default the last).

    Returns:
        A ``metric(logits, indices)`` whose sum over batches is the dataset mean; its
        ``logit_positions`` attribute declares the one position it reads per row
        (:func:`logit_positions`).
    """
    n = correct.shape[0]

    def metric(logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        last = logits[:, position]
        rows = torch.arange(last.shape[0], device=last.device)
        c, w = correct.to(last.device)[indices], wrong.to(last.device)[indices]
        return (last[rows, c] - last[rows, w]).sum() / n

    # the logits it reads (exact runs compute only these: logit_positions)
    metric.logit_positions = lambda indices: torch.full((len(indices),), position)  # type: ignore[attr-defined]
    return metric


def batch_indices(n: int, batch_size: int | None) -> list[torch.Tensor]:
    size = n if batch_size is None else max(1, batch_size)
    return [torch.arange(s, min(n, s + size)) for s in range(0, n, size)]


def neuron_head_coef(mlp: NeuronHeadLayerView, like: torch.Tensor, which: int) -> torch.Tensor:
    """One coefficient ``[K]`` of the neuron-heads (0: b, 1: d, 2: f, 3: e, 4: g)."""
    return mlp.coefficient_tensors(like)[which]


def qkv_weights(attn, inp: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W [heads, d_model, d_head], b [heads, d_head])`` of ``q``, ``k`` or ``v``.

    For ``k`` and ``v`` of grouped-query attention: one per key/value head.
    """
    if inp == "q":
        return attn.W_Q, attn.b_Q
    name = inp.upper()
    if hasattr(attn, f"_W_{name}"):  # grouped-query attention: one weight per key/value head
        return getattr(attn, f"_W_{name}"), getattr(attn, f"_b_{name}")
    return getattr(attn, f"W_{name}"), getattr(attn, f"b_{name}")


def input_site(model: AttnOnlyModel, dst: InputGroup) -> tuple[Norm | None, str]:
    """The normalisation an input reads through and the hook of its residual input."""
    if dst.kind == LOGITS:
        return None, block_act_name("resid_post", model.cfg.n_layers - 1)
    block = model.blocks[dst.layer]
    if dst.kind in ("attn", LATENT_ATTN):
        return block.ln1, block_act_name("resid_pre", dst.layer)
    resid = "resid_pre" if model.cfg.parallel_attn_mlp else "resid_mid"
    return block.ln2, block_act_name(resid, dst.layer)


def norm_linearisation(norm: Norm | None, x: torch.Tensor):
    """``(x_hat, 1/sigma, w, centred)`` of the normalisation at ``x`` [B, d], or None (identity)."""
    if norm is None:
        return None
    centred = norm.centred
    x = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    xc = x - x.mean(-1, keepdim=True) if centred else x
    sigma = (xc.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()
    return xc / sigma, 1.0 / sigma.squeeze(-1), norm.w, centred


# ---------------------------------------------------------------------------------------------
# what the sources write and what the inputs read
# ---------------------------------------------------------------------------------------------


def source_hook_names(model: ModelLike, graph: HeadGraph) -> list[str]:
    """The hooks :func:`source_values` reads: the embeddings, each layer's heads' ``z`` and
    neuron-heads' ``post`` (neuron level) or ``z``, and the scales of the norms after each
    sublayer (a post-normed node's output is divided by its run's)."""
    model = analysis_model(model)
    names = list(model.embed_hooks)
    for li in range(graph.n_layers):
        names.append(head_act_name("z", li, "attn"))
        if li in graph.split_experts:  # its experts' outputs (and their named neurons')
            names += expert_source_hooks(model, li, neurons=li in graph.expert_neurons)
        elif li in graph.expert_layers:  # the whole layer's output
            names.append(block_act_name("mlp_out", li))
        else:
            names.append(neuron_act_name("post" if graph.neuron_level else "z", li))
        for sublayer in ("attn", "mlp"):
            norm = post_norm(model, li, sublayer)
            if norm is not None:
                names.append(scale_hook(norm))
    return names


def _kept(t: torch.Tensor, group: SourceGroup | InputGroup, dim: int) -> torch.Tensor:
    """``t`` along ``dim`` restricted to the group's kept nodes (a restricted graph's).

    An MLP remainder (one node holding ``m`` neurons) takes its neurons' entries of ``t``
    ``[..., n, 1]`` (``dim = -2``) as one node's ``m`` coefficients ``[..., 1, m]``.
    """
    if group.kind == MLP_REST:
        return t.index_select(dim, torch.tensor(group.index, device=t.device)).transpose(-1, -2)
    if len(group.index) == group.size:
        return t
    return t.index_select(dim, torch.tensor(group.index, dtype=torch.long, device=t.device))


def source_values(
    acts: dict[str, torch.Tensor], src: SourceGroup, graph: HeadGraph, model: ModelLike
) -> torch.Tensor:
    """What a source group writes in the run of ``acts``: coefficients ``[batch, pos, n, r]`` of
    :func:`writer_matrix`. A sublayer normed before it is added (``ln1_post`` / ``ln2_post``):
    divided by the norm's scale in that run (``acts`` holds it: :func:`source_hook_names`), so
    that with :func:`writer_matrix`'s ``w * centre(U)`` they give the node's share of the normed
    output, ``w * centre(out_u) / sigma``."""
    if src.kind == EMBED:  # the embeddings' sum: what enters block 0
        embed_hooks = analysis_model(model).embed_hooks
        out = acts[embed_hooks[0]]
        for name in embed_hooks[1:]:
            out = out + acts[name]
        return out.unsqueeze(2)
    if src.kind == "attn":
        out = acts[head_act_name("z", src.layer, "attn")]
    elif src.kind == EXPERTS:  # [batch, pos, 1, d_model]: the layer's output
        out = acts[block_act_name("mlp_out", src.layer)].unsqueeze(2)
    elif src.kind == EXPERT:  # [batch, pos, n_components, d_model]: each expert's remainder
        named = graph.expert_neurons.get(src.layer, ())
        out = expert_source_values(acts, analysis_model(model), src.layer, named)
    elif src.kind == EXPERT_NEURON:  # [batch, pos, n, 1]: on each one's row of W_out
        out = expert_neuron_values(acts, analysis_model(model), src.layer, src.labels)
    elif graph.neuron_level:
        out = acts[neuron_act_name("post", src.layer)].unsqueeze(-1)
    else:
        out = acts[neuron_act_name("z", src.layer)]
    norm = post_norm(analysis_model(model), src.layer, "attn" if src.kind == "attn" else "mlp")
    if norm is not None:
        out = out / acts[scale_hook(norm)].unsqueeze(-1).to(out.dtype)
    return _kept(out, src, 2)


def writer_matrix(
    model: ModelLike, src: SourceGroup, graph: HeadGraph, like: torch.Tensor
) -> torch.Tensor:
    """``U [n, r, d_model]``: source ``n`` adds ``coefficients[..., n, :] @ U[n]`` to the stream
    (a sublayer normed before it is added: ``w * centre(U)``, its coefficients divided by the
    run's scale, :func:`source_values`)."""
    model = analysis_model(model)
    if src.kind in (EMBED, EXPERTS):
        return torch.eye(model.cfg.d_model, dtype=like.dtype, device=like.device).unsqueeze(0)
    if src.kind == EXPERT:  # each component writes its output vector
        return expert_writer(len(src.labels), like, model.cfg.d_model)
    if src.kind == EXPERT_NEURON:  # each expert neuron writes its row of its expert's W_out
        return expert_neuron_writer(model, src.layer, src.labels, like)
    norm = post_norm(model, src.layer, "attn" if src.kind == "attn" else "mlp")
    if norm is not None:  # w * centre(x U) / sigma = (x / sigma) (w * centre(U))
        scale = like.new_ones(()).expand(1, 1)  # the weights only: the scale is the run's
        return normed(_plain_writer(model, src, graph), norm, scale)
    return _plain_writer(model, src, graph)


def _plain_writer(model: AttnOnlyModel, src: SourceGroup, graph: HeadGraph) -> torch.Tensor:
    """:func:`writer_matrix` of a source group without a norm after its sublayer."""
    if src.kind == "attn":
        return _kept(model.blocks[src.layer].attn.W_O, src, 0)
    W_out = model.blocks[src.layer].mlp.W_out
    if not graph.neuron_level:
        W_out = W_out.repeat_interleave(graph.n_heads_per_neuron, dim=0)
    if src.kind == MLP_REST:  # one node writing sum_i post_i W_out[i]: [1, m, d_model]
        return W_out[list(src.index)].unsqueeze(0)
    return _kept(W_out, src, 0).unsqueeze(1)


def neuron_read_matrix(
    model: ModelLike,
    dst: InputGroup,
    graph: HeadGraph,
) -> torch.Tensor:
    """``[d_model, d_mlp]`` read by a neuron input: ``W_gate`` (gated ``gate``) or ``W_in``."""
    model = analysis_model(model)
    mlp = model.blocks[dst.layer].mlp
    if graph.gated and dst.input == "gate":
        return cast("GatedNeuronHeadLayerView", mlp).W_gate
    return mlp.W_in


def reader_matrix(
    model: ModelLike,
    dst: InputGroup,
    graph: HeadGraph,
    like: torch.Tensor,
) -> torch.Tensor:
    """``R [n, d_model, s]``: input ``n`` reads ``normalised_resid @ R[n]`` (plus a bias)."""
    model = analysis_model(model)
    if dst.kind in (LOGITS, EXPERTS, LATENT_ATTN):  # the residual stream (else normalised) itself
        return torch.eye(model.cfg.d_model, dtype=like.dtype, device=like.device).unsqueeze(0)
    if dst.kind == "attn":
        return _kept(qkv_weights(model.blocks[dst.layer].attn, dst.input)[0], dst, 0)
    W_in = neuron_read_matrix(model, dst, graph)
    if not graph.neuron_level:
        W_in = W_in.repeat_interleave(graph.n_heads_per_neuron, dim=1)
    if dst.kind == MLP_REST:  # one reader of m neurons' inputs: [1, d_model, m]
        return W_in[:, list(dst.index)].unsqueeze(0)
    return _kept(W_in, dst, 1).T.unsqueeze(-1)


def input_hook_name(dst: InputGroup, graph: HeadGraph) -> str:
    """The hook holding what ``dst`` reads (gated MLPs: ``hook_pre`` / ``hook_pre_linear``)."""
    if dst.kind == LOGITS:
        return block_act_name("resid_post", graph.n_layers - 1)
    if dst.kind == EXPERTS:
        return experts_input_hook(dst.layer)
    if dst.kind == LATENT_ATTN:
        return latent_attn_input_hook(dst.layer)
    if dst.kind in ("neuron", MLP_REST) and graph.gated:
        return neuron_act_name("pre" if dst.input == "gate" else "pre_linear", dst.layer)
    head_kind = "attn" if dst.kind == "attn" else "neuron"
    inp = {"gate": "q", "value": "v"}.get(dst.input, dst.input)
    return head_act_name(inp, dst.layer, head_kind)


def read_gradient(
    model: ModelLike,
    dst: InputGroup,
    graph: HeadGraph,
    grad: torch.Tensor,
) -> torch.Tensor:
    """d metric / d (what input ``n`` reads), ``[batch, pos, n, s]``."""
    model = analysis_model(model)
    if dst.kind in (LOGITS, EXPERTS, LATENT_ATTN):
        return grad.unsqueeze(2)
    if dst.kind == "attn":
        return _kept(grad, dst, 2)
    if graph.gated:  # d metric / d g or d u, [batch, pos, d_mlp] (neuron level only)
        return _kept(grad.unsqueeze(-1), dst, 2)
    mlp = model.blocks[dst.layer].mlp
    # q = b*pre + d, v = f*pre + e
    coef = neuron_head_coef(mlp, grad, 0 if dst.input == "gate" else 2)
    K = graph.n_heads_per_neuron
    per_head = grad.squeeze(-1).unflatten(-1, (-1, K)) * coef  # [batch, pos, d_mlp, K]
    if graph.neuron_level:
        return _kept(per_head.sum(-1, keepdim=True), dst, 2)
    return _kept(per_head.flatten(-2).unsqueeze(-1), dst, 2)


__all__ = [
    "BLOCK_BUDGET",
    "check_discoverable",
    "check_scoring_args",
    "logit_diff_metric",
]
