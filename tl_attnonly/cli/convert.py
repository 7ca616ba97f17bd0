"""``tl-attnonly convert`` and ``tl-attnonly verify``: load a model (local, saved, or from the
hub), convert it, save it or check it against its original.

``convert`` saves an :class:`~tl_attnonly.AttnOnlyTransformer` (or encoder), which needs
TransformerLens 3.x's ``HookedTransformer``. ``verify`` also checks a ``TransformerBridge``
(``--bridge`` on 3.x; the only kind on 4.x): a bridge converts in place, so the reference is a
second, unconverted bridge of the same weights
(:func:`tl_attnonly.cli.bridge_demo.verify_bridge_conversion`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tl_attnonly.cli.common import (
    CONVERSION_FILE,
    EXIT_FAIL,
    LOCAL_MODELS,
    CommandError,
    Probes,
    print_table,
    print_verdicts,
)


def _offline() -> bool:
    from tl_attnonly.hub import offline_mode

    return offline_mode()


def _local_names() -> str:
    return ", ".join(LOCAL_MODELS)


def _offline_advice(model: str, why: str) -> str:
    """Three lines: what was asked, why the hub cannot be used, what to do offline."""
    why = why.rstrip(".")
    return (
        f"Cannot load {model!r}: it comes from the Hugging Face hub and is not in the cache.\n"
        f"{why[:1].upper() + why[1:]}.\n"
        f"Work offline: a local model by name ({_local_names()}), `tl-attnonly verify DIR` "
        "(a saved conversion), `tl-attnonly demo`; or, with the model in your Hugging Face "
        "cache, set HF_HUB_OFFLINE=1."
    )


def _official_name(name: str) -> str:
    """TransformerLens's official name for ``name`` (or an alias), or a CommandError."""
    import difflib

    from tl_attnonly._compat import make_model_alias_map

    aliases = make_model_alias_map()
    official = aliases.get(name.lower())
    if official is not None:
        return official
    close = difflib.get_close_matches(name.lower(), list(aliases), n=3, cutoff=0.6)
    hint = f" Did you mean {', '.join(repr(aliases[c]) for c in close)}?" if close else ""
    raise CommandError(
        f"{name!r} is not a directory, a local model ({_local_names()}), nor a model name "
        f"TransformerLens knows.{hint} "
        'Names: `python -c "from transformer_lens.supported_models import OFFICIAL_MODEL_NAMES; '
        'print(*OFFICIAL_MODEL_NAMES, sep=chr(10))"`.'
    )


def _require_hub(name: str, probes: Probes) -> None:
    """Fail within about a second when ``name`` needs the hub and the hub does not answer.

    Called before TransformerLens is imported, so that no access is reported at once. A model
    in the local Hugging Face cache (under the name given), or offline mode, skips the probe:
    ``from_pretrained`` then checks the cache under TransformerLens's official name itself.
    """
    from tl_attnonly.hub import in_local_cache

    if _offline() or in_local_cache(name):
        return
    why = probes.hub_unreachable()
    if why is not None:
        raise CommandError(_offline_advice(name, f"the Hugging Face hub is unreachable: {why}"))


def _load_by_name(name: str, loader: Any, **kwargs: Any) -> Any:
    """``loader(official_name, **kwargs)``, failing clearly on an unknown name or a model missing
    from the cache under ``HF_HUB_OFFLINE``. Call :func:`_require_hub` first."""
    from tl_attnonly.hub import HubUnavailableError

    official = _official_name(name)
    try:
        return loader(official, **kwargs)
    except HubUnavailableError as exc:
        raise CommandError(_offline_advice(name, exc.why)) from exc
    except OSError as exc:
        if _offline():
            raise CommandError(
                _offline_advice(name, f"HF_HUB_OFFLINE is set and it is not in the cache ({exc})")
            ) from exc
        raise


