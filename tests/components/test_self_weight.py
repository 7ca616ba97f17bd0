"""``mlp.self_weight(pre)``: each neuron's first head's weight on itself, computed from its
pre-activation alone, is the head path's ``hook_pattern[:, i * K, :, 0]`` (what the neuron atlas
reads without running the head path), over activations with trivial and non-trivial query
coefficients, plain and gated, fp32 and fp64, on the model kind of the installed line."""

from __future__ import annotations

import pytest
import torch
from conftest import GATED_ZOO, make_tokens
from models import make_converted

from tl_attnonly.adapt import analysis_model
from tl_attnonly.hooks import neuron_act_name

CASES = [
    ("silu", {}),  # one exact SiLU head: b = 1, d = 0
    ("gelu", {}),  # K = 4 heads with fitted slopes and shifts
    ("relu", {}),
    ("silu", GATED_ZOO["llama"]),  # gated: the query reads the gate
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("act", "overrides"), CASES)
def test_self_weight_is_the_first_heads_pattern(act, overrides, dtype):
    model = analysis_model(make_converted(act, dtype=dtype, **overrides))
    names = [neuron_act_name(k, li) for li in range(model.cfg.n_layers) for k in ("pre", "pattern")]
    _, cache = model.run_with_cache(make_tokens(2, 9), names_filter=lambda n: n in names)
    K = model.n_heads_per_neuron
    tol = {torch.float32: 1e-6, torch.float64: 1e-14}[dtype]
    for li in range(model.cfg.n_layers):
        mlp = model.blocks[li].mlp
        pattern = cache[neuron_act_name("pattern", li)][:, ::K, :, 0].transpose(1, 2)
        got = mlp.self_weight(cache[neuron_act_name("pre", li)])
        assert got.shape == pattern.shape and got.dtype == pattern.dtype
        torch.testing.assert_close(got, pattern, rtol=0, atol=tol)
        if act == "gelu":  # the case must exercise non-trivial query coefficients
            assert (mlp.coefficients.b[0], mlp.coefficients.d[0]) != (1, 0)
