"""The literal form: a model made of nothing but plain softmax attention sublayers.

Huben & Morris (2023, arXiv 2309.08593) prove that an MLP-and-attention transformer can be
rewritten as an attention-only one. The structured form (:class:`tl_attnonly.AttnOnlyTransformer`)
computes each neuron-head's two-key softmax directly. This package builds the construction as the
paper states it, so that the theorems can be checked on a whole model:

* the sequence gets a real **bias token** at position 0 (real token ``j`` sits at ``1 + j``);
* the residual stream is augmented to width ``D'``: the original ``D`` coordinates, (for the
  ``"split"`` layout) ``2 * d_mlp`` hidden coordinates (``4 * d_mlp`` for a gated MLP), and
  ``1 + max_len`` one-hot position coordinates (the bias token's embedding is its own one-hot
  coordinate);
* every sublayer is a :class:`~tl_attnonly.components.LiteralAttention`,
  ``softmax(X W_QK X^T) X W_OV`` with no bias parameters and **no mask**: which keys a head may
  see is encoded in ``W_Q``/``W_K`` through the one-hot position coordinates and ``-omega``
  entries (Theorem 9).

Where each theorem lives (all but :func:`to_literal` in :mod:`tl_attnonly.literal.theorems`):

==========================================  ====================================================
:func:`theorem3_neuron_head`                one neuron -> ``K`` heads of internal dimension 1
:func:`theorem6_tweaked_attention_heads`    the model's own heads, tweaked to ignore the bias token
:func:`theorem7_linear_map_heads`           a linear map as self-attending heads
:func:`theorem8_activation_heads`           an entry-wise activation, one head per coordinate
:func:`theorem9_mask_qk`                    a mask written into ``W_Q``/``W_K``
:func:`to_literal`                          the whole model (Theorem 6 with 3, or 7 + 8; with 9)
:func:`product_heads`                       gated MLPs: ``g * u`` from softmax heads (not in the
                                            paper; :mod:`tl_attnonly.literal.gated`)
==========================================  ====================================================

Conventions that keep the construction exact:

* Every bias (``b_Q, b_K, b_V, b_in``, LayerNorm biases) is carried by the one-hot position
  coordinates of the real tokens (each real token has exactly one of them equal to 1; the post's
  "use the 1s in the position encoding dimensions for the bias terms"). Output biases (``b_O``,
  ``b_out``) are written by one extra *bias head* per sublayer that attends only to its own token
  and whose value is 1 on real tokens. Hence every value vector at the bias token is exactly 0,
  every sublayer writes exactly 0 at the bias token, and the bias token's residual stays its
  one-hot embedding through the whole model.
* ``-omega`` is added only to the scores of *disallowed* (query, key) pairs, never ``+omega`` to
  allowed ones: allowed scores are computed without any ``omega``-sized intermediate, so they carry
  no rounding at omega's scale, and the only error is the attention mass leaking to disallowed
  keys, at most ``n_keys * exp(score_range - omega)``.
* A neuron-head's constant bias-token value ``g_k`` is moved into the layer's output bias
  (``v - g_k`` on the token, 0 on the bias token); for SiLU and ReLU ``g_k = 0`` anyway.

LayerNorm is not in the paper. Here a sublayer that reads the original coordinates first applies
``LNPre``/``RMSPre`` to those ``D`` coordinates only (the hidden and position coordinates pass
through unchanged), and the norm's weight and bias are folded into the heads' ``W_Q, W_K, W_V``.
See ``docs/literal_form.md`` for exactly what is and is not standard attention in that case.

Modules: :mod:`~tl_attnonly.literal.layout` (the augmented residual stream),
:mod:`~tl_attnonly.literal.theorems` (one function per theorem), :mod:`~tl_attnonly.literal.gated`
(gated MLPs: product and activation heads, eps, error tables), :mod:`~tl_attnonly.literal.modules`
(partial norm, neuron layer, block), :mod:`~tl_attnonly.literal.transformer`
(:class:`LiteralTransformer`), :mod:`~tl_attnonly.literal.build` (:func:`to_literal` and its
checks), :mod:`~tl_attnonly.literal.support` (every config field: built or refused) and
:mod:`~tl_attnonly.literal.omega` (how large omega must be) and
:mod:`~tl_attnonly.literal.error_tables` (whole-model error tables: omega, gated eps).
"""

from tl_attnonly.components.literal_attention import LiteralAttention
from tl_attnonly.literal.build import (
    assemble_sublayer,
    sublayer_head_counts,
    to_literal,
)
from tl_attnonly.literal.error_tables import gated_literal_error_table, omega_error_table
from tl_attnonly.literal.gated import (
    DEFAULT_PRODUCT_RANGE,
    default_product_eps,
    gated_activation_heads,
    product_error_bound,
    product_error_table,
    product_heads,
)
from tl_attnonly.literal.layout import (
    DEFAULT_BUDGET_BYTES,
    SHARED_NEURON_HOOKS,
    LayoutName,
    LiteralBudgetError,
    MaskOption,
    ResidualLayout,
)
from tl_attnonly.literal.modules import LiteralBlock, LiteralNeuronLayer, PartialNorm
from tl_attnonly.literal.omega import (
    DEFAULT_OMEGA,
    TYPICAL_SCORE_RANGE,
    omega_requirement,
    omega_warnings,
)
from tl_attnonly.literal.support import CONFIG_AUDIT, check_literal_supported
from tl_attnonly.literal.theorems import (
    NeuronHeadWeights,
    SublayerHeads,
    allowed_pattern,
    linear_map_sublayer,
    neuron_sublayer,
    theorem3_neuron_head,
    theorem6_tweaked_attention_heads,
    theorem7_linear_map_heads,
    theorem8_activation_heads,
    theorem9_mask_qk,
)
from tl_attnonly.literal.transformer import LiteralTransformer, neuron_pattern_compact
from tl_attnonly.options import LiteralOptions

__all__ = [
    "CONFIG_AUDIT",
    "DEFAULT_BUDGET_BYTES",
    "DEFAULT_OMEGA",
    "DEFAULT_PRODUCT_RANGE",
    "SHARED_NEURON_HOOKS",
    "TYPICAL_SCORE_RANGE",
    "LayoutName",
    "LiteralAttention",
    "LiteralBlock",
    "LiteralBudgetError",
    "LiteralNeuronLayer",
    "LiteralOptions",
    "LiteralTransformer",
    "MaskOption",
    "NeuronHeadWeights",
    "PartialNorm",
    "ResidualLayout",
    "SublayerHeads",
    "allowed_pattern",
    "assemble_sublayer",
    "check_literal_supported",
    "default_product_eps",
    "gated_activation_heads",
    "gated_literal_error_table",
    "linear_map_sublayer",
    "neuron_pattern_compact",
    "neuron_sublayer",
    "omega_error_table",
    "omega_requirement",
    "omega_warnings",
    "product_error_bound",
    "product_error_table",
    "product_heads",
    "sublayer_head_counts",
    "theorem3_neuron_head",
    "theorem6_tweaked_attention_heads",
    "theorem7_linear_map_heads",
    "theorem8_activation_heads",
    "theorem9_mask_qk",
    "to_literal",
]
