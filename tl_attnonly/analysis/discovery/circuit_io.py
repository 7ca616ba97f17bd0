"""Save and load a :class:`~.circuit.Circuit`: JSON for what a person reads, safetensors for the
tensors (:meth:`~.circuit.Circuit.save`, :meth:`~.circuit.Circuit.load`).

A saved circuit is a directory of two files:

* ``circuit.json``: the format and its version, the package, torch and TransformerLens versions,
  the model it was found on (architecture, sizes, dtype: :func:`model_record`), the graph
  (:class:`~.graph.GraphShape`, ``neuron_level``, kept nodes, position classes), the scores'
  method and metrics, every field of the circuit and of its ``extra`` (DataFrames column by
  column with their dtypes, dicts as key/value pairs so that integer keys stay integers, nested
  circuits such as ``extra["coarse"]`` in the same form), the task's tokens where given, and the
  SHA-256 of the tensor file;
* ``tensors.safetensors``: the score and mask blocks and every other tensor, by key.

Floats are written by Python's ``repr`` (exact), tensors as they are: a loaded circuit equals the
saved one bit for bit, and evaluating it gives the same faithfulness. Loading against a model
checks the model's record first and refuses a mismatch, naming the field; a truncated or edited
file is refused, naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.discovery.graph import GraphShape, HeadGraph
from tl_attnonly.analysis.discovery.scored_edges import EdgeScores

FORMAT = "tl-attnonly circuit"
FORMAT_VERSION = 1
JSON_NAME = "circuit.json"
TENSORS_NAME = "tensors.safetensors"


class CircuitFileError(ValueError):
    """A saved circuit that cannot be read as saved (missing, truncated, edited, another
    format), or that does not fit the model it is loaded against."""


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def model_record(model: Any) -> dict[str, Any]:
    """What a saved circuit states of its model: architecture, sizes and dtype (either kind).

    Args:
        model: The converted model (an ``AttnOnlyTransformer`` or a converted bridge).
    """
    adapted = analysis_model(model)
    cfg = adapted.cfg
    shape = GraphShape.of(adapted)
    return {
        "architecture": cfg.original_architecture or type(model).__name__,
        "kind": type(model).__name__,
        "d_model": int(cfg.d_model),
        "d_vocab": int(cfg.d_vocab),
        "dtype": str(cfg.dtype).removeprefix("torch."),
        "shape": _shape_record(shape),
    }


#: The fields of :class:`~.graph.GraphShape` added after the format's first files.
_LATER_FIELDS = ("expert_layers", "latent_attn_layers", "expert_parts", "expert_widths")
#: Of those, the ones a model's record may lack although the model has them (a file saved
#: before the field existed).
_LATER_MODEL_FIELDS = ("expert_parts", "expert_widths")


def _shape_record(shape: GraphShape) -> dict[str, Any]:
    """``shape`` as its JSON reads back; the fields of :data:`_LATER_FIELDS` only where there
    are some (the records of files saved before they existed stay equal)."""
    record = dataclasses.asdict(shape)
    for name in _LATER_FIELDS:
        value = getattr(shape, name)
        if value:
            record[name] = [list(v) if isinstance(v, tuple) else v for v in value]
        else:
            del record[name]
    return record


class _Writer:
    """Encodes values as JSON, tensors by key (``"{prefix}{n}"``)."""

    def __init__(self, circuit_type: type) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.circuit_type = circuit_type

    def tensor(self, value: torch.Tensor) -> dict[str, str]:
        key = f"t{len(self.tensors)}"
        self.tensors[key] = value.detach().cpu().contiguous()
        return {"__tensor__": key}

    def value(self, value: Any, where: str, owner: Any) -> Any:
        if value is owner:
            return {"__self__": True}
        if isinstance(value, torch.Tensor):
            return self.tensor(value)
        if isinstance(value, pd.DataFrame):
            return {"__frame__": self.frame(value, where)}
        if isinstance(value, self.circuit_type):
            return {"__circuit__": self.circuit(value)}
        if isinstance(value, dict):
            return {
                "__dict__": [
                    [self.value(k, where, owner), self.value(v, f"{where}[{k!r}]", owner)]
                    for k, v in value.items()
                ]
            }
        if isinstance(value, (list, tuple)):
            items = [self.value(v, f"{where}[{i}]", owner) for i, v in enumerate(value)]
            return {"__tuple__": items} if isinstance(value, tuple) else items
        if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # numpy scalars
            value = value.item()
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(
            f"{where} is a {type(value).__name__}, which Circuit.save cannot store (it stores "
            "tensors, DataFrames, circuits, dicts, lists, tuples, numbers, strings and None)."
        )

    def frame(self, frame: pd.DataFrame, where: str) -> dict[str, Any]:
        return {
            "index": self.value(frame.index.tolist(), f"{where}.index", None),
            "index_name": frame.index.name,
            "columns": [
                {
                    "name": self.value(col, where, None),
                    "dtype": str(frame[col].dtype),
                    "values": self.value(frame[col].tolist(), f"{where}[{col!r}]", None),
                }
                for col in frame.columns
            ],
        }

    def circuit(self, circuit: Any) -> dict[str, Any]:
        scores: EdgeScores = circuit.scores
        graph = scores.graph
        out: dict[str, Any] = {
            "graph": {
                "shape": dataclasses.asdict(graph.shape),
                "neuron_level": graph.neuron_level,
                "nodes": graph.node_labels() if graph.restricted else None,
                "positions": list(graph.positions) if graph.positions is not None else None,
            },
            "scores": {
                "method": scores.method,
                "metric_clean": scores.metric_clean,
                "metric_corrupted": scores.metric_corrupted,
                "blocks": [[list(k), self.tensor(v)] for k, v in scores.scores.items()],
            },
            "mask": [[list(k), self.tensor(v)] for k, v in circuit.mask.items()],
        }
        for field in dataclasses.fields(circuit):
            if field.name not in ("scores", "mask"):
                where = f"circuit.{field.name}"
                out[field.name] = self.value(getattr(circuit, field.name), where, circuit)
        return out


def save_circuit(
    circuit: Any,
    path: str | Path,
    *,
    model: Any = None,
    clean_tokens: torch.Tensor | None = None,
    corrupted_tokens: torch.Tensor | None = None,
) -> Path:
    """Write ``circuit`` to the directory ``path`` (created; its two files replaced).

    Args:
        circuit: The :class:`~.circuit.Circuit`.
        path: A directory.
        model: The model it was found on, recorded (:func:`model_record`) and checked on load.
        clean_tokens, corrupted_tokens: The task's tokens ``[batch, pos]``, stored with it.

    Returns:
        The directory.
    """
    path = Path(path)
    writer = _Writer(type(circuit))
    body = writer.circuit(circuit)
    tokens = {
        name: writer.tensor(t)
        for name, t in (("clean", clean_tokens), ("corrupted", corrupted_tokens))
        if t is not None
    }
    blob = save_tensors(writer.tensors)
    record = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "versions": {
            "tl_attnonly": _version("tl-attnonly"),
            "torch": torch.__version__,
            "transformer_lens": _version("transformer-lens"),
        },
        "model": None if model is None else model_record(model),
        "tokens": tokens,
        "tensors_sha256": hashlib.sha256(blob).hexdigest(),
        "circuit": body,
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / TENSORS_NAME).write_bytes(blob)
    (path / JSON_NAME).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return path


class _Reader:
    def __init__(self, record: dict, tensors: dict[str, torch.Tensor], file: Path, make):
        self.tensors, self.file, self.make = tensors, file, make

    def need(self, mapping: dict, key: str, where: str) -> Any:
        if not isinstance(mapping, dict) or key not in mapping:
            raise CircuitFileError(f"{self.file}: key {where}.{key} is missing.")
        return mapping[key]

    def tensor(self, ref: dict, where: str) -> torch.Tensor:
        key = self.need(ref, "__tensor__", where)
        if key not in self.tensors:
            raise CircuitFileError(f"{self.file}: tensor {key!r} ({where}) is missing.")
        return self.tensors[key]

    def value(self, value: Any, where: str, owner: list) -> Any:
        if isinstance(value, list):
            return [self.value(v, f"{where}[{i}]", owner) for i, v in enumerate(value)]
        if not isinstance(value, dict):
            return value
        if "__tensor__" in value:
            return self.tensor(value, where)
        if "__self__" in value:
            return _SELF
        if "__tuple__" in value:
            return tuple(self.value(v, where, owner) for v in value["__tuple__"])
        if "__dict__" in value:
            return {
                self.value(k, where, owner): self.value(v, f"{where}[{k!r}]", owner)
                for k, v in value["__dict__"]
            }
        if "__frame__" in value:
            return self.frame(value["__frame__"], where)
        if "__circuit__" in value:
            return self.circuit(value["__circuit__"], where)
        raise CircuitFileError(f"{self.file}: {where} holds an unknown entry {sorted(value)}.")

    def frame(self, spec: dict, where: str) -> pd.DataFrame:
        columns = self.need(spec, "columns", where)
        data = {}
        for col in columns:
            name = self.value(self.need(col, "name", where), where, [])
            values = self.value(self.need(col, "values", where), where, [])
            data[name] = pd.Series(values, dtype=self.need(col, "dtype", where))
        index = self.value(self.need(spec, "index", where), where, [])
        frame = pd.DataFrame(data, columns=list(data))
        frame.index = pd.Index(index, name=spec.get("index_name"))
        return frame

    def circuit(self, body: dict, where: str) -> Any:
        graph_spec = self.need(body, "graph", where)
        try:
            shape = GraphShape(**self.need(graph_spec, "shape", where))
            graph = HeadGraph(
                shape, neuron_level=self.need(graph_spec, "neuron_level", where),
                nodes=graph_spec.get("nodes"), positions=graph_spec.get("positions"),
            )  # fmt: skip
        except (TypeError, ValueError) as err:
            raise CircuitFileError(f"{self.file}: {where}.graph cannot be rebuilt: {err}") from err
        sc = self.need(body, "scores", where)
        blocks = {tuple(k): self.tensor(v, f"{where}.scores") for k, v in sc["blocks"]}
        mask = {tuple(k): self.tensor(v, f"{where}.mask") for k, v in body["mask"]}
        expected = {(s.key, d.key): (len(s.labels), len(d.labels)) for s, d in graph.blocks()}
        for name, table in (("scores", blocks), ("mask", mask)):
            shapes = {k: tuple(v.shape) for k, v in table.items()}
            if shapes != expected:
                bad = sorted(set(shapes.items()) ^ set(expected.items()))[:2]
                raise CircuitFileError(
                    f"{self.file}: {where}.{name} does not fit its graph (e.g. {bad})."
                )
        scores = EdgeScores(
            graph, blocks, self.need(sc, "metric_clean", where),
            self.need(sc, "metric_corrupted", where), self.need(sc, "method", where),
        )  # fmt: skip
        fields = {
            k: self.value(v, f"{where}.{k}", [])
            for k, v in body.items()
            if k not in ("graph", "scores", "mask")
        }
        circuit = self.make(scores=scores, mask=mask, **fields)
        for key, value in list(circuit.extra.items()):
            if value is _SELF:
                circuit.extra[key] = circuit
        return circuit


_SELF = object()


def load_circuit(path: str | Path, model: Any = None, *, make: Callable[..., Any]) -> Any:
    """Read a circuit :func:`save_circuit` wrote (``make``: the circuit class).

    Args:
        path: The directory.
        model: Check the saved model record against this model (refused on a mismatch);
            None: no check (the graph is rebuilt from the saved shape).
        make: Builds a circuit from its fields.

    Raises:
        CircuitFileError: A missing, truncated or edited file, another format or version, a
            tensor that does not fit its graph, or a model that is not the saved one.
    """
    path = Path(path)
    json_file, tensor_file = path / JSON_NAME, path / TENSORS_NAME
    for file in (json_file, tensor_file):
        if not file.is_file():
            raise CircuitFileError(f"{file} is missing: not a saved circuit (Circuit.save).")
    try:
        record = json.loads(json_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise CircuitFileError(f"{json_file} is not valid JSON (truncated?): {err}") from err
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CircuitFileError(f"{json_file}: key format is not {FORMAT!r}.")
    if record.get("format_version") != FORMAT_VERSION:
        raise CircuitFileError(
            f"{json_file}: key format_version is {record.get('format_version')!r}; this "
            f"tl_attnonly reads version {FORMAT_VERSION}."
        )
    blob = tensor_file.read_bytes()
    if hashlib.sha256(blob).hexdigest() != record.get("tensors_sha256"):
        raise CircuitFileError(
            f"{tensor_file} does not match key tensors_sha256 of {json_file} (truncated or "
            "edited after saving)."
        )
    tensors = load_tensors(blob)
    if model is not None:
        _check_model(record, model, json_file)
    reader = _Reader(record, tensors, json_file, make)
    return reader.circuit(reader.need(record, "circuit", "record"), "circuit")


def saved_record(path: str | Path) -> dict[str, Any]:
    """What a saved circuit states besides the circuit: format, versions, the model's record
    (:func:`model_record`) and the task's tokens (``{"clean": [batch, pos], ...}``, those saved).

    Args:
        path: The directory :func:`save_circuit` wrote.
    """
    path = Path(path)
    record = json.loads((path / JSON_NAME).read_text(encoding="utf-8"))
    tensors = load_tensors((path / TENSORS_NAME).read_bytes())
    tokens = {name: tensors[ref["__tensor__"]] for name, ref in record.get("tokens", {}).items()}
    return {k: v for k, v in record.items() if k != "circuit"} | {"tokens": tokens}


def _check_model(record: dict, model: Any, file: Path) -> None:
    saved = record.get("model")
    if saved is None:
        return
    current = model_record(model)
    for name in _LATER_MODEL_FIELDS:
        if name not in (saved.get("shape") or {}):  # saved before the field existed
            current["shape"].pop(name, None)
    for key in ("architecture", "d_model", "d_vocab", "dtype", "shape"):
        if saved.get(key) != current[key]:
            raise CircuitFileError(
                f"{file} was saved for another model: {key} is {saved.get(key)!r} there and "
                f"{current[key]!r} here. Load it with the model it was found on (or model=None "
                "to read it without a check)."
            )


__all__ = ["CircuitFileError", "load_circuit", "model_record", "save_circuit", "saved_record"]
