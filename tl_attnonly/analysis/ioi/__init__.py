"""IOI prompts and the head roles of Wang et al. (2022), read from attention patterns.

Indirect object identification (IOI): in "When Mary and John went to the store, John gave a drink
to" a model should say " Mary". Wang et al. (2022, *Interpretability in the Wild*) found the
circuit in GPT-2 small and named its heads by what they attend to at four positions: **IO** (the
indirect object, " Mary"), **S1** and **S2** (the two mentions of the subject, " John"), and
**END** (the last token, " to"), with **S1+1** the token after S1:

=====================  ============================================  ==========================
role                   pattern (query -> key)                        direct logit attribution
=====================  ============================================  ==========================
name mover             END -> IO (more than to S1 and S2 together)   on ``IO - S``: > 0
negative name mover    END -> IO (likewise)                          < 0
S suppression          END -> S1 + S2 (more than to IO)              > 0 (writes against S)
S mover                END -> S1 + S2 (likewise)                     < 0 (writes S)
S-inhibition           END -> S2 (more than to IO)                   small
duplicate token        S2 -> S1
induction              S2 -> S1+1
previous token         S1+1 -> S1
=====================  ============================================  ==========================

Name movers, negative name movers, S-inhibition, duplicate-token, induction and previous-token
heads are Wang et al.'s classes; the two S roles are the same patterns with the answer written
through S (a negative name mover and an S suppressor both write against the name they attend to:
copy suppression, McDougall et al. 2023). Patterns and direct effects are necessary signs of a
role, not proof of it: Wang et al. confirm S-inhibition heads by path patching into the name
movers' queries.

:func:`make_ioi_dataset` writes such prompts from templates (names, places and objects of one
token each), in both orders (ABBA: "When Mary and John ..., John ..."; BABA: "When John and Mary
..., John ..."), with corrupted twins of the same length: ``"abc"`` (Wang et al.'s ABC
distribution: three new names, so nothing is duplicated), ``"swap"`` (IO and S exchanged
everywhere: the answer flips) or ``"s2"`` (only S2 replaced by a third name).
:meth:`IOIDataset.from_tokens` builds a dataset from token ids and positions, for models without
a tokenizer. :func:`ioi_head_scores` reads every attention head's scores from one cached run per
batch; :meth:`IOIHeadScores.roles` assigns the roles above by thresholds.

Modules: :mod:`~tl_attnonly.analysis.ioi.prompts` (templates, :class:`IOIDataset`,
:func:`make_ioi_dataset`) and :mod:`~tl_attnonly.analysis.ioi.roles` (:func:`ioi_head_scores`,
:class:`IOIHeadScores`). Everything works on any ``HookedTransformer`` (original or converted: a
converted model keeps the attention layers, so its scores are the original's to rounding) with
causal attention.
"""

from tl_attnonly.analysis.ioi.prompts import (
    CORRUPTIONS,
    IOI_NAMES,
    IOI_OBJECTS,
    IOI_PLACES,
    IOI_TEMPLATES,
    IOI_TEMPLATES_HELDOUT,
    IOIDataset,
    IOIWords,
    make_ioi_dataset,
)
from tl_attnonly.analysis.ioi.roles import ATTENTION_SCORES, ROLES, IOIHeadScores, ioi_head_scores

__all__ = [
    "ATTENTION_SCORES",
    "CORRUPTIONS",
    "IOI_NAMES",
    "IOI_OBJECTS",
    "IOI_PLACES",
    "IOI_TEMPLATES",
    "IOI_TEMPLATES_HELDOUT",
    "ROLES",
    "IOIDataset",
    "IOIWords",
    "IOIHeadScores",
    "ioi_head_scores",
    "make_ioi_dataset",
]
