"""Expert neuron-heads in token space: caches, activation patching and summaries (both kinds).

A mixture-of-experts layer (:class:`~tl_attnonly.components.NeuronHeadMoE` on an
:class:`~tl_attnonly.AttnOnlyTransformer`, :class:`~tl_attnonly.bridge.experts.
BridgeNeuronHeadExperts` on a converted bridge) hooks each routed expert's neuron-heads at
``blocks.{l}.mlp.experts.{e}.hook_*`` over the tokens routed to that expert only: position ``i``
of ``hook_z`` (``[1, n_routed, n_neuron_heads, 1]``) is the ``i``-th routed token in the experts'
gather order (by top-k slot, then by token of the flattened ``[batch * pos]``). The router's
top-k indices (``blocks.{l}.mlp.hook_expert_indices``, ``[batch * pos, top_k]``: TransformerLens's
hook on both kinds, mounted by the conversion on a TL 3.9 bridge) give that order back:
:func:`routed_tokens`.

A bridge's MoE block may also have a *shared* expert (Qwen2-MoE's ``shared_expert``, whose output
the block scales by its sigmoid ``shared_expert_gate``; DeepSeek's ``shared_experts``): a dense
neuron-head layer that runs on every token, hooked at ``blocks.{l}.mlp.{name}.hook_*`` (Qwen2-MoE
flattens the tokens first: ``hook_z`` ``[1, batch * pos, n_neuron_heads, 1]``; DeepSeek does not:
``[batch, pos, n_neuron_heads, 1]``). Every tool here takes it as ``expert``: by its name, as the
converted block holds it (:func:`shared_experts`), or as :data:`SHARED` (``"shared"``: the block's
only shared expert). Its values are at every token; its ``z`` is before the block's shared gate.
An :class:`~tl_attnonly.AttnOnlyTransformer`'s MoE (TransformerLens's) has no shared expert.

* :func:`expert_activation`: an expert's neuron-head activation from a ``run_with_cache`` cache,
  in ``[batch, pos, n_neuron_heads]``; tokens not routed to a routed expert are NaN (``fill``),
  so that a mean over them is not silently diluted by zeros.
* :func:`get_act_patch_expert_neuron_heads`: clean into corrupted activation patching of expert
  neuron-heads' ``z``, at the tokens routed to the expert in both runs (a shared expert: every
  token); tokens routed in only one run are counted in the result and left unpatched.
* :func:`summarize_expert_neuron_heads`: dataset summaries of a layer's expert neuron-heads
  (the streaming pass of :func:`~tl_attnonly.analysis.summarize_neuron_heads`), each over the
  tokens routed to its expert (a shared expert: every token): routed count, firing fraction,
  mean self weight and ``z``, largest ``z``, top contexts by self weight and by ``|z|``;
  ranked, labelled, saved and loaded as :class:`~tl_attnonly.analysis.NeuronHeadSummaries` are.

* :func:`expert_routing`: the weight each token gave each expert in a run, ``[batch, pos,
  n_experts]`` (drawn by :func:`tl_attnonly.vis.expert_routing_heatmap`).
* :func:`layer_heads`, :func:`layer_head_labels`, :func:`expert_heads_as_dense`: a layer's
  neuron-heads numbered layer-wide, its experts' end to end (routed experts, then the shared
  ones), as :func:`~tl_attnonly.analysis.get_act_patch_neuron_heads` and the neuron-head views
  number them, and their ``pattern``/``z`` in a dense layer's layout (NaN at the tokens not
  routed to a head's expert).

The dense decompositions (:func:`~tl_attnonly.analysis.decompose_resid_heads`,
:func:`~tl_attnonly.analysis.head_logit_attrs`) read an expert layer as its experts' weighted
contributions; circuit discovery takes it as one node
(:data:`~tl_attnonly.analysis.discovery.graph.EXPERTS`), or as its experts and their named
neurons (:mod:`tl_attnonly.analysis.discovery.expert_nodes`);
:func:`~tl_attnonly.analysis.summarize_neuron_heads` (all layers) summarises an expert layer's
neuron-heads as :func:`layer_heads` numbers them, each over the tokens routed to its expert.

Modules: :mod:`~tl_attnonly.analysis.experts.routing` (hook names, the experts of a block, routing,
activations), :mod:`~tl_attnonly.analysis.experts.patching` (activation patching) and
:mod:`tl_attnonly.analysis.summaries.experts` (dataset summaries).
"""

from tl_attnonly.analysis.experts.components import expert_routing
from tl_attnonly.analysis.experts.decomposition import (
    decompose_resid_experts,
    expert_components,
    expert_logit_attrs,
    routing_weights_hook_name,
)
from tl_attnonly.analysis.experts.patching import (
    get_act_patch_expert_neuron_heads,
    get_act_patch_experts,
)
from tl_attnonly.analysis.experts.routing import (
    ROUTING_HOOK,
    SHARED,
    Expert,
    expert_activation,
    expert_heads_as_dense,
    expert_hook_name,
    expert_neuron_head_label,
    experts_used,
    layer_head_labels,
    layer_heads,
    moe_layer,
    resolve_expert,
    routed_tokens,
    routing_hook_name,
    shared_experts,
)
from tl_attnonly.analysis.summaries.experts import (
    EXPERT_SUMMARY_FILES,
    ExpertNeuronHeadSummaries,
    summarize_expert_neuron_heads,
)

__all__ = [
    "EXPERT_SUMMARY_FILES",
    "ROUTING_HOOK",
    "SHARED",
    "Expert",
    "ExpertNeuronHeadSummaries",
    "decompose_resid_experts",
    "expert_components",
    "expert_logit_attrs",
    "expert_routing",
    "experts_used",
    "routing_weights_hook_name",
    "expert_activation",
    "expert_heads_as_dense",
    "expert_hook_name",
    "expert_neuron_head_label",
    "get_act_patch_expert_neuron_heads",
    "get_act_patch_experts",
    "layer_head_labels",
    "layer_heads",
    "moe_layer",
    "resolve_expert",
    "routed_tokens",
    "routing_hook_name",
    "shared_experts",
    "summarize_expert_neuron_heads",
]
