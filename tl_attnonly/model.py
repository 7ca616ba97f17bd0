"""The attention-only :class:`~transformer_lens.HookedTransformer` (Theorem 6, structured form).

Huben & Morris (2023), Theorem 6: applying Theorem 3 to every MLP layer turns an MLP-and-attention
transformer into an attention-only one. :class:`AttnOnlyTransformer` does exactly that inside
TransformerLens: every ``blocks[l].mlp`` is a :class:`~tl_attnonly.components.NeuronHeadMLP`,
everything else is TransformerLens's own code. Its constructor takes a config exactly like
``HookedTransformer(cfg)``, so TransformerLens's ``from_pretrained``, weight processing and tooling
apply unchanged.
"""

from __future__ import annotations

import contextvars
import copy
import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch
from transformer_lens import HookedTransformer
from transformer_lens.config.hooked_transformer_config import HookedTransformerConfig

from tl_attnonly.components.neuron_heads import NeuronHeadMLP
from tl_attnonly.options import ConversionOptions, check_convertible, overflow_warning

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
CONVERSION_FILE = "conversion.json"
TOKENIZER_DIR = "tokenizer"

# Options for models that TransformerLens itself constructs (``from_pretrained``): TL calls
# ``cls(cfg, tokenizer, move_to_device=False)``, so the options travel beside the call.
_PENDING_OPTIONS: contextvars.ContextVar[Optional[ConversionOptions]] = contextvars.ContextVar(
    "tl_attnonly_pending_options", default=None
)


