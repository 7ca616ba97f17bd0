"""Circuit discovery over attention and neuron-heads: EAP scores, exact circuit runs, splits.

Edge scores are checked against exact path patching where the path is linear (edges into the
logits and into the value inputs of last-layer neurons, in a model without normalisation, metric
linear in the logits), and, with normalisation, against autograd's directional derivative of the
metric along one edge (what EAP estimates, exactly). Circuit runs are checked against activation
patching. Every check runs on plain MLPs and on gated ones (SwiGLU, GeGLU K=4, ReGLU; LLaMA-,
Qwen2-, Mistral-, Phi-3-like configs of ``conftest.GATED_ZOO``), whose ``gate`` input is
``g = x W_gate`` (``hook_pre``) and ``value`` input ``u = x W_in`` (``hook_pre_linear``).
"""

from __future__ import annotations

import pytest
import torch
from conftest import GATED_ZOO, make_tokens
from models import (
    BRIDGES,
    facts,
    hooked_only,
    make_converted,
    make_original,
    tl3_extra,
    tl3_only,
)

import tl_attnonly.vis  # noqa: F401 - registers circuit_figure, which Circuit.figure() calls
from tl_attnonly.analysis import (
    circuit_metric,
    discover_circuit,
    edge_attribution_scores,
    faithfulness,
    logit_diff_metric,
    mask_size,
    path_patch,
    prune,
)
from tl_attnonly.analysis.discovery.graph import HeadGraph

CLEAN, CORRUPTED = make_tokens(3, 8, seed=0), make_tokens(3, 8, seed=1)
CONFIGS = {
    "ln": dict(normalization_type="LN"),
    "rms_rotary": dict(normalization_type="RMS", positional_embedding_type="rotary", rotary_dim=8),
    "lnpre_gqa": dict(normalization_type="LNPre", n_heads=4, d_head=4, n_key_value_heads=2),
    "parallel": dict(normalization_type="LN", parallel_attn_mlp=True),
    "no_norm": dict(normalization_type=None),
}
#: Gated configs (act_fn, overrides): the discoverable families of the gated zoo, and GeGLU (K=4)
#: with LLaMA's layout (Gemma 1; Gemma 2/3's norms after each sublayer are refused).
GATED = {
    "llama": ("silu", GATED_ZOO["llama"]),
    "qwen2": ("silu", GATED_ZOO["qwen2"]),
    "mistral_window": ("silu", GATED_ZOO["mistral_window"]),
    "phi3": ("silu", GATED_ZOO["phi3"]),
    "geglu": ("gelu_pytorch_tanh", GATED_ZOO["llama"]),
    "reglu_ln": ("relu", {k: v for k, v in GATED_ZOO["reglu_ln"].items() if k != "act_fn"}),
}


