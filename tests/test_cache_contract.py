"""run_with_cache on a converted model takes every TransformerLens argument and gives the original's
cache: the same keys (plus neuron-head-only hooks) with the same values, and derived neuron-head
entries equal to what a stored cache (``derive=False``) holds.

Arguments, each value in at least one case and every pair of values of two arguments together in
at least one case where TransformerLens allows the pair (:func:`pairwise_cases`):

- model: decoder (plain MLP, gated MLP, mixture of experts) and encoder; fp64 and fp32; the fused
  and the head path;
- input: tokens, strings (a word-level tokenizer built here, offline), the residual stream
  (``start_at_layer``), and ``tokens=`` beside it for the loss;
- ``start_at_layer`` (1, -1, final), ``stop_at_layer`` (0, 1, -1, final), ``names_filter`` (str,
  list, function), ``pos_slice`` (int, tuple, list, :class:`Slice`), ``remove_batch_dim``,
  ``incl_bwd``, ``device``, ``return_cache_object=False``, ``reset_hooks_end=False`` (the cache
  keeps filling on later runs), ``clear_contexts``, ``return_type``.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import random
import shutil
import tempfile
import warnings
from typing import Any

import pytest
import torch
from conftest import D_VOCAB, GATED_ZOO, make_config, make_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformer_lens import ActivationCache, HookedEncoder
from transformer_lens.utilities.slice import Slice
from transformers import PreTrainedTokenizerFast

from tl_attnonly import ConversionOptions, convert

pytestmark = pytest.mark.filterwarnings("ignore:HookedEncoder is deprecated:DeprecationWarning")

N_LAYERS = 3
#: |converted - original| bound on every shared entry, relative to the tensor's largest entry
#: (conversion of SiLU: exact up to rounding). Relative to the tensor, not to each entry: without a
#: norm a gated model's activations grow with depth, and an entry near 0 is a cancellation of
#: large terms (the fuzz drew fp32 logits of up to ~1e3 with an entry of 12.6 off by 2e-3).
TOL = {torch.float64: 1e-11, torch.float32: 1e-4}
#: |derived - stored| bound for the fused path (same pre-activations up to the fused rounding).
FUSED_TOL = {torch.float64: 1e-12, torch.float32: 1e-4}

MODEL_KINDS = {
    "plain": dict(normalization_type="LN"),
    "gated": dict(GATED_ZOO["llama"]),
    "moe": dict(normalization_type="LN", num_experts=2, experts_per_token=1),
    "encoder": None,
}

#: Every argument and the values it takes here (labels; :func:`run_kwargs` makes them arguments).
DIMENSIONS: dict[str, tuple[Any, ...]] = {
    "model": tuple(MODEL_KINDS),
    "dtype": ("fp64", "fp32"),
    "fused": (True, False),
    "input": ("tokens", "strings", "residual"),
    "start_at_layer": (None, 1, -1, "final"),
    "stop_at_layer": (None, 0, 1, -1, "final"),
    "names_filter": (None, "str", "list", "function"),
    "pos_slice": (None, "int", "tuple", "list", "Slice"),
    "remove_batch_dim": (False, True),
    "incl_bwd": (False, True),
    "device": (None, "cpu", "torch.device"),
    "return_cache_object": (True, False),
    "reset_hooks_end": (True, False),
    "clear_contexts": (False, True),
    "return_type": ("logits", "loss", None),
}


def allowed(case: dict[str, Any]) -> bool:
    """Whether TransformerLens accepts the combination (for the arguments given so far)."""
    get = case.get
    encoder = get("model") == "encoder"
    if encoder and (
        get("start_at_layer") is not None
        or get("stop_at_layer") is not None
        or get("input") == "residual"
        or get("incl_bwd")
        or get("return_type") == "loss"  # HookedEncoder: logits, predictions or None
    ):
        return False
    if get("model") == "moe" and get("dtype") == "fp64":
        return False  # TL's MoE router (nn.Linear) stays float32: an fp64 MoE cannot run in TL
    if get("model") == "moe" and get("remove_batch_dim"):
        # TL's expert hooks see [routed tokens, d_mlp], no batch dimension: remove_batch_dim
        # takes the first token, or fails (IndexError) on an expert no token was routed to.
        return False
    if get("model") == "moe" and get("pos_slice") is not None:
        # Same for TL's expert hooks and the experts' neuron-head hooks: the routed tokens stand
        # where positions are, and an expert no token was routed to fails TL's slicing with an
        # IndexError (test_cache_fuzz's regression test shows both). Not a contract case.
        return False
    if "input" in case and "start_at_layer" in case:
        if (case["input"] == "residual") != (case["start_at_layer"] is not None):
            return False
    if get("incl_bwd") and ("return_type" in case and get("return_type") != "loss"):
        return False  # backward needs a scalar output
    if get("incl_bwd") and get("stop_at_layer") is not None:
        return False  # stop_at_layer returns the residual stream
    if get("return_type") == "loss" and get("stop_at_layer") is not None:
        return False  # the loss is never computed: pointless, not wrong; keep cases meaningful
    return True


def pairwise_cases(seed: int = 0, pool_size: int = 1500) -> list[dict[str, Any]]:
    """Cases covering every allowed pair of values of two arguments (greedy, deterministic).

    Pairs no allowed case holds (refused combinations) are found by sampling ``pool_size``
    allowed cases; :func:`test_every_argument_value_is_covered` checks the result.
    """
    names = list(DIMENSIONS)
    rng = random.Random(seed)
    pool: list[dict[str, Any]] = []
    while len(pool) < pool_size:
        case = {name: rng.choice(DIMENSIONS[name]) for name in names}
        if allowed(case):
            pool.append(case)
    index = {name: {repr(v): i for i, v in enumerate(DIMENSIONS[name])} for name in names}
    pool_pairs = [
        frozenset(
            (a, index[a][repr(case[a])], b, index[b][repr(case[b])])
            for a, b in itertools.combinations(names, 2)
        )
        for case in pool
    ]
    uncovered = set().union(*pool_pairs)
    cases = []
    while uncovered:
        best = max(range(len(pool)), key=lambda i: len(pool_pairs[i] & uncovered))
        uncovered -= pool_pairs[best]
        cases.append(pool[best])
    return cases


CASES = pairwise_cases()


def test_every_argument_value_is_covered():
    """Guard on the generator: every value of every argument occurs in some case."""
    for name, values in DIMENSIONS.items():
        assert {repr(case[name]) for case in CASES} == {repr(v) for v in values}, name


# ---------------------------------------------------------------------------- models and inputs
@functools.cache
def _tokenizer_dir() -> str:
    """A word-level tokenizer over ``D_VOCAB`` words ``w0 ...``, built offline and saved (TL's
    ``set_tokenizer`` reloads a tokenizer from its ``name_or_path``)."""
    words = ["<|endoftext|>", "[UNK]"] + [f"w{i}" for i in range(D_VOCAB - 2)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    directory = tempfile.mkdtemp(prefix="tl_attnonly_word_tokenizer_")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="[UNK]",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],  # HookedEncoder's
    ).save_pretrained(directory)
    return directory


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A new copy of the word-level tokenizer (TransformerLens's ``set_tokenizer`` edits it)."""
    return PreTrainedTokenizerFast.from_pretrained(_tokenizer_dir())


