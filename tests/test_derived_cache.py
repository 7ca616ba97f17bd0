"""run_with_cache derives neuron-head entries on access: equal to a stored cache, entry by entry."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, make_tokens
from transformer_lens import HookedTransformer

from tl_attnonly import convert
from tl_attnonly.components.neuron_head_base import DERIVABLE_HOOKS
from tl_attnonly.hooked.derived_cache import NeuronHeadActivationCache
from tl_attnonly.hooks import neuron_act_name

MODELS = {
    "silu": dict(act_fn="silu"),
    "gelu_new": dict(act_fn="gelu_new"),
    "geglu": dict(act_fn="gelu_new", gated_mlp=True),
}
DTYPES = [torch.float32, torch.float64]
NEURON_NAMES = [neuron_act_name(kind, layer) for layer in range(2) for kind in DERIVABLE_HOOKS]


def _converted(kind: str, dtype: torch.dtype, fused: bool = True):
    converted = convert(make_model(dtype=dtype, normalization_type="LN", **MODELS[kind]))
    for mlp in converted.neuron_heads:
        mlp.fused = fused
    return converted


def _assert_same_cache(derived, stored):
    assert list(derived.keys()) == list(stored.keys())
    for name in stored.keys():
        assert torch.equal(derived[name], stored[name]), name


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_derived_cache_equals_the_stored_cache(kind, dtype):
    """Head path in both runs (fused=False): every entry, derived or not, is bit-identical."""
    converted = _converted(kind, dtype, fused=False)
    tokens = make_tokens()
    logits, derived = converted.run_with_cache(tokens)
    stored_logits, stored = converted.run_with_cache(tokens, derive=False)
    assert isinstance(derived, NeuronHeadActivationCache)
    assert not any(derived.cache_dict.is_derived(name) for name in NEURON_NAMES)
    assert torch.equal(logits, stored_logits)
    _assert_same_cache(derived, stored)
    assert all(derived.cache_dict.is_derived(name) for name in NEURON_NAMES)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_fused_run_gives_the_forward_pass_and_neuron_heads_to_rounding(kind, dtype):
    converted = _converted(kind, dtype)
    tokens = make_tokens()
    logits, derived = converted.run_with_cache(tokens)
    assert torch.equal(logits, converted(tokens))  # the cached run is the plain forward pass
    _, stored = converted.run_with_cache(tokens, derive=False)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for name in NEURON_NAMES:
        if name.startswith("blocks.0."):  # same pre-activations: same bits
            assert torch.equal(derived[name], stored[name]), name
        torch.testing.assert_close(derived[name], stored[name], rtol=0, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
@pytest.mark.parametrize("kind", ["gelu_new", "geglu"])
def test_edited_quantities_are_stored_as_edited(kind, dtype):
    converted = _converted(kind, dtype, fused=False)
    tokens = make_tokens()

    def halve_pattern_in_place(pattern, hook):
        pattern[:, 3] = 0.5

    def shift_pre(pre, hook):
        return pre + 0.25

    hooks = [
        (neuron_act_name("pattern", 1), halve_pattern_in_place),
        (neuron_act_name("pre", 0), shift_pre),
    ]
    with converted.hooks(fwd_hooks=hooks):
        _, derived = converted.run_with_cache(tokens)
        _, stored = converted.run_with_cache(tokens, derive=False)
    _, clean = converted.run_with_cache(tokens)
    _assert_same_cache(derived, stored)
    assert (derived[neuron_act_name("pattern", 1)][:, 3] == 0.5).all()
    assert not torch.equal(derived[neuron_act_name("q", 0)], clean[neuron_act_name("q", 0)])
    assert derived.cache_dict.is_derived(neuron_act_name("z", 1))  # layer 1: stored by the run


@pytest.mark.parametrize(
    "options",
    [
        dict(names_filter=lambda name: name.endswith(("hook_pattern", "hook_z"))),
        dict(names_filter=[neuron_act_name("v", 1), "blocks.1.hook_resid_post"]),
        dict(names_filter=neuron_act_name("attn_scores", 0)),
        dict(pos_slice=[1, 4]),
        dict(pos_slice=-1),
        dict(device="cpu"),
    ],
    ids=["callable", "list", "str", "pos_slice-list", "pos_slice-int", "device"],
)
def test_run_with_cache_options_apply_to_derived_entries(options):
    converted = _converted("gelu_new", torch.float64, fused=False)
    tokens = make_tokens()
    _, derived = converted.run_with_cache(tokens, **options)
    _, stored = converted.run_with_cache(tokens, derive=False, **options)
    _assert_same_cache(derived, stored)


def test_remove_batch_dim_option():
    converted = _converted("gelu_new", torch.float64, fused=False)
    tokens = make_tokens(batch=1)
    _, derived = converted.run_with_cache(tokens, remove_batch_dim=True)
    _, stored = converted.run_with_cache(tokens, remove_batch_dim=True, derive=False)
    _assert_same_cache(derived, stored)
    assert derived[neuron_act_name("pattern", 0)].ndim == 3


def test_activation_cache_methods_behave_as_on_a_stored_cache():
    converted = _converted("gelu_new", torch.float64, fused=False)
    tokens = make_tokens()
    _, derived = converted.run_with_cache(tokens)
    _, stored = converted.run_with_cache(tokens, derive=False)
    assert len(derived) == len(stored) and set(derived) == set(stored)
    assert "hook_embed" in derived.cache_dict and derived.has_embed
    for name, value in derived.items():
        assert torch.equal(value, stored[name])
    for a, b in zip(derived.values(), stored.values()):
        assert torch.equal(a, b)
    for kind in ("pattern", "z", "q", "k", "v", "attn_scores", "scores"):
        assert torch.equal(
            derived.stack_activation(kind, sublayer_type="mlp"),
            torch.stack([stored[neuron_act_name(kind, layer)] for layer in range(2)]),
        )
        assert torch.equal(derived[kind, -1, "mlp"], stored[neuron_act_name(kind, 1)])
    torch.testing.assert_close(derived.accumulated_resid(), stored.accumulated_resid())
    _, derived = converted.run_with_cache(tokens)
    sliced, sliced_ref = derived.apply_slice_to_batch_dim(1), stored.apply_slice_to_batch_dim(1)
    assert not sliced.has_batch_dim
    _assert_same_cache(sliced, sliced_ref)
    _, derived = converted.run_with_cache(tokens)
    _assert_same_cache(derived.apply_slice_to_batch_dim([0]), stored.apply_slice_to_batch_dim([0]))
    _, derived = converted.run_with_cache(tokens)
    moved = derived.to("cpu")
    assert not moved.cache_dict.is_derived(neuron_act_name("z", 1))  # moving derives nothing
    _assert_same_cache(moved, stored)
    _, one = converted.run_with_cache(tokens[:1])
    _, one_ref = converted.run_with_cache(tokens[:1], derive=False)
    _assert_same_cache(one.remove_batch_dim(), one_ref.remove_batch_dim())
    grad_mode = torch.is_grad_enabled()
    try:
        derived.toggle_autodiff(False)
        assert not torch.is_grad_enabled()
    finally:
        torch.set_grad_enabled(grad_mode)


def test_tuple_names_with_mlp_reach_the_neuron_heads():
    converted = _converted("silu", torch.float64)
    _, cache = converted.run_with_cache(make_tokens())
    assert cache["pattern", 0, "mlp"].shape[-1] == 2  # (self, bias), not an attention pattern
    assert torch.equal(cache["pattern", 0, "mlp"], cache["blocks.0.mlp.hook_pattern"])
    assert torch.equal(cache["pattern", 0], cache["blocks.0.attn.hook_pattern"])
    assert torch.equal(cache["z", 1, "attn"], cache["blocks.1.attn.hook_z"])
    _, partial = converted.run_with_cache(make_tokens(), names_filter="blocks.0.attn.hook_z")
    with pytest.raises(KeyError, match="blocks.0.mlp.hook_z"):
        partial["z", 0, "mlp"]


def test_cache_holds_about_the_originals_bytes():
    model = make_model("gelu_new", torch.float32, normalization_type="LN", d_mlp=64)
    converted = convert(model)
    tokens = make_tokens(batch=2, pos=12)
    _, original = model.run_with_cache(tokens)
    _, derived = converted.run_with_cache(tokens)
    original_bytes = sum(t.untyped_storage().nbytes() for t in original.values())
    assert derived.stored_nbytes() <= 1.05 * original_bytes
    _, stored = converted.run_with_cache(tokens, derive=False)
    assert stored.stored_nbytes() > 2 * original_bytes  # what deriving saves (K = 4)


def test_unconverted_cache_is_untouched():
    """The subclass is only for converted models; TransformerLens's own stays as it is."""
    model = make_model("silu", torch.float64)
    assert type(model.run_with_cache(make_tokens())[1]).__name__ == "ActivationCache"
    assert isinstance(model, HookedTransformer)