_LINEAR_WEIGHTS = [
    torch.randn(61, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    for seed in range(8)
]


def _linear_metric(seed: int = 0):
    weights = _LINEAR_WEIGHTS[seed]
    return lambda logits: (logits[:, -1] @ weights).sum()


def _model(act_fn="silu", **overrides):
    return make_converted(act_fn, **overrides)


def _config_model(config: str):
    """A converted model of ``CONFIGS`` (SiLU) or ``GATED``."""
    if config in GATED:
        act_fn, overrides = GATED[config]
        return _model(act_fn, **overrides)
    return _model(**CONFIGS[config])


def _score(es, src: str, dst: str, inp: str) -> float:
    frame = es.frame()
    row = frame[(frame.source == src) & (frame.target == dst) & (frame.input == inp)]
    assert len(row) == 1, (src, dst, inp)
    return float(row.score.iloc[0])


@tl3_only("no normalisation")
@pytest.mark.parametrize(
    "act_fn, gated",
    [("silu", False), ("gelu", False), ("silu", True), ("gelu_pytorch_tanh", True), ("relu", True)],
)
def test_linear_edges_equal_exact_path_patching(act_fn, gated):
    """Edges into the logits and into the value input of a last-layer neuron (for gated MLPs its
    linear branch ``u``: the neuron writes ``act_K(g) * u``) are linear paths: exact scores."""
    model = _model(act_fn, normalization_type=None, gated_mlp=gated)
    metric = _linear_metric()
    es = edge_attribution_scores(model, CLEAN, CORRUPTED, metric, progress=False, batch_size=2)
    base = metric(model(CORRUPTED)).item()
    assert es.metric_corrupted == pytest.approx(base, rel=1e-12)
    cases = [
        ("L0H1", "logits", "", "logits"),
        ("L1H0", "logits", "", "logits"),
        ("L0N5", "logits", "", "logits"),
        ("L1N7", "logits", "", "logits"),
        ("L0H1", "L1N4", "value", "L1N4:v"),
        ("L1H0", "L1N9", "value", "L1N9:v"),
        ("L0N2", "L1N9", "value", "L1N9:v"),
    ]
    K = facts(model).n_heads_per_neuron
    for src, dst, inp, receiver in cases:
        senders = [src] if "H" in src else [f"{src}.{k}" for k in range(K)] if K > 1 else [src]
        if gated and inp == "value":  # u is not a head input: patch it by hand
            exact = _edge_run(model, src, dst, inp, metric, 1.0).item() - base
            assert _score(es, src, dst, inp) == pytest.approx(exact, rel=1e-9, abs=1e-9)
            continue
        if K > 1 and "N" in receiver:
            neuron = receiver.split(":")[0]
            receiver = [f"{neuron}.{k}:v" for k in range(K)]
        exact = path_patch(model, CLEAN, CORRUPTED, senders, receiver, metric) - base
        assert _score(es, src, dst, inp) == pytest.approx(exact, rel=1e-9, abs=1e-9), (src, dst)


@tl3_only("no normalisation")
def test_ig_equals_eap_and_exact_on_logit_edges():
    model = _model(normalization_type=None)
    metric = _linear_metric(1)
    eap = edge_attribution_scores(model, CLEAN, CORRUPTED, metric, progress=False)
    ig = edge_attribution_scores(
        model, CLEAN, CORRUPTED, metric, method="eap-ig", ig_steps=3, progress=False
    )
    for key in eap.scores:
        if key[1] == "logits":
            torch.testing.assert_close(ig.scores[key], eap.scores[key], rtol=1e-10, atol=1e-10)
    # elsewhere the two differ (gradients move with the interpolation)
    assert not torch.allclose(
        ig.scores[("attn.0", "neuron.1.gate")], eap.scores[("attn.0", "neuron.1.gate")]
    )


def _edge_run(model, src: str, dst: str, inp: str, metric, t) -> torch.Tensor:
    """The metric of the corrupted run whose ``dst:inp`` reads ``resid + t * delta(src)``."""
    blocks, cfg = facts(model).blocks, model.cfg
    names = lambda n: n.endswith(
        ("hook_z", "hook_post", "hook_embed", "hook_pos_embed", "resid_pre", "resid_mid")
    )  # noqa: E731
    _, clean = model.run_with_cache(CLEAN, names_filter=names)
    _, corr = model.run_with_cache(CORRUPTED, names_filter=names)
    if src == "embed":
        delta = clean["hook_embed"] - corr["hook_embed"]
        if "hook_pos_embed" in clean.cache_dict:
            delta = delta + clean["hook_pos_embed"] - corr["hook_pos_embed"]
    elif "H" in src:
        layer, head = int(src[1]), int(src.split("H")[1])
        name = f"blocks.{layer}.attn.hook_z"
        delta = (clean[name] - corr[name])[:, :, head] @ blocks[layer].attn.W_O[head]
    else:
        layer, neuron = int(src[1]), int(src.split("N")[1])
        name = f"blocks.{layer}.mlp.hook_post"
        delta = (clean[name] - corr[name])[:, :, neuron, None] * blocks[layer].mlp.W_out[neuron]
    if dst == "logits":
        hooks = [(f"blocks.{cfg.n_layers - 1}.hook_resid_post", lambda a, hook: a + t * delta)]
    else:
        layer = int(dst[1])
        block = blocks[layer]
        parallel = facts(model).cfg.parallel_attn_mlp
        if "H" in dst:
            head = int(dst.split("H")[1])
            site = corr[f"blocks.{layer}.hook_resid_pre"]
            W, b = {
                "q": (block.attn.W_Q, block.attn.b_Q),
                "k": (
                    getattr(block.attn, "_W_K", block.attn.W_K),
                    getattr(block.attn, "_b_K", block.attn.b_K),
                ),
                "v": (
                    getattr(block.attn, "_W_V", block.attn.W_V),
                    getattr(block.attn, "_b_V", block.attn.b_V),
                ),
            }[inp]
            x = _normed(block.ln1, site + t * delta)

            def hook(act, hook):
                act = act.clone()
                act[:, :, head] = x @ W[head] + b[head]
                return act

            hooks = [(f"blocks.{layer}.attn.hook_{inp}", hook)]
        else:
            neuron = int(dst.split("N")[1])
            site = corr[f"blocks.{layer}.hook_resid_{'pre' if parallel else 'mid'}"]
            x = _normed(block.ln2, site + t * delta)
            if facts(model).cfg.gated_mlp:  # gate: g = x W_gate (hook_pre); value: u = x W_in
                W = block.mlp.W_gate if inp == "gate" else block.mlp.W_in
                pre = x @ W[:, neuron]
                name = f"blocks.{layer}.mlp.hook_{'pre' if inp == 'gate' else 'pre_linear'}"
            else:
                pre = x @ block.mlp.W_in[:, neuron] + block.mlp.b_in[neuron]  # SiLU: q = v = pre
                name = f"blocks.{layer}.mlp.hook_{'q' if inp == 'gate' else 'v'}"

            def hook(act, hook):
                act = act.clone()
                act[:, :, neuron, ...] = pre.reshape(act[:, :, neuron, ...].shape)
                return act

            hooks = [(name, hook)]
    return metric(model.run_with_hooks(CORRUPTED, fwd_hooks=hooks))


def _normed(norm, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)``, where the adapter's ``None`` is no normalisation."""
    return x if norm is None else norm(x)


def _directional_derivative(model, src: str, dst: str, inp: str, metric) -> float:
    """d metric / dt of the corrupted run whose ``dst:inp`` reads ``resid + t * delta(src)``."""
    t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    value = _edge_run(model, src, dst, inp, metric, t)
    return torch.autograd.grad(value, t)[0].item()


#: On TL 4 rms_rotary's bridge is a LLaMA one (gated MLP), like llama's.
RMS_ROTARY = pytest.param("rms_rotary", marks=tl3_extra("llama"))


@pytest.mark.parametrize("config", ["ln", RMS_ROTARY, "lnpre_gqa", "parallel", *sorted(GATED)])
def test_scores_are_the_directional_derivative_along_each_edge(config):
    model = _config_model(config)
    metric = _linear_metric(2)
    es = edge_attribution_scores(model, CLEAN, CORRUPTED, metric, progress=False)
    cases = [
        ("embed", "L0H1", "q"),
        ("embed", "L0N3", "gate"),
        ("L0H0", "L1H1", "q"),
        ("L0N3", "L1H0", "v"),
        ("L0N5", "L1N2", "gate"),
        ("L0H1", "L1N2", "value"),
        ("L1N8", "logits", ""),
        ("L0H0", "logits", ""),
    ]
    cases.append(("L0N1", "L1H1", "k"))
    cfg = facts(model).cfg
    if not cfg.parallel_attn_mlp:
        cases.append(("L1H0", "L1N6", "gate"))
    for src, dst, inp in cases:
        expected = _directional_derivative(model, src, dst, inp, metric)
        label = dst.replace("H", "KV") if cfg.n_key_value_heads and inp in "kv" else dst
        assert _score(es, src, label, inp) == pytest.approx(expected, rel=1e-8, abs=1e-10), (
            src,
            dst,
            inp,
        )


@pytest.mark.parametrize(
    "config",
    [pytest.param(c, marks=tl3_only("no normalisation")) if c == "no_norm" else c
     for c in sorted(CONFIGS) if c != "rms_rotary"] + [RMS_ROTARY] + sorted(GATED),
)  # fmt: skip
def test_full_graph_is_clean_and_empty_graph_is_corrupted(config):
    model = _config_model(config)
    metric = _linear_metric(3)
    graph = HeadGraph(model)
    full = circuit_metric(model, graph.full_mask(True), CLEAN, CORRUPTED, metric, batch_size=2)
    empty = circuit_metric(model, graph.full_mask(False), CLEAN, CORRUPTED, metric)
    clean, corrupted = metric(model(CLEAN)).item(), metric(model(CORRUPTED)).item()
    assert full == pytest.approx(clean, rel=1e-12)
    assert empty == pytest.approx(corrupted, rel=1e-12)
    assert faithfulness(full, clean, corrupted) == pytest.approx(1.0, abs=1e-10)
    assert faithfulness(empty, clean, corrupted) == pytest.approx(0.0, abs=1e-10)


@pytest.mark.parametrize(
    "config, act_fn",
    [(c, a) if c != "rms_rotary" else pytest.param(c, a, marks=tl3_extra("llama, geglu"))
     for c in ("ln", "rms_rotary", "parallel") for a in ("silu", "gelu")]
    + [(c, None) for c in ("llama", "geglu", "reglu_ln")],
)  # fmt: skip
def test_removing_a_node_s_edges_equals_activation_patching(config, act_fn):
    """No edge out of a node = its corrupted output everywhere; no edge into an input = corrupted
    input: both are plain activation patches of the clean run."""
    model = _model(act_fn, **CONFIGS[config]) if act_fn else _config_model(config)
    metric = _linear_metric(4)
    graph = HeadGraph(model)
    _, corr = model.run_with_cache(CORRUPTED)

    def patched(name, index):
        def hook(act, hook):
            act = act.clone()
            act[index] = corr[name][index]
            return act

        return metric(model.run_with_hooks(CLEAN, fwd_hooks=[(name, hook)])).item()

    K, cfg = facts(model).n_heads_per_neuron, facts(model).cfg
    checks = [
        ("attn.0", 1, "blocks.0.attn.hook_z", (slice(None), slice(None), 1)),
        ("neuron.0", 4, "blocks.0.mlp.hook_post", (slice(None), slice(None), 4)),
        ("neuron.1", 2, "blocks.1.mlp.hook_post", (slice(None), slice(None), 2)),
        ("attn.1", 0, "blocks.1.attn.hook_z", (slice(None), slice(None), 0)),
    ]
    for key, u, name, index in checks:
        mask = graph.full_mask(True)
        for (s, _), m in mask.items():
            if s == key:
                m[u, :] = False
        got = circuit_metric(model, mask, CLEAN, CORRUPTED, metric)
        assert got == pytest.approx(patched(name, index), rel=1e-10), key
    heads = slice(3 * K, 4 * K)
    gate, value = ("pre", "pre_linear") if cfg.gated_mlp else ("q", "v")
    if cfg.gated_mlp:
        heads = slice(3, 4)  # a gated neuron's gate and value are its g and u
    inputs = [
        ("attn.1.q", 1, "blocks.1.attn.hook_q", (slice(None), slice(None), 1)),
        ("attn.1.v", 0, "blocks.1.attn.hook_v", (slice(None), slice(None), 0)),
        ("neuron.1.gate", 3, f"blocks.1.mlp.hook_{gate}", (slice(None), slice(None), heads)),
        ("neuron.0.value", 3, f"blocks.0.mlp.hook_{value}", (slice(None), slice(None), heads)),
    ]
    for key, v, name, index in inputs:
        mask = graph.full_mask(True)
        for (_, d), m in mask.items():
            if d == key:
                m[:, v] = False
        got = circuit_metric(model, mask, CLEAN, CORRUPTED, metric)
        assert got == pytest.approx(patched(name, index), rel=1e-10), key


@pytest.mark.parametrize("config", ["ln", "llama"])
def test_discover_circuit_prunes_checks_and_draws(config):
    model = _config_model(config)
    correct = torch.tensor([1, 2, 3])
    metric = logit_diff_metric(correct, torch.tensor([4, 5, 6]))
    circuit = discover_circuit(
        model, CLEAN, CORRUPTED, metric, top_n=25, batch_size=2, progress=False
    )
    assert 0 < mask_size(circuit.mask) <= 25
    again = circuit_metric(model, circuit.mask, CLEAN, CORRUPTED, metric)
    assert circuit.metric_circuit == pytest.approx(again, rel=1e-12)
    assert circuit.faithfulness == pytest.approx(
        faithfulness(again, circuit.metric_clean, circuit.metric_corrupted)
    )
    # dropping dangling edges never changes the circuit's metric
    raw = prune(circuit.scores, top_n=25, drop_dangling=False)
    assert circuit_metric(model, raw, CLEAN, CORRUPTED, metric) == pytest.approx(again, rel=1e-10)
    assert circuit.gate_value is not None and len(circuit.gate_value) > 0
    fig = circuit.figure()
    names = {trace.name for trace in fig.data}
    assert {"attention head", "neuron-head"} <= names
    dashes = {trace.line.dash for trace in fig.data if trace.name == "neuron gate (pattern)"}
    assert dashes in (set(), {"dash"})


def test_unsupported_models_are_refused():
    with pytest.raises(TypeError, match="convert it first"):
        edge_attribution_scores(make_original(), CLEAN, CORRUPTED, _linear_metric())
    if not BRIDGES:  # no Hugging Face family has shortformer positions
        model = _model(normalization_type="LN", positional_embedding_type="shortformer")
        with pytest.raises(NotImplementedError, match="shortformer"):
            edge_attribution_scores(model, CLEAN, CORRUPTED, _linear_metric())
    with pytest.raises(ValueError, match="same shape"):
        edge_attribution_scores(_model(), CLEAN, CORRUPTED[:, :5], _linear_metric())


@pytest.mark.parametrize(
    "name, match",
    [
        pytest.param("moe", "NeuronHeadMoE", marks=tl3_only("mixtures of experts")),
        ("geglu_heads", "neuron_level=False on gated MLPs"),
    ],
)
def test_unsupported_gated_models_are_refused_before_any_work(name, match):
    if name == "moe":
        model = _model(normalization_type="RMS", gated_mlp=True, num_experts=2, experts_per_token=1)
    elif name == "geglu_heads":
        model = _config_model("geglu")
    else:
        overrides = dict(GATED_ZOO[name])
        model = _model(overrides.pop("act_fn", "silu"), **overrides)
    neuron_level = name != "geglu_heads"
    ran = []
    model.hook_dict["blocks.0.hook_resid_pre"].add_hook(lambda act, hook: ran.append(1))
    metric = _linear_metric()
    with pytest.raises(NotImplementedError, match=match):
        edge_attribution_scores(model, CLEAN, CORRUPTED, metric, neuron_level=neuron_level)
    with pytest.raises(NotImplementedError, match=match):
        circuit_metric(model, {}, CLEAN, CORRUPTED, metric, neuron_level=neuron_level)
    assert not ran
    model.reset_hooks()


# ---------------------------------------------------------------------------------------------
# node-level circuits (encoders and decoders)
# ---------------------------------------------------------------------------------------------


def _encoder_pair_inputs():
    from tl_attnonly.analysis.discovery.node_circuits import ModelInputs

    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 53, (4, 9), generator=g)  # the encoder zoo has 53 tokens
    corrupted = tokens.clone()
    corrupted[0::2, 3:6] = torch.randint(0, 53, (2, 3), generator=g)  # first sentence of each pair
    mask = torch.ones_like(tokens)
    mask[1, 7:] = 0  # padding in one row
    types = torch.zeros_like(tokens)
    return ModelInputs(tokens, types, mask), ModelInputs(corrupted, types, mask)


