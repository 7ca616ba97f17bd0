"""The conversion record (``conversion.json``) of a saved model: written, validated, checked.

:meth:`~tl_attnonly.AttnOnlyTransformer.save_pretrained` writes ``conversion.json`` beside the
config and the weights; :meth:`~tl_attnonly.AttnOnlyTransformer.load` reads it back through
:func:`read_record` and :func:`check_record`, which refuse, with an error naming the file and
what to do:

* a file that is not JSON (naming the line and column);
* a record that does not follow :data:`FORMAT_VERSION`'s schema: unknown, missing or
  misspelt keys and values of the wrong type (naming the key);
* neuron-head coefficients that are not the package's own for the activation and options
  (:func:`tl_attnonly.activations.head_coefficients`), unless the record declares them
  ``"custom": true`` (or the record was saved by another tl_attnonly version, whose fits may
  differ: then a warning); such coefficients are evaluated against the activation on load, and
  their measured max error must match the recorded one (:data:`ERROR_RTOL`, :data:`ERROR_ATOL`);
* files changed after the save: the record holds the SHA-256 of ``config.json`` (its parsed
  content), ``model.safetensors`` (its bytes) and the record itself (without the checksums).

A record written before format 2 (no ``format_version``; ``tl_attnonly`` 0.1.0 before this
change) has no checksums: it still loads, after the schema and coefficient checks, with a
warning that edits to its weights cannot be detected and that saving it again adds them.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import warnings
from pathlib import Path
from typing import Any

from tl_attnonly.activations import FIT_RANGE, NeuronHeadCoefficients

#: The record's format; 1 is the unversioned record of earlier saves (no checksums).
FORMAT_VERSION = 2
#: A custom coefficient set loads if its measured max error (float64, ``|x| <= FIT_RANGE``,
#: 200001 points) is within ``ERROR_RTOL * recorded + ERROR_ATOL`` of the recorded one.
ERROR_RTOL = 1e-6
ERROR_ATOL = 1e-12
CHECKSUM_ALGORITHM = "sha256"

_NUMBER = (int, float)


class SavedModelError(ValueError):
    """A saved model's files are malformed, inconsistent or changed; the message says which
    file, what is wrong and what to do."""


# ------------------------------------------------------------------------------------------------
# reading
# ------------------------------------------------------------------------------------------------
def read_json(path: Path) -> Any:
    """``path`` parsed as JSON; a :class:`SavedModelError` naming the file and line if it is not."""
    text = path.read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise SavedModelError(
            f"{path} is not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}. "
            "Restore the file from the original save, or save the model again with "
            "save_pretrained()."
        ) from None


# ------------------------------------------------------------------------------------------------
# schema
# ------------------------------------------------------------------------------------------------
def _is_number(value: Any) -> bool:
    return isinstance(value, _NUMBER) and not isinstance(value, bool) and math.isfinite(value)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


# key -> (description, predicate); every key is required.
_OPTIONS_SCHEMA: dict[str, tuple[str, Any]] = {
    "n_heads_per_neuron": (
        "an integer or null",
        lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)),
    ),
    "relu_k": ("a number", _is_number),
    "gelu_method": ("a string", lambda v: isinstance(v, str)),
    "fused": ("true or false", lambda v: isinstance(v, bool)),
    "compiled": ("true or false", lambda v: isinstance(v, bool)),
    "clamp": ("one of 'refuse', 'check'", lambda v: v in ("refuse", "check")),
}
#: Option keys a record may lack: added after format 2 was fixed (an older save has none; the
#: option's default applies when it loads).
_OPTIONAL_OPTIONS = frozenset({"clamp"})
_NUMBER_LIST = ("a non-empty list of numbers", lambda v: isinstance(v, list) and v and all(
    _is_number(x) for x in v
))
_COEFFICIENTS_SCHEMA: dict[str, tuple[str, Any]] = {
    "activation": ("a string", lambda v: isinstance(v, str)),
    "method": ("a string", lambda v: isinstance(v, str)),
    "b": _NUMBER_LIST,
    "d": _NUMBER_LIST,
    "f": _NUMBER_LIST,
    "e": _NUMBER_LIST,
    "g": _NUMBER_LIST,
    "relu_k": ("a number or null", lambda v: v is None or _is_number(v)),
}
# Added in format 2.
_COEFFICIENTS_SCHEMA_V2 = {
    **_COEFFICIENTS_SCHEMA,
    "custom": ("true or false", lambda v: isinstance(v, bool)),
    "max_abs_error": ("a number", _is_number),
}
_RECORD_SCHEMA: dict[str, tuple[str, Any]] = {
    "model_class": ("a string", lambda v: isinstance(v, str)),
    "options": ("an object", lambda v: isinstance(v, dict)),
    "coefficients": ("an object or null", lambda v: v is None or isinstance(v, dict)),
    "tl_attnonly_version": ("a string", lambda v: isinstance(v, str)),
}
_RECORD_SCHEMA_V2 = {
    "format_version": ("the integer 2", lambda v: v == FORMAT_VERSION and isinstance(v, int)),
    **_RECORD_SCHEMA,
    "checksums": ("an object", lambda v: isinstance(v, dict)),
}


def _check_keys(
    data: dict[str, Any],
    schema: dict[str, tuple[str, Any]],
    path: Path,
    prefix: str,
    optional: frozenset[str] = frozenset(),
) -> None:
    fix = "Restore the file from the original save, or save the model again with save_pretrained()."
    unknown = sorted(set(data) - set(schema))
    if unknown:
        close = difflib.get_close_matches(unknown[0], [k for k in schema if k not in data], n=1)
        hint = f" (did you mean {prefix}{close[0]!r}?)" if close else ""
        raise SavedModelError(
            f"{path}: unknown key {prefix}{unknown[0]!r}{hint}; the keys are "
            f"{', '.join(prefix + k for k in schema)}. {fix}"
        )
    missing = [k for k in schema if k not in data and k not in optional]
    if missing:
        raise SavedModelError(f"{path}: missing key {prefix}{missing[0]!r}. {fix}")
    for key, (description, ok) in schema.items():
        if key in data and not ok(data[key]):
            raise SavedModelError(
                f"{path}: key {prefix}{key!r} must be {description}, got "
                f"{_type_name(data[key])} {json.dumps(data[key])[:60]}. {fix}"
            )


def validate_record(record: Any, path: Path) -> int:
    """Check ``record`` against the schema of its format; return the format (1 or 2).

    Raises:
        SavedModelError: Naming ``path`` and the first key that is unknown, missing or of the
            wrong type.
    """
    if not isinstance(record, dict):
        raise SavedModelError(
            f"{path}: expected a JSON object, got {_type_name(record)}. Save the model again "
            "with save_pretrained()."
        )
    version = 1 if "format_version" not in record else record["format_version"]
    if version == 1:
        _check_keys(record, _RECORD_SCHEMA, path, "")
        coefficients_schema = _COEFFICIENTS_SCHEMA
    else:
        if version != FORMAT_VERSION:
            raise SavedModelError(
                f"{path}: format_version {json.dumps(version)} is not one this version of "
                f"tl_attnonly reads (1 or {FORMAT_VERSION}); it was saved by tl_attnonly "
                f"{record.get('tl_attnonly_version', '?')}. Load it with that version, or upgrade."
            )
        _check_keys(record, _RECORD_SCHEMA_V2, path, "")
        _check_keys(
            record["checksums"],
            {
                "algorithm": ("the string 'sha256'", lambda v: v == CHECKSUM_ALGORITHM),
                **{name: ("a hex string", _is_hex) for name in _CHECKSUMMED},
            },
            path,
            "checksums.",
        )
        coefficients_schema = _COEFFICIENTS_SCHEMA_V2
    _check_keys(record["options"], _OPTIONS_SCHEMA, path, "options.", _OPTIONAL_OPTIONS)
    if record["coefficients"] is not None:
        _check_keys(record["coefficients"], coefficients_schema, path, "coefficients.")
        lengths = {len(record["coefficients"][k]) for k in "bdfeg"}
        if len(lengths) != 1:
            raise SavedModelError(
                f"{path}: coefficients.b, d, f, e, g must have one entry per head (the same "
                "length). Restore the file from the original save, or save the model again."
            )
    return version


def _is_hex(value: Any) -> bool:
    hexdigits = "0123456789abcdef"
    return isinstance(value, str) and len(value) == 64 and all(c in hexdigits for c in value)


# ------------------------------------------------------------------------------------------------
# checksums
# ------------------------------------------------------------------------------------------------
#: What the checksums cover: the config (parsed), the weights (bytes), the record itself.
_CHECKSUMMED = ("config.json", "model.safetensors", "conversion.json")


def _canonical(data: Any) -> bytes:
    """``data`` as JSON, independent of formatting and key order (as written, then read)."""
    data = json.loads(json.dumps(data))  # tuples -> lists, int keys -> str, as in the file
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def _file_digest(path: Path) -> str:
    digest = hashlib.new(CHECKSUM_ALGORITHM)
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def checksums(config: dict[str, Any], weights: Path, record: dict[str, Any]) -> dict[str, str]:
    """The checksums a format-2 record carries (``record`` without its own ``checksums``)."""
    body = {k: v for k, v in record.items() if k != "checksums"}
    return {
        "algorithm": CHECKSUM_ALGORITHM,
        "config.json": hashlib.sha256(_canonical(config)).hexdigest(),
        "model.safetensors": _file_digest(weights),
        "conversion.json": hashlib.sha256(_canonical(body)).hexdigest(),
    }


def verify_checksums(
    record: dict[str, Any], config: dict[str, Any], weights: Path, directory: Path
) -> None:
    """Refuse files changed since :meth:`save_pretrained` wrote them.

    Raises:
        SavedModelError: Naming the changed file and what to do.
    """
    recorded = record["checksums"]
    actual = checksums(config, weights, record)
    for name in _CHECKSUMMED:
        if actual[name] != recorded[name]:
            raise SavedModelError(
                f"{directory / name} was changed after save_pretrained() wrote it: its SHA-256 "
                f"is not the one recorded in {directory / 'conversion.json'}. Restore the "
                "original file; to change a saved model, load it, change it in Python and call "
                "save_pretrained() again."
            )


# ------------------------------------------------------------------------------------------------
# coefficients
# ------------------------------------------------------------------------------------------------
def coefficients_record(
    coefficients: NeuronHeadCoefficients | None, package: NeuronHeadCoefficients | None
) -> dict[str, Any] | None:
    """What the record holds for ``coefficients``: marked custom unless equal to ``package``."""
    if coefficients is None:
        return None
    return {
        **coefficients.to_dict(),
        "custom": coefficients != package,
        "max_abs_error": coefficients.max_abs_error(FIT_RANGE),
    }


def saved_coefficients(data: dict[str, Any]) -> NeuronHeadCoefficients:
    """The coefficients of a (validated) record's ``coefficients`` entry."""
    return NeuronHeadCoefficients.from_dict(
        {k: v for k, v in data.items() if k not in ("custom", "max_abs_error")}
    )


