"""Which attention layers an exact circuit run can rebuild (:func:`attention_problems`).

An exact run rebuilds each head's ``q``, ``k`` and ``v`` from that head's mixed residual input
(``W ln1(x) + b``, :mod:`.exact_run`), so it needs the linear maps ``W_Q``, ``W_K``, ``W_V``.
Multi-head latent attention (DeepSeek-V2/V3) has none: its queries and keys carry a rotary part
computed apart from the rest, and its keys and values are decompressed from one latent per
position that is normalised (``kv_a_layernorm``) and shared by every head. A head's ``k``/``v``
therefore depend on the input of all heads at once, and no per-head edge into them exists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tl_attnonly.protocol import AttnOnlyModel

#: The tools that do run on an attention layer without linear q/k/v maps.
WORKS_WITHOUT_QKV_MAPS = (
    "head and neuron-head patching (get_act_patch_all_heads, get_act_patch_neuron_heads), "
    "attribution patching (attribute_then_patch), direct logit attribution and residual "
    "decompositions (head_logit_attrs), summaries (summarize_neuron_heads), the attention "
    "views and the report"
)


def attention_problems(model: AttnOnlyModel) -> list[str]:
    """The attention layers of ``model`` whose q/k/v a run cannot rebuild per head (``[]``: none).

    Args:
        model: The adapted model (:func:`~tl_attnonly.adapt.analysis_model`).
    """
    missing = []
    for index, block in enumerate(model.blocks):
        try:
            block.attn.W_Q  # noqa: B018  (TransformerLens raises where there is none)
            block.attn.W_K  # noqa: B018
        except NotImplementedError:
            missing.append(index)
    if not missing:
        return []
    return [
        f"attention without linear q/k/v maps in layers {missing} (multi-head latent attention: "
        "keys and values decompress one normalised latent shared by every head, so a head's "
        "inputs cannot be rebuilt per edge). What works on this model: " + WORKS_WITHOUT_QKV_MAPS
    ]


__all__ = ["WORKS_WITHOUT_QKV_MAPS", "attention_problems"]
