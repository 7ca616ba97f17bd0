"""A ``HookedTransformer`` / ``HookedEncoder`` (converted or not) as an
:class:`~tl_attnonly.protocol.AttnOnlyModel`.

The adapter is thin: the blocks' attention modules already have TransformerLens's weight
properties, and the neuron-head layers are the blocks' MLPs (an unconverted MLP is wrapped as an
:class:`~tl_attnonly.mlp_protocol.UnconvertedMLP`). It adds the norms as
:class:`~tl_attnonly.protocol.Norm` views and the runs that resume from a block
(``forward(resid, start_at_layer=l)``, with TransformerLens's frozen key-value cache for a shared
prefix). TransformerLens 3.x is imported only when a method needs it: this module imports on 4.x.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn as nn
from jaxtyping import Float, Int

from tl_attnonly.components.expert_facts import ExpertFacts
from tl_attnonly.components.neuron_head_base import NeuronHeadBase
from tl_attnonly.mlp_protocol import ExpertsMLP
from tl_attnonly.protocol import (
    AdapterBase,
    Block,
    ConvertedMLP,
    Hooks,
    ModelFacts,
    NeuronHeadLayerView,
    Norm,
    Tensor,
    UnconvertedMLP,
)


class HookedNorm:
    """A TransformerLens norm module (``LayerNorm``, ``LayerNormPre``, ``RMSNorm``,
    ``RMSNormPre``) as a :class:`~tl_attnonly.protocol.Norm`.

    Args:
        module: The module (``blocks[l].ln1``, ``ln_final``, ...).
    """

    def __init__(self, module: nn.Module):
        self.module = module
        name = type(module).__name__
        if name not in ("LayerNorm", "LayerNormPre", "RMSNorm", "RMSNormPre"):
            raise NotImplementedError(
                f"A {name} normalisation is not one the analysis tools read (LayerNorm, "
                "LayerNormPre, RMSNorm, RMSNormPre)."
            )
        self.centred = name.startswith("LayerNorm")
        self.eps = float(module.eps)  # type: ignore[arg-type]

    @property
    def w(self) -> torch.Tensor | None:
        return getattr(self.module, "w", None)

    @property
    def b(self) -> torch.Tensor | None:
        return getattr(self.module, "b", None)

    @property
    def hook_scale(self) -> str | None:
        return getattr(getattr(self.module, "hook_scale", None), "name", None)

    def normalised(
        self, x: Float[torch.Tensor, "... d_model"]
    ) -> Float[torch.Tensor, "... d_model"]:
        """What the module's ``hook_normalized`` holds for input ``x``: ``x_c / sigma`` (before
        the weight and bias), op for op as the module computes it, without its hooks."""
        dtype = cast(torch.dtype, self.module.cfg.dtype)
        if dtype not in (torch.float32, torch.float64):
            x = x.to(torch.float32)
        if self.centred:
            x = x - x.mean(-1, keepdim=True)
        return (x / (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()).to(dtype)

    def __call__(self, x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... d_model"]:
        """The module's arithmetic, op for op, without its hooks (``hook_scale``,
        ``hook_normalized``): a hook on them belongs to the model's run, not to analysis."""
        x = self.normalised(x)
        w, b = self.w, self.b
        if w is not None:
            x = x * w
        return x if b is None else x + b


def hooked_norm(module: Any) -> Norm | None:
    """The :class:`~tl_attnonly.protocol.Norm` of a TransformerLens norm slot (``None`` for none
    or ``nn.Identity``)."""
    if module is None or isinstance(module, nn.Identity):
        return None
    return HookedNorm(module)


def hooked_mlp(model: Any, block: Any) -> NeuronHeadLayerView:
    """A block's MLP as :attr:`~tl_attnonly.protocol.Block.mlp` holds it: a neuron-head layer
    (or mixture of neuron-head experts) as it is; TransformerLens's own MLP (or none, in an
    attention-only block) as an :class:`~tl_attnonly.mlp_protocol.UnconvertedMLP`, gated and a
    mixture of experts as the config says.

    Args:
        model: The model (its config).
        block: One of its blocks.
    """
    mlp = getattr(block, "mlp", None)
    if isinstance(mlp, ExpertFacts):  # dense members refuse, by name
        index = next(i for i, b in enumerate(model.blocks) if b is block)
        return cast(NeuronHeadLayerView, ExpertsMLP(mlp, index))
    if isinstance(mlp, NeuronHeadBase):
        return cast(NeuronHeadLayerView, mlp)
    cfg = model.cfg
    unconverted = UnconvertedMLP(
        mlp,
        gated=mlp is not None and bool(cfg.gated_mlp),
        is_mixture_of_experts=mlp is not None and bool(getattr(cfg, "num_experts", None)),
    )
    return cast(NeuronHeadLayerView, unconverted)  # its flags say what it is (Block.mlp)