def check_coefficients(
    data: dict[str, Any],
    saved: NeuronHeadCoefficients,
    package: NeuronHeadCoefficients | None,
    record: dict[str, Any],
    path: Path,
) -> None:
    """Refuse coefficients that are neither the package's own nor declared (and measured) custom.

    Args:
        data: The record's ``coefficients`` entry.
        saved: Those coefficients.
        package: The package's own coefficients for the saved activation and options (not
            needed, ``None``, for custom ones).
        record: The whole record (for its ``tl_attnonly_version``).
        path: The ``conversion.json`` path (for messages).

    Raises:
        SavedModelError: Saying which check failed and what to do.
    """
    from tl_attnonly._version import __version__

    version = record.get("tl_attnonly_version", "?")
    other_version = "format_version" in record and version != __version__
    if data.get("custom", False) or (saved != package and other_version):
        recorded = data["max_abs_error"]
        measured = saved.max_abs_error(FIT_RANGE)
        if not abs(measured - recorded) <= ERROR_RTOL * abs(recorded) + ERROR_ATOL:
            raise SavedModelError(
                f"{path}: the saved neuron-head coefficients do not approximate "
                f"{saved.activation} as recorded: measured max |error| {measured:.6g} on "
                f"|x| <= {FIT_RANGE:g}, recorded {recorded:.6g} (tolerance {ERROR_RTOL:g} "
                f"relative + {ERROR_ATOL:g}). The coefficients were edited; restore the file, or "
                "build the model with your coefficients in Python and call save_pretrained()."
            )
        if not data.get("custom", False):
            warnings.warn(
                f"{path} was saved by tl_attnonly {version}, whose {saved.activation} fit differs "
                f"from this version's ({__version__}): the model is rebuilt with the saved "
                f"coefficients (max |error| {measured:.3g}, as recorded). Convert the original "
                "model again to use this version's fit.",
                UserWarning,
                stacklevel=5,
            )
        return
    if saved != package:
        differing = [
            k
            for k in ("method", "b", "d", "f", "e", "g", "relu_k")
            if getattr(saved, k) != getattr(package, k)
        ]
        raise SavedModelError(
            f"{path}: the neuron-head coefficients ({', '.join(differing)}) are not this "
            f"package's own for {saved.activation} with {saved.n_heads} head(s), and the file "
            "does not declare them custom (coefficients.custom). Restore the file from the "
            "original save; to use your own coefficients, build the model with them in Python "
            "and call save_pretrained(), which records them as custom."
        )


def warn_unversioned(path: Path) -> None:
    """The warning for a format-1 record (no checksums)."""
    warnings.warn(
        f"{path} was written by an earlier tl_attnonly (no format_version): it has no "
        "checksums, so edits to the weights cannot be detected. Save the model again with "
        "model.save_pretrained(directory) to add them.",
        UserWarning,
        stacklevel=4,
    )


__all__ = [
    "CHECKSUM_ALGORITHM",
    "ERROR_ATOL",
    "ERROR_RTOL",
    "FORMAT_VERSION",
    "SavedModelError",
    "check_coefficients",
    "checksums",
    "coefficients_record",
    "read_json",
    "saved_coefficients",
    "validate_record",
    "verify_checksums",
    "warn_unversioned",
]
