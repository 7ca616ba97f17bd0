"""What the command line's subcommands share: exit codes, defaults, printing, and the probes of
the environment (which TransformerLens; whether the hub answers) that tests replace.

Nothing here imports torch or TransformerLens.
"""

from __future__ import annotations

import time

START = time.perf_counter()  # the demo reports its time from here, imports included

from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

DEFAULT_PROMPT = (
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n"
)
#: Exit codes: 0 PASS / done, 1 FAIL (verification), 2 usage or input error (as argparse).
EXIT_FAIL, EXIT_USAGE = 1, 2
#: Seconds to wait for the Hugging Face hub before calling it unreachable.
HUB_TIMEOUT = 1.0
#: Models every subcommand loads by name, offline (package data or an installed extra).
LOCAL_MODELS = {
    "bundled": "the bundled tiny-stdlib-silu decoder (package data)",
    "smollm2": "SmolLM2-135M-Instruct, a gated decoder (the [smollm2] extra)",
    "minilm": "all-MiniLM-L6-v2, a BERT encoder (the [minilm] extra)",
}
#: The file that marks a directory written by ``save_pretrained`` (as in ``neuron_head_model``;
#: repeated here so that a wrong directory is reported before torch is imported).
CONVERSION_FILE = "conversion.json"
#: The file that marks a finished neuron atlas site, its manifest (``tl_attnonly.atlas.site``'s
#: ``MANIFEST``, written last; repeated here for the same reason).
ATLAS_MANIFEST = "atlas.json"


class CommandError(Exception):
    """An input the command cannot use; the message says what to do. Exits with code 2."""


def print_table(df: Any) -> None:
    print(df.to_string(index=False, float_format=lambda v: f"{v:.3g}"))


def print_verdicts(verdicts: Sequence[Any]) -> bool:
    """Print one PASS/FAIL line per dtype; return whether all passed."""
    for v in verdicts:
        name = str(v.dtype).removeprefix("torch.")
        status = "PASS" if v.passed else "FAIL"
        line = (
            f"  {status}  {name:<8} max |Δlogits| = {v.max_abs_diff:.3g} "
            f"(tolerance {v.tolerance:.3g}, against the {v.reference})"
        )
        if v.reference not in ("original", "unconverted bridge"):
            unmodified = v.reference.split(" with ")[0]  # "original" / "unconverted bridge"
            line += f"; against the {unmodified}: {v.approximation_diff:.3g}"
        print(line)
    return all(v.passed for v in verdicts)


def has_hooked_transformer() -> bool:
    """Whether the installed TransformerLens has HookedTransformer (3.x; 4.x removed it), read
    from the package's metadata: no import of torch or TransformerLens, so the commands that
    fail fast (no hub, bad arguments) stay fast."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return int(version("transformer-lens").split(".")[0]) < 4
    except (PackageNotFoundError, ValueError):  # not installed, or an unreadable version
        from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER

        return HAS_HOOKED_TRANSFORMER


def hub_unreachable(timeout: float = HUB_TIMEOUT) -> str | None:
    """Why the Hugging Face hub cannot be reached (``None`` if it answers), within ``timeout``."""
    from tl_attnonly.hub import hub_unreachable

    return hub_unreachable(timeout)


@dataclass(frozen=True)
class Probes:
    """The environment probes a subcommand uses; :func:`tl_attnonly.cli.main` passes
    ``tl_attnonly.cli``'s own (looked up at each call, so that replacing them there takes
    effect)."""

    has_hooked_transformer: Callable[[], bool] = has_hooked_transformer
    hub_unreachable: Callable[..., str | None] = hub_unreachable


__all__ = [
    "ATLAS_MANIFEST",
    "CONVERSION_FILE",
    "CommandError",
    "DEFAULT_PROMPT",
    "EXIT_FAIL",
    "EXIT_USAGE",
    "HUB_TIMEOUT",
    "LOCAL_MODELS",
    "Probes",
    "START",
    "has_hooked_transformer",
    "hub_unreachable",
    "print_table",
    "print_verdicts",
]
