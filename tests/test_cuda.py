"""CUDA: the analysis core on a GPU gives the CPU's results (skipped without CUDA).

Each test builds the same weights twice, on the CPU and on ``cuda``, runs one tool on both and
compares: the converted model's logits and neuron-head cache, ``discover_circuit`` (default and
``neurons_per_mlp="auto"``: the same edges, named neurons and faithfulness), edge attribution,
exact circuit runs with kept neurons, activation patching, attribution patching, path patching
and dataset summaries, on both model kinds (the ``AttnOnlyTransformer`` on TransformerLens 3.x and
the converted ``TransformerBridge``). CI has no GPU: these run where one is lent
(``docs/development.md``). GPU float32 sums run in another order than the CPU's, so values agree
to ``RTOL`` (relative to the largest magnitude) and choices made on them (edge rankings) are
compared where the CPU's margins exceed that.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

import tl_attnonly
import tl_attnonly.analysis as A
from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER

#: The device under test (``TL_ATTNONLY_TEST_DEVICE=cpu`` checks the tests themselves on a CPU).
DEVICE = os.environ.get("TL_ATTNONLY_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(
    DEVICE.startswith("cuda") and not torch.cuda.is_available(), reason="needs a CUDA device"
)

ROOT = Path(__file__).resolve().parents[1]
RTOL = 2e-4
KINDS = ["hooked", "bridge"] if HAS_HOOKED_TRANSFORMER else ["bridge"]


def _bracket_task(model, n: int):
    spec = importlib.util.spec_from_file_location(
        "circuit_bracket", ROOT / "scripts" / "circuit_bracket.py"
    )
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.bracket_task(model, n)


def _load(kind: str, device: str):
    from tl_attnonly.bundled import load_bundled_bridge, load_bundled_model

    load = load_bundled_model if kind == "hooked" else load_bundled_bridge
    return tl_attnonly.convert(load(device=device))


@pytest.fixture(scope="module", params=KINDS)
def pair(request):
    """``(cpu model, cuda model, cpu task, cuda task)``: the bundled model converted, the bracket
    task of ``scripts/circuit_bracket.py`` (16 prompts) on each device."""
    cpu, gpu = _load(request.param, "cpu"), _load(request.param, DEVICE)
    return cpu, gpu, _bracket_task(cpu, 16), _bracket_task(gpu, 16)


def close(gpu, cpu, what: str) -> None:
    gpu = torch.as_tensor(gpu).detach().double().cpu()
    cpu = torch.as_tensor(cpu).detach().double().cpu()
    scale = max(1.0, float(cpu.abs().max())) if cpu.numel() else 1.0
    torch.testing.assert_close(gpu, cpu, rtol=0, atol=RTOL * scale, msg=lambda m: f"{what}: {m}")


def test_tasks_live_on_their_devices(pair):
    cpu, gpu, (clean, *_), (clean_gpu, *_) = pair
    assert clean.device.type == "cpu" and clean_gpu.device.type == torch.device(DEVICE).type
    assert torch.equal(clean, clean_gpu.cpu())


def test_logits_and_neuron_head_cache(pair):
    cpu, gpu, (clean, *_), (clean_gpu, *_) = pair
    logits, cache = cpu.run_with_cache(clean)
    logits_gpu, cache_gpu = gpu.run_with_cache(clean_gpu)
    close(logits_gpu, logits, "logits")
    for name in ("blocks.0.mlp.hook_pattern", "blocks.1.mlp.hook_z", "blocks.1.hook_resid_post"):
        assert cache_gpu[name].device.type == torch.device(DEVICE).type
        close(cache_gpu[name], cache[name], name)


@pytest.mark.parametrize("neurons", [8, "auto"], ids=["default", "auto"])
def test_discover_circuit_finds_the_cpu_circuit(pair, neurons):
    cpu, gpu, task, task_gpu = pair
    kw = dict(progress=False, neurons_per_mlp=neurons)
    found = A.discover_circuit(cpu, *task, **kw)
    found_gpu = A.discover_circuit(gpu, *task_gpu, **kw)
    assert A.mask_size(found_gpu.mask) == A.mask_size(found.mask)
    assert found_gpu.graph.node_labels() == found.graph.node_labels()
    for key in found.mask:
        assert torch.equal(found_gpu.mask[key].cpu(), found.mask[key].cpu()), key
    close(found_gpu.faithfulness, found.faithfulness, "faithfulness")
    close(found_gpu.metric_clean, found.metric_clean, "clean metric")


def test_tokens_on_the_cpu_run_on_the_gpu_model(pair):
    """Tokens built on the CPU (a tokenizer's, a list's) given to a model on the GPU: the entry
    points move them to the model's device, as ``HookedTransformer.forward`` does (a bridge does
    not: without the move its embedding refused them, and the HookedTransformer's edge scores,
    kept on the tokens' device, met the GPU's); datasets are built on the model's device."""
    cpu, gpu, task, (clean_gpu, corrupted_gpu, metric) = pair
    found = A.discover_circuit(cpu, *task, progress=False)
    found_gpu = A.discover_circuit(
        gpu, clean_gpu.cpu(), corrupted_gpu.cpu(), metric, progress=False
    )
    assert A.mask_size(found_gpu.mask) == A.mask_size(found.mask)
    close(found_gpu.faithfulness, found.faithfulness, "faithfulness")
    data = A.make_induction_dataset(gpu, 4, half_len=3)
    assert data.tokens.device.type == data.corrupted_tokens.device.type == torch.device(DEVICE).type