def make_encoder_from(overrides: dict[str, Any]) -> HookedEncoder:
    """A random BERT-like SiLU encoder (``make_config`` overrides) with the word tokenizer."""
    kwargs = dict(
        n_layers=N_LAYERS,
        attention_dir="bidirectional",
        normalization_type="LN",
        original_architecture="BertForMaskedLM",
    )
    cfg = make_config("silu", **{**kwargs, **overrides})
    model = HookedEncoder(cfg, word_tokenizer(), move_to_device=False)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # HookedEncoder leaves its weights uninitialised: set them all
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
            if name.endswith(".w"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.split(".")[-1].startswith("b"):
                p.copy_(0.2 * noise)
            else:
                p.copy_(noise / p.shape[-2] ** 0.5 if p.ndim >= 2 else noise)
    return model.eval()


@functools.cache
def model_pair(kind: str, dtype_name: str, fused: bool):
    """(original, converted), with the word tokenizer."""
    dtype = torch.float64 if dtype_name == "fp64" else torch.float32
    if kind == "encoder":
        original = make_encoder_from(dict(dtype=dtype))
    else:
        original = make_model("silu", dtype, n_layers=N_LAYERS, **MODEL_KINDS[kind])
        original.set_tokenizer(word_tokenizer())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = convert(original, conversion=ConversionOptions(fused=fused))
    return original, converted


def layer_arg(value: Any, model) -> Any:
    return model.cfg.n_layers if value == "final" else value


def make_input(case: dict[str, Any], original, seed: int = 0) -> tuple[tuple, dict[str, Any]]:
    """Positional and keyword model arguments of the case (batch 1 for remove_batch_dim)."""
    batch = 1 if case["remove_batch_dim"] else 2
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(2, D_VOCAB, (batch, 7), generator=g)
    strings = [" ".join(f"w{int(i) - 2}" for i in row) for row in words]
    kwargs: dict[str, Any] = dict(return_type=case["return_type"])
    if case["input"] == "strings":
        return (strings[0] if batch == 1 else strings,), kwargs
    tokens = original.to_tokens(strings)
    if case["model"] == "encoder":
        tokens = tokens[0]  # HookedEncoder.to_tokens: (tokens, token_type_ids, attention_mask)
    if case["input"] == "tokens":
        return (tokens,), kwargs
    with torch.no_grad():  # the residual stream entering layer `start`
        residual = original(tokens, stop_at_layer=layer_arg(case["start_at_layer"], original))
    if case["return_type"] == "loss":
        kwargs["tokens"] = tokens
    return (residual,), kwargs


def names_filter_for(case: dict[str, Any], converted) -> Any:
    """str: a neuron-head hook (derived); list: original and neuron-head hooks of several layers;
    function: suffixes that hit both."""
    neuron = [n for n in converted.hook_dict if ".mlp." in n and n.endswith("hook_pattern")]
    choice = case["names_filter"]
    if choice == "str":
        return neuron[-1]
    if choice == "list":
        return [neuron[0], neuron[-1], "blocks.1.hook_resid_post", "blocks.0.attn.hook_z"]
    if choice == "function":
        return lambda name: name.endswith(("hook_z", "hook_pre", "hook_resid_post", "hook_q"))
    return None


def run_kwargs(case: dict[str, Any], converted) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for name in ("start_at_layer", "stop_at_layer"):
        if case[name] is not None:
            kwargs[name] = layer_arg(case[name], converted)
    if case["names_filter"] is not None:
        kwargs["names_filter"] = names_filter_for(case, converted)
    pos_slice = {
        None: None,
        "int": -1,
        "tuple": (1, 5),
        "list": [0, 2, 3],
        "Slice": Slice((0, 6, 2)),
    }[case["pos_slice"]]
    if pos_slice is not None:
        kwargs["pos_slice"] = pos_slice
    device = {None: None, "cpu": "cpu", "torch.device": torch.device("cpu")}[case["device"]]
    if device is not None:
        kwargs["device"] = device
    for name in ("remove_batch_dim", "incl_bwd", "return_cache_object", "clear_contexts"):
        if case[name] != DIMENSIONS[name][0]:
            kwargs[name] = case[name]
    if not case["reset_hooks_end"]:
        kwargs["reset_hooks_end"] = False
    return kwargs


# ---------------------------------------------------------------------------- comparison
def is_neuron_head_only(name: str, original) -> bool:
    return name.removesuffix("_grad") not in original.hook_dict


def as_dict(cache: Any) -> Any:
    return cache.cache_dict if isinstance(cache, ActivationCache) else cache


def assert_scaled_close(actual: Any, expected: Any, rel: float, name: str = "") -> None:
    """``|actual - expected| <= rel * max(1, max |expected|)`` over the finite entries, and the
    same non-finite entries (masked attention scores: ``-inf``); ``rel = 0``: equal."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, name
    finite = expected.isfinite()
    assert torch.equal(actual[~finite], expected[~finite]), name  # -inf where masked
    if not finite.any():
        return
    scale = max(1.0, expected[finite].abs().max().item())
    error = (actual[finite] - expected[finite]).abs().max().item()
    assert error <= rel * scale, f"{name}: max |difference| {error:.3g} > {rel:g} x {scale:.3g}"


def assert_same_output(a: Any, b: Any, rel: float) -> None:
    if a is None or b is None:
        assert a is None and b is None
        return
    assert_scaled_close(b, a, rel, "output")


def assert_cache_contract(case, original, original_cache, converted_cache, stored_cache, dtype):
    """The contract, for one run (see the module docstring)."""
    returns_object = case["return_cache_object"]
    for cache in (original_cache, converted_cache, stored_cache):
        assert isinstance(cache, ActivationCache) == returns_object, type(cache)
        if returns_object:
            assert cache.has_batch_dim == (not case["remove_batch_dim"])
    original_keys = list(original_cache.keys())
    converted_keys = list(converted_cache.keys())
    # every original key, in the original's order; the rest are neuron-head-only hooks
    assert [k for k in converted_keys if not is_neuron_head_only(k, original)] == original_keys
    # derived and stored caches: the same keys in the same order
    assert converted_keys == list(stored_cache.keys())
    for name in original_keys:
        assert_scaled_close(converted_cache[name], original_cache[name], TOL[dtype], name)
    for name in converted_keys:
        derived, stored = converted_cache[name], stored_cache[name]
        if case["fused"]:
            assert_scaled_close(derived, stored, FUSED_TOL[dtype], name)
        else:  # head path in both runs: derived entries are the stored ones, bit for bit
            assert torch.equal(derived, stored), name


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=["-".join(f"{k}={v}" for k, v in case.items()) for case in CASES],
)
def test_run_with_cache_matches_the_original(case):
    original, converted = model_pair(case["model"], case["dtype"], case["fused"])
    check_case(case, original, converted)


def check_case(case: dict[str, Any], original, converted) -> None:
    """Run the case on both models and check the contract (the module docstring)."""
    dtype = original.cfg.dtype
    model_args, model_kwargs = make_input(case, original)
    # made now: making a residual input runs the original's blocks, which must not fire hooks
    later_args, later_kwargs = make_input(case, original, seed=1)
    kwargs = run_kwargs(case, converted)
    for model in (original, converted):  # TransformerLens's backward adds to .grad: start clean
        model.zero_grad(set_to_none=True)
    try:
        try:
            out_o, cache_o = original.run_with_cache(*model_args, **model_kwargs, **kwargs)
        except Exception as error:  # refused by TransformerLens: refused alike
            original.reset_hooks()
            for extra in ({}, dict(derive=False)):
                with pytest.raises(type(error)):
                    converted.run_with_cache(*model_args, **model_kwargs, **kwargs, **extra)
                converted.reset_hooks()
            return
        out_s, cache_s = converted.run_with_cache(
            *model_args, **model_kwargs, **kwargs, derive=False
        )
        converted.reset_hooks()  # with reset_hooks_end=False they would fill cache_s later on
        out_c, cache_c = converted.run_with_cache(*model_args, **model_kwargs, **kwargs)
        assert_same_output(out_o, out_c, TOL[dtype])
        assert_same_output(out_s, out_c, FUSED_TOL[dtype] if case["fused"] else 0.0)
        assert_cache_contract(case, original, cache_o, cache_c, cache_s, dtype)
        if not case["reset_hooks_end"]:
            # The caching hooks stayed attached: a later run fills the same cache object, in
            # TransformerLens and in the converted model alike.
            with torch.no_grad():
                original(*later_args, **later_kwargs, **layer_kwargs(kwargs))
                converted(*later_args, **later_kwargs, **layer_kwargs(kwargs))
            assert_cache_contract(case, original, cache_o, cache_c, cache_c, dtype)
    finally:
        original.reset_hooks()
        converted.reset_hooks()


def layer_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k in ("start_at_layer", "stop_at_layer")}


@pytest.mark.parametrize("kind", ["plain", "encoder"])
def test_remove_batch_dim_refused_for_batch_above_one_as_in_transformer_lens(kind):
    """TL's test_remove_batch_dim_fails_if_batch_gt_1: ``AssertionError`` on both models."""
    for model in model_pair(kind, "fp64", True):
        tokens = torch.randint(2, D_VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
        _, cache = model.run_with_cache(tokens)
        assert cache.has_batch_dim
        with pytest.raises(AssertionError, match="batch size 2"):
            cache.remove_batch_dim()
        with pytest.raises(AssertionError, match="without a batch dim"):
            cache.apply_slice_to_batch_dim(0).apply_slice_to_batch_dim(0)


@pytest.mark.parametrize("names_filter", [("hook_embed",), {"hook_embed"}, 3])
def test_names_filter_types_refused_as_in_transformer_lens(names_filter):
    """TL accepts None, a name, a list of names or a function; a tuple or set raises ValueError
    in TL, so it does in the converted model too (it used to be accepted there alone)."""
    original, converted = model_pair("plain", "fp64", True)
    tokens = torch.randint(2, D_VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    for model in (original, converted):
        with pytest.raises(ValueError, match="names_filter must be"):
            model.run_with_cache(tokens, names_filter=names_filter)
        model.reset_hooks()
