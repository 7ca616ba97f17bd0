"""A bridge's runs from a block (``BridgeAdapter.layer_runs``) over the zoo's decoders.

The runner calls the blocks from the given one with the arguments a full pass gave them
(``_BlockCalls``), where that reproduces the full pass exactly, and falls back to
TransformerLens 4's ``start_at_layer`` or a full pass with the entering residual replaced
elsewhere. Either way a run from block ``l`` with the full pass's residual entering ``l`` must
give the full pass's logits and fire the hooks from ``l`` on with the full pass's values, on
TransformerLens 3.9 and 4.x; the blocks below ``l`` are not run where the blocks are called.
"""

from __future__ import annotations

import pytest
import torch
from zoo import ZOO, build_bridge, tokens

from tl_attnonly.adapt import analysis_model
from tl_attnonly.bridge.attention_layout import repair_z_layouts
from tl_attnonly.bridge.layer_runner import _BlockCalls, blocks_can_be_called

DECODERS = [name for name, spec in ZOO.items() if not spec.encoder and not spec.broken]
#: Whose forward does more than the final norm and the unembedding after the blocks (Gemma 2's
#: logit soft-cap), or has no final norm component (GPT-1): the runner does not call the blocks.
NOT_CALLED = {"gemma2", "openai_gpt"}
#: Whose bridge fires no ``hook_resid_post`` (GPT-1's blocks' ``hook_out`` never fires, on the
#: bridge's own ``run_with_cache`` too): only the logits are compared.
NO_BLOCK_OUTPUT = {"openai_gpt"}


def _count(module: torch.nn.Module) -> tuple[list[int], torch.utils.hooks.RemovableHandle]:
    calls = [0]

    def count(*_):
        calls[0] += 1

    return calls, module.register_forward_hook(count)


@pytest.mark.parametrize("copies", [1, 2])
@pytest.mark.parametrize("name", DECODERS)
def test_a_run_from_a_block_is_the_full_pass(name, copies):
    bridge = build_bridge(name, torch.float32)
    # MLA's hook_z is refused until split into W_O's heads (what convert does; values unchanged)
    repair_z_layouts(bridge)
    adapter = analysis_model(bridge, neuron_heads=False, allow_experts=True)
    batch = tokens(2, 7)
    last = adapter.cfg.n_layers - 1
    names = ("blocks.1.hook_resid_pre", f"blocks.{last}.hook_resid_post")
    with torch.no_grad():
        full, cache = bridge.run_with_cache(batch.repeat(copies, 1), names_filter=list(names))

    runner = adapter.layer_runs(batch)
    seen: dict[str, torch.Tensor] = {}

    def record(act, hook):
        seen[hook.name] = act

    first_block, handle = _count(bridge.blocks[0])
    try:
        got = runner.run(cache[names[0]], 1, [(names[1], record)], 0, None)
        runs_of_first_block = first_block[0]
        again = runner.run(cache[names[0]], 1, [], 0, None)
    finally:
        handle.remove()
    called = runner._block_calls(copies) is not None
    assert called == (name not in NOT_CALLED)
    pairs = [(got, full)]
    if name not in NO_BLOCK_OUTPUT:
        pairs.append((seen[names[1]], cache[names[1]]))
    for value, want in pairs:
        if called:  # the same kernels on the same inputs: the same numbers
            assert torch.equal(value, want)
        else:
            torch.testing.assert_close(value, want)
    if called:  # the check (once per bridge) and the pass that recorded the blocks' arguments
        # ran block 0; the runs did not
        assert runs_of_first_block == 2 and first_block[0] == 2
    assert torch.equal(again, got)


def _caches(args: tuple, kwargs: dict) -> list:
    from transformers.cache_utils import Cache

    return [value for value in (*args, *kwargs.values()) if isinstance(value, Cache)]


@pytest.mark.parametrize("name", ["gpt_neox", "gptj", "llama"])
def test_each_run_gives_the_blocks_a_new_empty_key_value_cache(name):
    """GPT-NeoX's attention reads the ``layer_past`` cache its forward is given: called again with
    the full pass's cache, it would attend to that pass's keys as well (logits off by ~0.7 on
    this model when it was passed on). Called with none, attention reads the projections' views
    instead of the cache's copies, which rounds differently on some CPUs (GPT-J, GPT-Neo and OPT
    5e-7 off on an AVX-512 machine). So each run gets a new cache, empty when the run begins, as
    the pass's was: the blocks receive a cache where the pass gave them one, never the pass's,
    and never one from another run."""
    bridge = build_bridge(name, torch.float32)
    calls = _BlockCalls(bridge)
    seen: list = []
    with torch.no_grad(), calls.recording():
        bridge(tokens(2, 7))
    assert calls.complete and blocks_can_be_called(bridge, tokens(2, 7))

    def grab(_, args, kwargs):
        seen.append([(cache, cache.get_seq_length()) for cache in _caches(args, kwargs)])

    entering = torch.randn(2, 7, bridge.cfg.d_model)
    handles = [block.register_forward_pre_hook(grab, with_kwargs=True) for block in bridge.blocks]
    try:
        with torch.no_grad(), calls.recording():
            bridge(tokens(2, 7))
        passes = [cache for cache, _ in seen[0]]
        seen.clear()
        with torch.no_grad():
            for _ in range(2):
                calls.run(entering, 1)
    finally:
        for handle in handles:
            handle.remove()
    assert passes, "the full pass gives its blocks a key-value cache"
    per_run = len(bridge.blocks) - 1
    assert len(seen) == 2 * per_run and all(len(given) == len(passes) for given in seen)
    first = {id(cache) for given in seen[:per_run] for cache, _ in given}
    second = {id(cache) for given in seen[per_run:] for cache, _ in given}
    assert len(first) == len(second) == len(passes)  # one cache a run, shared by its blocks
    assert not first & second and not first & {id(cache) for cache in passes}
    assert all(length == 0 for given in (seen[0], seen[per_run]) for _, length in given)