def test_edge_scores_and_kept_neuron_runs(pair):
    cpu, gpu, task, task_gpu = pair
    scores = A.edge_attribution_scores(cpu, *task, progress=False, neuron_level=False)
    scores_gpu = A.edge_attribution_scores(gpu, *task_gpu, progress=False, neuron_level=False)
    for key, value in scores.scores.items():
        close(scores_gpu.scores[key], value, f"edge scores {key}")
    graph = A.HeadGraph(cpu, neuron_level=False)
    mask = graph.full_mask(True)
    d_mlp = cpu.cfg.d_mlp
    kept = [None, {0: torch.arange(d_mlp) % 3 == 0, 1: torch.arange(d_mlp) < 40}]
    values = A.circuit_metrics(cpu, [mask, mask], *task, neuron_level=False, kept_neurons=kept)
    values_gpu = A.circuit_metrics(
        gpu, [mask, mask], *task_gpu, neuron_level=False, kept_neurons=kept
    )
    close(torch.tensor(values_gpu), torch.tensor(values), "circuit_metrics with kept neurons")


def test_patching_attribution_and_path_patching(pair):
    cpu, gpu, (clean, corrupted, metric), (clean_gpu, corrupted_gpu, _) = pair
    target = cpu.to_single_token(")")

    def patch_metric(logits):
        return logits[:, -1, target].mean()

    results = []
    for model, c, k in ((cpu, clean, corrupted), (gpu, clean_gpu, corrupted_gpu)):
        _, cache = model.run_with_cache(c)
        c, k = c.cpu(), k.cpu()  # CPU tokens for the GPU model too: the entry points move them
        patched = A.get_act_patch_neuron_heads(model, k, cache, patch_metric, layers=[1])
        scores, labels = A.attribution_patch(model, cache, k, patch_metric)
        path = A.path_patch(model, c, k, ["L0H1", "L0N5"], "L1H2", patch_metric)
        results.append((patched, scores, labels, path))
    (patched, scores, labels, path), (patched_g, scores_g, labels_g, path_g) = results
    close(patched_g, patched, "neuron-head activation patching")
    assert labels_g == labels
    close(scores_g, scores, "attribution patching")
    close(path_g, path, "path patching")


def test_summaries_on_a_corpus(pair):
    cpu, gpu, *_ = pair
    corpus = ["for k, v in d.items():", "    return f(x)", "import os\nimport sys"]
    summary = A.summarize_neuron_heads(cpu, corpus, progress=False)
    summary_gpu = A.summarize_neuron_heads(gpu, corpus, progress=False)
    assert summary_gpu.n_positions == summary.n_positions
    close(summary_gpu.fire_count, summary.fire_count, "fire counts")
    close(summary_gpu.token_count, summary.token_count, "token counts")
    for ranking, layers in summary.top.items():
        for layer, top in enumerate(layers):
            top_gpu = summary_gpu.top[ranking][layer]
            values, values_gpu = top.values.clamp(min=-1e30), top_gpu.values.clamp(min=-1e30)
            close(values_gpu, values, f"top {ranking} values, layer {layer}")
