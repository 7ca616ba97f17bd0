"""Options objects (tl_attnonly.options): ConversionOptions.with_overrides and LiteralOptions."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import make_model, make_tokens

from tl_attnonly import ConversionOptions, LiteralOptions, convert, to_literal


def test_with_overrides_replaces_only_what_is_given():
    base = ConversionOptions(relu_k=50.0, gelu_method="paper")
    assert base.with_overrides() == base
    changed = base.with_overrides(n_heads_per_neuron=2, relu_k=None)
    assert changed == ConversionOptions(n_heads_per_neuron=2, relu_k=50.0, gelu_method="paper")
    assert base.n_heads_per_neuron is None  # frozen: a copy, never an edit
    assert base.with_overrides(fused=False).fused is False


def test_convert_merges_options_objects_with_single_options():
    model = make_model("relu", n_layers=1)
    converted = convert(model, conversion=ConversionOptions(relu_k=50.0, fused=False), relu_k=20.0)
    assert converted.conversion == ConversionOptions(relu_k=20.0, fused=False)


def test_literal_options_are_frozen_and_checked():
    opts = LiteralOptions(layout="split", max_len=6)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.omega = 1.0  # type: ignore[misc]
    with pytest.raises(ValueError, match="layout must be 'neuron' or 'split'"):
        LiteralOptions(layout="nueron")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mask must be"):
        opts.with_overrides(mask="none")
    with pytest.raises(TypeError, match=r"Unknown literal-form option\(s\) \['omgea'\]"):
        opts.with_overrides(omgea=1e3)


def test_to_literal_takes_an_options_object_or_keywords_alike():
    model = make_model(n_layers=1)
    tokens = make_tokens(pos=6)
    by_object = to_literal(model, LiteralOptions(layout="split", max_len=6, omega=1e3))
    by_keyword = to_literal(model, layout="split", max_len=6, omega=1e3)
    mixed = to_literal(model, LiteralOptions(layout="split"), max_len=6, omega=1e3)
    assert by_object.layout_name == "split" and by_object.max_len == 6 and by_object.omega == 1e3
    expected = by_keyword(tokens)
    torch.testing.assert_close(by_object(tokens), expected, rtol=0, atol=0)
    torch.testing.assert_close(mixed(tokens), expected, rtol=0, atol=0)
    via_convert = convert(model, form="literal", literal=LiteralOptions(layout="split", max_len=6))
    assert via_convert.layout_name == "split"


def test_to_literal_refuses_a_positional_omega_and_unknown_options():
    model = make_model(n_layers=1)
    with pytest.raises(TypeError, match="must be a tl_attnonly.LiteralOptions.*omega=..."):
        to_literal(model, 1e3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Unknown literal-form option"):
        to_literal(model, lenght=4)
    with pytest.raises(TypeError, match="belong to form='literal'"):
        convert(model, literal=LiteralOptions())  # type: ignore[call-overload]
