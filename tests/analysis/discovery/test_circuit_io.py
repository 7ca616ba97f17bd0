"""Circuit.save / Circuit.load: an exact round trip on both model kinds, the same faithfulness
when evaluated again, and refusals of another model or a damaged file (issue 46)."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pandas as pd
import pytest
import torch
from conftest import make_tokens
from models import make_converted

from tl_attnonly.analysis import Circuit, discover_circuit, evaluate_circuit, logit_diff_metric
from tl_attnonly.analysis.discovery.circuit_io import CircuitFileError, saved_record

CLEAN, CORRUPTED = make_tokens(3, 7, seed=0), make_tokens(3, 7, seed=1)
METRIC = logit_diff_metric(torch.tensor([1, 2, 3]), torch.tensor([5, 6, 7]))


@pytest.fixture(scope="module")
def model():
    return make_converted("silu")


@pytest.fixture(scope="module", params=[8, "auto"], ids=["named", "auto"])
def circuit(model, request):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return discover_circuit(
            model, CLEAN, CORRUPTED, METRIC, neurons_per_mlp=request.param, progress=False
        )


FIELDS = [f.name for f in dataclasses.fields(Circuit) if f.name not in ("scores", "mask", "extra")]


def assert_same(a, b, where="circuit"):
    """Equal bit for bit: tensors, DataFrames (values and dtypes), nested circuits."""
    if isinstance(a, Circuit):
        assert isinstance(b, Circuit), where
        assert a.graph.block_keys() == b.graph.block_keys(), where
        assert a.graph.node_labels() == b.graph.node_labels(), where
        assert (a.scores.method, a.scores.metric_clean, a.scores.metric_corrupted) == (
            b.scores.method, b.scores.metric_clean, b.scores.metric_corrupted,
        )  # fmt: skip
        assert_same(a.scores.scores, b.scores.scores, f"{where}.scores")
        assert_same(a.mask, b.mask, f"{where}.mask")
        for name in FIELDS:
            assert_same(getattr(a, name), getattr(b, name), f"{where}.{name}")
        assert list(a.extra) == list(b.extra), where
        for key in a.extra:
            if a.extra[key] is a:
                assert b.extra[key] is b, f"{where}.extra[{key!r}]"
            else:
                assert_same(a.extra[key], b.extra[key], f"{where}.extra[{key!r}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, pd.DataFrame):
        pd.testing.assert_frame_equal(a, b, check_exact=True, obj=where)
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), where  # NaN equals NaN here


def test_a_saved_circuit_loads_equal_and_evaluates_the_same(model, circuit, tmp_path):
    circuit.save(tmp_path / "c", model=model, clean_tokens=CLEAN, corrupted_tokens=CORRUPTED)
    loaded = Circuit.load(tmp_path / "c", model=model)
    assert_same(circuit, loaded)
    assert_same(Circuit.load(tmp_path / "c"), circuit)  # no model: rebuilt from the saved shape
    again = evaluate_circuit(model, loaded, CLEAN, CORRUPTED, METRIC)
    assert again == evaluate_circuit(model, circuit, CLEAN, CORRUPTED, METRIC)
    assert again.faithfulness == pytest.approx(circuit.faithfulness, abs=1e-12)
    record = saved_record(tmp_path / "c")
    assert torch.equal(record["tokens"]["clean"], CLEAN)
    assert record["model"]["shape"]["n_layers"] == 2 and record["versions"]["torch"]
    assert record["model"]["dtype"] == "float64"


def test_another_model_is_refused_naming_the_mismatch(model, circuit, tmp_path):
    circuit.save(tmp_path / "c", model=model)
    with pytest.raises(CircuitFileError, match="dtype is 'float64' there and 'float32' here"):
        Circuit.load(tmp_path / "c", model=make_converted("silu", dtype=torch.float32))
    with pytest.raises(CircuitFileError, match="shape"):
        Circuit.load(tmp_path / "c", model=make_converted("silu", d_mlp=12))


def test_damaged_files_are_refused_naming_file_and_key(circuit, tmp_path):
    path = circuit.save(tmp_path / "c")
    tensors = path / "tensors.safetensors"
    blob = tensors.read_bytes()
    tensors.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(CircuitFileError, match="tensors.safetensors.*tensors_sha256"):
        Circuit.load(path)
    tensors.write_bytes(blob)
    text = (path / "circuit.json").read_text()
    (path / "circuit.json").write_text(text[: len(text) // 2])
    with pytest.raises(CircuitFileError, match="circuit.json is not valid JSON"):
        Circuit.load(path)
    record = json.loads(text)
    del record["circuit"]["scores"]["metric_clean"]
    (path / "circuit.json").write_text(json.dumps(record))
    with pytest.raises(CircuitFileError, match="circuit.json: key circuit.metric_clean"):
        Circuit.load(path)
    record = json.loads(text)
    record["circuit"]["graph"]["nodes"] = ["L0H0"]  # a graph the masks do not fit
    (path / "circuit.json").write_text(json.dumps(record))
    with pytest.raises(CircuitFileError, match="does not fit its graph"):
        Circuit.load(path)
    (path / "circuit.json").unlink()
    with pytest.raises(CircuitFileError, match="circuit.json is missing"):
        Circuit.load(path)


def test_what_cannot_be_stored_is_named(circuit, tmp_path):
    import copy

    odd = copy.copy(circuit)
    odd.extra = dict(circuit.extra, callback=print)
    with pytest.raises(TypeError, match=r"circuit.extra\['callback'\] is a builtin_function"):
        odd.save(tmp_path / "c")
