"""pytest plugin: TransformerLens's tests with the attention-only classes in place of TL's.

Loaded by ``run.py`` (``-p tl_suite_plugin``). It

* swaps the classes before any test module imports them: ``transformer_lens.HookedTransformer``
  (the package attribute) and ``transformer_lens.HookedTransformer.HookedTransformer`` (the
  module attribute) become :class:`~tl_attnonly.AttnOnlyTransformer`; the same for
  ``HookedEncoder`` and :class:`~tl_attnonly.encoder.AttnOnlyEncoder`. ``HookedTransformer(cfg)``
  and ``HookedTransformer.from_pretrained(...)`` in TL's tests then build converted models.
  Module attributes only: no forward pass or method is patched. ``TL_SUITE_ORIGINAL=1`` leaves TL
  as it is (the baseline run);
* turns "needs the Hugging Face hub" errors into skips, at collection and in tests (the run is
  offline), so only what runs offline counts;
* reports the failures listed in ``allowlist.py`` as expected failures (each entry says why the
  converted model differs by design), and fails an allow-listed test that passes (a stale entry).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
from allowlist import ALLOWED_FAILURES

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
    import transformer_lens

    from tl_attnonly import AttnOnlyTransformer
    from tl_attnonly.encoder import AttnOnlyEncoder

    swaps = {"HookedTransformer": AttnOnlyTransformer, "HookedEncoder": AttnOnlyEncoder}
    for name, cls in swaps.items():
        setattr(transformer_lens, name, cls)
        setattr(sys.modules[f"transformer_lens.{name}"], name, cls)


def pytest_configure(config: pytest.Config) -> None:
    if SWAP:
        _swap()


def pytest_report_header(config: pytest.Config) -> list[str]:
    import transformer_lens

    names = ("HookedTransformer", "HookedEncoder")
    classes = ", ".join(
        f"{name} is {cls.__module__}.{cls.__qualname__}"
        for name, cls in [(name, getattr(transformer_lens, name)) for name in names]
    )
    return [f"tl_suite: {classes}", f"tl_suite: transformer_lens from {transformer_lens.__file__}"]


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
    if report.failed:
        report.outcome = "skipped"
        report.wasxfail = f"allow-listed: {reason}"
    elif report.when == "call" and report.passed:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} is in tests/tl_suite/allowlist.py but passed: remove the entry."
        )
