"""Dataset-level neuron-head summaries, in the spirit of Neuroscope and SAE dashboards.

:func:`summarize_neuron_heads` streams a corpus (any iterable of strings or token tensors; by
default Python standard-library source, offline) through a converted model and keeps, with memory
bounded by the number of heads (never by the corpus):

- for every neuron-head ``L{l}N{i}(.k)``: the top-``k`` contexts by its weight on itself
  (``hook_pattern[..., 0]``: whether it fires) and by ``|z|`` (what it writes), each with the
  tokens around the position and the head's self weight on every one of them (the bias token gets
  ``1 - self``);
- its firing fraction: the share of positions where its weight on itself exceeds 1/2;
- per neuron and token: the mean of ``hook_post`` (what the neuron writes) over the positions of
  that token, and per neuron-head and token the firing fraction, hence the AUC of "fires" as a
  detector of the token (token selectivity);
- the number of positions seen, per token.

A mixture-of-experts layer's neuron-heads are its experts' end to end (routed experts in index
order, then the shared ones: ``L{l}E{e}N{i}``, ``L{l}SN{i}``), each counted over the tokens routed
to its expert only (its firing fraction, top contexts and per-token statistics; the positions each
head counted: :meth:`~NeuronHeadSummaries.head_positions`); per-head tensors are as wide as the
widest layer, with nothing counted past a narrower layer's heads.

:class:`NeuronHeadSummaries` saves to and loads from a directory (safetensors + JSON), ranks heads
by dataset statistics (:meth:`~NeuronHeadSummaries.rank`; pass the result as ``heads=`` to the
views in :mod:`tl_attnonly.vis`), and renders an HTML page per head
(:func:`tl_attnonly.vis.summaries.summary_html`).

Modules: :mod:`~tl_attnonly.analysis.summaries.collect` (streaming the corpus),
:mod:`~tl_attnonly.analysis.summaries.results` (:class:`NeuronHeadSummaries`) and
:mod:`~tl_attnonly.analysis.summaries.experts` (a mixture-of-experts layer's expert neuron-heads,
each over the tokens routed to it: :class:`~.experts.ExpertNeuronHeadSummaries`; not imported
here: it reads :mod:`tl_attnonly.analysis.experts`, whose package imports it).
"""

from tl_attnonly.analysis.summaries.collect import (
    SummaryOptions,
    stdlib_corpus,
    summarize_neuron_heads,
)
from tl_attnonly.analysis.summaries.results import RANKINGS, NeuronHeadSummaries, TopContexts

__all__ = [
    "RANKINGS",
    "NeuronHeadSummaries",
    "SummaryOptions",
    "TopContexts",
    "stdlib_corpus",
    "summarize_neuron_heads",
]