def _load_local(name: str) -> Any:
    """The (unconverted) local model ``name`` (a key of :data:`LOCAL_MODELS`), with its
    tokenizer; a CommandError naming the extra if it is not installed."""
    try:
        if name == "smollm2":
            from tl_attnonly.smollm2 import load_smollm2, smollm2_path

            smollm2_path()  # fails fast, naming the extra, before anything heavy
            return load_smollm2()
        if name == "minilm":
            from tl_attnonly.minilm import load_minilm

            model, tokenizer = load_minilm()
            if model.tokenizer is None:
                model.tokenizer = tokenizer
            return model
    except ImportError as err:
        raise CommandError(f"{name}: {err}") from err
    from tl_attnonly.bundled import load_bundled_model

    return load_bundled_model()


def _is_local_name(name: str) -> bool:
    """``name`` is a local model's name, and no directory of that name is meant."""
    return name in LOCAL_MODELS and not Path(name).exists()


def _refuse_saving_a_bridge(probes: Probes) -> None:
    """A CommandError for ``convert`` on TransformerLens 4.x (no HookedTransformer), before
    anything is loaded: what it saves needs HookedTransformer, and a converted bridge holds
    nothing to save beyond the original checkpoint."""
    if not probes.has_hooked_transformer():
        raise CommandError(
            "tl-attnonly convert saves an AttnOnlyTransformer (config, weights, conversion "
            "record), which needs HookedTransformer, and TransformerLens 4.x removed it. On 4.x "
            "a model is converted as a TransformerBridge, in place, over the Hugging Face weights "
            "it wraps: there is nothing to save beyond the original checkpoint, so convert it when "
            "you load it, in Python: tl_attnonly.convert(bridge) (docs/bridge.md). To check the "
            "conversion: `tl-attnonly verify MODEL` (bundled, smollm2, or a model name). To save "
            "a converted model, install transformer-lens>=3,<4."
        )


def convert_cmd(args: argparse.Namespace, probes: Probes | None = None) -> int:
    """Load a model by TransformerLens name, convert it, save it."""
    probes = probes or Probes()
    _refuse_saving_a_bridge(probes)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CommandError(f"OUT_DIR {str(out)!r} exists and is not a directory.")
    options = {
        "n_heads_per_neuron": args.heads_per_neuron,
        "relu_k": args.relu_k,
        "gelu_method": args.gelu_method,
    }
    if _is_local_name(args.model):
        original = _load_local(args.model)
        if args.model == "minilm":
            from tl_attnonly.hooked.encoder import convert_encoder

            model = convert_encoder(original, **options)
        else:
            from tl_attnonly import convert

            model = convert(original, **options)
        path = model.save_pretrained(out)
        print(f"Saved the converted {args.model} to {path}.")
        return 0
    _require_hub(args.model, probes)
    from tl_attnonly import AttnOnlyTransformer

    model = _load_by_name(args.model, AttnOnlyTransformer.from_pretrained, **options)
    path = model.save_pretrained(out)
    print(f"Saved the converted {args.model} to {path}; check it with `tl-attnonly verify {path}`.")
    return 0


