"""The HookedTransformer adapter (TransformerLens 3.x): how the analysis tools read an
:class:`~tl_attnonly.AttnOnlyTransformer` or :class:`~tl_attnonly.AttnOnlyEncoder`
(:class:`~tl_attnonly.hooked.adapter.HookedAdapter`, an
:class:`~tl_attnonly.protocol.AttnOnlyModel`).

Importing this package imports nothing of TransformerLens 3.x: the adapter touches
``HookedTransformer`` only through the model it wraps.
"""

from tl_attnonly.hooked.adapter import HookedAdapter, HookedLayerRunner, HookedNorm

__all__ = ["HookedAdapter", "HookedLayerRunner", "HookedNorm"]
