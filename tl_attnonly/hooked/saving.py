"""Saving and loading a converted model: the files :meth:`save_pretrained` writes and
:meth:`load` reads.

:class:`~tl_attnonly.hooked.neuron_head_model.NeuronHeadModelMixin`'s ``save_pretrained`` and
``load`` call :func:`save_model` and :func:`load_model`; the format is described in
``docs/saving.md``.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Protocol, TypeVar

import torch
from transformer_lens import HookedTransformerConfig

from tl_attnonly.activations import NeuronHeadCoefficients
from tl_attnonly.hooked import conversion_record as record
from tl_attnonly.options import ConversionOptions

if TYPE_CHECKING:
    from tl_attnonly.components.factory import NeuronHeadLayer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
CONVERSION_FILE = "conversion.json"
TOKENIZER_DIR = "tokenizer"

# Coefficients of a saved model (``load``): the model is rebuilt from these, not from the
# package's current fits, so a later change to the fits cannot change a saved model.
_PENDING_COEFFICIENTS: contextvars.ContextVar[NeuronHeadCoefficients | None] = (
    contextvars.ContextVar("tl_attnonly_pending_coefficients", default=None)
)


class SavableModel(Protocol):
    """What :func:`save_model` and :func:`load_model` use of a converted model: a
    :class:`~tl_attnonly.hooked.neuron_head_model.NeuronHeadModelMixin` subclass, named by this
    protocol rather than imported (that module imports this one)."""

    cfg: HookedTransformerConfig
    conversion: ConversionOptions
    tokenizer: Any

    def __init__(
        self,
        cfg: HookedTransformerConfig,
        tokenizer: Any = None,
        move_to_device: bool = True,
        *,
        conversion: ConversionOptions | None = None,
    ) -> None: ...
    @property
    def neuron_heads(self) -> Sequence[NeuronHeadLayer]: ...
    @property
    def coefficients(self) -> NeuronHeadCoefficients | None: ...
    def state_dict(self) -> Mapping[str, torch.Tensor]: ...
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any: ...
    def to(
        self, device_or_dtype: torch.device | str | torch.dtype, print_details: bool = True
    ) -> Any: ...


M = TypeVar("M", bound=SavableModel)


@contextlib.contextmanager
def pending_coefficients(coefficients: NeuronHeadCoefficients | None) -> Iterator[None]:
    """Make models constructed inside the block use ``coefficients`` (``None``: their options')."""
    token = _PENDING_COEFFICIENTS.set(coefficients)
    try:
        yield
    finally:
        _PENDING_COEFFICIENTS.reset(token)


def get_pending_coefficients() -> NeuronHeadCoefficients | None:
    """The coefficients set by the innermost :func:`pending_coefficients` block, if any."""
    return _PENDING_COEFFICIENTS.get()


def save_model(model: SavableModel, directory: str | Path) -> Path:
    """:meth:`~tl_attnonly.hooked.neuron_head_model.NeuronHeadModelMixin.save_pretrained`'s work."""
    from safetensors.torch import save_file

    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"Cannot save to {directory}: it is not a directory.")
    if len({mlp.coefficients for mlp in model.neuron_heads}) > 1:
        raise ValueError(
            "Cannot save a model whose layers use different neuron-head coefficients: "
            f"{CONVERSION_FILE} records one set for all layers. Give every layer the same."
        )
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.saving-", dir=directory.parent))
    tmp.chmod(_directory_mode(directory))  # mkdtemp's is 0o700
    try:
        config = _config_to_json(model.cfg)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        state = {
            k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()
        }
        save_file(state, str(tmp / WEIGHTS_FILE))
        package = None if model.coefficients is None else model.conversion.coefficients(
            model.cfg.act_fn
        )
        conversion: dict[str, Any] = {
            "format_version": record.FORMAT_VERSION,
            "model_class": type(model).__name__,
            "options": model.conversion.to_dict(),
            "coefficients": record.coefficients_record(model.coefficients, package),
            "tl_attnonly_version": _version(),
        }
        conversion["checksums"] = record.checksums(config, tmp / WEIGHTS_FILE, conversion)
        (tmp / CONVERSION_FILE).write_text(json.dumps(conversion, indent=2))
        if model.tokenizer is not None:
            model.tokenizer.save_pretrained(str(tmp / TOKENIZER_DIR))
        _replace_directory(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def load_model(
    cls: type[M], directory: str | Path, device: str | torch.device | None = None
) -> M:
    """:meth:`~tl_attnonly.hooked.neuron_head_model.NeuronHeadModelMixin.load`'s work, for
    ``cls``."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if not (directory / CONFIG_FILE).exists():
        raise FileNotFoundError(
            f"No {CONFIG_FILE} in {directory}: expected a directory written by "
            f"{cls.__name__}.save_pretrained()."
        )
    if not (directory / CONVERSION_FILE).is_file():
        raise FileNotFoundError(
            f"No {CONVERSION_FILE} in {directory}: expected a directory written by "
            f"{cls.__name__}.save_pretrained() (a plain TransformerLens model has none)."
        )
    saved_config = record.read_json(directory / CONFIG_FILE)
    if not isinstance(saved_config, dict):
        raise record.SavedModelError(
            f"{directory / CONFIG_FILE}: expected a JSON object. Save the model again."
        )
    conversion = record.read_json(directory / CONVERSION_FILE)
    version = record.validate_record(conversion, directory / CONVERSION_FILE)
    cfg_dict = _config_from_json(saved_config)
    saved_class = conversion["model_class"]
    if saved_class != cls.__name__:
        raise TypeError(
            f"{directory} holds a {saved_class}, not a {cls.__name__}: load it with "
            f"{saved_class}.load()."
        )
    try:
        options = ConversionOptions.from_dict(conversion["options"])
    except ValueError as err:
        raise record.SavedModelError(
            f"{directory / CONVERSION_FILE}: options: {err}"
        ) from None
    coefficients = None
    if conversion["coefficients"] is not None:
        try:
            coefficients = record.saved_coefficients(conversion["coefficients"])
        except ValueError as err:
            raise record.SavedModelError(
                f"{directory / CONVERSION_FILE}: coefficients: {err}"
            ) from None
        custom = conversion["coefficients"].get("custom", False)
        _check_saved_coefficients(
            cfg_dict.get("act_fn"), options, coefficients, directory, custom=custom
        )
        record.check_coefficients(
            conversion["coefficients"],
            coefficients,
            None if custom else options.coefficients(cfg_dict.get("act_fn")),
            conversion,
            directory / CONVERSION_FILE,
        )
    if version == 1:
        record.warn_unversioned(directory / CONVERSION_FILE)
    else:
        record.verify_checksums(conversion, saved_config, directory / WEIGHTS_FILE, directory)
    tokenizer = None
    if (directory / TOKENIZER_DIR).exists():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(directory / TOKENIZER_DIR))
    else:
        cfg_dict["tokenizer_name"] = None  # nothing saved: never reach for the hub
    init_weights = cfg_dict.get("init_weights", True)
    cfg_dict["init_weights"] = False
    if device is None:
        device = cfg_dict.get("device") or "cpu"
        if not _device_available(device):
            device = "cpu"
    cfg_dict["device"] = str(device)
    cfg_dict["n_devices"] = _usable_n_devices(device, cfg_dict.get("n_devices", 1), directory)
    # A config with a seed reseeds the global RNGs when constructed; loading must not.
    seed = cfg_dict.pop("seed", None)
    cfg = HookedTransformerConfig.from_dict(cfg_dict)
    cfg.seed = seed
    with pending_coefficients(coefficients):
        model = cls(cfg, tokenizer, move_to_device=False, conversion=options)
    model.cfg.init_weights = init_weights
    model.load_state_dict(load_file(str(directory / WEIGHTS_FILE)), strict=True)
    if model.cfg.n_devices > 1:  # TransformerLens's own split, as its from_pretrained does
        model.move_model_modules_to_device()  # type: ignore[attr-defined]
        return model
    return model.to(device, print_details=False)


def _check_saved_coefficients(
    act_fn: str | None,
    options: ConversionOptions,
    saved: NeuronHeadCoefficients,
    directory: Path,
    custom: bool = False,
) -> None:
    """Refuse a saved model whose config, options and coefficients contradict each other.

    The model is rebuilt from ``saved``; the config and options must describe the same
    activation, method and number of heads (an edited ``config.json`` must not load silently as
    another model). Whether the values are the package's own (or declared custom and accurate
    as recorded) is :func:`tl_attnonly.hooked.conversion_record.check_coefficients`'s check.
    """
    if saved.activation != act_fn:
        raise ValueError(
            f"{directory}: {CONFIG_FILE} says act_fn={act_fn!r}, but the neuron-head coefficients "
            f"in {CONVERSION_FILE} were made for {saved.activation!r}. The files contradict each "
            f"other; restore act_fn={saved.activation!r} or save the model again."
        )
    if custom:  # the user's own: checked numerically against the activation instead
        return
    expected = options.coefficients(act_fn)
    for name in ("method", "n_heads", "relu_k"):
        if getattr(expected, name) != getattr(saved, name):
            raise ValueError(
                f"{directory}: the options in {CONVERSION_FILE} give {name}="
                f"{getattr(expected, name)!r}, but its saved coefficients have {name}="
                f"{getattr(saved, name)!r}. The file was edited or is corrupt; save the model "
                "again."
            )


def _replace_directory(new: Path, target: Path) -> None:
    """Make ``new`` (a complete save) be ``target``, by renames; foreign files of ``target`` stay.

    ``target`` never holds a mix of two saves: the old directory is renamed aside, ``new`` is
    renamed into place, then files that :meth:`save_pretrained` does not write are moved from
    the old directory into the new one and the old one is deleted.
    """
    if not target.exists():
        os.replace(new, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.replace(target, old / "save")
    try:
        os.replace(new, target)
    except BaseException:
        os.replace(old / "save", target)
        raise
    ours = {CONFIG_FILE, CONVERSION_FILE, WEIGHTS_FILE, TOKENIZER_DIR}
    for entry in (old / "save").iterdir():
        if entry.name not in ours:
            os.replace(entry, target / entry.name)
    shutil.rmtree(old, ignore_errors=True)


def _directory_mode(directory: Path) -> int:
    """``directory``'s permissions if it exists, else those ``mkdir`` would give it."""
    if directory.exists():
        return directory.stat().st_mode & 0o7777
    umask = os.umask(0)
    os.umask(umask)
    return 0o777 & ~umask


