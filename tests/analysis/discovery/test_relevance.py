"""Neuron relevance (RelP and attribution patching, gate and value apart) against references.

* ``rule="gradient"`` is attribution patching: equal to :func:`attribution_patch` of every
  neuron-head's ``z`` summed per neuron.
* ``rule="relp"`` on the last layer of a model without final norm (a linear path to a metric
  linear in the logits): equal to attribution patching and to the exact patching effect; on
  earlier layers the rules change the estimate.
* ``rule="relp"`` on the last layer of an RMSNorm model: equal to a closed form with the final
  norm's scale held constant (RelP's LN-rule), read from the bridge's own hooks (both lines).
* ``split=True``: gate + value equals the total computed from ``hook_post``; both parts nonzero.
* ``ig_steps=1`` (embeddings at the clean input): minus the gradient relevance of the swapped pair.
* RelP conserves relevance: on a bias-free model (LLaMA) the embeddings' relevance sums to the
  metric, which needs every rule (LN-, AH-, Identity-, Half-rule); plain gradients do not.
* Both model kinds agree on the same weights (TL 3.x).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2]))

import kinds  # noqa: E402
import models  # noqa: E402

from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER  # noqa: E402
from tl_attnonly.adapt import analysis_model  # noqa: E402
from tl_attnonly.analysis import attribution_patch, get_act_patch_outputs  # noqa: E402
from tl_attnonly.analysis.discovery.relevance import neuron_relevance, relp_hooks  # noqa: E402
from tl_attnonly.analysis.discovery.sites import logit_diff_metric  # noqa: E402
from tl_attnonly.hooks import head_names_filter, neuron_act_name  # noqa: E402

N = 3


def _task(d_vocab: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    clean = torch.randint(1, d_vocab, (N, 6), generator=generator)
    corrupted = torch.randint(1, d_vocab, (N, 6), generator=generator)
    answers = torch.randint(1, d_vocab, (2, N), generator=generator)
    return clean, corrupted, logit_diff_metric(answers[0], answers[1])


def _logits_metric(metric):
    return lambda logits: metric(logits, torch.arange(logits.shape[0]))


def _per_neuron_attribution(model, clean, corrupted, metric) -> torch.Tensor:
    """Attribution patching of every neuron-head's ``z``, summed per neuron: ``[layers, d_mlp]``."""
    with torch.no_grad():
        _, cache = model.run_with_cache(clean, names_filter=head_names_filter("z"))
    scores, _ = attribution_patch(
        model, cache, corrupted, _logits_metric(metric), kinds=("neuron",)
    )
    facts = analysis_model(model)
    return scores.unflatten(0, (facts.cfg.n_layers, -1, facts.n_heads_per_neuron)).sum(-1)


@pytest.mark.parametrize("family", ["gpt2", "llama_gqa", "gemma"])
def test_gradient_rule_is_attribution_patching(family):
    model = kinds.make_bridge(family)
    clean, corrupted, metric = _task(kinds.D_VOCAB)
    got = neuron_relevance(model, clean, corrupted, metric, rule="gradient")
    want = _per_neuron_attribution(model, clean, corrupted, metric)
    for li, rel in got.items():
        torch.testing.assert_close(rel, want[li].double(), rtol=1e-9, atol=1e-12)


@models.tl3_only("no normalisation")
def test_relp_is_exact_on_a_linear_path():
    """Last layer of a model without final norm, metric linear in the logits: its neurons reach the
    metric through W_out and W_U only, so RelP = attribution patching = the exact patch effect; on
    layer 0 RelP's rules (attention patterns, neuron-head patterns) change the estimate."""
    model = models.make_converted("silu", normalization_type=None)
    clean, corrupted, metric = _task(model.cfg.d_vocab)
    relp = neuron_relevance(model, clean, corrupted, metric, rule="relp")
    grad = neuron_relevance(model, clean, corrupted, metric, rule="gradient")
    last = model.cfg.n_layers - 1
    torch.testing.assert_close(relp[last], grad[last], rtol=1e-10, atol=1e-13)
    with torch.no_grad():
        _, cache = model.run_with_cache(clean, names_filter=head_names_filter("z"))
        base = float(_logits_metric(metric)(model(corrupted)))
    labels = [f"L{last}N{i}" for i in range(model.cfg.d_mlp)]
    patched, _ = get_act_patch_outputs(
        model, corrupted, cache, _logits_metric(metric), labels, level="neuron"
    )
    torch.testing.assert_close(relp[last], patched - base, rtol=1e-8, atol=1e-11)
    assert (relp[0] - grad[0]).abs().max() > 1e-3 * grad[0].abs().max()


@pytest.mark.parametrize("family", ["llama_gqa", "gemma"])
def test_relp_last_layer_holds_the_final_norm_scale_constant(family):
    """Closed form of the last layer's RelP relevance on an RMSNorm bridge: the metric's logit
    gradient read back through W_U, the final norm's weight and its scale (a constant: LN-rule),
    and W_out; the plain gradient differs (it also differentiates the scale)."""
    model = kinds.make_bridge(family)
    facts = analysis_model(model)
    clean, corrupted, metric = _task(kinds.D_VOCAB)
    last = facts.cfg.n_layers - 1
    relp = neuron_relevance(model, clean, corrupted, metric, layers=[last])[last]
    grad = neuron_relevance(model, clean, corrupted, metric, layers=[last], rule="gradient")[last]
    post = neuron_act_name("post", last)
    names = (post, "ln_final.hook_scale")
    with torch.no_grad():
        _, clean_cache = model.run_with_cache(clean, names_filter=lambda n: n in names)
        logits, corr_cache = model.run_with_cache(corrupted, names_filter=lambda n: n in names)
    logits = logits.detach().requires_grad_(True)
    (g_logits,) = torch.autograd.grad(metric(logits, torch.arange(N)), logits)
    w = facts.ln_final.w
    # d metric / d resid_final with the scale held constant: (w * (W_U g)) / scale
    g_resid = (g_logits @ facts.W_U.T) * w / corr_cache["ln_final.hook_scale"]
    g_post = g_resid @ facts.blocks[last].mlp.out_matrix.T  # [batch, pos, d_mlp]
    want = ((clean_cache[post] - corr_cache[post]) * g_post).sum((0, 1))
    torch.testing.assert_close(relp, want.double(), rtol=1e-9, atol=1e-12)
    assert (relp - grad).abs().max() > 1e-3 * grad.abs().max()


