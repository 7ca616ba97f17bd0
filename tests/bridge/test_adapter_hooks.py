"""Hooks added through :class:`~tl_attnonly.bridge.adapter.BridgeAdapter` do what the bridge's
own ``run_with_hooks`` does with them, with the names resolved once (``BridgeHooks``), not once per
hook: the same logits and the same activations and names seen by every hook (aliases, canonical
names, filters, compatibility mode), the same refusals, nothing left behind, and hook points that
the bridge replaced are the ones hooked. TransformerLens 3.9 and 4.x."""

from __future__ import annotations

import pytest
import torch
from bridge_models import make_bridge, make_tokens

import tl_attnonly
from tl_attnonly._compat import BRIDGE_STARTS_AT_LAYER
from tl_attnonly.adapt import analysis_model
from tl_attnonly.bridge.adapter import BridgeAdapter
from tl_attnonly.bridge.hook_names import named_hooks

#: Aliases and canonical names, the embedding, attention, neuron-head and final-norm stages.
NAMES = (
    "hook_embed",
    "blocks.0.hook_resid_pre",
    "blocks.0.attn.hook_z",
    "blocks.0.mlp.hook_pattern",
    "blocks.0.mlp.hook_z",
    "blocks.0.hook_mlp_out",
    "blocks.1.hook_in",
    "blocks.1.hook_resid_mid",
    "blocks.1.mlp.hook_pre",
    "ln_final.hook_normalized",
)


def _hooks(seen: list):
    """Hooks that record what they see and change it (each by its own amount), so that a hook
    run twice, skipped or run on the wrong point changes the logits."""

    def make(index: int):
        def hook(act, hook):
            seen.append((hook.name, act.detach().clone()))
            return act * (1.0 + 0.01 * (index + 1))

        return hook

    return [(name, make(i)) for i, name in enumerate(NAMES)] + [
        (lambda name: name.endswith("attn.hook_pattern"), make(len(NAMES)))
    ]


def _same_as_the_bridge(bridge, adapter: BridgeAdapter, tokens: torch.Tensor) -> None:
    ours: list = []
    theirs: list = []
    with torch.no_grad():
        got = adapter.run_with_hooks(tokens, fwd_hooks=_hooks(ours))
        want = bridge.run_with_hooks(tokens, fwd_hooks=named_hooks(_hooks(theirs)))
    assert torch.equal(got, want)
    assert [name for name, _ in ours] == [name for name, _ in theirs]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(ours, theirs))
    assert {name for name, _ in ours} >= set(NAMES)  # every named hook ran, by its own name


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_runs_as_the_bridges_run_with_hooks(arch):
    bridge = tl_attnonly.convert(make_bridge(arch))
    adapter = analysis_model(bridge)
    tokens = make_tokens()
    _same_as_the_bridge(bridge, adapter, tokens)
    with torch.no_grad():
        with adapter.hooks(fwd_hooks=_hooks([])):
            inside = bridge(tokens)
        assert torch.equal(inside, adapter.run_with_hooks(tokens, fwd_hooks=_hooks([])))
        assert torch.equal(adapter.run_with_hooks(tokens), bridge(tokens))
    # compatibility mode (processed weights, its own hook names), converted again
    bridge.enable_compatibility_mode(disable_warnings=True, no_processing=True)
    tl_attnonly.convert(bridge)
    _same_as_the_bridge(bridge, adapter, tokens)


def test_hook_dict_is_read_once_not_per_hook(monkeypatch):
    """The bridge's ``hook_dict`` rebuilds every alias on each read; TransformerLens 3.9's
    ``run_with_hooks`` read it once per hook (4.x: twice per run)."""
    bridge = tl_attnonly.convert(make_bridge("llama"))
    adapter = analysis_model(bridge)
    reads = []
    prop = type(bridge).hook_dict

    def counted(self):
        reads.append(1)
        return prop.fget(self)

    monkeypatch.setattr(type(bridge), "hook_dict", property(counted))
    tokens = make_tokens()
    with torch.no_grad():
        for _ in range(3):
            adapter.run_with_hooks(tokens, fwd_hooks=_hooks([]))
    assert len(reads) == 1