def test_a_full_pass_under_recording_gives_the_blocks_arguments():
    """The runs of a call take the blocks' arguments from the call's first (full) run: no pass
    of the runner's own besides the check, once per bridge."""
    bridge = build_bridge("llama", torch.float32)
    adapter = analysis_model(bridge, neuron_heads=False)
    batch = tokens(2, 7)
    assert blocks_can_be_called(bridge, batch)  # the check's pass, before counting
    with torch.no_grad():
        full, cache = bridge.run_with_cache(batch, names_filter="blocks.1.hook_resid_pre")
    runner = adapter.layer_runs(batch)
    first_block, handle = _count(bridge.blocks[0])
    try:
        with torch.no_grad(), runner.recording():
            adapter.run_with_hooks(batch)
        got = runner.run(cache["blocks.1.hook_resid_pre"], 1, [], 0, None)
    finally:
        handle.remove()
    assert first_block[0] == 1  # the caller's pass only
    assert torch.equal(got, full)


class _Filling(torch.nn.Module):
    """A block that writes its hidden states into the cache it is given by position (its layer:
    its own index) and returns them; ``received`` lists the caches the blocks were given."""

    def __init__(self, layer: int, received: list):
        super().__init__()
        self.layer, self.received = layer, received

    def forward(self, hidden, past=None, mask=None, use_cache=True):
        self.received.append(past)
        past.update(hidden[:, None], hidden[:, None], self.layer)
        return hidden


def test_a_cache_given_by_position_is_replaced_too():
    """transformers 5.17's GPT-2 passes its ``DynamicCache`` to the blocks as their second
    positional argument (5.24 by keyword): kept, every run of the bundled model's bridge from a
    block attended to the recorded pass's keys too and failed (attention scores over 12 keys
    against a mask of 6). By position too, a run gets a new empty cache in its place."""
    from types import SimpleNamespace

    from transformers.cache_utils import DynamicCache

    received: list = []
    blocks = torch.nn.ModuleList([_Filling(0, received), _Filling(1, received)])
    calls = _BlockCalls(SimpleNamespace(blocks=blocks))
    hidden, mask, cache = torch.zeros(1, 3, 4), torch.ones(1, 1, 3, 3), DynamicCache()
    with calls.recording():
        for block in calls.bridge.blocks:
            block(hidden, cache, mask, use_cache=True)
    assert cache.get_seq_length() == 3  # the pass filled it
    for args, kwargs in calls.calls.values():
        assert args[0] is not cache and args[1] is mask
        assert kwargs == {"use_cache": True}
    received.clear()
    calls.bridge.unembed = calls.bridge.ln_final = lambda x: x
    calls.run(hidden, 0)
    assert len(received) == 2 and received[0] is received[1]  # one cache for the run's blocks
    assert isinstance(received[0], DynamicCache) and received[0] is not cache
    assert received[0].get_seq_length() == 3 and cache.get_seq_length() == 3  # its own keys


def _recorded(bridge, batch: torch.Tensor, copies: int) -> _BlockCalls:
    calls = _BlockCalls(bridge)
    with torch.no_grad(), calls.recording():
        bridge(batch.repeat(copies, 1))
    return calls


def _same(scaled, recorded) -> None:
    """``scaled`` is ``recorded``: the same structure, equal tensors and values."""
    from tl_attnonly.bridge.layer_runner import _EmptyCache

    if isinstance(recorded, torch.Tensor):
        assert isinstance(scaled, torch.Tensor) and torch.equal(scaled, recorded)
    elif isinstance(recorded, (tuple, list)):
        assert type(scaled) is type(recorded) and len(scaled) == len(recorded)
        for a, b in zip(scaled, recorded, strict=True):
            _same(a, b)
    elif isinstance(recorded, dict):
        assert scaled.keys() == recorded.keys()
        for key in recorded:
            _same(scaled[key], recorded[key])
    elif isinstance(recorded, _EmptyCache):
        assert isinstance(scaled, _EmptyCache)
    else:
        assert scaled == recorded


