"""Export: standalone HTML; PNG, SVG and PDF images; text safe inside a ``<script>`` element."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import plotly.graph_objects as go
import torch
from circuitsvis.utils.render import RenderedHTML

from tl_attnonly.vis.links import link_script


def circuitsvis_js() -> str:
    """circuitsvis's bundled JavaScript (defines ``CircuitsVis``), safe to inline in ``<script>``.

    It is the file circuitsvis itself inlines for offline rendering (``dist/cdn/iife.js``); it loads
    nothing from the network.
    """
    return _circuitsvis_js()


_JS_CACHE: dict[str, str] = {}


def _circuitsvis_js() -> str:
    if "js" not in _JS_CACHE:
        import circuitsvis

        path = Path(circuitsvis.__file__).parent / "dist" / "cdn" / "iife.js"
        if not path.is_file():
            raise FileNotFoundError(
                f"circuitsvis's bundled JavaScript is missing ({path.name}); reinstall circuitsvis "
                "(pip install --force-reinstall 'circuitsvis>=1.43')."
            )
        js = path.read_text(encoding="utf-8")
        js = script_safe(js).replace("//# sourceMappingURL=iife.js.map", "")
        _JS_CACHE["js"] = js
    return _JS_CACHE["js"]


def script_safe(js: str) -> str:
    """JavaScript that cannot close the ``<script>`` element it is inlined in.

    ``"</script"`` becomes ``"<\\/script"``, which means the same in JavaScript strings and
    regular expressions (the only places it can occur in a bundle).
    """
    return js.replace("</script", "<\\/script")


_ZERO = re.compile(r"(?<=[\[ ])0\.0(?=[,\]])")


def script_safe_json(obj: Any) -> str:
    """JSON for inside ``<script>``: tensors/arrays as lists, ``<``, ``>``, ``&`` escaped."""

    def default(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            return o.tolist()
        if isinstance(o, np.ndarray):
            return o.tolist()
        if isinstance(o, np.generic):
            return o.item()
        raise TypeError(f"Cannot serialise {type(o).__name__} for circuitsvis.")

    text = json.dumps({k: v for k, v in obj.items() if v is not None}, default=default)
    text = _ZERO.sub("0", text)  # the many exact zeros of masked cells: "0" instead of "0.0"
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def save_figure(
    fig: go.Figure | RenderedHTML,
    path: str | Path,
    *,
    width: int | None = None,
    height: int | None = None,
    scale: float = 2.0,
) -> Path:
    """Write a plotly figure or a circuitsvis view to ``.html`` or ``.png`` (a plotly figure also
    to ``.svg`` or ``.pdf``).

    HTML is self-contained (plotly.js / circuitsvis's JavaScript inlined) and works offline; a
    circuit figure drawn with ``atlas=`` gets the handler that opens its nodes' atlas pages
    (:func:`~tl_attnonly.vis.links.link_script`). PNG,
    SVG and PDF of a plotly figure need the ``kaleido`` package (the ``[png]`` extra:
    ``pip install "tl-attnonly[png]"``) and a Chrome it can use (``plotly_get_chrome``); PNG of a
    circuitsvis view needs a Chrome/Chromium executable, which screenshots the whole view (its
    height measured first, unless given). If what is needed is missing, the figure is written as
    HTML next to the requested path and a warning names what to install.

    Args:
        fig: A plotly Figure or a circuitsvis RenderedHTML (e.g. a ``NeuronHeadView``).
        path: Output path ending in ``.html``, ``.png``, ``.svg`` or ``.pdf`` (the last two for
            plotly figures).
        width: Image width in CSS pixels (default: the figure's, or 1000).
        height: Image height in CSS pixels (default: the figure's; for views, the whole view).
        scale: PNG pixel ratio.

    Returns:
        The path written (``.html`` instead of the image when export was not possible).

    Raises:
        ValueError: For another suffix, or ``.svg`` / ``.pdf`` of a circuitsvis view.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".html", ".htm", ".png", *_VECTOR):
        raise ValueError(f"Can write .html, .png, .svg or .pdf, got {path.name!r}.")
    is_plotly = isinstance(fig, go.Figure)
    if not is_plotly and not isinstance(fig, RenderedHTML):
        raise TypeError(
            f"save_figure takes a plotly Figure or a circuitsvis view, got {type(fig).__name__}."
        )
    if suffix in _VECTOR and not is_plotly:
        raise ValueError(
            f"A circuitsvis view is written as .html or .png, got {path.name!r} (.svg and .pdf "
            "are for plotly figures)."
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix in (".html", ".htm"):
        path.write_text(_standalone_html(fig), encoding="utf-8")
        return path
    if is_plotly and importlib.util.find_spec("kaleido") is None:
        return _fallback(fig, path, "the kaleido package is not installed", _KALEIDO_ADVICE)
    if not is_plotly and find_chromium() is None:
        return _fallback(fig, path, "no Chrome/Chromium executable on PATH", _CHROMIUM_ADVICE)
    try:
        if is_plotly:
            fig.write_image(str(path), format=suffix[1:], width=width, height=height, scale=scale)
        else:
            page = _standalone_html(fig)
            width = width or 1000
            height = height or _page_height(page, width)
            _screenshot(page, path, width, height, scale)
        return path
    except Exception as err:  # kaleido/Chrome errors have many types
        advice = _KALEIDO_ADVICE if is_plotly else _CHROMIUM_ADVICE
        reason = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
        return _fallback(fig, path, reason, advice)


_KALEIDO_ADVICE = (
    "PNG, SVG and PDF export of plotly figures needs the kaleido package (the [png] extra: "
    'pip install "tl-attnonly[png]", or pip install kaleido) and a Chrome it can use (run '
    "`plotly_get_chrome` once)"
)
#: Vector formats (plotly figures only, through kaleido).
_VECTOR = (".svg", ".pdf")
_CHROMIUM_ADVICE = (
    "PNG export of circuitsvis views needs a Chrome/Chromium executable on PATH (e.g. "
    "`apt-get install chromium`)"
)
#: Height used when a view's height cannot be measured.
_DEFAULT_VIEW_HEIGHT = 800


def _fallback(fig: go.Figure | RenderedHTML, path: Path, reason: str, advice: str) -> Path:
    fallback = path.with_suffix(".html")
    fallback.write_text(_standalone_html(fig), encoding="utf-8")
    warnings.warn(
        f"Could not write {path.name}: {reason}. {advice}. Wrote {fallback} instead.",
        RuntimeWarning,
        stacklevel=3,
    )
    return fallback


def find_chromium() -> str | None:
    """Path of a Chrome/Chromium executable, or ``None``."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _standalone_html(fig: go.Figure | RenderedHTML) -> str:
    if isinstance(fig, go.Figure):
        return fig.to_html(include_plotlyjs=True, full_html=True, post_script=link_script(fig))
    if callable(getattr(fig, "to_html", None)):  # a NeuronHeadView: its own offline page
        return fig.to_html()
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8"></head><body>\n'
        f"{fig.local_src}\n</body></html>\n"
    )


# Waits until the page height stops changing (React renders after load), then records it.
_MEASURE = """<script>
window.addEventListener('load', () => {
  let last = -1, stable = 0;
  const tick = () => {
    const h = Math.ceil(document.documentElement.scrollHeight);
    stable = h === last ? stable + 1 : 0;
    last = h;
    if (stable >= 4) document.body.setAttribute('data-page-height', h);
    else setTimeout(tick, 250);
  };
  setTimeout(tick, 250);
});
</script>"""


def _chromium(page: str, width: int, height: int, *args: str, scale: float = 1.0) -> str:
    """Run headless Chromium on ``page``; return its stdout."""
    chromium = find_chromium()
    if chromium is None:
        raise FileNotFoundError("no chromium/chrome executable on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "view.html"
        src.write_text(page, encoding="utf-8")
        cmd = [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--force-device-scale-factor={scale}",
            f"--window-size={width},{height}",
            "--virtual-time-budget=10000",
            f"--user-data-dir={Path(tmp) / 'profile'}",
            *args,
            src.resolve().as_uri(),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"chromium failed: {done.stderr.strip()[-300:]}")
        return done.stdout


def _page_height(page: str, width: int) -> int:
    """The rendered height of ``page`` at ``width`` CSS pixels (a first Chromium pass)."""
    measured = page.replace("</body>", _MEASURE + "</body>", 1)
    dom = _chromium(measured, width, _DEFAULT_VIEW_HEIGHT, "--dump-dom")
    found = re.search(r'data-page-height="(\d+)"', dom)
    return max(int(found.group(1)), 100) if found else _DEFAULT_VIEW_HEIGHT


def _screenshot(page: str, path: Path, width: int, height: int, scale: float) -> None:
    _chromium(page, width, height, f"--screenshot={path.resolve()}", scale=scale)
    if not path.exists():
        raise RuntimeError(f"chromium wrote no {path.name}")


__all__ = [
    "circuitsvis_js",
    "find_chromium",
    "save_figure",
    "script_safe",
    "script_safe_json",
]
