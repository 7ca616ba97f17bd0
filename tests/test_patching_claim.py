"""What the README says about patching, on both model kinds and both TransformerLens lines.

``transformer_lens.patching`` runs unchanged on a converted model, but its head functions patch
attention heads only (``get_act_patch_attn_head_out_all_pos``: ``[n_layers, n_heads]``, the
unconverted model's numbers) and its ``generic_activation_patch`` finds no neuron-head hook;
``tl_attnonly.analysis.get_act_patch_neuron_heads`` patches neuron-heads, and equals patching
each head's ``blocks.{l}.mlp.hook_z`` by hand.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformer_lens import patching

sys.path.insert(0, str(Path(__file__).parent))

from kinds import make_bridge, make_pair, make_tokens  # noqa: E402

from tl_attnonly.analysis import get_act_patch_neuron_heads  # noqa: E402
from tl_attnonly.hooks import neuron_act_name  # noqa: E402

HEADS = [0, 7, 23]
CLEAN = make_tokens(batch=1, pos=6, seed=0)
CORRUPTED = make_tokens(batch=1, pos=6, seed=1)


def metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[0, -1, 3] - logits[0, -1, 5]


def close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-10) -> None:
    """Equal to float64 rounding (GPT-2 with SiLU: exact as neuron-heads)."""
    a, b = a.double(), b.double()
    torch.testing.assert_close(a, b, rtol=0, atol=rtol * max(1.0, float(b.abs().max())))


@pytest.fixture(scope="module")
def models():
    """``{name: model}``: the converted bridge, its unconverted twin, and on TransformerLens
    3.x the ``AttnOnlyTransformer`` of the same weights."""
    hooked, bridge = make_pair("gpt2")
    out = {"bridge": bridge, "unconverted": make_bridge("gpt2", convert=False)}
    if hooked is not None:
        out["AttnOnlyTransformer"] = hooked
    return out


def test_tl_head_patching_covers_attention_heads_as_on_the_original(models):
    results = {}
    for name, model in models.items():
        _, cache = model.run_with_cache(CLEAN)
        result = patching.get_act_patch_attn_head_out_all_pos(model, CORRUPTED, cache, metric)
        assert result.shape == (model.cfg.n_layers, model.cfg.n_heads)  # attention heads only
        results[name] = result
        if name != "unconverted":
            with pytest.raises(KeyError):  # no neuron-head names in TransformerLens's patching
                patching.generic_activation_patch(
                    model, CORRUPTED, cache, metric, patching.layer_head_vector_patch_setter,
                    "mlp.hook_z", index_axis_names=("layer", "head"),
                )  # fmt: skip
    for result in results.values():
        close(result, results["unconverted"])


def _patch_by_hand(model, clean_cache, layer: int, head: int) -> float:
    name = neuron_act_name("z", layer)

    def patch(z: torch.Tensor, hook) -> torch.Tensor:
        z = z.clone()
        z[:, :, head] = clean_cache[name][:, :, head]
        return z

    with torch.no_grad():
        return float(metric(model.run_with_hooks(CORRUPTED, fwd_hooks=[(name, patch)])))


def test_neuron_head_patching_equals_patching_each_hook_by_hand(models):
    results = []
    for name, model in models.items():
        if name == "unconverted":
            continue
        _, cache = model.run_with_cache(CLEAN)
        one_by_one = get_act_patch_neuron_heads(
            model, CORRUPTED, cache, metric, heads=HEADS, patches_per_pass=1
        )  # TransformerLens's generic_activation_patch over the neuron-head hooks
        batched = get_act_patch_neuron_heads(model, CORRUPTED, cache, metric, heads=HEADS)
        assert one_by_one.shape == batched.shape == (model.cfg.n_layers, len(HEADS))
        by_hand = torch.tensor(
            [[_patch_by_hand(model, cache, layer, h) for h in HEADS] for layer in range(2)],
            dtype=torch.float64,
        )
        close(one_by_one, by_hand, rtol=1e-6)  # generic_activation_patch keeps float32 results
        close(batched, by_hand)
        results.append(batched)
    for result in results:  # both kinds give the same numbers
        close(result, results[0])


def test_the_readme_says_which_patching_covers_neuron_heads():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    intro = readme.split("## ", 1)[0]
    assert (
        "`transformer_lens.patching`, `FactoredMatrix` circuits and `circuitsvis` all" not in intro
    )
    assert "its head functions patch attention heads only" in intro
    assert "get_act_patch_neuron_heads" in readme  # shown in a block that tests/test_readme.py runs
