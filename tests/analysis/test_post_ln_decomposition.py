"""Residual decomposition and direct logit attribution on a residual post-LN: models that
normalise the residual stream itself after each sublayer (GPT-1, BERT, OPT's
``do_layer_norm_before=False``), each norm's scale from the run.

In a run, each norm is affine once its scale is the run's, so the components (every head carried
through the later norms, the embeddings, one bias) sum to the stream after any norm to rounding,
and on GPT-1 their direct logit attributions to the logit. Bridges: the zoo's tiny random models
(both TransformerLens lines); ``HookedEncoder`` (TransformerLens 3.x): the converted random
encoder of ``tests/test_encoder.py``. These were refused before (``require_additive_residual``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(0, str(Path(__file__).parents[1] / "bridge"))

from models import hooked_only  # noqa: E402
from zoo import build_bridge, convert_zoo_bridge  # noqa: E402

from tl_attnonly.adapt import analysis_model  # noqa: E402
from tl_attnonly.analysis import (  # noqa: E402
    decompose_resid_heads,
    head_logit_attrs,
    stack_all_head_results,
)
from tl_attnonly.hooks import decomposition_names_filter  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:HookedEncoder is deprecated:DeprecationWarning")

#: Relative tolerance (of the stream's largest entry) per dtype.
RTOL = {torch.float64: 1e-10, torch.float32: 1e-5}
DTYPES = [pytest.param(d, id=str(d)[6:]) for d in RTOL]
EMBEDS = ("embed", "pos_embed", "token_type_embed", "bias")


def _bridge(name: str, dtype: torch.dtype):
    """Zoo model ``name``, converted. (OPT with ``do_layer_norm_before=False`` is a residual
    post-LN too, but TransformerLens's OPT bridge does not run it.)"""
    return convert_zoo_bridge(build_bridge(name, dtype))


def _tokens() -> torch.Tensor:
    return torch.randint(2, 128, (2, 7), generator=torch.Generator().manual_seed(0))


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol = RTOL[dtype] * float(expected.detach().abs().max())
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol)


def _check_sums(cache, targets, dtype) -> None:
    """``targets``: ``{(layer, mlp_input): the stream there}``; each decomposition sums to it."""
    for (layer, mlp_input), target in targets.items():
        stack, labels = decompose_resid_heads(cache, layer, mlp_input=mlp_input, return_labels=True)
        assert len(labels) == stack.shape[0] and labels[-1] == "bias" and "embed" in labels
        _close(stack.sum(0), target, dtype)
        heads = [i for i, label in enumerate(labels) if label not in EMBEDS]
        if heads:
            assert stack[heads].abs().max() > 1e-3  # the heads do contribute


