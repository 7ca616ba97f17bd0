"""load() checks what it loads: JSON, the conversion record's schema, coefficients, checksums."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from conftest import make_model
from safetensors.torch import load_file, save_file

from tl_attnonly import AttnOnlyTransformer, convert
from tl_attnonly.activations import FIT_RANGE, head_coefficients
from tl_attnonly.hooked.conversion_record import SavedModelError
from tl_attnonly.hooked.saving import pending_coefficients as _pending_coefficients


@pytest.fixture
def saved(tmp_path):
    """A converted gelu_new model (fp64, K=4 fit) saved to ``tmp_path / "m"``."""
    model = convert(make_model("gelu_new", torch.float64))
    model.save_pretrained(tmp_path / "m")
    return model, tmp_path / "m"


def _edit(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data, indent=2))


def test_a_coefficient_edited_in_conversion_json_is_refused(saved):
    # the user's report: 1.5x one list loaded silently and moved the logits by 0.55
    _, directory = saved
    _edit(directory / "conversion.json", lambda d: d["coefficients"].update(
        f=[1.5 * v for v in d["coefficients"]["f"]]
    ))
    with pytest.raises(SavedModelError) as err:
        AttnOnlyTransformer.load(directory)
    message = str(err.value)
    assert str(directory / "conversion.json") in message
    assert "not this package's own for gelu_new with 4 head(s)" in message and "(f)" in message


def test_malformed_json_names_the_file_and_the_line(saved):
    _, directory = saved
    path = directory / "conversion.json"
    lines = path.read_text().splitlines()
    lines[1] = lines[1].rstrip(",")  # a missing comma on line 2
    path.write_text("\n".join(lines))
    with pytest.raises(SavedModelError, match=r"conversion\.json is not valid JSON: .* line 3"):
        AttnOnlyTransformer.load(directory)
    (directory / "config.json").write_text('{"d_model": 8,\n')
    with pytest.raises(SavedModelError, match=r"config\.json is not valid JSON: .* line 2"):
        AttnOnlyTransformer.load(directory)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        # a misspelt key
        (
            lambda d: d.update(coeficients=d.pop("coefficients")),
            "unknown key 'coeficients' (did you mean 'coefficients'?)",
        ),
        (lambda d: d["options"].update(fuzed=True), "unknown key options.'fuzed'"),
        (lambda d: d["coefficients"].update(note="mine"), "unknown key coefficients.'note'"),
        (lambda d: d["options"].pop("relu_k"), "missing key options.'relu_k'"),
        (lambda d: d.pop("checksums"), "missing key 'checksums'"),
        (lambda d: d["options"].update(relu_k="100"), "key options.'relu_k' must be a number"),
        (lambda d: d["options"].update(fused=1), "key options.'fused' must be true or false"),
        (lambda d: d["coefficients"].update(b=[1, "x", 2, 3]), "coefficients.'b' must be a non"),
        (lambda d: d["coefficients"].update(custom="yes"), "coefficients.'custom' must be true"),
        (lambda d: d.update(format_version=3), "format_version 3 is not one"),
        (lambda d: d["checksums"].update(algorithm="md5"), "checksums.'algorithm' must be"),
        (lambda d: d["options"].update(clamp="ignore"), "key options.'clamp' must be one of"),
    ],
)
def test_the_conversion_record_is_checked_against_its_schema(saved, change, expected):
    _, directory = saved
    _edit(directory / "conversion.json", change)
    with pytest.raises(SavedModelError) as err:
        AttnOnlyTransformer.load(directory)
    assert str(directory / "conversion.json") in str(err.value)
    assert expected in str(err.value)


def test_edited_weights_are_caught_by_the_checksum(saved):
    _, directory = saved
    state = load_file(str(directory / "model.safetensors"))
    state["blocks.0.mlp.W_out"][0, 0] += 1e-3
    save_file(state, str(directory / "model.safetensors"))
    with pytest.raises(SavedModelError) as err:
        AttnOnlyTransformer.load(directory)
    assert f"{directory / 'model.safetensors'} was changed after save_pretrained()" in str(
        err.value
    )
    assert "call save_pretrained() again" in str(err.value)


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("config.json", lambda d: d.update(model_name="renamed")),
        ("conversion.json", lambda d: d["options"].update(fused=False)),
        ("conversion.json", lambda d: d.update(tl_attnonly_version="9.9")),
    ],
)
def test_other_edits_are_caught_by_the_checksum(saved, name, change):
    _, directory = saved
    _edit(directory / name, change)
    with pytest.raises(SavedModelError, match=f"{name} was changed after save_pretrained"):
        AttnOnlyTransformer.load(directory)


def test_reformatting_a_json_file_is_not_an_edit(saved, tokens):
    model, directory = saved
    for name in ("config.json", "conversion.json"):
        path = directory / name
        path.write_text(json.dumps(json.loads(path.read_text()), sort_keys=True))
    assert torch.equal(AttnOnlyTransformer.load(directory)(tokens), model(tokens))


def _custom_model():
    package = head_coefficients("gelu_new", 4)
    custom = type(package)(
        "gelu_new", "fit", package.b, package.d, [v * 1.01 for v in package.f], package.e,
        package.g,
    )
    with _pending_coefficients(custom):
        model = convert(make_model("gelu_new", torch.float64))
    assert model.coefficients == custom
    return model


def test_custom_coefficients_are_recorded_and_checked_numerically(tmp_path, tokens):
    model = _custom_model()
    model.save_pretrained(tmp_path / "m")
    data = json.loads((tmp_path / "m" / "conversion.json").read_text())["coefficients"]
    assert data["custom"] is True
    assert data["max_abs_error"] == model.coefficients.max_abs_error(FIT_RANGE) > 1e-3
    loaded = AttnOnlyTransformer.load(tmp_path / "m")
    assert loaded.coefficients == model.coefficients
    assert torch.equal(loaded(tokens), model(tokens))
    # a package model is not custom
    convert(make_model("gelu_new", torch.float64)).save_pretrained(tmp_path / "p")
    package = json.loads((tmp_path / "p" / "conversion.json").read_text())["coefficients"]
    assert package["custom"] is False


def test_edited_custom_coefficients_fail_the_numerical_check(tmp_path):
    _custom_model().save_pretrained(tmp_path / "m")
    path = tmp_path / "m" / "conversion.json"
    _edit(path, lambda d: d["coefficients"].update(f=[1.5 * v for v in d["coefficients"]["f"]]))
    with pytest.raises(SavedModelError, match="do not approximate gelu_new as recorded"):
        AttnOnlyTransformer.load(tmp_path / "m")


def test_edited_custom_coefficients_with_their_error_fail_the_checksum(tmp_path):
    _custom_model().save_pretrained(tmp_path / "m")
    path = tmp_path / "m" / "conversion.json"

    def change(d):
        c = d["coefficients"]
        c["f"] = [1.5 * v for v in c["f"]]
        c["max_abs_error"] = type(_custom_model().coefficients).from_dict(
            {k: v for k, v in c.items() if k not in ("custom", "max_abs_error")}
        ).max_abs_error(FIT_RANGE)

    _edit(path, change)
    with pytest.raises(SavedModelError, match="conversion.json was changed after save_pretrained"):
        AttnOnlyTransformer.load(tmp_path / "m")


def test_a_save_from_before_the_clamp_option_loads(saved, tokens):
    """Saves written before ``ConversionOptions.clamp`` existed (format 2, checksummed, no
    ``options.clamp``) still load, with the option's default."""
    from tl_attnonly.hooked.conversion_record import checksums

    model, directory = saved
    path = directory / "conversion.json"
    record = json.loads(path.read_text())
    del record["options"]["clamp"]
    config = json.loads((directory / "config.json").read_text())
    record["checksums"] = checksums(config, directory / "model.safetensors", record)
    path.write_text(json.dumps(record, indent=2))
    loaded = AttnOnlyTransformer.load(directory)
    assert loaded.conversion.clamp == "refuse"
    assert torch.equal(loaded(tokens), model(tokens))


