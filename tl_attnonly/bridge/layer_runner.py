"""Runs of a ``TransformerBridge`` that start at a block (:class:`BridgeLayerRunner`).

A run from block ``l`` calls the bridge's blocks from ``l`` on with the arguments a full pass of
the batch gave them (rotary tables, masks, ALiBi biases; recorded once per batch; a key-value
cache as a new empty copy of the one the pass began with, for each run), then the final norm and
the unembedding: the blocks below ``l`` are not run. For ``c`` stacked copies of the batch the
arguments are scaled from the passes of one and two copies (:meth:`_BlockCalls.scaled`), not
recorded in a pass of ``c`` copies (a whole forward pass of up to 256 copies, which cost several
times a late layer's patching sweep). Where that does not give the full pass's
logits exactly (checked once per bridge: a forward that does more after its blocks, such as
Gemma 2's logit soft-cap), TransformerLens 4.x's ``start_at_layer`` runs it (which still runs the
blocks below), and on 3.x a full pass of the tokens whose residual stream entering block ``l`` is
replaced. Passes never skip leading positions (``prefix_reuse`` is false): the bridge has no
frozen key-value cache.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from jaxtyping import Int

from tl_attnonly._compat import BRIDGE_STARTS_AT_LAYER
from tl_attnonly.bridge.hook_names import BridgeHooks
from tl_attnonly.protocol import Hooks, Tensor

#: Positional embeddings with which a 4.x bridge's ``start_at_layer`` run equals the full pass
#: from that block (tested in ``tests/bridge/test_layouts_bridge.py`` and the analysis suites).
RESUMABLE = ("standard", "rotary")


class _EmptyCache:
    """Stands in a recorded call for the key-value cache the full pass gave a block: that
    cache as it was when the pass began (empty), copied anew for each run (:meth:`fresh`)."""

    def __init__(self, cache: Any):
        self.cache = copy.deepcopy(cache)

    def fresh(self, made: dict[int, Any]) -> Any:
        """This run's copy: one per run, given to every block of it (``made``: the run's)."""
        if id(self) not in made:
            made[id(self)] = copy.deepcopy(self.cache)
        return made[id(self)]


class _BlockCalls:
    """What a bridge's blocks received in a full pass of one token batch, to call them again
    from a given residual stream: per block, the arguments after the hidden states (rotary
    tables, position ids, attention masks, ALiBi biases: whatever the model's forward gives
    them). A key-value cache is not given again (a second call would attend to the first pass's
    keys): each run gets a new copy of it as the pass began, empty, so the blocks compute as in
    the pass (with a cache, attention reads keys and values from the cache's own copies, which
    round differently on some CPUs than the projections' views; without one, blocks 5e-7 apart on
    GPT-J, GPT-Neo and OPT on an AVX-512 machine: logits 7e-7 to 1e-5 off the pass).

    Args:
        bridge: The bridge.
    """

    def __init__(self, bridge: Any):
        self.bridge = bridge
        self.calls: dict[int, tuple[tuple, dict[str, Any]]] = {}
        #: block -> the hidden states entering it in the recorded pass (``keep_entering`` only)
        self.entering: dict[int, torch.Tensor] = {}

    @contextmanager
    def recording(self, keep_entering: Collection[int] = ()) -> Iterator[None]:
        """Record the blocks' arguments in the pass run inside the ``with`` block (PyTorch
        forward pre-hooks on the blocks, removed after it)."""

        empty: dict[int, _EmptyCache] = {}  # id of a pass's cache -> it as the pass began

        def stand_in(value: Any) -> Any:
            if not _is_kv_cache(value):
                return value
            if id(value) not in empty:  # first seen by block 0, before any block filled it
                empty[id(value)] = _EmptyCache(value)
            return empty[id(value)]

        def record(args: tuple, kwargs: dict, layer: int) -> None:
            hidden = args[0] if args else kwargs.get("hidden_states")
            if layer in keep_entering and isinstance(hidden, torch.Tensor):
                self.entering[layer] = hidden
            # a cache may come by keyword or by position (transformers 5.17's GPT-2 passes it
            # second): either way a run gets a new empty one
            kwargs = {k: stand_in(v) for k, v in kwargs.items() if k != "hidden_states"}
            self.calls[layer] = (tuple(stand_in(value) for value in args[1:]), kwargs)

        handles = [
            block.register_forward_pre_hook(
                lambda _, args, kwargs, layer=layer: record(args, kwargs, layer), with_kwargs=True
            )
            for layer, block in enumerate(self.bridge.blocks)
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def scaled(self, two: _BlockCalls, copies: int) -> _BlockCalls | None:
        """These calls (recorded for one copy of a batch) for ``copies`` stacked copies, from
        how the calls recorded for two copies (``two``) differ from them: a tensor twice as long
        along its first axis that equals this one repeated is repeated ``copies`` times; a value
        equal in both is kept; a key-value cache stays a new empty one per run. ``None`` where a
        value follows neither rule (the calls for ``copies`` must then be recorded)."""
        try:
            calls = {
                layer: (
                    _scale(args, two.calls[layer][0], copies),
                    _scale(kwargs, two.calls[layer][1], copies),
                )
                for layer, (args, kwargs) in self.calls.items()
            }
        except (_NotScalable, KeyError):
            return None
        out = _BlockCalls(self.bridge)
        out.calls = calls
        return out

    @property
    def complete(self) -> bool:
        """Whether every block's arguments were recorded."""
        return len(self.calls) == len(self.bridge.blocks)

    def run(
        self, resid: torch.Tensor, layer: int, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The logits ``[batch, pos, d_vocab]`` of ``resid`` entering block ``layer``: the
        blocks from ``layer`` on, then the final norm and the unembedding (the hooks in force
        fire as in a full pass). ``positions`` ``[batch]``: only those positions' logits (one
        per row; the final norm and the unembedding see ``[batch, 1, d_model]``), the others
        NaN."""
        hidden = resid
        made: dict[int, Any] = {}  # this run's new empty caches

        def given(value: Any) -> Any:
            return value.fresh(made) if isinstance(value, _EmptyCache) else value

        for index in range(layer, len(self.bridge.blocks)):
            args, kwargs = self.calls[index]
            out = self.bridge.blocks[index](
                hidden, *map(given, args), **{k: given(v) for k, v in kwargs.items()}
            )
            hidden = out[0] if isinstance(out, tuple) else out
        if positions is None:
            return self.bridge.unembed(self.bridge.ln_final(hidden))
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        at = positions.to(hidden.device)
        picked = self.bridge.unembed(self.bridge.ln_final(hidden[rows, at].unsqueeze(1)))
        logits = picked.new_full((hidden.shape[0], hidden.shape[1], picked.shape[-1]), torch.nan)
        logits[rows, at] = picked[:, 0]
        return logits


class _NotScalable(Exception):
    """A recorded argument that neither repeats with the batch nor stays the same."""


def _scale(one: Any, two: Any, copies: int) -> Any:
    """``one`` (an argument for one copy of the batch) for ``copies`` copies, by its relation
    to ``two`` (the same argument for two copies); see :meth:`_BlockCalls.scaled`."""
    if isinstance(one, torch.Tensor):
        if not isinstance(two, torch.Tensor):
            raise _NotScalable
        if one.shape == two.shape and torch.equal(one, two):
            return one
        reps = (2,) + (1,) * (one.ndim - 1)
        if one.ndim and two.shape[0] == 2 * one.shape[0] and torch.equal(one.repeat(reps), two):
            return one.repeat((copies,) + reps[1:])
        raise _NotScalable
    if isinstance(one, (tuple, list)):
        if type(one) is not type(two) or len(one) != len(two):
            raise _NotScalable
        return type(one)(_scale(a, b, copies) for a, b in zip(one, two, strict=True))
    if isinstance(one, dict):
        if not isinstance(two, dict) or one.keys() != two.keys():
            raise _NotScalable
        return {key: _scale(value, two[key], copies) for key, value in one.items()}
    if isinstance(one, _EmptyCache):
        if not isinstance(two, _EmptyCache):
            raise _NotScalable
        return one  # each run copies it anew; an empty cache has no batch yet
    try:
        same = one is two or bool(one == two)
    except Exception:  # noqa: BLE001 - a value without a plain equality: not scalable
        same = False
    if not same:
        raise _NotScalable
    return one


def _is_kv_cache(value: Any) -> bool:
    """Whether ``value`` is a Hugging Face key-value cache (``transformers.Cache``)."""
    from transformers.cache_utils import Cache

    return isinstance(value, Cache)


#: bridge -> (dtype, device) -> whether calling its blocks from one (:class:`_BlockCalls`) gives
#: its full pass's logits exactly (a property of the model's forward, checked once per process)
_EXACT_CALLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def blocks_can_be_called(bridge: Any, tokens: Int[torch.Tensor, "batch pos"]) -> bool:
    """Whether calling ``bridge``'s blocks from the middle one with the arguments a full pass
    gave them, then the final norm and the unembedding, gives that pass's logits exactly
    (checked on ``tokens`` once per bridge, dtype and device; not: a forward that does more after
    its blocks, such as Gemma 2's logit soft-cap, or a bridge without ``ln_final``)."""
    param = next(bridge.parameters())
    key = (param.dtype, param.device)
    verdicts = _EXACT_CALLS.setdefault(bridge, {})
    if key not in verdicts:
        check = len(bridge.blocks) // 2
        calls = _BlockCalls(bridge)
        with torch.no_grad(), calls.recording(keep_entering=[check]):
            full = bridge(tokens)
        verdicts[key] = (
            all(hasattr(bridge, name) for name in ("ln_final", "unembed"))
            and calls.complete
            and check in calls.entering
            and torch.equal(calls.run(calls.entering[check], check), full)
        )
    return verdicts[key]


class BridgeLayerRunner:
    """Runs of a bridge that start at a block (see the module docstring).

    A run from block ``l`` calls the bridge's blocks from ``l`` on with the arguments a full
    pass of the batch gave them (:class:`_BlockCalls`: recorded in the caller's full pass under
    :meth:`recording`, else in a pass of its own once per number of copies), then the final
    norm and the unembedding: the blocks below ``l`` are not run. That is used where it
    reproduces the full pass's logits exactly (:func:`blocks_can_be_called`); otherwise
    TransformerLens 4's ``start_at_layer`` or a full pass.

    Args:
        bridge: The bridge's adapter.
        tokens: The batch the residual streams given to :meth:`run` are copies of.
        n_layers: Its blocks.
        starts_at_layer: Where calling the blocks is not exact, run from the block with
            TransformerLens 4's ``start_at_layer``; else (TL 3.9, or positions that a run from
            a block would not see) a full pass from the tokens with the block's entering
            residual replaced.
        hook_table: The adapter's hook names resolved once (its
            :attr:`~tl_attnonly.bridge.adapter.BridgeAdapter.bridge_hooks`), through which a run
            that calls the blocks adds its hooks; ``None``: a table of its own for the bridge.
    """

    prefix_reuse = False

    def __init__(
        self,
        bridge: Any,
        tokens: Int[torch.Tensor, "batch pos"],
        n_layers: int,
        *,
        starts_at_layer: bool = BRIDGE_STARTS_AT_LAYER,
        hook_table: BridgeHooks | None = None,
    ):
        self.model = bridge  # the adapter: hooks see the names they were added by
        self.hook_table = BridgeHooks(bridge.model) if hook_table is None else hook_table
        self.tokens = tokens
        self.batch = tokens.shape[0]
        self.n_layers = n_layers
        self.starts_at_layer = starts_at_layer
        self._calls: dict[int, _BlockCalls] = {}  # copies -> the blocks' recorded arguments
        self._exact: bool | None = None

    def recording(self) -> contextlib.AbstractContextManager[None]:
        """A context in which the caller runs the full pass of :attr:`tokens` (hooked or not:
        the blocks' other arguments do not depend on the residual stream); the later runs call
        the blocks with the arguments it gave them, instead of recording them in a pass of
        their own."""
        self._calls[1] = _BlockCalls(self.model.model)
        return self._calls[1].recording()

    def _block_calls(self, copies: int) -> _BlockCalls | None:
        """The blocks' recorded arguments for ``copies`` stacked batches, or ``None`` where
        calling the blocks would not be exact."""
        if self._exact is None:
            self._exact = blocks_can_be_called(self.model.model, self.tokens)
        if not self._exact:
            return None
        calls = self._calls.get(copies)
        if calls is not None and calls.complete:
            return calls
        if copies > 2:  # scaled from the calls for one and two copies, where they follow them
            calls = self._recorded(1).scaled(self._recorded(2), copies)
        if calls is None or not calls.complete:
            calls = self._recorded(copies)
        self._calls[copies] = calls
        return calls

    def _recorded(self, copies: int) -> _BlockCalls:
        """The blocks' arguments recorded in a pass of ``copies`` copies of the batch (once)."""
        calls = self._calls.get(copies)
        if calls is None or not calls.complete:
            calls = self._calls[copies] = _BlockCalls(self.model.model)
            with torch.no_grad(), calls.recording():
                self.model.model(self.tokens.repeat(copies, 1))
        return calls

    def run(
        self,
        resid: Tensor,
        layer: int,
        hooks: Hooks,
        first_pos: int,
        prefix: Tensor | None,
        *,
        logit_positions: Tensor | None = None,
    ):
        copies = resid.shape[0] // self.batch
        hooks = list(hooks)
        if layer < self.n_layers or not hooks:
            # from a block, or (no hook to fire) only the final norm and the unembedding
            calls = self._block_calls(copies)
            if calls is not None:
                positions = None if logit_positions is None else logit_positions.repeat(copies)
                with torch.no_grad(), self.hook_table.added(hooks, (), layer):
                    return calls.run(resid, layer, positions)
        if layer < self.n_layers:
            site, start = f"blocks.{layer}.hook_resid_pre", layer
        else:  # only the final norm and the unembedding
            site, start = f"blocks.{self.n_layers - 1}.hook_resid_post", self.n_layers - 1

        def replace(act: torch.Tensor, hook: Any) -> torch.Tensor:
            return resid

        with torch.no_grad():
            if self.starts_at_layer:
                if layer < self.n_layers:
                    return self.model.run_with_hooks(resid, start_at_layer=layer, fwd_hooks=hooks)
                # the last block runs, its output replaced
                entering = torch.zeros_like(resid)
                return self.model.run_with_hooks(
                    entering, start_at_layer=start, fwd_hooks=[(site, replace)] + hooks
                )
            tokens = self.tokens.repeat(copies, 1)
            return self.model.run_with_hooks(tokens, fwd_hooks=[(site, replace)] + hooks)


__all__ = [
    "RESUMABLE",
    "BridgeLayerRunner",
    "blocks_can_be_called",
]