def _version() -> str:
    from tl_attnonly._version import __version__

    return __version__


def _usable_n_devices(device: str | torch.device, saved: int, directory: Path) -> int:
    """The saved ``n_devices`` where the target can hold it, else 1 (a warning says so on CUDA).

    TransformerLens splits layers over devices only on CUDA; elsewhere ``n_devices`` means
    nothing, and its config refuses more CUDA devices than exist.
    """
    if saved <= 1 or torch.device(device).type != "cuda":
        return 1
    available = torch.cuda.device_count()
    if available < saved:
        warnings.warn(
            f"{directory} was saved split over n_devices={saved}, but only {available} CUDA "
            "device(s) exist: loading onto one. Set model.cfg.n_devices and call "
            "model.move_model_modules_to_device() to split it again.",
            RuntimeWarning,
            stacklevel=4,
        )
        return 1
    return saved


def _device_available(device: str) -> bool:
    kind = str(device).split(":")[0]
    if kind == "cuda":
        return torch.cuda.is_available()
    if kind == "mps":
        return torch.backends.mps.is_available()
    return True


def _config_to_json(cfg: HookedTransformerConfig) -> dict[str, Any]:
    """The config's constructor arguments as JSON (dtypes and devices as strings)."""
    out: dict[str, Any] = {}
    for field in dataclasses.fields(cfg):
        if not field.init:
            continue
        value = getattr(cfg, field.name)
        if isinstance(value, torch.dtype):
            value = {"__dtype__": str(value).removeprefix("torch.")}
        elif isinstance(value, torch.device):
            value = str(value)
        else:
            value = copy.deepcopy(value)
        try:
            json.dumps(value)
        except TypeError as err:
            raise TypeError(
                f"Cannot save config field {field.name}={value!r}: it is not JSON-serialisable."
            ) from err
        out[field.name] = value
    return out


def _config_from_json(d: dict[str, Any]) -> dict[str, Any]:
    return {
        k: getattr(torch, v["__dtype__"]) if isinstance(v, dict) and "__dtype__" in v else v
        for k, v in d.items()
    }


__all__ = [
    "CONFIG_FILE",
    "CONVERSION_FILE",
    "SavableModel",
    "TOKENIZER_DIR",
    "WEIGHTS_FILE",
    "get_pending_coefficients",
    "load_model",
    "pending_coefficients",
    "save_model",
]
