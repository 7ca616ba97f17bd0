"""TransformerLens tests that fail with the attention-only classes swapped in, by design.

``nodeid -> reason``. Keep it short: every entry says why the converted model differs from the
original by design (not "it fails"); a failure not listed here fails the run, and a listed test
that passes fails it too (remove the entry).
"""

from __future__ import annotations

ALLOWED_FAILURES: dict[str, str] = {}