def _facts(model: Any, gated_mlp: bool) -> ModelFacts:
    """The facts of ``model``; ``gated_mlp``: what its blocks' MLPs say (``gated``)."""
    from tl_attnonly._compat import POST_NORM_ARCHITECTURES

    cfg = model.cfg
    return ModelFacts(
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        n_key_value_heads=getattr(cfg, "n_key_value_heads", None),
        d_model=cfg.d_model,
        d_head=cfg.d_head,
        d_mlp=cfg.d_mlp,
        d_vocab=cfg.d_vocab,
        d_vocab_out=cfg.d_vocab_out,
        n_ctx=cfg.n_ctx,
        act_fn=cfg.act_fn,
        positional_embedding_type=cfg.positional_embedding_type,
        normalization_type=cfg.normalization_type,
        attention_dir=cfg.attention_dir,
        parallel_attn_mlp=bool(cfg.parallel_attn_mlp),
        post_norm=bool(cfg.use_normalization_before_and_after)
        or cfg.original_architecture in POST_NORM_ARCHITECTURES,
        use_qk_norm=bool(getattr(cfg, "use_qk_norm", False)),
        attn_only=bool(cfg.attn_only),
        gated_mlp=gated_mlp,
        default_prepend_bos=bool(cfg.default_prepend_bos),
        device=torch.device(cfg.device) if cfg.device is not None else model.W_E.device,
        dtype=cfg.dtype,
        original_architecture=cfg.original_architecture,
    )


def _block(model: Any, block: Any) -> Block:
    """One block as analysis reads it. OLMo 2/3 (``POST_NORM_ARCHITECTURES``): TransformerLens's
    ``ln1`` / ``ln2`` there normalise the sublayers' outputs, so they are ``ln1_post`` /
    ``ln2_post`` (and the sublayers read the residual stream itself)."""
    from tl_attnonly._compat import POST_NORM_ARCHITECTURES

    norms = {name: hooked_norm(getattr(block, name, None)) for name in ("ln1", "ln2")}
    if model.cfg.original_architecture in POST_NORM_ARCHITECTURES:
        ln1, ln2, ln1_post, ln2_post = None, None, norms["ln1"], norms["ln2"]
    else:
        ln1, ln2 = norms["ln1"], norms["ln2"]
        ln1_post = hooked_norm(getattr(block, "ln1_post", None))
        ln2_post = hooked_norm(getattr(block, "ln2_post", None))
    return Block(
        attn=block.attn,
        mlp=hooked_mlp(model, block),
        ln1=ln1,
        ln2=ln2,
        ln1_post=ln1_post,
        ln2_post=ln2_post,
    )


#: A ``HookedEncoder``'s embeddings (``BertEmbed``'s hooks), summed before ``embed.ln``.
ENCODER_EMBEDDING_HOOKS = (
    ("embed", "embed.hook_embed"),
    ("pos_embed", "embed.hook_pos_embed"),
    ("token_type_embed", "embed.hook_token_type_embed"),
)


