"""The seam onto TransformerLens and torch internals (tl_attnonly._compat), against the installed
versions: if a TransformerLens release moves one of them, these tests say which."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import make_model
from transformer_lens.hook_points import HookPoint

from tl_attnonly import SUPPORTED_ACTIVATIONS, NeuronHeadMLP, convert
from tl_attnonly._compat import (
    TL_ACTIVATIONS,
    CanBeUsedAsMLP,
    batch_addmm,
    convert_bert_weights,
    convert_llama_weights,
    has_hooks,
    hf_offline_mode,
    rotary_base,
    softcap_enabled,
    tl_lists_repo_files,
    tl_official_model_name,
)


def _identity_hook(tensor, hook):
    return tensor


def test_has_hooks_sees_transformer_lens_hooks_both_directions():
    hp = HookPoint()
    assert not has_hooks(hp)
    hp.add_hook(_identity_hook)
    assert has_hooks(hp) and hp.has_hooks()  # TL's public answer agrees
    hp.remove_hooks()
    assert not has_hooks(hp)
    hp.add_hook(lambda grad, hook: None, dir="bwd")
    assert has_hooks(hp)
    hp.remove_hooks(dir="bwd")
    assert not has_hooks(hp)


def test_has_hooks_falls_back_to_hooks_registered_with_torch_directly():
    hp = HookPoint()
    handle = hp.register_forward_hook(lambda module, args, out: out)
    assert not hp.has_hooks()  # TransformerLens does not know of it ...
    assert has_hooks(hp)  # ... but its value must still be computed
    handle.remove()
    assert not has_hooks(hp)
    handle = hp.register_forward_pre_hook(lambda module, args: None)
    assert has_hooks(hp)
    handle.remove()


def test_a_torch_level_hook_sees_the_real_pattern_on_the_fused_path():
    model = make_model(n_layers=1)
    converted = convert(model)
    tokens = torch.arange(6)[None]
    _, cache = converted.run_with_cache(tokens, names_filter="blocks.0.mlp.hook_pattern")
    seen = []
    hp = converted.blocks[0].mlp.hook_pattern
    handle = hp.register_forward_hook(lambda module, args, out: seen.append(out.detach()))
    try:
        converted(tokens)
    finally:
        handle.remove()
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], cache["blocks.0.mlp.hook_pattern"], rtol=0, atol=0)


def test_rotary_base_is_the_one_transformer_lens_builds_its_tables_with():
    model = make_model(positional_embedding_type="rotary", rotary_dim=8, rotary_base=500)
    attn = model.blocks[0].attn
    assert rotary_base(attn) == 500
    sin, cos = attn.calculate_sin_cos_rotary(
        8, model.cfg.n_ctx, base=rotary_base(attn), dtype=attn.rotary_sin.dtype
    )
    torch.testing.assert_close(sin, attn.rotary_sin, rtol=0, atol=0)
    torch.testing.assert_close(cos, attn.rotary_cos, rtol=0, atol=0)
    # Without TL's private method, the config's base.
    assert rotary_base(SimpleNamespace(cfg=SimpleNamespace(rotary_base=123))) == 123


def test_the_rest_of_the_seam_resolves():
    assert issubclass(NeuronHeadMLP, CanBeUsedAsMLP)
    assert set(SUPPORTED_ACTIVATIONS) <= set(TL_ACTIVATIONS)
    x, W, b = torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 5), torch.randn(5)
    W = W.double()
    b = b.double()
    torch.testing.assert_close(batch_addmm(b, W, x), x @ W + b)
    assert not softcap_enabled(None) and softcap_enabled(30.0)
    with pytest.raises((KeyError, AttributeError, TypeError)):
        convert_bert_weights({}, SimpleNamespace())  # imported and called: fails on no weights
    with pytest.raises((KeyError, AttributeError, TypeError)):
        convert_llama_weights({}, SimpleNamespace())


def test_tl_official_model_name_is_transformer_lens_s_repository():
    assert tl_official_model_name("gpt2") == "gpt2"
    assert tl_official_model_name("pythia-70m") == "EleutherAI/pythia-70m"
    assert tl_official_model_name("gtp2") is None
    assert tl_lists_repo_files(tl_official_model_name("solu-1l"))
    assert not tl_lists_repo_files("EleutherAI/pythia-70m")


def test_hf_offline_mode_switches_huggingface_hub_and_transformers():
    from huggingface_hub import constants
    from transformers.utils.hub import is_offline_mode

    before = constants.HF_HUB_OFFLINE
    with hf_offline_mode():
        assert constants.HF_HUB_OFFLINE and is_offline_mode()
    assert constants.HF_HUB_OFFLINE == before


def test_model_alias_map_is_transformer_lens_own():
    from tl_attnonly._compat import make_model_alias_map

    ours = make_model_alias_map()
    assert ours["gpt2"] == "gpt2" and ours["gpt2-small"] == "gpt2"
    try:  # TransformerLens 3.x still has its own; 4.x removed it
        from transformer_lens.loading_from_pretrained import make_model_alias_map as theirs
    except ImportError:
        return
    assert ours == theirs()


def test_put_tensor_puts_the_tensor_itself_and_keeps_buffer_persistence():
    from tl_attnonly._compat import put_tensor

    root = torch.nn.Sequential(torch.nn.Linear(2, 3))
    root[0].register_buffer("scratch", torch.zeros(1), persistent=False)
    weight = torch.nn.Parameter(torch.ones(3, 2, dtype=torch.float64))
    scratch = torch.ones(1)
    put_tensor(root, "0.weight", weight)
    put_tensor(root, "0.scratch", scratch, buffer=True)
    assert root[0].weight is weight and root[0].scratch is scratch
    assert "0.scratch" not in root.state_dict()  # still non-persistent


class TransformerBridge(torch.nn.Module):
    """A look-alike: named ``TransformerBridge``, but not TransformerLens's."""


def test_is_transformer_bridge_says_yes_for_a_bridge_raw_converted_or_subclassed():
    from kinds import make_bridge

    from tl_attnonly._compat import is_transformer_bridge

    bridge = make_bridge("gpt2", convert=False)  # built offline, TransformerLens 3.9 and 4.x
    assert is_transformer_bridge(bridge)
    assert is_transformer_bridge(convert(bridge))  # converted in place: still the bridge

    class MyBridge(type(bridge)):  # a user's subclass, outside transformer_lens
        pass

    bridge.__class__ = MyBridge
    assert is_transformer_bridge(bridge)


def test_is_transformer_bridge_says_no_for_other_models():
    from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER, is_transformer_bridge

    assert not is_transformer_bridge(torch.nn.Module())
    assert not is_transformer_bridge(torch.nn.Linear(2, 3))
    assert not is_transformer_bridge(TransformerBridge())  # the name alone is not enough
    assert not is_transformer_bridge(HookPoint())  # a transformer_lens module, not a bridge
    if HAS_HOOKED_TRANSFORMER:  # TransformerLens 3.x
        model = make_model(n_layers=1)
        assert not is_transformer_bridge(model)
        assert not is_transformer_bridge(convert(model))  # an AttnOnlyTransformer
