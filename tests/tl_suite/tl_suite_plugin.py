"""pytest plugin: TransformerLens's tests on the attention-only classes or converted bridges.

Loaded by ``run.py`` (``-p tl_suite_plugin``). It imports the *installed* ``transformer_lens``
first (the unpacked sdist beside the tests holds a copy of the package, which pytest's rootdir
would otherwise put first on ``sys.path``), and

* on TransformerLens 3.x, swaps the classes before any test module imports them:
  ``transformer_lens.HookedTransformer``
  (the package attribute) and ``transformer_lens.HookedTransformer.HookedTransformer`` (the
  module attribute) become :class:`~tl_attnonly.AttnOnlyTransformer`; the same for
  ``HookedEncoder`` and :class:`~tl_attnonly.AttnOnlyEncoder`. ``HookedTransformer(cfg)``
  and ``HookedTransformer.from_pretrained(...)`` in TL's tests then build converted models.
  Module attributes only: no forward pass or method is patched. ``TL_SUITE_ORIGINAL=1`` leaves TL
  as it is (the baseline run);
* on TransformerLens 4.x (no ``HookedTransformer``), converts every ``TransformerBridge`` the
  tests build, right after it is built (``bridge_conversion.py``), and prints how many bridges
  were converted and why the others were not. ``TL_SUITE_ORIGINAL=1`` converts none;
* turns "needs the Hugging Face hub" errors into skips, at collection and in tests (the run is
  offline), so only what runs offline counts;
* reports the failures listed in ``allowlist.py`` (``allowlist_tl4.py`` on 4.x) as expected
  failures (each entry says why the converted model differs by design), and fails an
  allow-listed test that passes (a stale entry), except those listed in the allow-list's
  ``ROUNDING`` (a difference of float rounding whose sign on a logit depends on the CPU's
  kernels: they fail on some machines and pass on others).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import bridge_conversion
import pytest
import transformer_lens  # the installed package, before the sdist's copy can shadow it

from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER

if HAS_HOOKED_TRANSFORMER:
    from allowlist import ALLOWED_FAILURES, ROUNDING

    ALLOWLIST = "tests/tl_suite/allowlist.py"
else:
    from allowlist_tl4 import ALLOWED_FAILURES, ROUNDING

    ALLOWLIST = "tests/tl_suite/allowlist_tl4.py"

SWAP = os.environ.get("TL_SUITE_ORIGINAL", "0") != "1"

#: Exception type names (anywhere in a failure's chain) meaning "this needs the hub".
#: ``HubUnavailableError`` is tl_attnonly's own fast failure (``tl_attnonly.hub``), raised before
#: TransformerLens reaches the hub client.
HUB_ERRORS = ("LocalEntryNotFoundError", "OfflineModeIsEnabled", "HubUnavailableError")
#: Text in an error, or in a test's output, meaning the same (a loader that catches the error
#: and prints it, or OSError messages of transformers' offline mode).
HUB_TEXT = (
    "OfflineModeIsEnabled",
    "HubUnavailableError",
    "LocalEntryNotFoundError",
    "We couldn't connect to 'https://huggingface.co'",
    "outgoing traffic has been disabled",
    "offline mode is enabled",
)


def _swap() -> None:
    from tl_attnonly import AttnOnlyTransformer
    from tl_attnonly.hooked.encoder import AttnOnlyEncoder

    swaps = {"HookedTransformer": AttnOnlyTransformer, "HookedEncoder": AttnOnlyEncoder}
    for name, cls in swaps.items():
        setattr(transformer_lens, name, cls)
        setattr(sys.modules[f"transformer_lens.{name}"], name, cls)


def pytest_configure(config: pytest.Config) -> None:
    if not SWAP:
        return
    if HAS_HOOKED_TRANSFORMER:
        _swap()
    else:
        bridge_conversion.install()


def pytest_report_header(config: pytest.Config) -> list[str]:
    where = f"tl_suite: transformer_lens from {transformer_lens.__file__}"
    if not HAS_HOOKED_TRANSFORMER:
        what = "every TransformerBridge converted after it is built" if SWAP else "original"
        return [f"tl_suite: {what}", where]
    names = ("HookedTransformer", "HookedEncoder")
    classes = ", ".join(
        f"{name} is {cls.__module__}.{cls.__qualname__}"
        for name, cls in [(name, getattr(transformer_lens, name)) for name in names]
    )
    return [f"tl_suite: {classes}", where]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_line(f"tl_suite: transformer_lens from {transformer_lens.__file__}")
    if SWAP and not HAS_HOOKED_TRANSFORMER:
        for line in bridge_conversion.summary():
            terminalreporter.write_line(line)
        record = os.environ.get("TL_SUITE_RECORD")
        if record:
            with open(record, "w", encoding="utf-8") as file:
                json.dump(bridge_conversion.BY_TEST, file, indent=1, sort_keys=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any):
    bridge_conversion.CURRENT[0] = item.nodeid
    yield
    bridge_conversion.CURRENT[0] = ""


def needs_hub(error: BaseException | None) -> bool:
    """Whether ``error`` (or an exception it was raised from) says the hub was needed."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if type(error).__name__ in HUB_ERRORS or any(text in str(error) for text in HUB_TEXT):
            return True
        error = error.__cause__ or error.__context__
    return False


def _skip(report: Any, path: str, lineno: int) -> None:
    report.outcome = "skipped"
    report.longrepr = (path, lineno, "needs the Hugging Face hub (the suite runs offline)")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    outcome = yield
    report = outcome.get_result()
    if report.failed and any(text in str(report.longrepr) for text in HUB_TEXT):
        _skip(report, str(collector.path), 0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.excinfo is not None:
        output = report.capstdout + report.capstderr
        if needs_hub(call.excinfo.value) or any(text in output for text in HUB_TEXT):
            path, lineno, _ = report.location
            _skip(report, path, (lineno or 0) + 1)
            return
    if not SWAP:
        return
    reason = ALLOWED_FAILURES.get(item.nodeid)
    if reason is None:
        return
    # An entry may fail in any phase (a teardown error too): it is stale only if no phase failed
    # or skipped, which the teardown report, the last, can tell.
    outcomes = _ALLOWED_OUTCOMES.setdefault(item.nodeid, set())
    outcomes.add(report.outcome)
    if report.failed:
        report.outcome = "skipped"
        report.wasxfail = f"allow-listed: {reason}"
    elif report.when == "teardown" and stale(item.nodeid, outcomes):
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} is in the tl_suite allow-list ({ALLOWLIST}) but passed: remove the "
            "entry."
        )


def stale(nodeid: str, outcomes: set[str]) -> bool:
    """Whether an allow-listed test's entry is stale, given the outcomes of its phases: each
    passed, and its failure is not one of float rounding that some CPUs show and others not
    (the allow-list's ``ROUNDING``)."""
    return outcomes == {"passed"} and nodeid not in ROUNDING


#: ``nodeid -> outcomes of its phases so far``, for the allow-listed tests.
_ALLOWED_OUTCOMES: dict[str, set[str]] = {}
