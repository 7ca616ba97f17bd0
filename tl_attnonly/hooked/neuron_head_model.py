"""What the attention-only decoder and encoder share: neuron-head state, dtype checks, save/load.

:class:`~tl_attnonly.AttnOnlyTransformer` (a ``HookedTransformer``) and
:class:`~tl_attnonly.hooked.encoder.AttnOnlyEncoder` (a ``HookedEncoder``) differ only in their
TransformerLens base class; everything about their neuron-heads lives here, once.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, TypeVar, cast

import torch
from transformer_lens import HookedRootModule, HookedTransformerConfig

from tl_attnonly._compat import TypedModuleList, put_tensor
from tl_attnonly.components.factory import NeuronHeadLayer, neuron_heads_for
from tl_attnonly.hooked.saving import (
    CONFIG_FILE,
    CONVERSION_FILE,
    TOKENIZER_DIR,
    WEIGHTS_FILE,
    get_pending_coefficients,
    load_model,
    save_model,
)
from tl_attnonly.options import ConversionOptions, check_convertible, overflow_warning

# Options for models that TransformerLens itself constructs (``from_pretrained``): TL calls
# ``cls(cfg, tokenizer, move_to_device=False)``, so the options travel beside the call.
_PENDING_OPTIONS: contextvars.ContextVar[ConversionOptions | None] = contextvars.ContextVar(
    "tl_attnonly_pending_options", default=None
)

M = TypeVar("M", bound="NeuronHeadModelMixin")


@contextlib.contextmanager
def pending_options(options: ConversionOptions) -> Iterator[None]:
    """Make ``options`` the default of models constructed inside the block (``from_pretrained``)."""
    token = _PENDING_OPTIONS.set(options)
    try:
        yield
    finally:
        _PENDING_OPTIONS.reset(token)


def resolve_options(cfg: HookedTransformerConfig, conversion: ConversionOptions | None):
    """The options to build with (given, pending, or default), checked against ``cfg``."""
    if conversion is None:
        conversion = _PENDING_OPTIONS.get() or ConversionOptions()
    check_convertible(cfg, conversion, form="structured")
    return conversion


if TYPE_CHECKING:  # what the mixin is mixed into, for the type checker
    _MixedInto = HookedRootModule
else:
    _MixedInto = object


class NeuronHeadModelMixin(_MixedInto):
    """Neuron-head state and persistence for a TransformerLens model whose MLPs are neuron-heads.

    Mixed in before the TransformerLens base class (``class M(NeuronHeadModelMixin, HookedX)``).
    At run time it derives from ``object``; for the type checker from ``HookedRootModule``, with
    the attributes below, which the TransformerLens base class provides.
    """

    conversion: ConversionOptions
    if TYPE_CHECKING:
        cfg: HookedTransformerConfig
        blocks: TypedModuleList[Any]  # of TransformerBlock (decoder) or BertBlock (encoder)
        tokenizer: Any
        W_E: torch.Tensor

        def __init__(
            self,
            cfg: HookedTransformerConfig | dict[str, Any],
            tokenizer: Any = None,
            move_to_device: bool = True,
            **kwargs: Any,
        ) -> None: ...

    def _install_neuron_heads(self, conversion: ConversionOptions) -> None:
        """Replace every ``blocks[l].mlp`` by its neuron-head form with the same weights.

        TL's ``MLP`` becomes a :class:`~tl_attnonly.components.NeuronHeadMLP`, ``GatedMLP`` a
        :class:`~tl_attnonly.components.GatedNeuronHeadMLP`, ``MoE`` a
        :class:`~tl_attnonly.components.NeuronHeadMoE` (see
        :func:`~tl_attnonly.components.neuron_heads_for`).
        """
        self.conversion = conversion
        if self.cfg.attn_only:  # no MLPs: zero neuron-heads, the model as TL builds it
            return
        coefficients = get_pending_coefficients() or conversion.coefficients(self.cfg.act_fn)
        for block in self.blocks:
            mlp = block.mlp
            with torch.device("meta"):  # no memory: the MLP's own tensors are put in place
                neuron_heads = neuron_heads_for(mlp, coefficients)
            neuron_heads.fused = conversion.fused
            neuron_heads.compiled = conversion.compiled
            # TransformerLens's initialisation (or loaded weights) of the MLP, on its device: the
            # same tensors, not copies, so building the model holds each weight once. (Only a
            # tensor TL builds in another dtype than cfg.dtype, MoE's float32 layers, is cast.)
            dtypes = {name: p.dtype for name, p in neuron_heads.named_parameters()}
            share_tensors(neuron_heads, mlp, fix=_INSTALL_FIX)
            for name, param in list(neuron_heads.named_parameters()):
                if param.dtype != dtypes[name]:
                    cast_param = torch.nn.Parameter(
                        param.detach().to(dtypes[name]), requires_grad=param.requires_grad
                    )
                    put_tensor(neuron_heads, name, cast_param)
            block.mlp = neuron_heads

    @classmethod
    def _converted_copy(
        cls: type[M], model: Any, options: ConversionOptions, share_weights: bool = False
    ) -> M:
        """A converted copy of a TransformerLens ``model`` (which is left untouched).

        The copy is built on the meta device (no memory), then every parameter and buffer is put
        in place: a copy of ``model``'s (default) or, with ``share_weights``, ``model``'s own
        tensor. Either way each tensor keeps its device, dtype and ``requires_grad``, so a model
        that TransformerLens split over several devices (``cfg.n_devices > 1``) converts to one
        split the same way, and converting holds at most one copy of the weights.
        """
        cfg = copy.deepcopy(model.cfg)
        init_weights = cfg.init_weights
        cfg.init_weights = False  # the weights are put in place below; no random initialisation
        with torch.device("meta"):
            converted = cls(cfg, model.tokenizer, move_to_device=False, conversion=options)
        converted.cfg.init_weights = init_weights
        share_tensors(
            converted, model, _SHARE_FIX if share_weights else _INSTALL_FIX, clone=not share_weights
        )
        converted.train(model.training)
        return converted

    # ------------------------------------------------------------------ neuron-head state
    @property
    def neuron_heads(self) -> list[NeuronHeadLayer]:
        """The neuron-head module of every layer (``blocks[l].mlp``); empty if ``attn_only``."""
        if self.cfg.attn_only:
            return []
        return [cast(NeuronHeadLayer, block.mlp) for block in self.blocks]

    @property
    def n_heads_per_neuron(self) -> int:
        """Heads per MLP neuron (K); 0 for an attention-only config (no neurons)."""
        return self.neuron_heads[0].n_heads_per_neuron if self.neuron_heads else 0

    @property
    def n_neuron_heads(self) -> int:
        """Neuron-heads per layer: ``d_mlp * K``; 0 for an attention-only config."""
        return self.neuron_heads[0].n_neuron_heads if self.neuron_heads else 0

    def set_use_neuron_result(self, use_neuron_result: bool) -> None:
        """Compute and hook per-neuron-head results ``[batch, pos, n_neuron_heads, d_model]``.

        Like TL's ``set_use_attn_result``, but for neuron-heads, and off by default: the tensor is
        ``d_mlp * K`` times larger than the residual stream.
        """
        for mlp in self.neuron_heads:
            mlp.use_neuron_result = use_neuron_result

    @property
    def coefficients(self):
        """The :class:`~tl_attnonly.activations.NeuronHeadCoefficients` every neuron uses.

        ``None`` for an attention-only config (``attn_only=True``: no neurons).
        """
        return self.neuron_heads[0].coefficients if self.neuron_heads else None

    def check_hooks_to_add(
        self, hook_point, hook_point_name, hook, dir="fwd", is_permanent=False, prepend=False
    ) -> None:
        if ".mlp." in hook_point_name and hook_point_name.endswith("hook_result"):
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

    def run_with_cache(self, *model_args: Any, derive: bool = True, **kwargs: Any):
        """TransformerLens's ``run_with_cache``, returning a
        :class:`~tl_attnonly.hooked.derived_cache.NeuronHeadActivationCache`.

        Neuron-head entries (``q, k, v, attn_scores, pattern, z``) that no hook touched in the
        run are derived from ``hook_pre`` when first read, bit for bit what a stored cache holds,
        so the run takes the fused path and the cache holds about what the original model's
        does. Entries of layers whose neuron-head hooks had hooks attached are stored as edited.
        ``cache["pattern", l, "mlp"]`` reaches the neuron-heads.

        Args:
            *model_args: Forward-pass arguments.
            derive: ``False``: store every entry (TransformerLens's behaviour).
            **kwargs: As for TransformerLens's ``run_with_cache`` (``names_filter``, ``device``,
                ``remove_batch_dim``, ``incl_bwd``, ``pos_slice``, ``return_cache_object``,
                ``reset_hooks_end``, ``clear_contexts``) and the forward pass
                (``start_at_layer``, ``stop_at_layer``, ``tokens``, ``return_type``, ...), with
                TransformerLens's keys and values (``tests/test_cache_contract.py``).
        """
        from tl_attnonly.hooked.derived_cache import run_with_derived_cache

        return run_with_derived_cache(
            self,
            super().run_with_cache,
            model_args,
            derive=derive,
            **kwargs,
        )

    # ------------------------------------------------------------------ dtype / device
    def to(  # type: ignore[override]
        self,
        device_or_dtype: torch.device | str | torch.dtype,
        print_details: bool = True,
    ):
        out = super().to(device_or_dtype, print_details=print_details)  # type: ignore[call-overload]
        if isinstance(device_or_dtype, torch.dtype):
            self._warn_if_overflows(device_or_dtype)
        return out

    def _warn_if_overflows(self, dtype: torch.dtype) -> None:
        if self.coefficients is None:
            return
        message = overflow_warning(self.coefficients, dtype)
        if message is not None:
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------------ save / load
    def save_pretrained(self, directory: str | Path) -> Path:
        """Write config, weights (safetensors), conversion options and tokenizer to ``directory``.

        :meth:`load` rebuilds the model exactly; no hub access is needed. Everything is written
        to a temporary directory beside ``directory`` first, which then replaces it: a failed
        save leaves an earlier save untouched, and a new save never keeps files of an old one
        (a model without a tokenizer drops the old ``tokenizer/``). Files in ``directory`` that
        :meth:`save_pretrained` does not write are kept.

        Returns:
            The directory.
        """
        return save_model(self, directory)

    @classmethod
    def load(cls: type[M], directory: str | Path, device: str | torch.device | None = None) -> M:
        """Load a model written by :meth:`save_pretrained`, offline.

        Args:
            directory: The directory :meth:`save_pretrained` wrote.
            device: Where to put the model; default: the saved config's device if available,
                else CPU. A model saved with ``cfg.n_devices > 1`` is split again by
                TransformerLens's ``move_model_modules_to_device`` when ``device`` is CUDA and
                that many CUDA devices exist; otherwise it loads onto one device.

        Raises:
            FileNotFoundError: No ``config.json`` or ``conversion.json`` in ``directory``.
            tl_attnonly.hooked.conversion_record.SavedModelError: (a ``ValueError``) A file
                that is not JSON (naming the line), a ``conversion.json`` with an unknown,
                missing or mistyped key (naming it), coefficients that are neither the package's
                own nor declared custom and accurate as recorded, or a file changed after the
                save (its checksum). See ``docs/saving.md``.
        """
        return load_model(cls, directory, device)


_SHARE_FIX = "Convert without share_weights=True (copies the weights)."
UNCONVERT_FIX = (
    "The converted model's tensors no longer match TransformerLens's original class; please "
    "report this with the model's config."
)
_INSTALL_FIX = (
    "The TransformerLens MLP class and its neuron-head replacement disagree; please report this "
    "with the model's config."
)


def share_tensors(
    converted: torch.nn.Module, model: torch.nn.Module, fix: str = _SHARE_FIX, clone: bool = False
) -> None:
    """Make every parameter and buffer of ``converted`` the same tensor as ``model``'s (or, with
    ``clone``, a copy of it).

    Each tensor stays where it is (device, dtype, ``requires_grad``): a model split over devices
    stays split the same way.

    Raises:
        ValueError: If the two modules' tensors do not have the same names (``fix`` says what to
            do).
    """
    expected = dict(converted.named_parameters()).keys() | dict(converted.named_buffers()).keys()
    given = dict(model.named_parameters()).keys() | dict(model.named_buffers()).keys()
    if expected != given:
        raise ValueError(
            "Cannot put the original's tensors in place: the new model's tensors "
            f"{sorted(expected ^ given)[:5]} do not match the original's. {fix}"
        )
    for buffer, tensors in ((False, model.named_parameters()), (True, model.named_buffers())):
        for name, tensor in tensors:
            if clone:
                copied = tensor.detach().clone()
                if isinstance(tensor, torch.nn.Parameter):
                    copied = torch.nn.Parameter(copied, requires_grad=tensor.requires_grad)
                tensor = copied
            put_tensor(converted, name, tensor, buffer=buffer)
    # Meta tensors left that the original does not have as meta (a model built on the meta
    # device, as the share_weights path builds it, hands its meta tensors on).
    source = {**model.state_dict(keep_vars=True), **dict(model.named_buffers())}
    left = [
        name
        for name, t in [*converted.state_dict(keep_vars=True).items(), *converted.named_buffers()]
        if t.is_meta and not (name in source and source[name].is_meta)
    ]
    if left:
        raise ValueError(
            f"Cannot put the original's tensors in place: {left[:5]} have no counterpart in the "
            f"original model. {fix}"
        )


__all__ = [
    "CONFIG_FILE",
    "CONVERSION_FILE",
    "TOKENIZER_DIR",
    "WEIGHTS_FILE",
    "NeuronHeadModelMixin",
    "pending_options",
    "resolve_options",
]
