"""Convert a HookedTransformer into its attention-only form (Theorem 6).

This module imports torch and TransformerLens only when :func:`convert` runs: ``tl_attnonly``
binds ``convert`` (the function) on import, and a module of the same name must not replace it,
while the command line's ``--help`` must not pay for torch.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Any, Literal, overload

if TYPE_CHECKING:
    from transformer_lens import HookedEncoder, HookedTransformer

    from tl_attnonly._compat import TransformerBridge
    from tl_attnonly.hooked.encoder import AttnOnlyEncoder
    from tl_attnonly.hooked.model import AttnOnlyTransformer
    from tl_attnonly.literal import LiteralTransformer
    from tl_attnonly.options import ConversionOptions, LiteralOptions


@overload
def convert(
    model: HookedTransformer,
    conversion: ConversionOptions | None = None,
    *,
    form: Literal["structured"] = "structured",
    n_heads_per_neuron: int | None = None,
    relu_k: float | None = None,
    gelu_method: str | None = None,
    share_weights: bool | None = None,
) -> AttnOnlyTransformer: ...
@overload
def convert(
    model: HookedEncoder,
    conversion: ConversionOptions | None = None,
    *,
    form: Literal["structured"] = "structured",
    n_heads_per_neuron: int | None = None,
    relu_k: float | None = None,
    gelu_method: str | None = None,
    share_weights: bool | None = None,
) -> AttnOnlyEncoder: ...
@overload
def convert(
    model: HookedTransformer,
    conversion: ConversionOptions | None = None,
    *,
    form: Literal["literal"],
    n_heads_per_neuron: int | None = None,
    relu_k: float | None = None,
    gelu_method: str | None = None,
    literal: LiteralOptions | None = None,
    **literal_kwargs: Any,
) -> LiteralTransformer: ...
@overload
def convert(
    model: TransformerBridge,
    conversion: ConversionOptions | None = None,
    *,
    form: Literal["structured"] = "structured",
    n_heads_per_neuron: int | None = None,
    relu_k: float | None = None,
    gelu_method: str | None = None,
    share_weights: bool | None = None,
) -> TransformerBridge: ...
def convert(
    model: HookedTransformer | HookedEncoder | TransformerBridge,
    conversion: ConversionOptions | None = None,
    *,
    form: Literal["structured", "literal"] = "structured",
    n_heads_per_neuron: int | None = None,
    relu_k: float | None = None,
    gelu_method: str | None = None,
    literal: LiteralOptions | None = None,
    share_weights: bool | None = None,
    **literal_kwargs: Any,
) -> AttnOnlyTransformer | AttnOnlyEncoder | LiteralTransformer | TransformerBridge:
    """Rewrite every MLP neuron of ``model`` as attention heads (Huben & Morris 2023, Thm. 6).

    The original model is not modified: by default the result has its own copy of the weights
    (the tokenizer is shared). With ``share_weights=True`` it has none: its parameters and buffers
    *are* the original's tensors (no copy, no ``__class__`` swap), so converting needs no second
    copy of the model's memory, and **an edit to either model's weights shows in both**.

    A ``TransformerBridge`` (TransformerLens 3.x or 4.x) is converted **in place** and returned
    (the same object; its weights are shared, never copied): every MLP runs as neuron-heads, the
    bridge's hooks stay and the neuron-head hooks are added (see
    :func:`tl_attnonly.bridge.convert_bridge` and ``docs/bridge.md``).

    Args:
        model: A TransformerLens ``TransformerBridge`` (see above), a ``HookedTransformer``
            (any weight processing already applied is kept: a model after ``fold_ln`` converts to
            one after ``fold_ln``), or a ``HookedEncoder`` (structured form only; see
            :func:`tl_attnonly.convert_encoder`).
        form: ``"structured"`` (default): an :class:`AttnOnlyTransformer`, same FLOPs as the MLP,
            compact patterns. ``"literal"``: every sublayer plain softmax attention over a real
            bias token, masks by Omega (see :func:`tl_attnonly.literal.to_literal`).
        conversion: Conversion options; or give them one by one:
        n_heads_per_neuron: Heads per GELU-family neuron (see :class:`ConversionOptions`).
        relu_k: Sharpness of the ReLU approximation.
        gelu_method: ``"fit"`` or ``"paper"``.
        literal: Options of the literal form (:class:`~tl_attnonly.LiteralOptions`); or give them
            one by one:
        share_weights: Structured form only: share the original's parameter and buffer tensors
            instead of copying them (see above). Default: ``False`` (a copy) for a
            ``HookedTransformer``; a bridge always shares (``False`` is refused).
        **literal_kwargs: Fields of :class:`~tl_attnonly.LiteralOptions` (``omega``,
            ``layout``, ...), replacing those of ``literal``.

    Returns:
        The converted model.

    Raises:
        ValueError, NotImplementedError: For models that cannot be converted, before any work.

    Example:
        >>> converted = convert(model)
        >>> logits, cache = converted.run_with_cache(tokens)
        >>> cache["blocks.0.mlp.hook_pattern"].shape  # [batch, n_neuron_heads, pos, 2]
    """
    from tl_attnonly._compat import (
        HAS_HOOKED_TRANSFORMER,
        NO_HOOKED_TRANSFORMER,
        is_transformer_bridge,
    )
    from tl_attnonly.options import ConversionOptions, LiteralOptions

    unknown = sorted(set(literal_kwargs) - {f.name for f in dataclasses.fields(LiteralOptions)})
    if unknown:
        raise TypeError(
            f"convert() got unexpected keyword argument(s) {unknown}. It takes conversion, "
            "n_heads_per_neuron, relu_k, gelu_method, share_weights and form; with "
            "form='literal', also literal= and the fields of tl_attnonly.LiteralOptions."
        )
    options = (conversion or ConversionOptions()).with_overrides(
        n_heads_per_neuron=n_heads_per_neuron, relu_k=relu_k, gelu_method=gelu_method
    )
    if is_transformer_bridge(model):
        if form != "structured" or literal is not None or literal_kwargs:
            raise NotImplementedError(
                "A TransformerBridge converts to the structured form only (neuron-heads in place "
                "of its MLPs); the literal form needs a HookedTransformer (TransformerLens 3.x)."
            )
        if share_weights is False:
            raise ValueError(
                "A TransformerBridge is converted in place and shares its weights (no copy); "
                "share_weights=False is not supported for a bridge. Build a second bridge to keep "
                "an unconverted one (or tl_attnonly.bridge.unconvert_bridge(bridge) to undo)."
            )
        from tl_attnonly.bridge import convert_bridge

        return convert_bridge(model, options)
    if not HAS_HOOKED_TRANSFORMER:
        raise ImportError(
            f"tl_attnonly.convert({type(model).__name__}) {NO_HOOKED_TRANSFORMER}"
        )
    from transformer_lens import HookedEncoder, HookedTransformer

    from tl_attnonly.options import check_convertible

    share_weights = bool(share_weights)
    literal_given = literal is not None or bool(literal_kwargs)
    if isinstance(model, HookedEncoder) and form == "structured" and not literal_given:
        from tl_attnonly.hooked.encoder import convert_encoder

        return convert_encoder(model, conversion=options, share_weights=share_weights)
    if not isinstance(model, HookedTransformer):
        raise TypeError(
            f"convert() takes a transformer_lens.HookedTransformer (or, for the structured form, a "
            f"HookedEncoder or a TransformerBridge), got {type(model).__name__}."
        )
    check_convertible(model.cfg, options, form=form)
    if share_weights and form != "structured":
        raise ValueError(
            "share_weights=True is supported for form='structured' only: the literal form builds "
            "new, larger weight matrices. Drop share_weights or use the structured form."
        )
    if form == "literal":
        from tl_attnonly.literal import to_literal

        return to_literal(model, literal, conversion=options, **literal_kwargs)
    if form != "structured":
        raise ValueError(f"form must be 'structured' or 'literal', got {form!r}.")
    if literal_given:
        given = sorted(literal_kwargs) or ["literal"]
        raise TypeError(
            f"Unexpected options for the structured form: {given} (these belong to form='literal')."
        )
    if model.cfg.attn_only:
        warnings.warn(
            "The model is attention-only already (cfg.attn_only=True): it has no MLP neurons, so "
            "convert() returns an AttnOnlyTransformer copy with zero neuron-heads and the same "
            "outputs.",
            UserWarning,
            stacklevel=2,
        )
    return _convert_structured(model, options, share_weights)


def _convert_structured(
    model: HookedTransformer, options: ConversionOptions, share_weights: bool = False
) -> AttnOnlyTransformer:
    from tl_attnonly.hooked.model import AttnOnlyTransformer

    converted = AttnOnlyTransformer._converted_copy(model, options, share_weights=share_weights)
    if model.cfg.use_attn_result:
        converted.set_use_attn_result(True)
    return converted


__all__ = [
    "convert",
]
