"""The bridge adapter's facts come from the layers where TransformerLens's bridge config says
otherwise: OPT's and XGLM's MLP width is ``ffn_dim``, not the ``4 * d_model`` of the config."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import tl_attnonly  # noqa: E402
from tl_attnonly.adapt import analysis_model  # noqa: E402
from tl_attnonly.analysis import HeadGraph, circuit_metric, summarize_neuron_heads  # noqa: E402

zoo = pytest.importorskip("zoo")


def metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 3].sum() - logits[:, -1, 5].sum()


def test_opt_s_mlp_width_is_its_layers():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        original = zoo.build_bridge("opt", torch.float64)
        converted = tl_attnonly.convert(zoo.build_bridge("opt", torch.float64))
    width = zoo.make_config("opt").ffn_dim
    assert original.cfg.d_mlp != width  # what the bridge's config says
    assert analysis_model(converted).cfg.d_mlp == width
    clean, corrupted = zoo.tokens(), zoo.tokens(seed=2)
    graph = HeadGraph(converted)
    full = circuit_metric(converted, graph.full_mask(), clean, corrupted, metric)
    with torch.no_grad():
        assert full == pytest.approx(metric(original(clean)).item(), rel=1e-8, abs=1e-8)
    summaries = summarize_neuron_heads(converted, [clean], progress=False)
    assert summaries.d_mlp == width


def test_gpt1_s_residual_post_ln_is_known_and_refused_where_the_maths_says_no():
    """GPT-1 normalises the residual stream after each sublayer (``ln_1(x + attn)``), which its
    bridge config does not say: discovery and the plain-sum remainder refuse; the decompositions
    run with each norm's scale from the run (tests/analysis/test_post_ln_decomposition.py)."""
    from tl_attnonly.analysis import head_logit_attrs, stack_all_head_results
    from tl_attnonly.analysis.post_norm import residual_post_norm

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = tl_attnonly.convert(zoo.build_bridge("openai_gpt", torch.float64))
    model = analysis_model(converted)
    assert model.cfg.post_norm and residual_post_norm(model)
    clean, corrupted = zoo.tokens(), zoo.tokens(seed=2)
    with torch.no_grad():
        _, cache = converted.run_with_cache(clean)
    assert head_logit_attrs(cache, torch.tensor([3, 4]), pos_slice=-1).shape[1] == 2
    with pytest.raises(NotImplementedError, match="normalises the residual stream itself"):
        stack_all_head_results(cache, incl_remainder=True)
    with pytest.raises(NotImplementedError, match="post-LN of the residual stream|pre-norm"):
        circuit_metric(converted, {}, clean, corrupted, metric)


def test_exaone4_s_norms_after_each_sublayer_are_read_as_such_on_both_lines():
    """EXAONE-4 normalises each sublayer's output and has no pre-norms. TransformerLens 4's bridge
    names those norms ``ln1_post`` / ``ln2_post``; 3.9's names them ``ln1`` / ``ln2`` (its ``ln2``
    wraps the layer's ``post_feedforward_layernorm``), which the adapter read as pre-norms (wrong
    decompositions and discovery). Either way: no pre-norms, norms after both sublayers, and the
    full graph's exact run is the clean run."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        original = zoo.build_bridge("exaone4", torch.float64)
        converted = zoo.convert_zoo_bridge(zoo.build_bridge("exaone4", torch.float64))
    model = analysis_model(converted)
    assert model.cfg.post_norm
    for block in model.blocks:
        assert block.ln1 is None and block.ln2 is None
        assert block.ln1_post is not None and block.ln2_post is not None
    clean, corrupted = zoo.tokens(), zoo.tokens(seed=2)
    full = circuit_metric(converted, HeadGraph(converted).full_mask(), clean, corrupted, metric)
    with torch.no_grad():
        assert full == pytest.approx(metric(original(clean)).item(), rel=1e-8, abs=1e-8)
