"""An :class:`~transformer_lens.ActivationCache` that derives neuron-head entries when first read.

A neuron-head layer's queries, keys, values, scores, patterns and ``z`` are elementwise functions
of its pre-activations (``hook_pre``; and ``hook_pre_linear`` for gated MLPs). Storing them for
every one of ``d_mlp * K`` heads costs up to ``5 K`` times the original model's cache, and
computing them forces the slower head path. So ``AttnOnlyTransformer.run_with_cache`` runs the
fused forward pass, keeps the pre-activations, and returns a :class:`NeuronHeadActivationCache`
whose neuron-head entries are computed on first access, by the same code and arithmetic as the
head path, so they equal what a stored cache would hold bit for bit
(``tests/test_derived_cache.py``).

What is stored rather than derived: every entry of a layer whose neuron-head hooks had a hook
attached during the run (an edit must be kept as made), per-head results
(``set_use_neuron_result``), and everything when gradients are cached (``incl_bwd=True``) or the
caching hooks stay attached (``reset_hooks_end=False``: later runs keep filling the cache, as in
TransformerLens). ``names_filter`` limits the derived entries like the stored ones, and only
layers that ran have entries (``start_at_layer`` / ``stop_at_layer`` skip layers).

Every ``run_with_cache`` argument TransformerLens accepts works as on the original model, with
the same keys (plus the neuron-head hooks) and values: ``tests/test_cache_contract.py`` checks
every argument value, pairwise, on decoders (plain, gated, MoE) and encoders.

Every :class:`~transformer_lens.ActivationCache` method works as on a stored cache (``keys``,
``items``, ``values``, ``stack_activation``, ``to``, ``remove_batch_dim``,
``apply_slice_to_batch_dim``, ``toggle_autodiff``, ``__getitem__`` with tuples, ...); methods that
go over every value (``items``, ``values``, ``to`` is not one of them) derive what they read.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformer_lens import ActivationCache
from transformer_lens.utilities import Slice

from tl_attnonly.hooks import hook_kind, neuron_act_name

#: Tuple-form activation names that, with ``"mlp"`` as the layer type, mean neuron-head hooks
#: (TransformerLens's ``get_act_name`` sends them to the attention layer), with its aliases.
NEURON_TUPLE_KINDS = ("q", "k", "v", "attn_scores", "scores", "pattern", "z", "result")
_TL_ALIASES = {
    "attn": "pattern",
    "attn_logits": "attn_scores",
    "key": "k",
    "query": "q",
    "value": "v",
}
#: Layer types that name the MLP (``get_act_name``'s alias ``"m"`` included).
MLP_LAYER_TYPES = ("mlp", "m")
#: ``get_act_name``'s shorthand: ``"pattern0mlp"`` is ``("pattern", 0, "mlp")``.
_SHORTHAND = re.compile(r"([a-z]+)(\d+)([a-z]?.*)")

Transform = Callable[[torch.Tensor], torch.Tensor]


class CacheBatchDimError(AssertionError, ValueError):
    """A batch-dimension operation the cache cannot do (``remove_batch_dim`` with batch size
    above 1, batch indexing after the batch dimension is gone).

    TransformerLens's :class:`~transformer_lens.ActivationCache` raises ``AssertionError`` here,
    so this is one (code written for TransformerLens catches it); it is a ``ValueError`` too.
    """


class _Pending:
    """A cache entry not computed yet: ``compute()`` derives it (then the transforms applied to
    the cache since, in order)."""

    def __init__(self, compute: Callable[[], torch.Tensor]):
        self.compute = compute

    def then(self, transform: Transform) -> _Pending:
        compute = self.compute
        return _Pending(lambda: transform(compute()))


class DerivingDict(MutableMapping):
    """``name -> tensor`` whose pending entries are computed on first read and then kept.

    Iteration, ``len`` and ``in`` see every name (pending or not) without computing anything.
    """

    def __init__(self, entries: dict[str, torch.Tensor | _Pending]):
        self._entries = entries

    def __getitem__(self, name: str) -> torch.Tensor:
        value = self._entries[name]
        if isinstance(value, _Pending):
            value = self._entries[name] = value.compute()
        return value

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        self._entries[name] = value

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def is_derived(self, name: str) -> bool:
        """Whether ``name`` has been computed (or was stored by the run)."""
        return not isinstance(self._entries[name], _Pending)

    def stored(self) -> dict[str, torch.Tensor]:
        """The entries held now (stored by the run, or derived and kept)."""
        return {k: v for k, v in self._entries.items() if not isinstance(v, _Pending)}

    def mapped(
        self, transform: Transform, keep: Callable[[torch.Tensor], bool] | None = None
    ) -> DerivingDict:
        """A new dict with ``transform`` applied to every entry (lazily to pending ones);
        ``keep(tensor)`` true leaves an entry as it is."""

        def apply(tensor: torch.Tensor) -> torch.Tensor:
            return tensor if keep is not None and keep(tensor) else transform(tensor)

        return DerivingDict(
            {
                name: value.then(apply) if isinstance(value, _Pending) else apply(value)
                for name, value in self._entries.items()
            }
        )


class NeuronHeadActivationCache(ActivationCache):
    """The :class:`~transformer_lens.ActivationCache` of a converted model's ``run_with_cache``.

    Neuron-head entries not stored by the run are derived from the stored pre-activations when
    first read (see the module docstring). Tuple names with layer type ``"mlp"``
    (``cache["pattern", 0, "mlp"]``) reach the neuron-heads; TransformerLens's ``get_act_name``
    alone would give the attention layer's tensor.

    Args:
        cache_dict: A :class:`DerivingDict` (or a plain dict: nothing derived).
        model: The model that ran.
        has_batch_dim: As for :class:`~transformer_lens.ActivationCache`.
    """

    cache_dict: Any

    def __init__(
        self,
        cache_dict: Any,
        model: Any,
        has_batch_dim: bool = True,
        derive_sources: tuple[torch.Tensor, ...] = (),
        batch_size: int | None = None,
    ):
        if not isinstance(cache_dict, DerivingDict):
            # The dict itself, not a copy: with ``reset_hooks_end=False`` TransformerLens's caching
            # hooks stay attached and keep writing into it, and the cache shows what they write.
            if not isinstance(cache_dict, dict):
                cache_dict = dict(cache_dict)
            cache_dict = DerivingDict(cache_dict)
        super().__init__(cache_dict, model, has_batch_dim=has_batch_dim)
        #: The tensors derived entries are computed from (held, though not entries).
        self._derive_sources = derive_sources
        self._pending_batch_size = batch_size

    def __getitem__(self, key) -> torch.Tensor:
        name = self._neuron_head_name(key)
        if name is None:
            return super().__getitem__(key)
        if name not in self.cache_dict:
            raise KeyError(
                f"{name} (= {key!r}, a neuron-head hook) is not in this cache: run "
                "run_with_cache with a names_filter that keeps it."
            )
        return self.cache_dict[name]

    def _neuron_head_name(self, key: Any) -> str | None:
        """The neuron-head hook an MLP-qualified key names (``("pattern", 0, "mlp")``, its
        shorthand ``"pattern0mlp"``, ``"m"`` for ``"mlp"``), else None (TransformerLens's
        resolution applies)."""
        if isinstance(key, str):
            match = None if key in self.cache_dict else _SHORTHAND.fullmatch(key)
            if match is None:
                return None
            key = (match.group(1), int(match.group(2)), match.group(3))
        if not (isinstance(key, tuple) and len(key) >= 3 and key[1] is not None):
            return None
        kind = _TL_ALIASES.get(key[0], key[0])
        if key[2] not in MLP_LAYER_TYPES or kind not in NEURON_TUPLE_KINDS:
            return None
        layer = key[1] if key[1] >= 0 else self.model.cfg.n_layers + key[1]
        return neuron_act_name(kind, layer)

    def __repr__(self) -> str:
        return f"NeuronHeadActivationCache with keys {list(self.cache_dict.keys())}"

    # ----------------------------------------------------- methods that would read every entry
    def _batch_size(self) -> int:
        """As TransformerLens's, from the entries held (a derived entry has the batch size of
        the pre-activations it comes from, which are held)."""
        stored = self.cache_dict.stored()
        counts = Counter(v.size(0) for v in stored.values() if v.ndim > 0)
        if self._pending_batch_size is not None and len(stored) < len(self.cache_dict):
            counts[self._pending_batch_size] += len(self.cache_dict) - len(stored)
        return counts.most_common(1)[0][0] if counts else 1

    def to(self, device: str | torch.device) -> NeuronHeadActivationCache:
        """Move the cache to ``device``; entries not derived yet are moved when derived."""
        self.cache_dict = self.cache_dict.mapped(lambda t: t.to(device))
        return self

    def remove_batch_dim(self, batch_size: int | None = None) -> NeuronHeadActivationCache:
        """Remove the batch dimension (batch size 1), lazily for entries not derived yet.

        Args:
            batch_size: The true batch size when the caller knows it (TransformerLens 4.x's
                argument); by default inferred from the entries.
        """
        if not self.has_batch_dim:
            super().remove_batch_dim()  # TL's: warns and returns self
            return self
        if batch_size is None:
            batch_size = self._batch_size()
        if batch_size != 1:
            raise CacheBatchDimError(
                f"Cannot remove batch dimension from cache with batch size {batch_size}: only a "
                "batch of one can lose it. Slice one item first: "
                "cache.apply_slice_to_batch_dim(i) (or run_with_cache on one input)."
            )
        self.cache_dict = self.cache_dict.mapped(
            lambda t: t[0], keep=lambda t: t.ndim == 0 or t.size(0) != 1
        )
        self.has_batch_dim = False
        self._pending_batch_size = None
        return self

    def apply_slice_to_batch_dim(self, batch_slice: Any) -> NeuronHeadActivationCache:
        """Slice the batch dimension of every entry, lazily for entries not derived yet."""
        if not isinstance(batch_slice, Slice):
            batch_slice = Slice(batch_slice)
        if not (self.has_batch_dim or batch_slice.mode == "empty"):
            raise CacheBatchDimError(
                "Cannot index into a cache without a batch dim (remove_batch_dim was applied): "
                "index the tensors directly."
            )
        still_has_batch_dim = (batch_slice.mode != "int") and self.has_batch_dim
        batch_size = self._batch_size()
        new = self.cache_dict.mapped(
            lambda t: batch_slice.apply(t, dim=0),
            keep=lambda t: t.ndim == 0 or t.size(0) != batch_size,
        )
        new_batch_size = None
        if still_has_batch_dim:
            new_batch_size = batch_slice.apply(torch.arange(batch_size), dim=0).numel()
        return NeuronHeadActivationCache(
            new,
            self.model,
            has_batch_dim=still_has_batch_dim,
            derive_sources=self._derive_sources,
            batch_size=new_batch_size,
        )

    # ----------------------------------------------------- accounting
    def stored_nbytes(self) -> int:
        """Bytes of tensor storage the cache holds now, each storage counted once (the hidden
        pre-activations that derived entries come from included)."""
        seen: dict[int, int] = {}
        tensors = list(self.cache_dict.stored().values()) + list(self._derive_sources)
        for tensor in tensors:
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())


def neuron_head_cache(cache: ActivationCache) -> NeuronHeadActivationCache:
    """A converted model's cache in which MLP-qualified keys reach the neuron-heads.

    ``cache["pattern", l, "mlp"]`` (and ``q, k, v, attn_scores, z, result``; ``"m"`` for
    ``"mlp"``; the shorthand ``"pattern0mlp"``) is ``blocks.{l}.mlp.hook_pattern`` here, as in
    the cache of :meth:`AttnOnlyTransformer.run_with_cache
    <tl_attnonly.AttnOnlyTransformer.run_with_cache>`, which is returned as it is. A converted
    ``TransformerBridge``'s ``run_with_cache`` is TransformerLens's own and returns a plain
    :class:`~transformer_lens.ActivationCache`, whose ``get_act_name`` sends those keys to the
    attention layer (``cache["pattern", l, "mlp"]`` is then the attention pattern
    ``[batch, n_heads, pos, pos]``): wrap it with this. The wrapper shares the cache's tensors
    (nothing is copied) and answers every other key, and every method, as TransformerLens does.

    Args:
        cache: The ``ActivationCache`` of a converted model's ``run_with_cache`` (a converted
            bridge, or an :class:`~tl_attnonly.AttnOnlyTransformer`).

    Returns:
        A :class:`NeuronHeadActivationCache`.

    Raises:
        ValueError: For the cache of a model with no neuron-head hooks (not converted).

    Example:
        >>> logits, cache = bridge.run_with_cache(tokens)  # bridge = tl_attnonly.convert(bridge)
        >>> tl_attnonly.neuron_head_cache(cache)["pattern", 0, "mlp"].shape
        torch.Size([batch, n_neuron_heads, pos, 2])
    """
    if isinstance(cache, NeuronHeadActivationCache):
        return cache
    hook_dict = getattr(cache.model, "hook_dict", {})
    # (a mixture of experts: blocks.{l}.mlp.experts.{e}.hook_pattern)
    if not any(".mlp." in name and name.endswith(".hook_pattern") for name in hook_dict):
        raise ValueError(
            f"neuron_head_cache: the cache's model ({type(cache.model).__name__}) has no "
            "neuron-head hooks (blocks.0.mlp.hook_pattern). Convert it first: "
            "model = tl_attnonly.convert(model), then run_with_cache."
        )
    return NeuronHeadActivationCache(
        cache.cache_dict, cache.model, has_batch_dim=cache.has_batch_dim
    )


@dataclass(frozen=True)
class CacheRunOptions:
    """TransformerLens's ``run_with_cache`` keywords (as for ``HookedRootModule.run_with_cache``;
    the defaults are its own), apart from the forward pass's.

    :func:`run_with_derived_cache` takes them as ``options=CacheRunOptions(...)`` or, as
    ``run_with_cache`` does, each by keyword (which replaces the one in ``options``).
    """

    names_filter: Any = None
    device: Any = None
    remove_batch_dim: bool = False
    incl_bwd: bool = False
    pos_slice: Any = None
    reset_hooks_end: bool = True
    clear_contexts: bool = False
    return_cache_object: bool = True

    def with_overrides(self, kwargs: dict[str, Any]) -> CacheRunOptions:
        """A copy with the cache keywords in ``kwargs`` replaced; they are removed from
        ``kwargs``, which keeps the forward pass's keywords."""
        names = [f.name for f in dataclasses.fields(self)]
        return dataclasses.replace(self, **{n: kwargs.pop(n) for n in names if n in kwargs})


