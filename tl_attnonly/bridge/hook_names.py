"""Hook names on a ``TransformerBridge``: hooks added by name, each name resolved once.

A bridge's hook names are aliases (``blocks.0.hook_resid_pre`` is ``blocks.0.hook_in``), and
TransformerLens 3.x's ``run_with_hooks`` resolves them once per hook (each read of a bridge's
``hook_dict`` rebuilds every alias). :class:`BridgeHooks` resolves them once and adds the hooks
as the bridge's own ``run_with_hooks`` would; hook functions see ``hook.name`` as the name they
were added by (:class:`HookAs`, :func:`named_hooks`). The bridge adapter's ``run_with_hooks``
and ``hooks`` (:mod:`tl_attnonly.bridge.adapter`) and the runs from a block
(:mod:`tl_attnonly.bridge.layer_runner`) add their hooks through it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER, hook_alias_generation


class HookAs:
    """A bridge hook point seen under the name a hook was added by.

    A bridge's hook names are aliases (``blocks.0.hook_resid_pre`` is ``blocks.0.hook_in``,
    ``hook_embed`` is ``embed.hook_out``); a hook function receives the hook point, whose
    ``name`` is the canonical one. Hook functions that look activations up by ``hook.name`` (as
    TransformerLens's patching does on a ``HookedTransformer``) see the name they were added by.
    """

    def __init__(self, hook: Any, name: str):
        self._hook = hook
        self.name = name

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._hook, attribute)


def _seen_as(fn: Callable, name: str) -> Callable:
    """``fn`` as a hook function that sees ``hook.name`` as ``name`` (:class:`HookAs`)."""

    def as_named(tensor: Any, hook: Any) -> Any:
        return fn(tensor, hook=HookAs(hook, name))

    return as_named


def named_hooks(hooks: Any) -> list[tuple[Any, Callable]]:
    """``(name, fn)`` hooks whose functions see ``hook.name`` as ``name`` (:class:`HookAs`);
    hooks added by a filter function are passed as they are."""
    return [(name, _seen_as(fn, name) if isinstance(name, str) else fn) for name, fn in hooks or ()]


#: Options of TransformerLens's ``run_with_hooks`` that its ``forward`` does not take: a run given
#: one goes through the bridge's own ``run_with_hooks``.
RUN_OPTIONS = frozenset(
    ("reset_hooks_end", "clear_contexts", "names_filter", "stop_at_layer", "remove_batch_dim")
)


def _embedding_stage(name: str) -> bool:
    """A hook of the embedding stage, which a run from a block skips (as TransformerLens 4's
    ``run_with_hooks(..., start_at_layer=l)`` does)."""
    return name in ("hook_embed", "hook_pos_embed", "hook_tokens") or name.startswith(
        ("embed.", "pos_embed.")
    )


class BridgeHooks:
    """Hooks added to a bridge's hook points by name, each name resolved as the bridge's
    ``run_with_hooks`` resolves it (``hook_dict`` and its aliases), but not once per hook.

    A bridge's ``hook_dict`` rebuilds every alias on each read, and TransformerLens 3.x's
    ``run_with_hooks`` reads it once per hook: milliseconds per hook on a 30-layer model, more
    than the forward pass for the hundreds of hooks of an exact circuit run. The resolution
    here is read once and kept while the bridge's hook points are the same objects, TL's alias
    generation is the same and compatibility mode is unchanged (the hook points are kept alive
    by the table, so their identities cannot be reused while it holds them).

    What the bridge's ``run_with_hooks`` does with a hook is done here the same way: a name it
    refuses (``check_hooks_to_add``) is refused, a filter's gated-off matches are skipped with a
    warning, a hook is added at a new context level (an alias in compatibility mode with both
    names) and removed at that level afterwards, and a run from a block skips the hooks of the
    embedding stage and of earlier blocks. A name the bridge does not have raises ``KeyError``.

    Args:
        bridge: The ``TransformerBridge``.
    """

    def __init__(self, bridge: Any):
        self.bridge = bridge
        self._state: tuple[Any, ...] | None = None
        self._points: dict[str, Any] = {}
        self._canonical: dict[str, str] = {}

    def _current(self) -> tuple[Any, ...]:
        hook_points = getattr(self.bridge, "hook_points", None)
        if hook_points is None:  # no registry to check against: read it every time
            return (object(),)
        compatible = bool(getattr(self.bridge, "compatibility_mode", False))
        return (tuple(map(id, hook_points())), hook_alias_generation(), compatible)

    def points(self) -> dict[str, Any]:
        """The bridge's ``hook_dict`` (every name, aliases included -> its hook point), read
        again only when the bridge's hook points or aliases changed."""
        state = self._current()
        if state != self._state:
            hook_dict = self.bridge.hook_dict
            self._points = dict(hook_dict)
            # run_with_hooks: an alias is the name of its hook point (build_alias_to_canonical_map)
            self._canonical = {name: point.name or name for name, point in hook_dict.items()}
            self._state = state
        return self._points

    def resolve(self, name: str, points: dict[str, Any] | None = None) -> tuple[str, Any]:
        """``(canonical name, hook point)`` of the hook point ``name`` (or an alias) names.

        Args:
            name: The name.
            points: :meth:`points`, if just read (it checks the bridge's hook points).

        Raises:
            KeyError: If the bridge has no hook point of that name.
        """
        points = self.points() if points is None else points
        canonical = self._canonical.get(name, name)
        if canonical not in points:
            raise KeyError(f"Hook name {name!r} does not exist on this model.")
        return canonical, points[canonical]

    def _refusal(self, point: Any, name: str, fn: Callable, direction: str) -> None:
        """The bridge's own check of a hook before it is added (raises ``ValueError`` for a
        gated-off hook point; its signature changed in TransformerLens 4)."""
        if HAS_HOOKED_TRANSFORMER:  # TransformerLens 3.x
            self.bridge.check_hooks_to_add(name)
        else:
            self.bridge.check_hooks_to_add(point, name, fn, dir=direction)

    @contextmanager
    def added(
        self, fwd_hooks: Any = (), bwd_hooks: Any = (), start_at_layer: int | None = None
    ) -> Iterator[Any]:
        """The hooks on for the ``with`` block (their functions see ``hook.name`` as the name
        they were added by, :class:`HookAs`), off after it; the hooks added before stay."""
        bridge = self.bridge
        start = start_at_layer
        if start is not None and start < 0:
            start += len(bridge.blocks)
        level = getattr(bridge, "context_level", 0) + 1
        compatible = bool(getattr(bridge, "compatibility_mode", False))
        added: list[tuple[Any, str]] = []

        def add(point: Any, fn: Callable, name: str, direction: str) -> None:
            if start is not None:
                if _embedding_stage(name):
                    return
                parts = name.split(".")
                if parts[0] == "blocks" and len(parts) > 1 and parts[1].isdigit():
                    if int(parts[1]) < start:
                        return
            if compatible and name != point.name:
                aliases = ([point.name] if point.name is not None else []) + [name]
                point.add_hook(fn, dir=direction, level=level, alias_names=aliases)
            else:
                point.add_hook(fn, dir=direction, level=level)
            added.append((point, direction))

        points = self.points()

        def apply(hooks: Any, direction: str) -> None:
            for name, fn in hooks or ():
                if isinstance(name, str):
                    canonical, point = self.resolve(name, points)
                    fn = _seen_as(fn, name)
                    self._refusal(point, canonical, fn, direction)
                    add(point, fn, canonical, direction)
                    continue
                seen: set[int] = set()
                skipped: list[str] = []
                for key, point in points.items():
                    if not name(key) or id(point) in seen:
                        continue
                    seen.add(id(point))
                    try:
                        self._refusal(point, point.name or key, fn, direction)
                    except ValueError:
                        skipped.append(key)
                        continue
                    add(point, fn, point.name or key, direction)
                if skipped:
                    warnings.warn(
                        f"run_with_hooks: skipped {len(skipped)} gated-off hook name(s) that "
                        f"would never fire: {skipped}. Call the relevant set_use_*(True) setter "
                        "first to enable them.",
                        stacklevel=4,
                    )

        try:
            bridge.context_level = level
            apply(fwd_hooks, "fwd")
            apply(bwd_hooks, "bwd")
            yield bridge
        finally:
            for point, direction in added:
                point.remove_hooks(dir=direction, level=level)
            bridge.context_level = level - 1


__all__ = [
    "RUN_OPTIONS",
    "BridgeHooks",
    "HookAs",
    "named_hooks",
]