@hooked_only("node circuits on an AttnOnlyEncoder")
def test_node_circuits_on_an_encoder_are_exact_and_split_gate_and_value():
    from test_encoder import make_encoder

    from tl_attnonly.analysis.discovery.node_circuits import (
        discover_node_circuit,
        node_circuit_metrics,
        node_labels,
        pair_cosine_metric,
    )
    from tl_attnonly.hooked.encoder import convert_encoder

    model = convert_encoder(
        make_encoder("gelu", n_layers=2, d_model=16, n_heads=2, d_head=8, d_mlp=12)
    )
    clean, corrupted = _encoder_pair_inputs()
    metric = pair_cosine_metric()
    with pytest.raises(NotImplementedError, match="node_circuits"):
        edge_attribution_scores(model, clean.tokens, corrupted.tokens, metric)
    full, empty = node_circuit_metrics(
        model, [set(node_labels(model)), set()], clean, corrupted, metric
    )

    def run(inputs, hooks=()):
        with model.hooks(fwd_hooks=list(hooks)):
            hidden = model.encoder_output(
                inputs.tokens, inputs.token_type_ids, inputs.attention_mask
            )
        return metric(hidden, inputs).item()

    assert full == pytest.approx(run(clean), rel=1e-12)
    assert empty == pytest.approx(run(corrupted), rel=1e-12)
    circuit = discover_node_circuit(
        model, clean, corrupted, metric, top_n=10, max_gate_value_neurons=2
    )
    assert len(circuit.nodes) == 10 and len(circuit.gate_value) >= 1
    # the gate-only run by hand: the circuit's ablations plus the neuron's corrupted values
    row = circuit.gate_value.iloc[0]
    K = model.n_heads_per_neuron
    layer, neuron = int(row.node[1]), int(row.node.split("N")[1])
    _, corr_cache = model.run_with_cache(
        corrupted.tokens, corrupted.token_type_ids, one_zero_attention_mask=corrupted.attention_mask
    )
    hooks = []
    for name in ["hook_full_embed"] + [
        f"blocks.{li}.{sub}" for li in range(2) for sub in ("attn.hook_z", "mlp.hook_post")
    ]:
        n = 1 if name == "hook_full_embed" else (2 if "attn" in name else 12)
        label = (
            (lambda i: "embed")
            if name == "hook_full_embed"
            else (lambda i, name=name: f"L{name[7]}{'H' if 'attn' in name else 'N'}{i}")
        )
        off = [i for i in range(n) if label(i) not in circuit.nodes]
        if name == "hook_full_embed":
            if off:
                hooks.append((name, lambda act, hook: corr_cache[hook.name]))
            continue

        def patch(act, hook, off=off):
            act = act.clone()
            act[:, :, off] = corr_cache[hook.name][:, :, off]
            return act

        if off:
            hooks.append((name, patch))

    def corrupt_v(act, hook):
        act = act.clone()
        act[:, :, neuron * K : neuron * K + K] = corr_cache[hook.name][
            :, :, neuron * K : neuron * K + K
        ]
        return act

    def corrupt_post(act, hook):
        act = act.clone()
        act[:, :, neuron] = corr_cache[hook.name][:, :, neuron]
        return act

    gate_only = run(clean, hooks + [(f"blocks.{layer}.mlp.hook_v", corrupt_v)])
    none = run(clean, hooks + [(f"blocks.{layer}.mlp.hook_post", corrupt_post)])
    assert row.gate == pytest.approx(gate_only - none, rel=1e-9, abs=1e-12)
    assert row.both == pytest.approx(circuit.metric_circuit - none, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("config, act_fn", [("ln", "gelu"), ("llama", None)])
def test_node_circuits_on_a_decoder_are_exact_and_split_gate_and_value(config, act_fn):
    """The node circuits of a decoder (GELU, K = 4; SwiGLU): the full and empty sets are the clean
    and corrupted runs, and a neuron's gate-only split is the clean run with every node left out
    and that neuron's values set to the corrupted run's, by plain hooks."""
    from tl_attnonly.analysis.discovery.node_circuits import (
        ModelInputs,
        discover_node_circuit,
        node_circuit_metrics,
        node_labels,
    )

    model = _model(act_fn, **CONFIGS[config]) if act_fn else _config_model(config)
    weights = _LINEAR_WEIGHTS[7]

    def metric(logits, inputs):
        return (logits[:, -1] @ weights).sum()

    clean, corrupted = ModelInputs(CLEAN), ModelInputs(CORRUPTED)
    full, empty = node_circuit_metrics(
        model, [set(node_labels(model)), set()], clean, corrupted, metric
    )
    with torch.no_grad():
        assert full == pytest.approx(metric(model(CLEAN), clean).item(), rel=1e-12)
        assert empty == pytest.approx(metric(model(CORRUPTED), corrupted).item(), rel=1e-12)
    circuit = discover_node_circuit(
        model, clean, corrupted, metric, top_n=12, max_gate_value_neurons=2
    )
    assert len(circuit.nodes) == 12 and len(circuit.gate_value) >= 1
    row = circuit.gate_value.iloc[0]
    K, cfg = facts(model).n_heads_per_neuron, facts(model).cfg
    layer, neuron = int(row.node[1]), int(row.node.split("N")[1])
    _, corr = model.run_with_cache(CORRUPTED)

    def corrupted_at(name, index):  # by the name it is added by
        def hook(act, hook):
            act = act.clone()
            act[:, :, index] = corr[name][:, :, index]
            return act

        return hook

    hooks = []
    if "embed" not in circuit.nodes:
        embeds = ["hook_embed"] + (
            ["hook_pos_embed"] if "hook_pos_embed" in corr.cache_dict else []
        )
        hooks += [(name, lambda act, hook, name=name: corr[name]) for name in embeds]
    for li in range(cfg.n_layers):
        for kind, n, name in (
            ("H", cfg.n_heads, f"blocks.{li}.attn.hook_z"),
            ("N", cfg.d_mlp, f"blocks.{li}.mlp.hook_post"),
        ):
            off = [i for i in range(n) if f"L{li}{kind}{i}" not in circuit.nodes]
            if off:
                hooks.append((name, corrupted_at(name, off)))

    def run(extra):
        with torch.no_grad():
            return metric(model.run_with_hooks(CLEAN, fwd_hooks=hooks + extra), clean).item()

    v_name, post_name = f"blocks.{layer}.mlp.hook_v", f"blocks.{layer}.mlp.hook_post"
    heads = list(range(neuron * K, neuron * K + K))
    gate_only = run([(v_name, corrupted_at(v_name, heads))])
    none = run([(post_name, corrupted_at(post_name, [neuron]))])
    assert row.gate == pytest.approx(gate_only - none, rel=1e-9, abs=1e-12)
    assert row.both == pytest.approx(circuit.metric_circuit - none, rel=1e-9, abs=1e-12)
    assert abs(row.both) > 1e-6  # the neuron matters to the circuit


def test_circuit_figure_draws_with_the_builder_vis_registers_and_refuses_without_one(monkeypatch):
    """No import of vis/ in analysis/: vis registers circuit_figure, Circuit.figure calls it."""
    from tl_attnonly.analysis.discovery import circuit as circuit_module
    from tl_attnonly.vis.circuit import circuit_figure

    assert circuit_module._figure_builder is circuit_figure
    monkeypatch.setattr(circuit_module, "_figure_builder", None)
    with pytest.raises(RuntimeError, match="import tl_attnonly.vis"):
        circuit_module.Circuit.__new__(circuit_module.Circuit).figure()
    drawn = []
    monkeypatch.setattr(circuit_module, "_figure_builder", lambda c, **kw: drawn.append(kw) or 7)
    assert circuit_module.Circuit.__new__(circuit_module.Circuit).figure(max_edges=3) == 7
    assert drawn == [{"max_edges": 3}]
