"""The HookedTransformer form (TransformerLens 3.x): the converted models and how the analysis
tools read them, as :mod:`tl_attnonly.bridge` is the TransformerBridge form.

* :mod:`~tl_attnonly.hooked.model`: :class:`~tl_attnonly.AttnOnlyTransformer`, the converted
  ``HookedTransformer``; :mod:`~tl_attnonly.hooked.encoder`: :class:`~tl_attnonly.AttnOnlyEncoder`
  (``HookedEncoder``); :mod:`~tl_attnonly.hooked.neuron_head_model`: what the two share.
* :mod:`~tl_attnonly.hooked.saving` and :mod:`~tl_attnonly.hooked.conversion_record`:
  ``save_pretrained`` / ``load`` and the record of a saved conversion.
* :mod:`~tl_attnonly.hooked.derived_cache`: the cache that derives neuron-head entries when first
  read.
* :mod:`~tl_attnonly.hooked.adapter`: :class:`~tl_attnonly.hooked.adapter.HookedAdapter`, either
  model as an :class:`~tl_attnonly.protocol.AttnOnlyModel` (exported here).

Importing this package imports nothing of TransformerLens 3.x (it imports on TransformerLens 4.x,
which has no ``HookedTransformer``): the adapter touches ``HookedTransformer`` only through the
model it wraps, and the modules above are imported only when named.
"""

from tl_attnonly.hooked.adapter import HookedAdapter, HookedLayerRunner, HookedNorm

__all__ = ["HookedAdapter", "HookedLayerRunner", "HookedNorm"]