# ------------------------------------------------------------------------------------------------
# verify
# ------------------------------------------------------------------------------------------------
def _load_converted_dir(directory: Path, bridge: bool) -> tuple[Any, Any, str]:
    conversion = directory / CONVERSION_FILE
    if not conversion.is_file():
        raise CommandError(
            f"{str(directory)!r} is a directory but not a converted model: it has no "
            f"{CONVERSION_FILE}. `verify` takes a directory written by `tl-attnonly convert` (or "
            "AttnOnlyTransformer.save_pretrained), or a TransformerLens model name. To convert a "
            "model: `tl-attnonly convert NAME OUT_DIR`."
        )
    if bridge:
        raise CommandError(
            f"{str(directory)!r} holds a saved AttnOnlyTransformer; loading it needs "
            "HookedTransformer (TransformerLens 3.x: run `tl-attnonly verify DIR` there, without "
            "--bridge). A TransformerBridge is verified by model: `tl-attnonly verify MODEL` "
            "(bundled, smollm2, or a model name)."
        )
    from tl_attnonly.hooked.conversion_record import SavedModelError, read_json

    try:
        record = read_json(conversion)
    except SavedModelError as exc:
        raise CommandError(str(exc)) from exc
    saved_class = (
        record.get("model_class", "AttnOnlyTransformer")
        if isinstance(record, dict)
        else "AttnOnlyTransformer"  # load() names what is wrong
    )
    if saved_class != "AttnOnlyTransformer":
        raise CommandError(
            f"{str(directory)!r} holds a {saved_class}; `verify` checks decoder models "
            "(AttnOnlyTransformer). Check an encoder with tl_attnonly.verify in Python."
        )
    from tl_attnonly import AttnOnlyTransformer

    try:
        converted = AttnOnlyTransformer.load(directory)
    except SavedModelError as exc:
        raise CommandError(str(exc)) from exc
    original = converted.to_hooked_transformer()
    return original, converted, "the MLP model rebuilt from the saved weights"


def _bridge_loader(name: str, local: bool) -> tuple[Callable[[Any], Any], str]:
    """``(dtype -> unconverted TransformerBridge, what it is)`` for a local model or a
    TransformerLens model name (boots from the hub or the Hugging Face cache; call
    :func:`_require_hub` first)."""
    if local and name == "smollm2":
        from tl_attnonly.smollm2 import (
            SMOLLM2_NAME,
            load_smollm2_hf,
            smollm2_bridge_from_hf,
            smollm2_path,
        )

        try:
            smollm2_path()  # fails fast, naming the extra, before anything heavy
        except ImportError as err:
            raise CommandError(f"{name}: {err}") from err
        hf_model, tokenizer = load_smollm2_hf()  # read once; each bridge wraps a copy
        return (
            lambda dtype: smollm2_bridge_from_hf(hf_model, tokenizer, dtype=dtype),
            f"{SMOLLM2_NAME}, a bridge around the Hugging Face model",
        )
    if local:
        from tl_attnonly.bundled import load_bundled_bridge

        return (lambda dtype: load_bundled_bridge(dtype=dtype)), LOCAL_MODELS[name]
    from tl_attnonly._compat import boot_bridge

    official = _official_name(name)  # an unknown name fails here, before any loading
    return (
        lambda dtype: _load_by_name(official, boot_bridge, dtype=dtype),
        f"{official}, booted with TransformerBridge.boot_transformers",
    )


def _verify_bridge(args: argparse.Namespace, local: bool) -> int:
    """``verify`` of a TransformerBridge: converted in place, against a second, unconverted
    bridge of the same weights, per dtype."""
    from tl_attnonly.bridge import is_converted_bridge
    from tl_attnonly.cli.bridge_demo import verify_bridge_conversion

    load, what = _bridge_loader(args.model, local)
    print(
        f"Verifying the converted {args.model}, {what}, as a TransformerBridge against an "
        "unconverted bridge of the same weights (a bridge converts in place)."
    )
    last: dict[str, Any] = {}

    def load_and_keep(dtype: Any) -> Any:
        last["bridge"] = load(dtype)
        return last["bridge"]

    verdicts = verify_bridge_conversion(load_and_keep, args.prompt, tolerance=args.tolerance)
    converted = last["bridge"]
    if not is_converted_bridge(converted):  # what the neuron-heads are, for the summary
        from tl_attnonly import convert

        converted = convert(converted)
    description, coefs = _describe(converted, converted.to_tokens(args.prompt))
    print(description)
    return _print_verdicts(args, verdicts, coefs)


