"""The shared types and checks (tl_attnonly._types)."""

from __future__ import annotations

import pytest
from conftest import make_model

from tl_attnonly import convert, to_literal
from tl_attnonly._types import check_kinds
from tl_attnonly.adapt import analysis_model


def test_check_kinds_orders_attention_heads_first():
    assert check_kinds(("neuron", "attn")) == ("attn", "neuron")
    assert check_kinds(["neuron"]) == ("neuron",)


@pytest.mark.parametrize("kinds", ["attn", (), ("attn", "mlp")])
def test_check_kinds_refuses_strings_empty_and_unknown(kinds):
    with pytest.raises(ValueError, match="non-empty subset of \\('attn', 'neuron'\\)"):
        check_kinds(kinds)


def test_analysis_model_accepts_converted_models_only():
    model = make_model(n_layers=1)
    converted = convert(model)
    adapted = analysis_model(converted)
    assert adapted.model is converted and analysis_model(adapted) is adapted
    assert analysis_model(model, neuron_heads=False).model is model
    with pytest.raises(TypeError, match=r"HookedTransformer has no neuron-heads.*convert\(model\)"):
        analysis_model(model)
    with pytest.raises(TypeError, match="structured form"):
        analysis_model(to_literal(model, max_len=4))
    # Duck typing is not enough: an object with a neuron_heads attribute is not a model.
    with pytest.raises(TypeError, match="got SimpleNamespace"):
        from types import SimpleNamespace

        analysis_model(SimpleNamespace(neuron_heads=[]))