@pytest.mark.parametrize("rules", [True, False])
def test_relp_conserves_relevance(rules):
    """LLaMA has no biases: with the norm scales and all patterns constant every layer is
    homogeneous (attention of degree 1, the gated product of degree 2, halved by the Half-rule),
    so ``sum(embed * relp_grad) = metric`` (Euler); the plain gradient breaks it."""
    model = kinds.make_bridge("llama_gqa")
    clean, _, _ = _task(kinds.D_VOCAB)
    kept = {}

    def embed(act, hook):
        kept["embed"] = act.detach().requires_grad_(True)
        return kept["embed"]

    hooks = [("hook_embed", embed), *(relp_hooks(model) if rules else [])]
    with torch.enable_grad():
        value = model.run_with_hooks(clean, fwd_hooks=hooks)[:, -1, 5].sum()
        (grad,) = torch.autograd.grad(value, kept["embed"])
    relevance = float((kept["embed"] * grad).sum().detach())
    if rules:
        assert relevance == pytest.approx(float(value), rel=1e-6, abs=1e-9)
    else:
        assert abs(relevance - float(value)) > 1e-2 * abs(float(value))


@pytest.mark.parametrize("family", ["gpt2", "llama_gqa", "gemma"])
@pytest.mark.parametrize("rule", ["relp", "gradient"])
def test_gate_plus_value_is_the_total(family, rule):
    model = kinds.make_bridge(family)
    clean, corrupted, metric = _task(kinds.D_VOCAB)
    total = neuron_relevance(model, clean, corrupted, metric, rule=rule)
    parts = neuron_relevance(model, clean, corrupted, metric, rule=rule, split=True)
    for li, rel in total.items():
        assert parts[li].shape == (rel.shape[0], 2)
        torch.testing.assert_close(parts[li].sum(-1), rel, rtol=1e-9, atol=1e-12)
        for j in range(2):  # neither part is trivially zero
            assert parts[li][:, j].abs().max() > 1e-3 * rel.abs().max()


def test_ig_one_step_is_the_gradient_at_the_clean_input():
    """``ig_steps=1`` takes the gradient with the clean embeddings (LLaMA: no position embedding),
    so it is minus the gradient relevance of the swapped pair; other step counts differ."""
    model = kinds.make_bridge("llama_gqa")
    clean, corrupted, metric = _task(kinds.D_VOCAB)
    ig1 = neuron_relevance(model, clean, corrupted, metric, rule="gradient", ig_steps=1)
    swapped = neuron_relevance(model, corrupted, clean, metric, rule="gradient")
    ig5 = neuron_relevance(model, clean, corrupted, metric, rule="gradient", ig_steps=5)
    for li in ig1:
        torch.testing.assert_close(ig1[li], -swapped[li], rtol=1e-9, atol=1e-12)
        assert (ig5[li] - ig1[li]).abs().max() > 1e-3 * ig1[li].abs().max()


def test_layers_and_batches_give_the_same_numbers():
    model = kinds.make_bridge("llama_gqa")
    clean, corrupted, metric = _task(kinds.D_VOCAB)
    full = neuron_relevance(model, clean, corrupted, metric, split=True)
    part = neuron_relevance(model, clean, corrupted, metric, split=True, layers=[1], batch_size=2)
    assert list(part) == [1]
    torch.testing.assert_close(part[1], full[1], rtol=1e-9, atol=1e-12)


@pytest.mark.skipif(not HAS_HOOKED_TRANSFORMER, reason="TL 4.x has no HookedTransformer")
@pytest.mark.parametrize(("family", "rtol"), [("gpt2", 1e-9), ("llama_gqa", 1e-5)])
def test_both_kinds_agree(family, rtol):
    """Same weights as AttnOnlyTransformer and bridge (the LLaMA bridge's attention softmax runs
    in float32, hence its tolerance), RelP with the split and with interpolated gradients."""
    hooked, bridge = kinds.make_pair(family)
    clean, corrupted, metric = _task(kinds.D_VOCAB)
    for kwargs in (dict(split=True), dict(ig_steps=3)):
        a = neuron_relevance(hooked, clean, corrupted, metric, **kwargs)
        b = neuron_relevance(bridge, clean, corrupted, metric, **kwargs)
        for li in a:
            torch.testing.assert_close(a[li], b[li], rtol=rtol, atol=rtol * a[li].abs().max())


def test_refusals():
    model = kinds.make_bridge("gpt2")
    clean, corrupted, metric = _task(kinds.D_VOCAB)
    with pytest.raises(ValueError, match="rule must be one of"):
        neuron_relevance(model, clean, corrupted, metric, rule="lrp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ig_steps"):
        neuron_relevance(model, clean, corrupted, metric, ig_steps=0)
    with pytest.raises(IndexError, match="out of range"):
        neuron_relevance(model, clean, corrupted, metric, layers=[2])
    with pytest.raises(ValueError, match="differ in shape"):
        neuron_relevance(model, clean, corrupted[:, :-1], metric)
