"""``tl-attnonly convert`` and ``tl-attnonly verify``: load a model (local, saved, or from the
hub), convert it, save it or check it against its original."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from tl_attnonly.cli_common import (
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


def _require_hooked_transformer(command: str, probes: Probes) -> None:
    """A CommandError for ``convert`` / ``verify`` on TransformerLens 4.x (no HookedTransformer),
    before anything is loaded."""
    if not probes.has_hooked_transformer():
        raise CommandError(
            f"tl-attnonly {command} converts and saves HookedTransformer models, which "
            "TransformerLens 4.x removed. On 4.x: `tl-attnonly demo` (the bundled model as a "
            "TransformerBridge) or tl_attnonly.convert(bridge) in Python (docs/bridge.md); or "
            "install transformer-lens>=3,<4."
        )


def convert_cmd(args: argparse.Namespace, probes: Probes | None = None) -> int:
    """Load a model by TransformerLens name, convert it, save it."""
    probes = probes or Probes()
    _require_hooked_transformer("convert", probes)
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
            from tl_attnonly.encoder import convert_encoder

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
def _load_converted_dir(directory: Path) -> tuple[Any, Any, str]:
    conversion = directory / CONVERSION_FILE
    if not conversion.is_file():
        raise CommandError(
            f"{str(directory)!r} is a directory but not a converted model: it has no "
            f"{CONVERSION_FILE}. `verify` takes a directory written by `tl-attnonly convert` (or "
            "AttnOnlyTransformer.save_pretrained), or a TransformerLens model name. To convert a "
            "model: `tl-attnonly convert NAME OUT_DIR`."
        )
    from tl_attnonly.conversion_record import SavedModelError, read_json

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


def verify_cmd(args: argparse.Namespace, probes: Probes | None = None) -> int:
    """Compare a converted model against its original (a TL model name or a saved directory)."""
    probes = probes or Probes()
    _require_hooked_transformer("verify", probes)
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
                "`tl-attnonly convert minilm OUT_DIR`, and compare it in Python "
                "(docs/saving.md). Decoders by name: bundled, smollm2."
            )
        from tl_attnonly import convert

        original = _load_local(args.model)
        converted = convert(original)
        what = f"the original ({LOCAL_MODELS[args.model]})"
    elif target.is_dir():
        original, converted, what = _load_converted_dir(target)
    elif target.exists():
        raise CommandError(
            f"{args.model!r} is a file; `verify` takes a directory written by "
            "`tl-attnonly convert`, or a TransformerLens model name."
        )
    else:
        _require_hub(args.model, probes)
        from transformer_lens import HookedTransformer

        from tl_attnonly import convert

        original = _load_by_name(args.model, HookedTransformer.from_pretrained)
        converted = convert(original)
        what = "the TransformerLens model"
    if original.tokenizer is None:
        raise CommandError("The model has no tokenizer: verify it with token ids in Python.")
    from tl_attnonly.verify import verify_conversion

    coefs = converted.coefficients
    print(
        f"Verifying the converted {args.model} against {what}: {converted.cfg.n_layers} layers, "
        f"{converted.n_neuron_heads} neuron-heads/layer ({coefs.activation}, "
        f"{coefs.n_heads} head(s)/neuron, method {coefs.method!r}), "
        f"prompt of {original.to_tokens(args.prompt).shape[-1]} tokens."
    )
    verdicts = verify_conversion(original, converted, args.prompt, tolerance=args.tolerance)
    for v in verdicts:
        print(f"\n{str(v.dtype).removeprefix('torch.')}: max |converted - original|")
        print_table(v.table)
    if coefs.method != "exact":
        print(
            f"\n{coefs.activation} is approximated ({coefs.method}, max error per neuron "
            f"{coefs.max_abs_error():.2g} on |x| <= 20): the verdict compares with the original "
            "using the heads' activation, so it checks the conversion itself."
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
