"""A neuron atlas: every neuron of a converted model on its own page, built from any corpus.

:func:`build_atlas` streams a corpus through a converted model (an
:class:`~tl_attnonly.AttnOnlyTransformer` or a converted ``TransformerBridge``, read through
:func:`tl_attnonly.adapt.analysis_model`) and keeps for every neuron of every layer, in memory
bounded by the number of neurons: its top contexts with each token's activation and self weight,
quantile samples, a histogram, its firing frequency, min and max, for gated layers the gate/value
sign quadrants, and its direct logit effect. The state merges exactly
(:meth:`AtlasState.merge`), checkpoints and resumes; the result is an offline static site
(:mod:`~tl_attnonly.atlas.site`) that :class:`Atlas` reads back in Jupyter.

Modules: :mod:`~tl_attnonly.atlas.state` (the mergeable per-neuron state),
:mod:`~tl_attnonly.atlas.build` (the streaming pass), :mod:`~tl_attnonly.atlas.run` (a whole run:
checks, checkpoints, the site), :mod:`~tl_attnonly.atlas.records` (a neuron's JSON record),
:mod:`~tl_attnonly.atlas.site` and :mod:`~tl_attnonly.atlas.templates` (the site),
:mod:`~tl_attnonly.atlas.notebook` (:class:`Atlas`), :mod:`~tl_attnonly.atlas.subset` (a site of
some neurons: a circuit's).
"""

from tl_attnonly.atlas.build import AtlasState, collect_atlas, logit_effect
from tl_attnonly.atlas.notebook import Atlas, NeuronPage
from tl_attnonly.atlas.run import build_atlas, write_atlas
from tl_attnonly.atlas.state import AtlasOptions
from tl_attnonly.atlas.subset import write_subset

__all__ = [
    "Atlas",
    "AtlasOptions",
    "AtlasState",
    "NeuronPage",
    "build_atlas",
    "collect_atlas",
    "logit_effect",
    "write_atlas",
    "write_subset",
]