def _as_previous_version(directory):
    """Rewrite a save as the previous version wrote it (no format_version, no checksums)."""

    def change(d):
        del d["format_version"], d["checksums"]
        del d["coefficients"]["custom"], d["coefficients"]["max_abs_error"]

    _edit(directory / "conversion.json", change)


def test_a_save_of_the_previous_version_loads_with_a_warning(saved, tokens):
    model, directory = saved
    _as_previous_version(directory)
    with pytest.warns(UserWarning, match="no checksums.*save_pretrained"):
        loaded = AttnOnlyTransformer.load(directory)
    assert torch.equal(loaded(tokens), model(tokens))
    loaded.save_pretrained(directory)  # saving again adds the checksums
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        AttnOnlyTransformer.load(directory)
    assert not [w for w in caught if "checksums" in str(w.message)]


def test_a_save_of_the_previous_version_with_edited_coefficients_is_refused(saved):
    _, directory = saved
    _as_previous_version(directory)
    _edit(directory / "conversion.json", lambda d: d["coefficients"].update(
        e=[v + 0.1 for v in d["coefficients"]["e"]]
    ))
    with pytest.raises(SavedModelError, match="not this package's own"):
        AttnOnlyTransformer.load(directory)


def test_save_refuses_layers_with_different_coefficients(tmp_path):
    model = convert(make_model("relu"))
    model.blocks[1].mlp.coefficients = head_coefficients("relu", relu_k=10.0)
    with pytest.raises(ValueError, match="different neuron-head coefficients"):
        model.save_pretrained(tmp_path / "m")
    assert not (tmp_path / "m").exists()
