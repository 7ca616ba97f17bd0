"""The attention-only :class:`~transformer_lens.HookedEncoder` (Theorem 6 for BERT-style encoders).

Huben & Morris (2023), Theorem 6, applied to an encoder: every ``blocks[l].mlp`` of a
TransformerLens ``HookedEncoder`` (post-LN ``BertBlock``, bidirectional attention) becomes the same
:class:`~tl_attnonly.components.NeuronHeadMLP` that :class:`~tl_attnonly.AttnOnlyTransformer` uses.
``BertBlock`` calls its MLP as ``mlp(ln1(resid_mid))`` and adds the result before ``ln2``; the
neuron-head module has the MLP's parameters, hooks and call signature, so nothing else changes:
hook names are the decoder side's (``blocks.{l}.mlp.hook_pattern``, ``hook_z``, ...), the state
dict is the ``HookedEncoder``'s, and a neuron's heads attend to the token itself and a bias token
whatever the attention direction of the model's ordinary heads.

Example:
    >>> converted = convert_encoder(encoder, n_heads_per_neuron=4)
    >>> _, cache = converted.run_with_cache(tokens, one_zero_attention_mask=mask)
    >>> cache["blocks.0.mlp.hook_pattern"].shape  # [batch, n_neuron_heads, pos, 2]
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from transformer_lens import HookedEncoder, HookedTransformerConfig

from tl_attnonly.hooked.neuron_head_model import (
    UNCONVERT_FIX,
    NeuronHeadModelMixin,
    pending_options,
    resolve_options,
    share_tensors,
)
from tl_attnonly.hub import hub_access
from tl_attnonly.options import ConversionOptions, check_convertible


class AttnOnlyEncoder(NeuronHeadModelMixin, HookedEncoder):
    """A :class:`~transformer_lens.HookedEncoder` whose MLP neurons are attention heads.

    Each ``blocks[l].mlp`` is a :class:`~tl_attnonly.components.NeuronHeadMLP` (``K`` heads of
    internal dimension 1 per neuron, attending to the token itself and to a bias token); the
    embeddings, attention, LayerNorms, pooler and heads are TransformerLens's own. Usually built
    with :func:`convert_encoder` or :meth:`from_pretrained`; constructing it from a config gives
    an uninitialised model, like ``HookedEncoder(cfg)``.

    The neuron-head helpers are the decoder's (:class:`~tl_attnonly.AttnOnlyTransformer`):
    ``neuron_heads``, ``n_heads_per_neuron``, ``n_neuron_heads``, ``coefficients``,
    ``set_use_neuron_result``, ``save_pretrained`` and ``load``.

    Args:
        cfg: The encoder config (``act_fn`` stays what it was, e.g. ``"gelu"``).
        tokenizer: As for :class:`~transformer_lens.HookedEncoder`.
        move_to_device: As for :class:`~transformer_lens.HookedEncoder`.
        conversion: How neurons become heads; default :class:`ConversionOptions()`.
        **kwargs: Passed to :class:`~transformer_lens.HookedEncoder`.

    Raises:
        ValueError, NotImplementedError: Before anything is built, for a model that cannot be
            converted (see :func:`tl_attnonly.options.check_convertible`).
    """

    conversion: ConversionOptions

    def __init__(
        self,
        cfg: HookedTransformerConfig | dict,
        tokenizer: Any = None,
        move_to_device: bool = True,
        conversion: ConversionOptions | None = None,
        **kwargs: Any,
    ):
        cfg = HookedTransformerConfig.unwrap(cfg)
        conversion = resolve_options(cfg, conversion)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # "HookedEncoder is deprecated"
            super().__init__(cfg, tokenizer=tokenizer, move_to_device=False, **kwargs)
        self._install_neuron_heads(conversion)
        if move_to_device:
            if self.cfg.device is None:
                raise ValueError("Cannot move to device when cfg.device is None.")
            HookedEncoder.to(self, self.cfg.device, print_details=False)
        self.setup()
        self._warn_if_overflows(self.cfg.dtype)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(  # type: ignore[override]
        cls,
        model_name: str,
        *,
        conversion: ConversionOptions | None = None,
        n_heads_per_neuron: int | None = None,
        relu_k: float | None = None,
        gelu_method: str | None = None,
        **tl_kwargs: Any,
    ) -> AttnOnlyEncoder:
        """Load a BERT model with ``HookedEncoder.from_pretrained``, then convert it.

        TransformerLens builds this class directly and loads the weights into it. This needs a
        model name TransformerLens knows (``"bert-base-cased"``, ...) and its Hugging Face files;
        for the bundled ``all-MiniLM-L6-v2`` use :func:`tl_attnonly.minilm.load_minilm` and
        :func:`convert_encoder`.

        Args:
            model_name: Any name ``HookedEncoder.from_pretrained`` accepts.
            conversion: Conversion options; or give them one by one:
            n_heads_per_neuron: See :class:`ConversionOptions`.
            relu_k: See :class:`ConversionOptions`.
            gelu_method: See :class:`ConversionOptions`.
            **tl_kwargs: Passed to ``HookedEncoder.from_pretrained`` (``device``, ``dtype``, ...).

        Raises:
            tl_attnonly.hub.HubUnavailableError: (an ``OSError``) Within about a second, before
                TransformerLens is called, when the model is not in the local Hugging Face cache
                and offline mode is on or the hub does not answer (see ``docs/saving.md``). A
                cached model loads from the cache, offline if the hub does not answer.
        """
        options = (conversion or ConversionOptions()).with_overrides(
            n_heads_per_neuron=n_heads_per_neuron, relu_k=relu_k, gelu_method=gelu_method
        )
        with hub_access(model_name, cls.__name__, tl_kwargs), pending_options(options):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                return super().from_pretrained(model_name, **tl_kwargs)  # type: ignore[return-value]

    def to_hooked_encoder(self) -> HookedEncoder:
        """The original MLP encoder back: a plain ``HookedEncoder`` with the same weights (each
        tensor copied on its own device)."""
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore", DeprecationWarning)
            model = HookedEncoder(copy.deepcopy(self.cfg), self.tokenizer, move_to_device=False)
        share_tensors(model, self, fix=UNCONVERT_FIX, clone=True)
        return model.train(self.training)


def convert_encoder(
    model: HookedEncoder,
    *,
    conversion: ConversionOptions | None = None,
    n_heads_per_neuron: int | None = None,
    relu_k: float | None = None,
    gelu_method: str | None = None,
    share_weights: bool = False,
) -> AttnOnlyEncoder:
    """Rewrite every MLP neuron of a BERT-style ``HookedEncoder`` as attention heads (Thm. 6).

    The original model is not modified: by default the result has its own copy of the weights
    (the tokenizer is shared). With ``share_weights=True`` its parameters and buffers are the
    original's tensors (no copy): **an edit to either model's weights shows in both**.

    Args:
        model: A TransformerLens ``HookedEncoder``.
        conversion: Conversion options; or give them one by one:
        n_heads_per_neuron: Heads per GELU-family neuron (see :class:`ConversionOptions`).
        relu_k: Sharpness of the ReLU approximation.
        gelu_method: ``"fit"`` or ``"paper"``.
        share_weights: Share the original's tensors instead of copying them (see above).

    Returns:
        The converted :class:`AttnOnlyEncoder`, on the model's device, in the model's train/eval
        mode.

    Raises:
        TypeError: If ``model`` is not a ``HookedEncoder`` (use :func:`tl_attnonly.convert` for a
            ``HookedTransformer``).
        ValueError, NotImplementedError: For models that cannot be converted, before any work.
    """
    if not isinstance(model, HookedEncoder):
        raise TypeError(
            f"convert_encoder() takes a transformer_lens.HookedEncoder, got "
            f"{type(model).__name__}. For decoder models (HookedTransformer) use "
            "tl_attnonly.convert()."
        )
    options = (conversion or ConversionOptions()).with_overrides(
        n_heads_per_neuron=n_heads_per_neuron, relu_k=relu_k, gelu_method=gelu_method
    )
    check_convertible(model.cfg, options, form="structured")
    return AttnOnlyEncoder._converted_copy(model, options, share_weights=share_weights)


__all__ = [
    "AttnOnlyEncoder",
    "convert_encoder",
]