def verify_cmd(args: argparse.Namespace, probes: Probes | None = None) -> int:
    """Compare a converted model against its original (a TL model name or a saved directory)."""
    probes = probes or Probes()
    bridge = bool(getattr(args, "bridge", False)) or not probes.has_hooked_transformer()
    target = Path(args.model).expanduser()
    looks_like_path = args.model.startswith((".", "/", "~", os.sep)) or args.model.endswith("/")
    if looks_like_path and not target.exists():
        raise CommandError(
            f"No such directory: {args.model!r}. `verify` takes a directory written by "
            "`tl-attnonly convert NAME OUT_DIR`, or a TransformerLens model name."
        )
    if _is_local_name(args.model):
        if args.model == "minilm":
            raise CommandError(
                "minilm is an encoder; `verify` compares decoder logits. Convert it with "
                "`tl-attnonly convert minilm OUT_DIR` (TransformerLens 3.x), and compare it in "
                "Python (docs/saving.md). Decoders by name: bundled, smollm2."
            )
        if bridge:
            return _verify_bridge(args, local=True)
        from tl_attnonly import convert

        original = _load_local(args.model)
        converted = convert(original)
        what = f"the original ({LOCAL_MODELS[args.model]})"
    elif target.is_dir():
        original, converted, what = _load_converted_dir(target, bridge)
    elif target.exists():
        raise CommandError(
            f"{args.model!r} is a file; `verify` takes a directory written by "
            "`tl-attnonly convert`, or a TransformerLens model name."
        )
    else:
        _require_hub(args.model, probes)
        if bridge:
            return _verify_bridge(args, local=False)
        from transformer_lens import HookedTransformer

        from tl_attnonly import convert

        original = _load_by_name(args.model, HookedTransformer.from_pretrained)
        converted = convert(original)
        what = "the TransformerLens model"
    if original.tokenizer is None:
        raise CommandError("The model has no tokenizer: verify it with token ids in Python.")
    from tl_attnonly.verify import verify_conversion

    description, coefs = _describe(converted, original.to_tokens(args.prompt))
    print(f"Verifying the converted {args.model} against {what}: {description}")
    verdicts = verify_conversion(original, converted, args.prompt, tolerance=args.tolerance)
    return _print_verdicts(args, verdicts, coefs)


def _describe(converted: Any, tokens: Any) -> tuple[str, Any]:
    """``"N layers, M neuron-heads/layer (activation, ...), prompt of T tokens."`` and the
    neuron-heads' coefficients (layer 0's)."""
    from tl_attnonly.adapt import analysis_model

    model = analysis_model(converted)
    coefs = model.neuron_heads[0].coefficients
    text = (
        f"{model.cfg.n_layers} layers, {model.n_neuron_heads} neuron-heads/layer "
        f"({coefs.activation}, {coefs.n_heads} head(s)/neuron, method {coefs.method!r}), "
        f"prompt of {tokens.shape[-1]} tokens."
    )
    return text, coefs


def _print_verdicts(args: argparse.Namespace, verdicts: list[Any], coefs: Any) -> int:
    """Each dtype's table and verdict, and the overall one; the exit code."""
    reference = verdicts[0].reference.split(" with ")[0]  # "original" / "unconverted bridge"
    for v in verdicts:
        print(f"\n{str(v.dtype).removeprefix('torch.')}: max |converted - {reference}|")
        print_table(v.table)
    if coefs.method != "exact":
        print(
            f"\n{coefs.activation} is approximated ({coefs.method}, max error per neuron "
            f"{coefs.max_abs_error():.2g} on |x| <= 20): the verdict compares with the "
            f"{reference} using the heads' activation, so it checks the conversion itself."
        )
    tolerance = (
        "relative: 1e-4 (float32) / 1e-10 (float64) x max(1, max |logits|)"
        if args.tolerance is None
        else f"{args.tolerance:g}"
    )
    print(f"\nVerdict (tolerance {tolerance}):")
    if print_verdicts(verdicts):
        print("PASS")
        return 0
    print("FAIL: the converted model does not compute what the original does.")
    return EXIT_FAIL


__all__ = ["convert_cmd", "verify_cmd"]
