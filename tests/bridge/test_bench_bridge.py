"""benchmarks/bench_bridge.py: its conversion-memory figure, against the target."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_bridge import conversion_memory_in_child  # noqa: E402


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("kind", ["swiglu", "silu"])
def test_bridge_conversion_peak_memory_within_target(kind):
    """Converting a bridge shares its weights, so the resident peak while converting must stay
    within 1.05x the model (4 layers, d_model 768, vocab 1000; fixed costs excluded: a 1-layer
    model is converted first). Measured 1.21x (SwiGLU) and 1.25x (plain SiLU) before: the
    self-check allocated ``|W_out|`` in float64 for each layer, and the GELU/SiLU fit error was
    evaluated on 200,001 points at once; both now go a block at a time (1.02x)."""
    ratio = conversion_memory_in_child(kind)["ratio"]
    assert ratio <= 1.05, f"conversion peak memory {ratio:.3f}x the model"