def test_hook_points_the_bridge_replaced_are_the_ones_hooked():
    """An adapter read before the bridge changed hooks the bridge's live hook points: the
    neuron-head hook points a conversion adds, and the new ones a re-conversion mounts."""
    bridge = make_bridge("gpt2")
    adapter = analysis_model(bridge, neuron_heads=False)
    tokens = make_tokens()
    seen: list = []

    def record(act, hook):
        seen.append(hook.name)

    with torch.no_grad(), pytest.raises(KeyError, match="blocks.0.mlp.hook_pattern"):
        adapter.run_with_hooks(tokens, fwd_hooks=[("blocks.0.mlp.hook_pattern", record)])
    for _ in range(2):  # converted, then re-converted (new hook points, the same names)
        old = bridge.get_hook_point("blocks.1.mlp.hook_z") if seen else None
        tl_attnonly.convert(bridge)
        assert bridge.get_hook_point("blocks.1.mlp.hook_z") is not old
        seen.clear()
        with torch.no_grad():
            adapter.run_with_hooks(tokens, fwd_hooks=[("blocks.1.mlp.hook_z", record)])
        assert seen == ["blocks.1.mlp.hook_z"]


def test_refusals_and_cleanup_match_the_bridge():
    """A gated-off hook point (``ValueError``) and an unknown name (``KeyError``, which
    TransformerLens 3.9's ``run_with_hooks`` silently skips) are refused before the run; a hook
    that raises leaves no hook behind; hooks added before the run stay."""
    bridge = tl_attnonly.convert(make_bridge("gpt2"))
    adapter = analysis_model(bridge)
    tokens = make_tokens()
    level = bridge.context_level
    keep = bridge.get_hook_point("blocks.0.hook_in")
    kept: list = []
    bridge.add_hook("blocks.0.hook_in", lambda act, hook: kept.append(1))

    def boom(act, hook):
        raise RuntimeError("boom")

    def fine(act, hook):
        return act

    with torch.no_grad():
        with pytest.raises(ValueError, match="use_attn_result"):
            bridge.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_result", fine)])
        with pytest.raises(ValueError, match="use_attn_result"):
            hooks = [("blocks.0.hook_resid_pre", fine), ("blocks.0.attn.hook_result", fine)]
            adapter.run_with_hooks(tokens, fwd_hooks=hooks)
        with pytest.raises(KeyError, match="blocks.0.hook_nothing"):
            adapter.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_nothing", fine)])
        with pytest.raises(RuntimeError, match="boom"):
            adapter.run_with_hooks(tokens, fwd_hooks=[("blocks.1.mlp.hook_pattern", boom)])
        with pytest.warns(UserWarning, match="gated-off"):
            adapter.run_with_hooks(tokens, fwd_hooks=[(lambda n: n.endswith("hook_result"), fine)])
    assert bridge.context_level == level
    assert len(keep.fwd_hooks) == 1  # the hook added before: every other one is gone
    assert not any(p.fwd_hooks for p in bridge.hook_points() if p is not keep)
    kept.clear()
    with torch.no_grad():
        bridge(tokens)
    assert kept == [1]
    bridge.reset_hooks()


@pytest.mark.skipif(not BRIDGE_STARTS_AT_LAYER, reason="TransformerLens 4.x starts at a block")
def test_a_run_from_a_block_skips_the_earlier_hooks_as_the_bridge_does():
    bridge = tl_attnonly.convert(make_bridge("llama"))
    adapter = analysis_model(bridge)
    with torch.no_grad():
        _, cache = bridge.run_with_cache(make_tokens(), names_filter="blocks.1.hook_in")
        resid = cache["blocks.1.hook_in"]
        ours: list = []
        theirs: list = []
        got = adapter.run_with_hooks(resid, start_at_layer=1, fwd_hooks=_hooks(ours))
        want = bridge.run_with_hooks(resid, start_at_layer=1, fwd_hooks=named_hooks(_hooks(theirs)))
    assert torch.equal(got, want)
    assert [name for name, _ in ours] == [name for name, _ in theirs]
    assert not any(name.startswith(("blocks.0.", "hook_embed")) for name, _ in ours)


def test_the_alias_generation_is_transformer_lens_own():
    """``_compat.hook_alias_generation`` (part of the table's validity check) reads TL's count."""
    from transformer_lens.model_bridge.generalized_components import base

    from tl_attnonly._compat import hook_alias_generation

    assert hook_alias_generation() == base.alias_generation()
    base._bump_alias_generation()
    assert hook_alias_generation() == base.alias_generation()
