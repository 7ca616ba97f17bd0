"""The attention-only :class:`~transformer_lens.HookedTransformer` (Theorem 6, structured form).

Huben & Morris (2023), Theorem 6: applying Theorem 3 to every MLP layer turns an MLP-and-attention
transformer into an attention-only one. :class:`AttnOnlyTransformer` does exactly that inside
TransformerLens: every ``blocks[l].mlp`` is a :class:`~tl_attnonly.components.NeuronHeadMLP`,
everything else is TransformerLens's own code. Its constructor takes a config exactly like
``HookedTransformer(cfg)``, so TransformerLens's ``from_pretrained``, weight processing and tooling
apply unchanged.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import torch
from transformer_lens import HookedTransformer, HookedTransformerConfig

from tl_attnonly.hooked.neuron_head_model import (
    UNCONVERT_FIX,
    NeuronHeadModelMixin,
    pending_options,
    resolve_options,
    share_tensors,
)
from tl_attnonly.hub import hub_access
from tl_attnonly.options import ConversionOptions


class AttnOnlyTransformer(NeuronHeadModelMixin, HookedTransformer):
    """A :class:`~transformer_lens.HookedTransformer` whose MLP neurons are attention heads.

    Each ``blocks[l].mlp`` is a :class:`~tl_attnonly.components.NeuronHeadMLP`: every neuron is
    ``K`` attention heads of internal dimension 1 that attend to the token itself and to a bias
    token (``K = 1`` for SiLU and ReLU). Weights keep TransformerLens's names
    (``W_in, b_in, W_out, b_out``); the heads' ``W_Q, W_K, W_V, W_O`` are derived from them.

    Usually built with :func:`tl_attnonly.convert` or :meth:`from_pretrained`; constructing it
    from a config gives a randomly initialised model, like ``HookedTransformer(cfg)``.

    Args:
        cfg: The model config (unchanged by the conversion: ``act_fn`` stays what it was).
        tokenizer: As for :class:`~transformer_lens.HookedTransformer`.
        move_to_device: As for :class:`~transformer_lens.HookedTransformer`.
        default_padding_side: As for :class:`~transformer_lens.HookedTransformer`.
        conversion: How neurons become heads; default :class:`ConversionOptions()`.

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
        default_padding_side: Literal["left", "right"] | None = None,
        conversion: ConversionOptions | None = None,
    ):
        cfg = HookedTransformerConfig.unwrap(cfg)
        conversion = resolve_options(cfg, conversion)
        super().__init__(
            cfg,
            tokenizer=tokenizer,
            move_to_device=False,
            default_padding_side=default_padding_side,
        )
        self._install_neuron_heads(conversion)
        if move_to_device:
            self.move_model_modules_to_device()
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
    ) -> AttnOnlyTransformer:
        """Load a model with TransformerLens, then convert it.

        TransformerLens builds this class directly and loads (and processes: ``fold_ln``,
        ``center_writing_weights``, ...) the weights into it; no second copy is made.

        Args:
            model_name: Any name ``HookedTransformer.from_pretrained`` accepts.
            conversion: Conversion options; or give them one by one:
            n_heads_per_neuron: See :class:`ConversionOptions`.
            relu_k: See :class:`ConversionOptions`.
            gelu_method: See :class:`ConversionOptions`.
            **tl_kwargs: Passed to ``HookedTransformer.from_pretrained`` (``fold_ln``,
                ``device``, ``dtype``, ...).

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
            return super().from_pretrained(model_name, **tl_kwargs)

    def to_hooked_transformer(self) -> HookedTransformer:
        """The original MLP model back: a plain ``HookedTransformer`` with the same weights.

        The state dicts of both forms are identical, so nothing is lost by converting. Each
        tensor is copied on its own device (a model split over devices stays split).
        """
        cfg = copy.deepcopy(self.cfg)
        init_weights, cfg.init_weights = cfg.init_weights, False
        with torch.device("meta"):  # no memory: copies of this model's tensors are put in place
            model = HookedTransformer(cfg, self.tokenizer, move_to_device=False)
        model.cfg.init_weights = init_weights
        share_tensors(model, self, fix=UNCONVERT_FIX, clone=True)  # on their devices
        return model.train(self.training)


__all__ = [
    "AttnOnlyTransformer",
]