class HookedAdapter(AdapterBase):
    """An :class:`~tl_attnonly.AttnOnlyTransformer`, :class:`~tl_attnonly.AttnOnlyEncoder` or an
    unconverted ``HookedTransformer`` as an :class:`~tl_attnonly.protocol.AttnOnlyModel`.

    Args:
        model: The model; read live (weights, hooks), never copied.
    """

    kind = "HookedTransformer"

    def __init__(self, model: Any):
        self.model = model
        self.is_encoder = hasattr(model, "encoder_output") or type(model).__name__.endswith(
            "Encoder"
        )
        self.can_resume = not self.is_encoder
        self.blocks: list[Block] = [_block(model, block) for block in model.blocks]
        self.cfg = _facts(model, gated_mlp=any(block.mlp.gated for block in self.blocks))
        self.ln_final = hooked_norm(getattr(model, "ln_final", None))
        if self.is_encoder:  # BertEmbed: the three embeddings' sum, then its LayerNorm
            self.embed_norm = hooked_norm(getattr(model.embed, "ln", None))
            self.embedding_hooks = ENCODER_EMBEDDING_HOOKS

    # ------------------------------------------------------------------ neuron-heads
    @property
    def is_converted(self) -> bool:
        neuron_heads = getattr(type(self.model), "neuron_heads", None)
        return isinstance(neuron_heads, property) and bool(self.model.neuron_heads)

    @property
    def neuron_heads(self) -> list[ConvertedMLP]:
        return list(self.model.neuron_heads) if self.is_converted else []

    @property
    def n_heads_per_neuron(self) -> int:
        return self.model.n_heads_per_neuron if self.is_converted else 0

    @property
    def n_neuron_heads(self) -> int:
        return self.model.n_neuron_heads if self.is_converted else 0

    def set_use_neuron_result(self, use_neuron_result: bool) -> None:
        self.model.set_use_neuron_result(use_neuron_result)

    # ------------------------------------------------------------------ encoders
    def tokenize(
        self, text: str | list[str]
    ) -> tuple[Int[torch.Tensor, "batch pos"], dict[str, Any]]:
        """The model's ``to_tokens(text)``: a ``HookedEncoder``'s gives ``(tokens,
        token_type_ids, attention_mask)``, the last two the forward's keyword arguments."""
        if not self.is_encoder:
            return super().tokenize(text)
        tokens, token_type_ids, mask = self.model.to_tokens(text)
        return tokens, dict(token_type_ids=token_type_ids, one_zero_attention_mask=mask)

    def mlp_input_hook(
        self, layer: int
    ) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]] | None:
        block = self.blocks[layer]
        if not isinstance(block.ln2, HookedNorm) or not isinstance(block.mlp, NeuronHeadBase):
            return None
        return f"blocks.{layer}.ln2.hook_normalized", block.ln2.normalised

    def layer_runs(self, tokens: Int[torch.Tensor, "batch pos"]) -> HookedLayerRunner:
        if not self.can_resume:
            raise TypeError(f"{type(self.model).__name__} cannot start a forward pass at a layer.")
        return HookedLayerRunner(self.model, tokens)


