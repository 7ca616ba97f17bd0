"""scripts/model_family_table.py: derived from TL's config code offline, verdicts as converted."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from transformer_lens.supported_models import OFFICIAL_MODEL_NAMES

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "model_family_table.py"


@pytest.fixture(scope="module")
def rows():
    spec = importlib.util.spec_from_file_location("model_family_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {row["model"]: row for row in module.model_rows()}


def test_every_official_name_has_a_verdict(rows):
    assert list(rows) == list(OFFICIAL_MODEL_NAMES)


@pytest.mark.parametrize(
    "name, verdict, architecture",
    [
        ("meta-llama/Llama-3.2-1B", "exact", "LlamaForCausalLM"),  # SwiGLU
        ("google/gemma-2-2b", "approximate", "Gemma2ForCausalLM"),  # GeGLU tanh
        ("allenai/OLMo-2-0425-1B", "exact", "Olmo2ForCausalLM"),
        ("openai/gpt-oss-20b", "refused", "GptOssForCausalLM"),  # clamped experts
        ("mistralai/Mixtral-8x7B-v0.1", "by hub act_fn", "MixtralForCausalLM"),  # MoE converts
        ("google-bert/bert-base-cased", "not a decoder", "BertForMaskedLM"),
    ],
)
def test_verdicts_follow_tl_configs_and_the_package(rows, name, verdict, architecture):
    row = rows[name]
    assert (row["verdict"], row["architecture"]) == (verdict, architecture)
