"""Subject-verb agreement: a second circuit task, with a prior that it is sparse in neurons.

In "The key near the cabinets" a model should continue with " is", not " are": the verb agrees
with the subject (" key"), not with the nearer *attractor* noun (" cabinets"). Arora, Wu,
Steinhardt & Schwettmann (2025, *Language Model Circuits Are Sparse in the Neuron Basis*) find
that about a hundred MLP neurons control this agreement in Llama-3.1-8B, which makes it a test of
whether a circuit's MLPs resolve into few named neurons here.

:func:`make_sva_dataset` writes prompts from templates (:data:`SVA_TEMPLATES`, and a held-out set
:data:`SVA_TEMPLATES_HELDOUT` written apart) and word lists shipped with the package
(``tl_attnonly/data/sva_words.json``: singular/plural subjects and attractors, verbs with their
two forms; :func:`sva_word_lists`). Each corrupted twin is the same prompt with the subject's
number flipped (" key" -> " keys"), so the answer flips too; a subject pair whose two forms
tokenize to different lengths is refused before any prompt is built (:func:`aligned_pairs`
filters a list for a tokenizer). The metric (:meth:`SVADataset.logit_diff`) is
``logit(verb form agreeing with the clean subject) - logit(the other form)`` at the last token;
``seed=`` and ``exclude=`` draw fresh prompts the search never saw.
"""

from tl_attnonly.analysis.sva.prompts import (
    ATTRACTORS,
    SVA_TEMPLATES,
    SVA_TEMPLATES_HELDOUT,
    SVADataset,
    SVAWords,
    aligned_pairs,
    make_sva_dataset,
    sva_word_lists,
)

__all__ = [
    "ATTRACTORS",
    "SVA_TEMPLATES",
    "SVA_TEMPLATES_HELDOUT",
    "SVADataset",
    "SVAWords",
    "aligned_pairs",
    "make_sva_dataset",
    "sva_word_lists",
]