class HookedLayerRunner:
    """Runs of a ``HookedTransformer`` that start at a block (``start_at_layer``).

    In a causal decoder with learned or rotary positions and no padding, a run whose residual
    stream equals the corrupted one before ``first_pos`` runs positions ``first_pos..`` only,
    attending to the tokens' keys and values of the earlier positions (TransformerLens's frozen
    key-value cache, filled once by a run of the prefix).

    Args:
        model: The decoder.
        tokens: The batch the residual streams given to :meth:`run` are copies of.
    """

    def __init__(self, model: Any, tokens: Int[torch.Tensor, "batch pos"]):
        self.model = model
        self.tokens = tokens
        self.batch = tokens.shape[0]
        with torch.no_grad():
            # What forward(tokens) passes to every block besides the residual stream.
            _, _, self._shortformer, self._mask = model.input_to_embed(tokens)
        cfg = model.cfg
        self.prefix_reuse = (
            cfg.attention_dir == "causal"
            and cfg.positional_embedding_type in ("standard", "rotary")
            and self._mask is None
            and self._shortformer is None
        )
        self._prefixes: dict[int, Any] = {}

    def recording(self) -> contextlib.AbstractContextManager[None]:
        """Nothing to record: the blocks' other arguments come from ``input_to_embed``."""
        return contextlib.nullcontext()

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
        n_pos = resid.shape[1]
        positions = None if logit_positions is None else logit_positions.repeat(copies)
        if first_pos > 0 and self.prefix_reuse and not hooks and prefix is not None:
            first_pos = min(first_pos, n_pos)
            prefix = prefix[:, :first_pos].repeat(copies, 1, 1)
            if first_pos == n_pos:
                return prefix
            past = self._prefix_cache(first_pos, copies)
            with torch.no_grad():
                if positions is None:
                    suffix = self.model(
                        resid[:, first_pos:], start_at_layer=layer, past_kv_cache=past
                    )
                    return torch.cat((prefix, suffix), dim=1)
                final = self.model(
                    resid[:, first_pos:],
                    start_at_layer=layer,
                    stop_at_layer=self.model.cfg.n_layers,
                    past_kv_cache=past,
                )
            return self._tail(final, positions, first_pos, prefix)
        kwargs: dict[str, Any] = {}
        if self._mask is not None:
            kwargs["attention_mask"] = self._mask.repeat(copies, 1)
        if self._shortformer is not None:
            kwargs["shortformer_pos_embed"] = self._shortformer.repeat(copies, 1, 1)
        with torch.no_grad():
            if positions is None:
                return self.model.run_with_hooks(
                    resid, start_at_layer=layer, fwd_hooks=list(hooks), **kwargs
                )
            with self.model.hooks(fwd_hooks=list(hooks)):
                final = self.model(
                    resid, start_at_layer=layer, stop_at_layer=self.model.cfg.n_layers, **kwargs
                )
                return self._tail(final, positions, 0, None)

    def _tail(
        self,
        final: Float[torch.Tensor, "batch suffix_pos d_model"],
        positions: Int[torch.Tensor, " batch"],
        offset: int,
        prefix: Float[torch.Tensor, "batch prefix_pos d_vocab"] | None,
    ) -> Float[torch.Tensor, "batch pos d_vocab"]:
        """The logits at ``positions`` (one per row) of the residual stream after the last
        block, as ``HookedTransformer.forward`` ends (final norm, unembedding, logit soft cap),
        the other positions NaN. ``final`` holds positions ``offset..``; a position before
        ``offset`` takes ``prefix``'s logits (the corrupted run's there)."""
        model = self.model
        rows = torch.arange(final.shape[0], device=final.device)
        at = positions.to(final.device)
        n_pos = offset + final.shape[1]
        logits = final.new_full((final.shape[0], n_pos, model.cfg.d_vocab_out), torch.nan)
        early = at < offset
        if prefix is not None and bool(early.any()):
            logits[rows[early], at[early]] = prefix[rows[early], at[early]]
        late = ~early
        picked = final[rows[late], at[late] - offset].unsqueeze(1)  # [rows, 1, d_model]
        if model.cfg.normalization_type is not None:
            picked = model.ln_final(picked)
        picked = model.unembed(picked)
        cap = model.cfg.output_logits_soft_cap
        if cap is not None and cap > 0:  # as HookedTransformer.forward's apply_softcap
            picked = cap * torch.tanh(picked / cap)
        logits[rows[late], at[late]] = picked[:, 0]
        return logits

    def _prefix_cache(self, first_pos: int, copies: int) -> Any:
        """The tokens' keys and values of positions ``< first_pos``, every layer, for ``copies``
        copies of the batch, frozen (a pass reads them, never extends them)."""
        from transformer_lens import (
            TransformerLensKeyValueCache,
            TransformerLensKeyValueCacheEntry,
        )

        if first_pos not in self._prefixes:
            cache = TransformerLensKeyValueCache.init_cache(
                self.model.cfg, self.model.cfg.device, self.batch
            )
            prefix = self.tokens[:, :first_pos]
            with torch.no_grad():  # causal: the prefix alone gives the same keys and values
                self.model(  # its blocks fill the cache; no unembedding
                    prefix,
                    past_kv_cache=cache,
                    attention_mask=torch.ones_like(prefix),
                    stop_at_layer=self.model.cfg.n_layers,
                )
            self._prefixes[first_pos] = cache
        cache = self._prefixes[first_pos]
        entries = [
            TransformerLensKeyValueCacheEntry(
                entry.past_keys.repeat(copies, 1, 1, 1),
                entry.past_values.repeat(copies, 1, 1, 1),
                frozen=True,
            )
            for entry in cache.entries
        ]
        mask = cache.previous_attention_mask.repeat(copies, 1)
        return TransformerLensKeyValueCache(entries, mask, frozen=True)


__all__ = ["HookedAdapter", "HookedLayerRunner", "HookedNorm", "hooked_mlp", "hooked_norm"]