def _bridge_targets(full, n_layers: int) -> dict:
    """The stream after every norm, on a bridge: block inputs, ``ln1``'s output (the MLP's
    input), the last ``ln2``'s output (the final hidden states)."""
    targets = {(n_layers, False): full[f"blocks.{n_layers - 1}.ln2.hook_out"]}
    for layer in range(n_layers):
        targets[(layer, False)] = full[f"blocks.{layer}.hook_resid_pre"]
        targets[(layer, True)] = full[f"blocks.{layer}.ln1.hook_out"]
    return targets


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["openai_gpt", "bert"])
def test_bridge_components_sum_to_the_stream_after_every_norm(name, dtype):
    bridge = _bridge(name, dtype)
    model = analysis_model(bridge)
    assert model.is_encoder == (name == "bert")
    tokens = _tokens()
    _, full = bridge.run_with_cache(tokens)
    _, cache = bridge.run_with_cache(tokens, names_filter=decomposition_names_filter())
    _check_sums(cache, _bridge_targets(full, model.cfg.n_layers), dtype)
    labels = decompose_resid_heads(cache, return_labels=True)[1]
    embeds = [label for label in labels if label in EMBEDS]
    expected = ["embed", "pos_embed"] + (["token_type_embed"] if name == "bert" else [])
    assert embeds == expected + ["bias"]
    if name == "openai_gpt":  # its hook_resid_mid is the MLP's input, and its last block's
        # output is what the unembedding reads (the block fires no hook_out)
        stack = decompose_resid_heads(cache, 1, mlp_input=True)
        _close(stack.sum(0), full["blocks.1.hook_resid_mid"], dtype)
        _close(decompose_resid_heads(cache).sum(0), full["unembed.hook_in"], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpt1_dla_sums_to_the_logit_difference(dtype):
    """GPT-1 has no final norm: the rows sum to the logit difference less ``b_U``'s (zero), at
    every position."""
    bridge = _bridge("openai_gpt", dtype)
    model = analysis_model(bridge)
    assert model.ln_final is None
    tokens = _tokens()
    logits, cache = bridge.run_with_cache(tokens, names_filter=decomposition_names_filter())
    correct, wrong = tokens, (tokens + 1) % 128
    attrs, labels = head_logit_attrs(
        cache, correct, wrong, incl_embeds_and_bias=True, return_labels=True
    )
    assert attrs.shape == (len(labels), *tokens.shape)
    difference = logits.gather(-1, correct[..., None]) - logits.gather(-1, wrong[..., None])
    constant = model.b_U[correct] - model.b_U[wrong]
    _close(attrs.sum(0) + constant, difference[..., 0], dtype)
    # one position: the same rows
    last = head_logit_attrs(cache, correct[:, -1], wrong[:, -1], pos_slice=-1)
    n_heads = last.shape[0]
    _close(last, attrs[:n_heads, :, -1], dtype)


def _by_hand(x, full, norm, name, bias: bool):
    """``x`` through one norm of the GPT-1 bridge, its scale computed from the norm's cached input
    (``w * x_c / sigma``, plus ``b`` with ``bias``)."""
    original = norm.original_component
    u = full[f"{name}.hook_in"]
    u = u - u.mean(-1, keepdim=True)
    sigma = (u.pow(2).mean(-1, keepdim=True) + original.eps).sqrt()
    out = (x - x.mean(-1, keepdim=True)) / sigma * original.weight
    return out + original.bias if bias else out


def test_gpt1_components_match_a_hand_computation():
    """One attention head, one neuron-head and the bias of the GPT-1 bridge, carried through every
    later norm by hand."""
    bridge = _bridge("openai_gpt", torch.float64)
    model = analysis_model(bridge)
    tokens = _tokens()
    _, full = bridge.run_with_cache(tokens)
    _, cache = bridge.run_with_cache(tokens, names_filter=decomposition_names_filter())
    stack, labels = decompose_resid_heads(cache, return_labels=True)
    steps = [(li, n) for li in range(2) for n in ("ln1", "ln2")]  # the norms, in order

    def through(x, first: int):  # x through the norms from steps[first] on, no biases
        for li, n in steps[first:]:
            x = _by_hand(x, full, bridge.blocks[li].get_submodule(n), f"blocks.{li}.{n}", False)
        return x

    head = full["blocks.0.attn.hook_z"][:, :, 1] @ model.blocks[0].attn.W_O[1]  # L0H1's result
    torch.testing.assert_close(stack[labels.index("L0H1")], through(head, 0), rtol=0, atol=1e-12)
    mlp = model.blocks[1].mlp  # L1N3.2: neuron 3's head 2 (K = 4), before the last norm only
    neuron_head = full["blocks.1.mlp.hook_z"][:, :, 14] * mlp.W_O[14, 0]
    torch.testing.assert_close(
        stack[labels.index("L1N3.2")], through(neuron_head, 3), rtol=0, atol=1e-12
    )
    bias = torch.zeros(64, dtype=torch.float64)
    for li, sublayer in steps:
        b_O = model.blocks[li].attn.b_O if sublayer == "ln1" else model.blocks[li].mlp.b_O
        bias = bias + b_O
        bias = _by_hand(
            bias, full, bridge.blocks[li].get_submodule(sublayer), f"blocks.{li}.{sublayer}", True
        )
    torch.testing.assert_close(stack[labels.index("bias")], bias, rtol=0, atol=1e-12)


def test_bert_bridge_dla_is_refused_naming_its_head_and_what_works():
    bridge = _bridge("bert", torch.float64)
    tokens = _tokens()
    _, cache = bridge.run_with_cache(tokens, names_filter=decomposition_names_filter())
    with pytest.raises(NotImplementedError, match="masked-LM head.*not linear.*decompose_resid"):
        head_logit_attrs(cache, tokens[:, -1], pos_slice=-1)


@pytest.mark.parametrize("name", ["openai_gpt", "bert"])
def test_what_stays_refused_on_a_residual_post_ln(name):
    """``incl_remainder`` (a plain sum) and ``apply_ln`` (the stream is already a norm's output)
    are refused, saying why; the heads' own stacks still work."""
    bridge = _bridge(name, torch.float32)
    _, cache = bridge.run_with_cache(_tokens(), names_filter=decomposition_names_filter())
    with pytest.raises(NotImplementedError, match="plain sum.*What works: decompose_resid_heads"):
        stack_all_head_results(cache, incl_remainder=True)
    with pytest.raises(ValueError, match="apply_ln=True has no norm to apply"):
        decompose_resid_heads(cache, 1, apply_ln=True)
    assert stack_all_head_results(cache).shape[0] > 0


# ---------------------------------------------------------------------------- HookedEncoder
def _encoder(dtype: torch.dtype):
    from test_encoder import make_encoder, make_inputs

    from tl_attnonly.hooked.encoder import convert_encoder

    encoder = convert_encoder(make_encoder("gelu", dtype), n_heads_per_neuron=2)
    tokens, token_types, mask = make_inputs()
    return encoder, tokens, dict(token_type_ids=token_types, one_zero_attention_mask=mask)


@hooked_only("HookedEncoder")
@pytest.mark.parametrize("dtype", DTYPES)
def test_hooked_encoder_components_sum_to_the_stream_after_every_norm(dtype):
    """A ``HookedEncoder``'s ``hook_resid_mid`` / ``hook_resid_post`` are the sums before
    ``ln1`` / ``ln2``: the MLP's input is ``hook_resid_post - hook_mlp_out``, the final hidden
    states ``hook_normalized_resid_post``."""
    encoder, tokens, kwargs = _encoder(dtype)
    _, full = encoder.run_with_cache(tokens, **kwargs)
    _, cache = encoder.run_with_cache(tokens, names_filter=decomposition_names_filter(), **kwargs)
    n_layers = encoder.cfg.n_layers
    targets = {(n_layers, False): full[f"blocks.{n_layers - 1}.hook_normalized_resid_post"]}
    for layer in range(n_layers):
        targets[(layer, False)] = full[f"blocks.{layer}.hook_resid_pre"]
        mid = full[f"blocks.{layer}.hook_resid_post"] - full[f"blocks.{layer}.hook_mlp_out"]
        targets[(layer, True)] = mid
    _check_sums(cache, targets, dtype)
    hidden = encoder.encoder_output(
        tokens, kwargs["token_type_ids"], kwargs["one_zero_attention_mask"]
    )
    _close(decompose_resid_heads(cache).sum(0), hidden, dtype)
    labels = decompose_resid_heads(cache, return_labels=True)[1]
    assert labels[-4:] == list(EMBEDS)


@hooked_only("HookedEncoder")
def test_hooked_encoder_dla_is_refused_naming_its_head():
    encoder, tokens, kwargs = _encoder(torch.float64)
    _, cache = encoder.run_with_cache(tokens, **kwargs)
    with pytest.raises(NotImplementedError, match="masked-LM head.*not linear"):
        head_logit_attrs(cache, tokens[:, -1], pos_slice=-1)