def run_with_derived_cache(
    model: Any,
    run: Callable[..., tuple[Any, Any]],
    model_args: tuple[Any, ...],
    *,
    options: CacheRunOptions | None = None,
    derive: bool = True,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """``run_with_cache`` of a neuron-head model (see the module docstring).

    Args:
        model: The converted model.
        run: TransformerLens's ``run_with_cache`` of the model's base class, bound.
        model_args: Positional arguments of the forward pass.
        options: ``run_with_cache``'s own keywords (:class:`CacheRunOptions`).
        derive: ``False`` stores every entry (the slower head path runs wherever a neuron-head
            hook is cached).
        **kwargs: ``run_with_cache``'s keywords (``names_filter``, ``device``,
            ``remove_batch_dim``, ``incl_bwd``, ``pos_slice``, ``reset_hooks_end``,
            ``clear_contexts``, ``return_cache_object``; each replaces the one in ``options``),
            the rest passed to the forward pass.
    """
    kwargs = dict(kwargs)
    resolved = (options or CacheRunOptions()).with_overrides(kwargs)
    names_filter, device = resolved.names_filter, resolved.device
    remove_batch_dim, incl_bwd = resolved.remove_batch_dim, resolved.incl_bwd
    pos_slice, reset_hooks_end = resolved.pos_slice, resolved.reset_hooks_end
    clear_contexts, return_cache_object = resolved.clear_contexts, resolved.return_cache_object
    from tl_attnonly._compat import has_hooks
    from tl_attnonly.components.neuron_head_base import DERIVABLE_HOOKS, NeuronHeadBase

    run_options = dict(
        device=device,
        remove_batch_dim=remove_batch_dim,
        incl_bwd=incl_bwd,
        reset_hooks_end=reset_hooks_end,
        clear_contexts=clear_contexts,
    )
    if pos_slice is not None:
        run_options["pos_slice"] = pos_slice
    if not return_cache_object or not derive or incl_bwd or not reset_hooks_end:
        # Everything stored, by TransformerLens's own run_with_cache. (With reset_hooks_end=False
        # its caching hooks stay attached and later runs overwrite the cache: a derived entry
        # would come from a later run than the stored entry beside it.)
        out, cache = run(
            *model_args,
            names_filter=names_filter,
            return_cache_object=False,
            **run_options,
            **kwargs,
        )
        if not return_cache_object:
            return out, cache
        return out, NeuronHeadActivationCache(cache, model, has_batch_dim=not remove_batch_dim)
    wanted = as_names_filter(names_filter)
    derived: dict[int, list[str]] = {}
    for layer, mlp in enumerate(model.neuron_heads):
        if not isinstance(mlp, NeuronHeadBase):
            continue  # mixture-of-experts: the experts' entries are stored
        if mlp.use_neuron_result or any(
            has_hooks(getattr(mlp, f"hook_{kind}")) for kind in DERIVABLE_HOOKS
        ):
            continue  # hooked: what the hooks did must be stored as it was
        names = [neuron_act_name(kind, layer) for kind in DERIVABLE_HOOKS]
        names = [name for name in names if wanted(name)]
        if names:
            derived[layer] = names
    skipped = {name for names in derived.values() for name in names}
    keep = lambda name: wanted(name) and name not in skipped  # noqa: E731
    stored: dict[str, torch.Tensor] = {}
    sources: dict[int, dict[str, torch.Tensor]] = {layer: {} for layer in derived}
    # How many stored entries precede a layer's derived ones (they follow its last input).
    positions: dict[int, int] = {}

    def capture(tensor: torch.Tensor, hook: Any) -> None:
        layer = int(hook.name.split(".")[1])
        sources[layer][hook.name.rsplit(".", 1)[1]] = tensor.detach()
        positions[layer] = len(stored) + (1 if keep(hook.name) else 0)

    capture_hooks = [
        (f"blocks.{layer}.mlp.{source}", capture)
        for layer in derived
        for source in model.neuron_heads[layer].derive_inputs
    ]
    # TransformerLens's HookedRootModule.run_with_cache, with the capture hooks running first.
    _, caching_hooks, _ = model.get_caching_hooks(
        keep,
        False,
        device,
        remove_batch_dim=remove_batch_dim,
        cache=stored,
        pos_slice=pos_slice,
    )
    with model.hooks(
        fwd_hooks=capture_hooks + caching_hooks,
        reset_hooks_end=reset_hooks_end,
        clear_contexts=clear_contexts,
    ):
        out = model(*model_args, **kwargs)
    slicer = Slice.unwrap(pos_slice)
    # Only layers that ran have entries, as in TransformerLens's cache: start_at_layer and
    # stop_at_layer skip layers, whose hooks (and so the capture hooks) never fire.
    derived = {
        layer: names
        for layer, names in derived.items()
        if set(sources[layer]) == set(model.neuron_heads[layer].derive_inputs)
    }
    sources = {layer: sources[layer] for layer in derived}

    def pending(layer: int, name: str) -> _Pending:
        kind = hook_kind(name)
        mlp = model.neuron_heads[layer]

        def compute() -> torch.Tensor:
            with torch.no_grad():
                tensor = mlp.derive_activation(kind, **sources[layer])
            # exactly what TransformerLens's caching hook does to a stored tensor
            tensor = tensor.to(device)
            if remove_batch_dim:
                tensor = tensor[0]
            pos_dim = -3 if kind in ("q", "k", "v", "z") else -2
            if tensor.dim() >= -pos_dim:
                tensor = slicer.apply(tensor, dim=pos_dim)
            return tensor

        return _Pending(compute)

    entries: dict[str, torch.Tensor | _Pending] = {}
    by_position: dict[int, list[int]] = {}
    for layer in derived:
        by_position.setdefault(positions.get(layer, len(stored)), []).append(layer)
    for index, (name, tensor) in enumerate([*stored.items(), ("", None)]):
        for layer in by_position.get(index, []):
            for derived_name in derived[layer]:
                entries[derived_name] = pending(layer, derived_name)
        if tensor is not None:
            entries[name] = tensor
    batch_size = None
    if derived and not remove_batch_dim:
        first = next(iter(derived))
        batch_size = sources[first][model.neuron_heads[first].derive_inputs[0]].size(0)
    cache = NeuronHeadActivationCache(
        DerivingDict(entries),
        model,
        has_batch_dim=not remove_batch_dim,
        derive_sources=tuple(t for layer in sources.values() for t in layer.values()),
        batch_size=batch_size,
    )
    return out, cache


def as_names_filter(names_filter: Any) -> Callable[[str], bool]:
    """``names_filter`` as a function, accepting what TransformerLens's ``get_caching_hooks``
    accepts (``None``, a hook name, a list of hook names, a function) and refusing the rest with
    its error, so a converted model takes exactly the original's arguments.

    Raises:
        ValueError: For any other type (a tuple or set of names: pass a list).
    """
    if names_filter is None:
        return lambda name: True
    if isinstance(names_filter, str):
        return lambda name: name == names_filter
    if isinstance(names_filter, list):
        allowed = list(names_filter)
        return lambda name: name in allowed
    if callable(names_filter):
        return names_filter
    raise ValueError(
        "names_filter must be a string, list of strings, or function (as TransformerLens "
        f"requires); got a {type(names_filter).__name__}. Pass list(...) for a tuple or set."
    )


__all__ = [
    "NEURON_TUPLE_KINDS",
    "CacheBatchDimError",
    "CacheRunOptions",
    "DerivingDict",
    "NeuronHeadActivationCache",
    "Transform",
    "as_names_filter",
    "neuron_head_cache",
    "run_with_derived_cache",
]
