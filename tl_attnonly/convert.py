"""Convert a HookedTransformer into its attention-only form (Theorem 6)."""

from __future__ import annotations

import copy
from typing import Any, Literal, Optional

from transformer_lens import HookedTransformer

from tl_attnonly.model import AttnOnlyTransformer, _options
from tl_attnonly.options import ConversionOptions, check_convertible


def convert(
    model: HookedTransformer,
    *,
    form: Literal["structured", "literal"] = "structured",
    conversion: Optional[ConversionOptions] = None,
    n_heads_per_neuron: Optional[int] = None,
    relu_k: Optional[float] = None,
    gelu_method: Optional[str] = None,
    **literal_kwargs: Any,
):
    """Rewrite every MLP neuron of ``model`` as attention heads (Huben & Morris 2023, Thm. 6).

    The original model is not modified: the result has its own copy of the weights (the tokenizer
    is shared).

    Args:
        model: A TransformerLens ``HookedTransformer`` (any weight processing already applied is
            kept: a model after ``fold_ln`` converts to one after ``fold_ln``).
        form: ``"structured"`` (default): an :class:`AttnOnlyTransformer`, same FLOPs as the MLP,
            compact patterns. ``"literal"``: every sublayer plain softmax attention over a real
            bias token, masks by Omega (see :func:`tl_attnonly.literal.to_literal`).
        conversion: Conversion options; or give them one by one:
        n_heads_per_neuron: Heads per GELU-family neuron (see :class:`ConversionOptions`).
        relu_k: Sharpness of the ReLU approximation.
        gelu_method: ``"fit"`` or ``"paper"``.
        **literal_kwargs: Options of the literal form (``omega``, ``layout``, ...).

    Returns:
        The converted model.

    Raises:
        ValueError, NotImplementedError: For models that cannot be converted, before any work.

    Example:
        >>> converted = convert(model)
        >>> logits, cache = converted.run_with_cache(tokens)
        >>> cache["blocks.0.mlp.hook_pattern"].shape  # [batch, n_neuron_heads, pos, 2]
    """
    if not isinstance(model, HookedTransformer):
        raise TypeError(
            f"convert() takes a transformer_lens.HookedTransformer, got {type(model).__name__}. "
            "For BERT-style encoders use tl_attnonly.convert_encoder()."
        )
    options = _options(conversion, n_heads_per_neuron, relu_k, gelu_method)
    check_convertible(model.cfg, options)
    if form == "literal":
        from tl_attnonly.literal import to_literal

        return to_literal(model, conversion=options, **literal_kwargs)
    if form != "structured":
        raise ValueError(f"form must be 'structured' or 'literal', got {form!r}.")
    if literal_kwargs:
        raise TypeError(
            f"Unexpected options for the structured form: {sorted(literal_kwargs)} (these belong "
            "to form='literal')."
        )
    return _convert_structured(model, options)


def _convert_structured(
    model: HookedTransformer, options: ConversionOptions
) -> AttnOnlyTransformer:
    cfg = copy.deepcopy(model.cfg)
    init_weights = cfg.init_weights
    cfg.init_weights = False  # the weights are copied below; skip a random initialisation
    converted = AttnOnlyTransformer(cfg, model.tokenizer, move_to_device=False, conversion=options)
    converted.cfg.init_weights = init_weights
    converted.load_state_dict(model.state_dict(), strict=True)
    if model.cfg.use_attn_result:
        converted.set_use_attn_result(True)
    converted.to(next(model.parameters()).device, print_details=False)
    converted.train(model.training)
    return converted