@pytest.mark.parametrize("batch_size", [1, 2])
@pytest.mark.parametrize("name", [n for n in DECODERS if n not in NOT_CALLED])
def test_calls_scaled_to_many_copies_are_the_ones_a_pass_of_them_records(name, batch_size):
    """Issue 47: a run of ``c`` copies took its blocks' arguments from a pass of ``c`` copies of
    the batch (a whole forward pass of up to 256 copies per call, several times a late layer's
    sweep). They are scaled from the passes of one and two copies instead, and are the
    arguments a pass of ``c`` copies gives, on every decoder of the zoo."""
    bridge = build_bridge(name, torch.float32)
    repair_z_layouts(bridge)
    batch = tokens(batch_size, 7)
    one, two = _recorded(bridge, batch, 1), _recorded(bridge, batch, 2)
    scaled = one.scaled(two, 5)
    assert scaled is not None and scaled.complete
    recorded = _recorded(bridge, batch, 5)
    for layer, (args, kwargs) in recorded.calls.items():
        _same(scaled.calls[layer][0], args)
        _same(scaled.calls[layer][1], kwargs)


def test_a_runner_of_many_copies_never_runs_a_pass_of_them():
    bridge = build_bridge("llama", torch.float32)
    adapter = analysis_model(bridge, neuron_heads=False)
    batch = tokens(2, 7)
    assert blocks_can_be_called(bridge, batch)  # the check's pass, before counting
    with torch.no_grad():
        full, cache = bridge.run_with_cache(
            batch.repeat(4, 1), names_filter="blocks.1.hook_resid_pre"
        )
    runner = adapter.layer_runs(batch)
    rows: list[int] = []
    handle = bridge.blocks[0].register_forward_pre_hook(lambda _, args: rows.append(len(args[0])))
    try:
        got = runner.run(cache["blocks.1.hook_resid_pre"], 1, [], 0, None)
    finally:
        handle.remove()
    assert rows == [2, 4]  # the passes of one and two copies, not one of four
    assert torch.equal(got, full)


def test_an_argument_that_follows_neither_rule_is_recorded():
    """A value that differs between one and two copies other than by repeating (here a count
    of rows) is not scaled: the calls are recorded for the copies asked for."""
    from types import SimpleNamespace

    one, two = _BlockCalls(SimpleNamespace(blocks=[])), _BlockCalls(SimpleNamespace(blocks=[]))
    one.calls = {0: ((torch.ones(2, 3),), {"rows": 2})}
    two.calls = {0: ((torch.ones(4, 3),), {"rows": 4})}
    assert one.scaled(two, 3) is None
    two.calls = {0: ((torch.ones(4, 3),), {"rows": 2})}
    scaled = one.scaled(two, 3)
    assert scaled is not None and scaled.calls[0][0][0].shape == (6, 3)
    two.calls = {0: ((torch.arange(4.0)[:, None].expand(4, 3),), {"rows": 2})}  # not a repeat
    assert one.scaled(two, 3) is None


@pytest.mark.parametrize("name", ["llama", "gpt2", "gemma2"])
def test_a_run_of_the_final_norm_and_unembedding_runs_no_block(name):
    """Issue 47: a run from ``n_layers`` (only the final norm and the unembedding: a patch of the
    last layer's output) ran the last block on zeros and replaced its output, and unembedded
    every position: a sweep of SmolLM2's layer 29 took 45 s on a bridge against 3 s on a
    HookedTransformer. Where the blocks can be called it now runs no block, and unembeds only
    the positions asked for."""
    bridge = build_bridge(name, torch.float32)
    adapter = analysis_model(bridge, neuron_heads=False)
    batch = tokens(2, 7)
    last = adapter.cfg.n_layers - 1
    final = f"blocks.{last}.hook_resid_post"
    with torch.no_grad():
        full, cache = bridge.run_with_cache(batch.repeat(3, 1), names_filter=final)
    runner = adapter.layer_runs(batch)
    runner._block_calls(3)  # the recording passes, before counting
    last_block, handle = _count(bridge.blocks[last])
    try:
        got = runner.run(cache[final], last + 1, [], 0, None)
        at = torch.tensor([6, 3])
        picked = runner.run(cache[final], last + 1, [], 0, None, logit_positions=at)
    finally:
        handle.remove()
    rows = torch.arange(6)
    if name in NOT_CALLED:  # the bridge's own run (its last block on zeros, output replaced)
        torch.testing.assert_close(got, full)
        return
    assert last_block[0] == 0
    assert torch.equal(got, full)
    torch.testing.assert_close(picked[rows, at.repeat(3)], full[rows, at.repeat(3)])
    assert picked.isnan().sum() == 6 * 6 * full.shape[-1]  # the other 6 positions of each row
