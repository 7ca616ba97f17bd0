"""Position embeddings without a hook of their own (XGLM's sinusoidal embedding on a bridge: no
``hook_pos_embed``): the tools read them as block 0's input less ``hook_embed``
(:attr:`~tl_attnonly.protocol.AttnOnlyModel.embed_hooks`). Before, the decompositions left them
out (off by the sinusoids' amplitude) and discovery failed with a ``KeyError``. Checked in fp64
against the bridge's own runs: the components sum to the residual stream, and the full and empty
graphs' exact runs are the clean and corrupted runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tl_attnonly.adapt import analysis_model  # noqa: E402
from tl_attnonly.analysis import (  # noqa: E402
    HeadGraph,
    circuit_metrics,
    decompose_resid_heads,
    logit_diff_metric,
)
from tl_attnonly.hooks import decomposition_names_filter  # noqa: E402

pytest.importorskip("transformers")
zoo = pytest.importorskip("zoo")

ATOL = 1e-4  # float32, residual values up to ~30 (embeddings scaled by sqrt(d_model))


@pytest.fixture(scope="module")
def xglm():
    bridge = zoo.build_bridge("xglm", torch.float32)
    zoo.convert_zoo_bridge(bridge)
    return bridge


def test_unhooked_positions_are_block_0s_input(xglm):
    assert "hook_pos_embed" not in xglm.hook_dict
    assert analysis_model(xglm).embed_hooks == ("blocks.0.hook_resid_pre",)
    clean = zoo.tokens()
    _, cache = xglm.run_with_cache(clean, names_filter=decomposition_names_filter())
    stack, labels = decompose_resid_heads(cache, return_labels=True)
    assert "pos_embed" in labels
    positions = stack[labels.index("pos_embed")]
    assert positions.abs().max() > 0.5  # sinusoids: what was left out before
    last = xglm.cfg.n_layers - 1
    _, full = xglm.run_with_cache(clean)
    names = [f"blocks.{last}.hook_resid_post", "ln_final.hook_in"]
    target = next(full[name] for name in names if name in full.cache_dict)
    torch.testing.assert_close(stack.sum(0), target, atol=ATOL, rtol=0)


def test_exact_runs_with_unhooked_positions(xglm):
    clean, corrupted = zoo.tokens(), zoo.tokens(seed=5)
    metric = logit_diff_metric(torch.full((2,), 3), torch.full((2,), 4))
    full = HeadGraph(xglm).full_mask()
    empty = {key: torch.zeros_like(block) for key, block in full.items()}
    runs = circuit_metrics(xglm, [full, empty], clean, corrupted, metric)
    indices = torch.arange(clean.shape[0])
    with torch.no_grad():
        expected = [float(metric(xglm(t), indices)) for t in (clean, corrupted)]
    assert runs == pytest.approx(expected, abs=ATOL)