class AttnOnlyTransformer(HookedTransformer):
    """A :class:`~transformer_lens.HookedTransformer` whose MLP neurons are attention heads.

    Each ``blocks[l].mlp`` is a :class:`~tl_attnonly.components.NeuronHeadMLP`: every neuron is
    ``K`` attention heads of internal dimension 1 that attend to the token itself and to a bias
    token (``K = 1`` for SiLU and ReLU). Weights keep TransformerLens's names
    (``W_in, b_in, W_out, b_out``); the heads' ``W_Q, W_K, W_V, W_O`` are derived from them.

    Usually built with :func:`tl_attnonly.convert` or :meth:`from_pretrained`; constructing it
    from a config gives a randomly initialised model, like ``HookedTransformer(cfg)``.

    Args:
        cfg: The model config (unchanged by the conversion: ``act_fn`` stays what it was).
        tokenizer: As for :class:`~transformer_lens.HookedTransformer`.
        move_to_device: As for :class:`~transformer_lens.HookedTransformer`.
        default_padding_side: As for :class:`~transformer_lens.HookedTransformer`.
        conversion: How neurons become heads; default :class:`ConversionOptions()`.

    Raises:
        ValueError, NotImplementedError: Before anything is built, for a model that cannot be
            converted (see :func:`tl_attnonly.options.check_convertible`).
    """

    conversion: ConversionOptions

    def __init__(
        self,
        cfg: Union[HookedTransformerConfig, dict],
        tokenizer: Any = None,
        move_to_device: bool = True,
        default_padding_side: Optional[Literal["left", "right"]] = None,
        conversion: Optional[ConversionOptions] = None,
    ):
        cfg = HookedTransformerConfig.unwrap(cfg)
        if conversion is None:
            conversion = _PENDING_OPTIONS.get() or ConversionOptions()
        check_convertible(cfg, conversion)
        super().__init__(
            cfg,
            tokenizer=tokenizer,
            move_to_device=False,
            default_padding_side=default_padding_side,
        )
        self.conversion = conversion
        coefficients = conversion.coefficients(self.cfg.act_fn)
        for block in self.blocks:
            neuron_heads = NeuronHeadMLP(self.cfg, coefficients)
            neuron_heads.fused = conversion.fused
            # Keep TransformerLens's initialisation of the MLP weights.
            neuron_heads.load_state_dict(block.mlp.state_dict())
            block.mlp = neuron_heads
        if move_to_device:
            self.move_model_modules_to_device()
        self.setup()
        self._warn_if_overflows(self.cfg.dtype)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(  # type: ignore[override]
        cls,
        model_name: str,
        *,
        conversion: Optional[ConversionOptions] = None,
        n_heads_per_neuron: Optional[int] = None,
        relu_k: Optional[float] = None,
        gelu_method: Optional[str] = None,
        **tl_kwargs: Any,
    ) -> AttnOnlyTransformer:
        """Load a model with TransformerLens, then convert it.

        TransformerLens builds this class directly and loads (and processes: ``fold_ln``,
        ``center_writing_weights``, ...) the weights into it; no second copy is made.

        Args:
            model_name: Any name ``HookedTransformer.from_pretrained`` accepts.
            conversion: Conversion options; or give them one by one:
            n_heads_per_neuron: See :class:`ConversionOptions`.
            relu_k: See :class:`ConversionOptions`.
            gelu_method: See :class:`ConversionOptions`.
            **tl_kwargs: Passed to ``HookedTransformer.from_pretrained`` (``fold_ln``,
                ``device``, ``dtype``, ...).
        """
        options = _options(conversion, n_heads_per_neuron, relu_k, gelu_method)
        token = _PENDING_OPTIONS.set(options)
        try:
            return super().from_pretrained(model_name, **tl_kwargs)
        finally:
            _PENDING_OPTIONS.reset(token)

    # ------------------------------------------------------------------ neuron-head state
    @property
    def neuron_heads(self) -> list[NeuronHeadMLP]:
        """The neuron-head module of every layer (``blocks[l].mlp``)."""
        return [block.mlp for block in self.blocks]  # type: ignore[misc]

    @property
    def n_heads_per_neuron(self) -> int:
        """Heads per MLP neuron (K)."""
        return self.neuron_heads[0].n_heads_per_neuron

    @property
    def n_neuron_heads(self) -> int:
        """Neuron-heads per layer: ``d_mlp * K``."""
        return self.neuron_heads[0].n_neuron_heads

    def set_use_neuron_result(self, use_neuron_result: bool) -> None:
        """Compute and hook per-neuron-head results ``[batch, pos, n_neuron_heads, d_model]``.

        Like TL's ``set_use_attn_result``, but for neuron-heads, and off by default: the tensor is
        ``d_mlp * K`` times larger than the residual stream.
        """
        for mlp in self.neuron_heads:
            mlp.use_neuron_result = use_neuron_result

    @property
    def coefficients(self):
        """The :class:`~tl_attnonly.activations.NeuronHeadCoefficients` every neuron uses."""
        return self.neuron_heads[0].coefficients

    def check_hooks_to_add(
        self, hook_point, hook_point_name, hook, dir="fwd", is_permanent=False, prepend=False
    ) -> None:
        if hook_point_name.endswith("mlp.hook_result"):
            if not self.neuron_heads[0].use_neuron_result:
                raise ValueError(
                    f"Cannot add hook {hook_point_name}: per-neuron-head results are off. Call "
                    "model.set_use_neuron_result(True) first (memory: batch * pos * "
                    f"{self.n_neuron_heads} * d_model per layer)."
                )
            return
        super().check_hooks_to_add(
            hook_point, hook_point_name, hook, dir=dir, is_permanent=is_permanent, prepend=prepend
        )

    def to_hooked_transformer(self) -> HookedTransformer:
        """The original MLP model back: a plain ``HookedTransformer`` with the same weights.

        The state dicts of both forms are identical, so nothing is lost by converting.
        """
        cfg = copy.deepcopy(self.cfg)
        init_weights, cfg.init_weights = cfg.init_weights, False
        model = HookedTransformer(cfg, self.tokenizer, move_to_device=False)
        model.cfg.init_weights = init_weights
        model.load_state_dict(self.state_dict(), strict=True)
        return model.to(next(self.parameters()).device, print_details=False).train(self.training)

    # ------------------------------------------------------------------ dtype / device
    def to(  # type: ignore[override]
        self,
        device_or_dtype: Union[torch.device, str, torch.dtype],
        print_details: bool = True,
    ):
        out = super().to(device_or_dtype, print_details=print_details)
        if isinstance(device_or_dtype, torch.dtype):
            self._warn_if_overflows(device_or_dtype)
        return out

    def _warn_if_overflows(self, dtype: torch.dtype) -> None:
        message = overflow_warning(self.coefficients, dtype)
        if message is not None:
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------------ save / load
    def save_pretrained(self, directory: Union[str, Path]) -> Path:
        """Write config, weights (safetensors), conversion options and tokenizer to ``directory``.

        :meth:`load` rebuilds the model exactly; no hub access is needed.

        Returns:
            The directory.
        """
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG_FILE).write_text(json.dumps(_config_to_json(self.cfg), indent=2))
        conversion = {
            "options": self.conversion.to_dict(),
            "coefficients": self.coefficients.to_dict(),
            "tl_attnonly_version": _version(),
        }
        (directory / CONVERSION_FILE).write_text(json.dumps(conversion, indent=2))
        state = {k: v.detach().to("cpu").contiguous().clone() for k, v in self.state_dict().items()}
        save_file(state, str(directory / WEIGHTS_FILE))
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(directory / TOKENIZER_DIR))
        return directory

    @classmethod
    def load(
        cls, directory: Union[str, Path], device: Optional[Union[str, torch.device]] = None
    ) -> AttnOnlyTransformer:
        """Load a model written by :meth:`save_pretrained`, offline.

        Args:
            directory: The directory :meth:`save_pretrained` wrote.
            device: Where to put the model; default: the saved config's device if available,
                else CPU.
        """
        from safetensors.torch import load_file

        directory = Path(directory)
        if not (directory / CONFIG_FILE).exists():
            raise FileNotFoundError(
                f"No {CONFIG_FILE} in {directory}: expected a directory written by "
                "AttnOnlyTransformer.save_pretrained()."
            )
        cfg_dict = _config_from_json(json.loads((directory / CONFIG_FILE).read_text()))
        conversion = json.loads((directory / CONVERSION_FILE).read_text())
        options = ConversionOptions.from_dict(conversion["options"])
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
        cfg = HookedTransformerConfig.from_dict(cfg_dict)
        model = cls(cfg, tokenizer, move_to_device=False, conversion=options)
        model.cfg.init_weights = init_weights
        model.load_state_dict(load_file(str(directory / WEIGHTS_FILE)), strict=True)
        return model.to(device, print_details=False)


def _options(
    conversion: Optional[ConversionOptions],
    n_heads_per_neuron: Optional[int],
    relu_k: Optional[float],
    gelu_method: Optional[str],
) -> ConversionOptions:
    """Merge a ConversionOptions with individually given options (the latter win)."""
    options = conversion or ConversionOptions()
    changes: dict[str, Any] = {}
    if n_heads_per_neuron is not None:
        changes["n_heads_per_neuron"] = n_heads_per_neuron
    if relu_k is not None:
        changes["relu_k"] = relu_k
    if gelu_method is not None:
        changes["gelu_method"] = gelu_method
    return dataclasses.replace(options, **changes)


def _version() -> str:
    from tl_attnonly import __version__

    return __version__


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
