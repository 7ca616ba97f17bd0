"""A ``TransformerBridge`` (converted by :func:`tl_attnonly.convert`, or not) as an
:class:`~tl_attnonly.protocol.AttnOnlyModel`: how the analysis tools read a bridge.

What differs from :class:`~tl_attnonly.hooked.adapter.HookedAdapter`, and how it is bridged:

* **Weights.** The bridge's attention components give TransformerLens-shaped ``W_Q`` ... ``W_O``
  (TL 3.9 and 4.x); :class:`BridgeAttention` fills absent biases with zeros and repeats grouped
  key/value heads per query head, as ``GroupedQueryAttention.W_K`` does. The neuron-head layers
  are the converted bridge's (:func:`tl_attnonly.bridge.neuron_head_layers`).
* **Norms.** :class:`BridgeNorm` is the bridge's own normalisation maths (TransformerLens's
  python path: LayerNorm or RMSNorm, Gemma's ``1 + weight``), computed without firing hooks.
* **Facts** the bridge's config does not state are read from its structure: norms after each
  sublayer (Gemma 2's ``ln1_post`` / ``ln2_post``), parallel blocks, grouped-query attention.
* **Runs from a block** (:class:`BridgeLayerRunner`). A run from block ``l`` calls the
  bridge's blocks from ``l`` on with the arguments a full pass of the batch gave them (rotary
  tables, masks, ALiBi biases; recorded once per batch; a key-value cache as a new empty copy of
  the one the pass began with, for each run), then the final norm and the unembedding: the
  blocks below ``l`` are not run. Where that does not give the full pass's logits exactly
  (checked once per bridge: a forward that does more after its blocks, such as Gemma 2's logit
  soft-cap), TransformerLens 4.x's ``start_at_layer`` runs it (which still runs the blocks
  below), and on 3.x a full pass of the tokens whose residual stream entering block ``l`` is
  replaced. Passes never skip leading positions
  (``prefix_reuse`` is false): the bridge has no frozen key-value cache.
* **Hooks by name.** ``run_with_hooks`` and ``hooks`` resolve hook names once
  (:class:`BridgeHooks`) instead of once per hook as the bridge's own ``run_with_hooks`` does on
  TransformerLens 3.x (each read of a bridge's ``hook_dict`` rebuilds every alias), then call the
  bridge's ``forward``; hook functions see ``hook.name`` as the name they were added by.
* **Raw and compatibility mode.** Everything is read live from the components, so both work;
  in compatibility mode the weights are the processed ones (folded norms), exactly as the bridge
  runs them.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
import weakref
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.nn as nn
from jaxtyping import Float, Int

from tl_attnonly._compat import (
    BRIDGE_STARTS_AT_LAYER,
    HAS_HOOKED_TRANSFORMER,
    child_module,
    hook_alias_generation,
)
from tl_attnonly.protocol import AdapterBase, Block, Hooks, ModelFacts, Tensor


class BridgeNorm:
    """A bridge normalisation component as a :class:`~tl_attnonly.protocol.Norm`.

    Calling it computes what the bridge's ``NormalizationBridge`` computes, without firing its
    hooks: the wrapped Hugging Face module where the bridge calls it (its native path, e.g.
    ``LlamaRMSNorm``, which works in float32 inside), else TransformerLens's python path: centre
    (LayerNorm), divide by ``sqrt(mean(x**2) + eps)``, times the weight (Gemma: ``1 + weight``),
    plus the bias (LayerNorm). ``centred``, ``eps``, ``w`` and ``b`` are that maths' parameters
    (what edge attribution linearises).

    Args:
        component: The bridge's ``NormalizationBridge`` (``blocks[l].ln1``, ``ln_final``, ...).
        config_eps: The bridge config's ``eps``.
    """

    def __init__(self, component: Any, config_eps: float):
        self.component = component
        self.centred = not bool(getattr(component, "uses_rms_norm", False))
        original = getattr(component, "original_component", None)
        eps = getattr(original, "eps", None)
        if eps is None:
            eps = getattr(original, "variance_epsilon", None)
        folding = bool(getattr(component.config, "layer_norm_folding", False))
        # The python path reads the config's eps; the folded (HF) path the module's own.
        self.eps = float(eps if folding and eps is not None else config_eps)

    @property
    def _offset(self) -> bool:
        offset = getattr(self.component, "uses_weight_offset", None)
        if offset is None:  # TransformerLens 3.x: the config says it for RMS norms
            offset = not self.centred and bool(
                getattr(self.component.config, "rmsnorm_uses_offset", False)
            )
        return bool(offset)

    @property
    def w(self) -> torch.Tensor | None:
        original = getattr(self.component, "original_component", None)
        weight = getattr(original, "weight", None)
        if not isinstance(weight, torch.Tensor):
            return None
        return 1.0 + weight if self._offset else weight

    @property
    def b(self) -> torch.Tensor | None:
        if not self.centred:
            return None
        original = getattr(self.component, "original_component", None)
        bias = getattr(original, "bias", None)
        return bias if isinstance(bias, torch.Tensor) else None

    def __call__(self, x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... d_model"]:
        component = self.component
        if getattr(component, "use_native_layernorm_autograd", False) or getattr(
            component.config, "layer_norm_folding", False
        ):  # the bridge runs the Hugging Face module itself (e.g. float32 inside LlamaRMSNorm)
            return component.original_component(x)
        dtype = x.dtype
        h = x if dtype in (torch.float32, torch.float64) else x.float()
        if self.centred:
            h = h - h.mean(-1, keepdim=True)
        h = h / (h.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()
        w, b = self.w, self.b
        if w is not None:
            h = h * w
        if b is not None:
            h = h + b
        return h.to(dtype)


def n_key_value_heads(component: Any, n_heads: int) -> int:
    """Key/value heads of a bridge attention component (``W_K``'s first axis).

    TransformerLens's multi-head latent attention (DeepSeek-V2/V3's ``MLAAttentionBridge``) has
    no ``W_K``: reading it raises ``NotImplementedError``. Its keys and values are per query head
    (decompressed from a shared latent), so it has ``n_heads``; its weights stay unavailable
    (a tool that reads them gets TransformerLens's error), while the tools that only run the
    model and read its hooks (the expert tools) work.
    """
    try:
        return int(component.W_K.shape[0])
    except NotImplementedError:  # multi-head latent attention
        return n_heads


class BridgeAttention:
    """A bridge attention component's weights in TransformerLens's shapes
    (:class:`~tl_attnonly.protocol.AttentionWeights`).

    Args:
        component: The bridge's attention component (``blocks[l].attn``).
        n_heads: Query heads.
        d_model: Residual width (for an absent ``b_O``).
    """

    def __init__(self, component: Any, n_heads: int, d_model: int):
        self.component = component
        self.n_heads = n_heads
        self.d_model = d_model
        self.n_kv_heads = n_key_value_heads(component, n_heads)
        if self.n_kv_heads != n_heads:  # grouped-query attention: TL's per-kv-head names
            self._W_K = self._kv("W_K")
            self._W_V = self._kv("W_V")
            self._b_K = self._kv_bias("b_K")
            self._b_V = self._kv_bias("b_V")

    def _bias(self, name: str, like: torch.Tensor) -> torch.Tensor:
        bias = getattr(self.component, name)
        return (
            bias
            if isinstance(bias, torch.Tensor)
            else like.new_zeros(like.shape[0], like.shape[-1])
        )

    def _kv(self, name: str) -> torch.Tensor:
        return getattr(self.component, name)

    def _kv_bias(self, name: str) -> torch.Tensor:
        return self._bias(name, self._kv("W_" + name[-1]))

    def _per_query_head(self, t: torch.Tensor) -> torch.Tensor:
        if self.n_kv_heads == self.n_heads:
            return t
        return t.repeat_interleave(self.n_heads // self.n_kv_heads, dim=0)

    @property
    def W_Q(self) -> Float[torch.Tensor, "n_heads d_model d_head"]:
        return self.component.W_Q

    @property
    def W_K(self) -> Float[torch.Tensor, "n_heads d_model d_head"]:
        return self._per_query_head(self.component.W_K)

    @property
    def W_V(self) -> Float[torch.Tensor, "n_heads d_model d_head"]:
        return self._per_query_head(self.component.W_V)

    @property
    def W_O(self) -> Float[torch.Tensor, "n_heads d_head d_model"]:
        return self.component.W_O

    @property
    def b_Q(self) -> Float[torch.Tensor, "n_heads d_head"]:
        return self._bias("b_Q", self.component.W_Q)

    @property
    def b_K(self) -> Float[torch.Tensor, "n_heads d_head"]:
        return self._per_query_head(self._kv_bias("b_K"))

    @property
    def b_V(self) -> Float[torch.Tensor, "n_heads d_head"]:
        return self._per_query_head(self._kv_bias("b_V"))

    @property
    def b_O(self) -> Float[torch.Tensor, " d_model"]:
        bias = self.component.b_O
        return bias if isinstance(bias, torch.Tensor) else self.W_O.new_zeros(self.d_model)


def _norm(component: Any, eps: float) -> BridgeNorm | None:
    if component is None:
        return None
    original = getattr(component, "original_component", None)
    if original is None or isinstance(original, torch.nn.Identity):
        return None
    return BridgeNorm(component, eps)


def _facts(bridge: Any) -> ModelFacts:
    from tl_attnonly.bridge.modules import BridgeGatedNeuronHeadMLP

    cfg = bridge.cfg
    blocks = list(bridge.blocks)
    first = blocks[0]
    attn: Any = child_module(first, "attn")
    post_norm = (
        bool(getattr(cfg, "use_normalization_before_and_after", False))
        or getattr(cfg, "do_layer_norm_before", True) is False  # OPT's post-LN (opt-350m)
        or any(
            child_module(block, name) is not None
            for block in blocks
            for name in ("ln1_post", "ln2_post")
        )
    )
    qk_norm = bool(getattr(cfg, "use_qk_norm", False)) or any(
        child_module(cast(nn.Module, child_module(block, "attn")), name) is not None
        for block in blocks
        for name in ("q_norm", "k_norm")
    )
    mlp_layers = [getattr(child_module(b, "mlp"), "original_component", None) for b in blocks]
    n_kv = n_key_value_heads(attn, cfg.n_heads) if attn is not None else cfg.n_heads
    W_E = bridge.W_E
    return ModelFacts(
        n_layers=len(blocks),
        n_heads=cfg.n_heads,
        n_key_value_heads=n_kv if n_kv != cfg.n_heads else None,
        d_model=cfg.d_model,
        d_head=cfg.d_head,
        d_mlp=getattr(cfg, "d_mlp", None),
        d_vocab=cfg.d_vocab,
        d_vocab_out=getattr(cfg, "d_vocab_out", cfg.d_vocab),
        n_ctx=cfg.n_ctx,
        act_fn=getattr(cfg, "act_fn", None),
        positional_embedding_type=cfg.positional_embedding_type,
        normalization_type=getattr(cfg, "normalization_type", None),
        attention_dir=getattr(cfg, "attention_dir", "causal"),
        parallel_attn_mlp=bool(getattr(cfg, "parallel_attn_mlp", False))
        or type(first).__name__ == "ParallelBlockBridge",
        post_norm=post_norm,
        use_qk_norm=qk_norm,
        attn_only=False,
        gated_mlp=any(isinstance(m, BridgeGatedNeuronHeadMLP) for m in mlp_layers)
        or bool(getattr(cfg, "gated_mlp", False)),
        default_prepend_bos=bool(getattr(cfg, "default_prepend_bos", True)),
        device=W_E.device,
        dtype=W_E.dtype,
        original_architecture=getattr(cfg, "original_architecture", None)
        or getattr(cfg, "architecture", None),
    )


class BridgeAdapter(AdapterBase):
    """A ``TransformerBridge`` as an :class:`~tl_attnonly.protocol.AttnOnlyModel` (see the module
    docstring for what differs from a ``HookedTransformer`` and how).

    Args:
        bridge: The bridge; read live (weights, hooks, neuron-head layers), never copied.
    """

    kind = "TransformerBridge"

    def __init__(self, bridge: Any):
        self.model = bridge
        self.cfg = _facts(bridge)
        #: A BERT-style encoder (post-LN, bidirectional): TL 4 says ``attention_dir``; TL 3.9's
        #: BERT bridge does not, but its Hugging Face model cannot generate (a masked LM).
        self.is_encoder = self.cfg.attention_dir == "bidirectional" or not bool(
            getattr(bridge.original_model, "can_generate", lambda: True)()
        )
        #: Runs from a block (output deltas, exact circuit runs) are decoder runs.
        self.can_resume = not self.is_encoder
        eps = float(getattr(bridge.cfg, "eps", 1e-5))
        self.blocks: list[Block] = []
        for block in bridge.blocks:
            mlp = child_module(block, "mlp")
            self.blocks.append(
                Block(
                    attn=BridgeAttention(
                        child_module(block, "attn"), self.cfg.n_heads, self.cfg.d_model
                    ),
                    mlp=getattr(mlp, "original_component", None),
                    ln1=_norm(child_module(block, "ln1"), eps),
                    ln2=_norm(child_module(block, "ln2"), eps),
                )
            )
        self.ln_final = _norm(getattr(bridge, "ln_final", None), eps)
        self._hooks = BridgeHooks(bridge)

    # ------------------------------------------------------------------ neuron-heads
    @property
    def is_converted(self) -> bool:
        from tl_attnonly.bridge.convert import is_converted_bridge

        return is_converted_bridge(self.model)

    @property
    def neuron_heads(self) -> list[Any]:
        from tl_attnonly.bridge.convert import neuron_head_layers

        return list(neuron_head_layers(self.model)) if self.is_converted else []

    @property
    def n_heads_per_neuron(self) -> int:
        layers = self.neuron_heads
        return layers[0].n_heads_per_neuron if layers else 0

    @property
    def n_neuron_heads(self) -> int:
        layers = self.neuron_heads
        return layers[0].n_neuron_heads if layers else 0

    def set_use_neuron_result(self, use_neuron_result: bool) -> None:
        from tl_attnonly.bridge.convert import set_use_neuron_result

        set_use_neuron_result(self.model, use_neuron_result)

    # ------------------------------------------------------------------ hooks by the names asked
    @property
    def hook_dict(self) -> dict[str, Any]:
        return dict(self._hooks.points())

    def run_with_hooks(self, *args: Any, fwd_hooks: Any = (), bwd_hooks: Any = (), **kwargs: Any):
        """The bridge's ``run_with_hooks``, its hooks added by :class:`BridgeHooks` (names resolved
        once, not once per hook): the hooks on, then the bridge's ``forward``, then the hooks off.
        Options only TransformerLens's ``run_with_hooks`` takes (``stop_at_layer``,
        ``reset_hooks_end``, ...) go to it as they are."""
        if kwargs.keys() & _RUN_OPTIONS:
            return self.model.run_with_hooks(
                *args, fwd_hooks=named_hooks(fwd_hooks), bwd_hooks=named_hooks(bwd_hooks), **kwargs
            )
        with self._hooks.added(fwd_hooks, bwd_hooks, kwargs.get("start_at_layer")):
            return self.model.forward(*args, **kwargs)

    def hooks(self, fwd_hooks: Any = (), bwd_hooks: Any = (), **kwargs: Any) -> Any:
        if kwargs:  # reset_hooks_end / clear_contexts: TransformerLens's own context manager
            return self.model.hooks(
                fwd_hooks=named_hooks(fwd_hooks), bwd_hooks=named_hooks(bwd_hooks), **kwargs
            )
        return self._hooks.added(fwd_hooks, bwd_hooks)

    def layer_runs(self, tokens: Int[torch.Tensor, "batch pos"]) -> BridgeLayerRunner:
        if not self.can_resume:
            raise TypeError("An encoder bridge cannot start a forward pass at a layer.")
        # Where the blocks cannot be called again exactly: a 4.x bridge's start_at_layer
        # recomputes rotary and learned positions but not position biases given to every block
        # (ALiBi: BLOOM, MPT, Falcon), which then differ from the full pass: those run full
        # passes with the entering residual replaced.
        starts = BRIDGE_STARTS_AT_LAYER and self.cfg.positional_embedding_type in RESUMABLE
        return BridgeLayerRunner(self, tokens, self.cfg.n_layers, starts_at_layer=starts)


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
_RUN_OPTIONS = frozenset(
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
    """

    prefix_reuse = False

    def __init__(
        self,
        bridge: Any,
        tokens: Int[torch.Tensor, "batch pos"],
        n_layers: int,
        *,
        starts_at_layer: bool = BRIDGE_STARTS_AT_LAYER,
    ):
        self.model = bridge  # the adapter: hooks see the names they were added by
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
        if layer < self.n_layers:
            calls = self._block_calls(copies)
            if calls is not None:
                positions = None if logit_positions is None else logit_positions.repeat(copies)
                with torch.no_grad(), self.model._hooks.added(hooks, (), layer):
                    return calls.run(resid, layer, positions)
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
    "BridgeAdapter",
    "BridgeAttention",
    "BridgeHooks",
    "BridgeLayerRunner",
    "BridgeNorm",
    "HookAs",
    "named_hooks",
]
