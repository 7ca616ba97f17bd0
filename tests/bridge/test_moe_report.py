"""The HTML report on mixtures of experts (Qwen2-MoE, every layer experts with a shared expert;
DeepSeek-V3, a dense layer 0 and an expert layer 1, with MLA attention; GPT-OSS, clamped): every
section is there; an expert layer's place in the patterns holds its routing, the weights the run
gave each expert (``expert_routing``, the hooks the block's own router fired); the strips and the
neuron-head patching heatmap hold the dense layers only.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_report import _array, _figures, _sections, _views
from zoo_tools import build_converted

from tl_attnonly.analysis.experts import expert_routing, experts_used
from tl_attnonly.report import REPORT_SECTIONS, write_demo_report

PROMPT = " ".join(f"w{i}" for i in (5, 17, 3, 99, 42, 8, 64))


#: GPT-OSS: its scaled SiLU is not in the activation error table (the report's last section
#: lists the model's own activation only where the table has it).
MODELS = [("qwen2_moe", []), ("deepseek_v3", [0]), ("gpt_oss", [])]


@pytest.mark.parametrize(("name", "dense"), MODELS)
def test_the_report_draws_expert_layers_as_their_routing(name, dense, tmp_path):
    bridge = build_converted(name)
    path = write_demo_report(
        None, bridge, PROMPT, tmp_path / "r.html", equivalence={}, top_k=2, square_k=1,
        progress=False,
    )  # fmt: skip
    sections = _sections(path.read_text("utf-8"))
    assert list(sections) == list(REPORT_SECTIONS)
    n_layers = bridge.cfg.n_layers
    experts = [layer for layer in range(n_layers) if layer not in dense]

    with torch.no_grad():
        _, cache = bridge.run_with_cache(bridge.to_tokens(PROMPT))
    routing = _figures(sections["patterns"])
    assert len(routing) == len(experts)
    for layer, (data, layout) in zip(experts, routing, strict=True):
        assert f"Layer {layer}: routing" in str(layout["title"])
        want = expert_routing(cache, layer)[0].numpy()  # [pos, n_experts]
        got = np.nan_to_num(_array(data[0]["z"]))
        np.testing.assert_allclose(got, want, atol=1e-6)
        routed = np.zeros_like(want, dtype=bool)
        np.put_along_axis(routed, experts_used(cache)[layer][0].numpy(), True, axis=-1)
        assert ((got > 0) == routed).all()  # nonzero exactly at the router's top-k
    assert [layer for layer, _ in _views(sections["patterns"])] == dense

    assert len(_figures(sections["activity"])) == len(dense)
    patching = _figures(sections["patching"])
    assert len(patching) == 1 + bool(dense)
    assert _array(patching[0][0][0]["z"]).shape == (n_layers, bridge.cfg.n_heads)
    if dense:
        assert patching[1][0][0]["y"] == [str(layer) for layer in dense]
    else:
        assert "get_act_patch_expert_neuron_heads" in sections["patching"]
