"""Fail fast, with a short message, when ``from_pretrained`` cannot reach the Hugging Face hub.

Without the hub, TransformerLens's ``from_pretrained`` (through ``transformers`` and
``huggingface_hub``) retries for tens of seconds and ends in a long traceback. Before calling it,
:func:`hub_access` decides, cheaply:

1. the model's repository (TransformerLens's official name, :func:`tl_attnonly._compat.
   tl_official_model_name`) has its ``config.json`` in the local Hugging Face cache
   (``huggingface_hub.try_to_load_from_cache``: a file-system look-up, no network);
2. offline mode is on (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``, or
   ``huggingface_hub.constants.HF_HUB_OFFLINE``);
3. otherwise, whether the hub answers a ``HEAD`` request within :data:`HUB_TIMEOUT` seconds
   (:func:`hub_unreachable`; the request runs in a daemon thread, so a slow DNS look-up cannot
   hold it longer).

Cached: the load goes on (offline, if the hub does not answer). Not cached and offline or
unreachable: :class:`HubUnavailableError`, three lines: what was asked, why the hub cannot be
used, how to load local weights instead. This module imports neither torch nor TransformerLens
(the command line uses it before importing them).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Iterator

#: Seconds to wait for the hub's answer before calling it unreachable.
HUB_TIMEOUT = 1.0
_TRUE = ("1", "true", "yes", "on")


class HubUnavailableError(OSError):
    """The hub is needed (the model is not in the local cache) but offline or unreachable.

    Attributes:
        asked: Line 1 of the message: what was asked.
        why: Line 2: offline mode, or the hub did not answer.
        advice: Line 3: how to load local weights instead.
    """

    def __init__(self, asked: str, why: str, advice: str):
        self.asked, self.why, self.advice = asked, why, advice
        super().__init__(f"{asked}\n{why}\n{advice}")

    def __str__(self) -> str:
        return f"{self.asked}\n{self.why}\n{self.advice}"


def offline_mode() -> bool:
    """Whether Hugging Face offline mode is on (environment, or ``huggingface_hub``'s constant)."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").strip().lower() in _TRUE:
            return True
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - a dependency of transformers
        return False
    return bool(constants.HF_HUB_OFFLINE)


def hub_endpoint() -> str:
    """The hub's address (``HF_ENDPOINT``, default ``https://huggingface.co``)."""
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def hub_unreachable(timeout: float = HUB_TIMEOUT) -> str | None:
    """Why the hub cannot be reached, or ``None`` if it answers; returns within ~``timeout`` s.

    Any HTTP answer (even an error status) counts as reachable. The request runs in a daemon
    thread, so a DNS look-up that hangs is abandoned after ``timeout`` as well.
    """
    import urllib.error
    import urllib.request

    endpoint = hub_endpoint()
    result: list[str | None] = []

    def probe() -> None:
        try:
            request = urllib.request.Request(endpoint, method="HEAD")
            with urllib.request.urlopen(request, timeout=timeout):
                result.append(None)
        except urllib.error.HTTPError:
            result.append(None)  # it answered
        except Exception as exc:  # URLError, timeouts, DNS failures, a bad URL
            result.append(str(getattr(exc, "reason", exc)))

    thread = threading.Thread(target=probe, name="tl_attnonly-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    if not result:
        return f"{endpoint} did not answer within {timeout:g} s"
    if result[0] is None:
        return None
    return f"{endpoint} did not answer ({result[0]})"


def in_local_cache(repo_id: str, cache_dir: Any = None) -> bool:
    """Whether ``repo_id``'s ``config.json`` is in the local Hugging Face cache (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover
        return False
    try:
        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir)
    except Exception:  # an id the cache cannot hold (a path, odd characters): not cached
        return False
    return isinstance(found, str)


def _why(offline: bool) -> str | None:
    if offline:
        return "Hugging Face offline mode is on (HF_HUB_OFFLINE=1), so the hub is not asked."
    why = hub_unreachable()
    return None if why is None else f"The Hugging Face hub is unreachable: {why}."


def python_advice(class_name: str) -> str:
    """Line 3 of the message for ``{class_name}.from_pretrained``."""
    if class_name == "AttnOnlyEncoder":
        bundled = (
            "the bundled all-MiniLM-L6-v2: convert_encoder(tl_attnonly.minilm.load_minilm()[0])"
        )
    else:
        bundled = (
            "the bundled models: tl_attnonly.convert(tl_attnonly.bundled.load_bundled_model()) "
            "or tl_attnonly.convert(tl_attnonly.smollm2.load_smollm2())"
        )
    return (
        f"Load local weights instead: {class_name}.load(DIR) for a saved conversion, {bundled}; "
        "or, with the model in your Hugging Face cache (HF_HOME), set HF_HUB_OFFLINE=1."
    )


@contextlib.contextmanager
def hub_access(
    model_name: str, class_name: str, tl_kwargs: dict[str, Any] | None = None
) -> Iterator[None]:
    """Run the block (TransformerLens's ``from_pretrained``) only if it can get its files.

    Args:
        model_name: The name given to ``from_pretrained``.
        class_name: The class whose ``from_pretrained`` was called (for the message).
        tl_kwargs: The keyword arguments passed on to TransformerLens (``cache_dir``,
            ``local_files_only``).

    Raises:
        HubUnavailableError: Not in the cache, and offline mode is on or the hub does not answer
            within :data:`HUB_TIMEOUT` s. Raised before the block runs.
    """
    from tl_attnonly._compat import hf_offline_mode, tl_lists_repo_files, tl_official_model_name

    tl_kwargs = tl_kwargs or {}
    official = tl_official_model_name(model_name)
    if official is None:  # a name TransformerLens does not know: its own error says so
        yield
        return
    cached = not tl_lists_repo_files(official) and in_local_cache(
        official, tl_kwargs.get("cache_dir")
    )
    why = _why(offline_mode() or bool(tl_kwargs.get("local_files_only")))
    if why is None:
        yield
        return
    if cached:  # offline from the cache, without a retry on the hub
        with hf_offline_mode():
            yield
        return
    raise HubUnavailableError(
        f"{class_name}.from_pretrained({model_name!r}) needs the Hugging Face hub: {official!r} "
        "is not in the local cache.",
        why,
        python_advice(class_name),
    )


__all__ = [
    "HUB_TIMEOUT",
    "HubUnavailableError",
    "hub_access",
    "hub_endpoint",
    "hub_unreachable",
    "in_local_cache",
    "offline_mode",
    "python_advice",
]
