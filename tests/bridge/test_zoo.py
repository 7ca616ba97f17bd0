"""TransformerBridge zoo: every architecture builds offline, runs, and converts exactly, within the
activation's bound, or is refused with a clear error (see ``zoo.py`` for the models)."""

from __future__ import annotations

import pytest
import torch
from zoo import ZOO, build_bridge, tokens

ALL = list(ZOO)
WORKING = [name for name in ZOO if not ZOO[name].broken]
BROKEN = [name for name in ZOO if ZOO[name].broken]
DTYPES = [torch.float32, torch.float64]


def _dtype_params(names: list[str]) -> list:
    """(name, dtype) pairs, skipping float64 where the model cannot run in it."""
    out = []
    for name in names:
        for dtype in DTYPES:
            marks = []
            if dtype == torch.float64 and ZOO[name].no_fp64:
                marks = [pytest.mark.skip(reason=ZOO[name].no_fp64)]
            out.append(pytest.param(name, dtype, id=f"{name}-{str(dtype)[6:]}", marks=marks))
    return out


@pytest.mark.parametrize(("name", "dtype"), _dtype_params(WORKING))
def test_unconverted_bridge_matches_hf_model(name, dtype):
    """The bridge's logits are the wrapped HF model's, and its hooks fire."""
    bridge = build_bridge(name, dtype)
    toks = tokens()
    with torch.no_grad():
        hf_logits = bridge.original_model(toks).logits
        logits, cache = bridge.run_with_cache(toks)
    assert logits.dtype == dtype
    assert logits.shape == (*toks.shape, ZOO[name].kwargs.get("vocab_size", 128))
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(logits, hf_logits, rtol=0, atol=tol)
    for layer in range(bridge.cfg.n_layers):
        assert any(key.startswith(f"blocks.{layer}.mlp.") for key in cache.keys())
    # The random draw must put MLP inputs off the nearly linear region around 0.
    assert logits.std() > 0.1


@pytest.mark.parametrize("name", BROKEN)
def test_broken_bridges_still_fail(name):
    """Architectures recorded as broken in TransformerLens itself: when TL fixes one, this fails
    and the zoo entry's ``broken`` note must be removed."""
    bridge = build_bridge(name)
    with pytest.raises(Exception):  # noqa: B017 - any failure of TL's own bridge
        bridge(tokens())
