"""The report page's machinery (:mod:`tl_attnonly.report`): its style sheet, packed JavaScript
(plotly.js and circuitsvis gzip-compressed, unpacked by the browser), figures and tables as HTML,
and the progress bar over the report's steps.
"""

from __future__ import annotations

import base64
import functools
import gzip
import re
from typing import Any

import pandas as pd
import plotly.graph_objects as go
from tqdm.auto import tqdm

from tl_attnonly.vis.links import link_script

#: The page's style sheet.
CSS = """
body { font-family: -apple-system, "Segoe UI", Roboto, sans-serif; margin: 24px auto;
       max-width: 1200px; color: #222; line-height: 1.45; padding: 0 16px; }
h1 { font-size: 26px; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 4px; margin-top: 36px; }
table.df { border-collapse: collapse; font-size: 13px; margin: 8px 0 16px; }
table.df th, table.df td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
table.df th { background: #f3f3f3; }
pre.prompt { background: #f7f7f7; padding: 8px; border-radius: 4px; overflow-x: auto; }
.note { color: #555; font-size: 14px; }
nav a { margin-right: 14px; }
code { background: #f3f3f3; padding: 0 3px; }
"""


# ------------------------------------------------------------------------------------------------
# packed JavaScript: plotly.js and circuitsvis are gzip-compressed (6.1 MB -> 2.4 MB as base64)
# and unpacked by the browser (DecompressionStream), then the page's own scripts run, in order.
# ------------------------------------------------------------------------------------------------
#: Type of the page's own scripts, run once the libraries are unpacked.
DEFERRED_TYPE = "text/x-tl-attnonly-deferred"
#: Type of a packed library (gzip, then base64).
PACKED_TYPE = "application/x-tl-attnonly-gzip-base64"

NO_DECOMPRESSION = (
    '<p id="tl-unpack-error" class="note" style="display:none; color:#b2182b">This browser cannot '
    "unpack the report's JavaScript (it needs DecompressionStream: Chrome 80, Firefox 113, Safari "
    "16.4 or later), so the figures are not drawn.</p>"
)
_UNPACK = """<script>
(async () => {
  if (typeof DecompressionStream === "undefined") {
    document.getElementById("tl-unpack-error").style.display = "block";
    return;
  }
  for (const packed of document.querySelectorAll('script[type="PACKED"]')) {
    const bytes = Uint8Array.from(atob(packed.textContent.trim()), (c) => c.charCodeAt(0));
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
    (0, eval)(await new Response(stream).text());
  }
  for (const script of document.querySelectorAll('script[type="DEFERRED"]')) {
    (0, eval)(script.textContent);
  }
})();
</script>"""


def packed(libraries: dict[str, str]) -> str:
    parts = []
    for name, js in libraries.items():
        data = _gzip_base64(js)
        parts.append(f'<script type="{PACKED_TYPE}" data-library="{name}">{data}</script>')
    unpack = _UNPACK.replace("PACKED", PACKED_TYPE).replace("DEFERRED", DEFERRED_TYPE)
    return "\n".join(parts) + "\n" + unpack


@functools.lru_cache(maxsize=4)
def _gzip_base64(js: str) -> str:
    return base64.b64encode(gzip.compress(js.encode("utf-8"), compresslevel=9, mtime=0)).decode()


def deferred(body: str) -> str:
    """The body's inline scripts, marked to run after the libraries are unpacked."""
    return re.sub(r'<script(?: type="text/javascript")?>', f'<script type="{DEFERRED_TYPE}">', body)


def plotly_html(fig: go.Figure) -> str:
    """The figure as a ``div`` (plotly.js not included), with the handler of its atlas links if
    it has any (:func:`~tl_attnonly.vis.links.link_script`)."""
    return fig.to_html(
        full_html=False,
        include_plotlyjs=False,
        config={"displaylogo": False},
        post_script=link_script(fig),
    )


def df_html(df: pd.DataFrame) -> str:
    return df.to_html(
        index=False,
        classes="df",
        border=0,
        float_format=lambda v: f"{v:.3g}",
        na_rep="",
    )


class Steps:
    """A tqdm bar over named steps (``with steps.step("name"): ...``)."""

    def __init__(self, total: int, enabled: bool):
        self.bar = tqdm(total=total, desc="report", unit="step", disable=not enabled)

    def step(self, name: str) -> Step:
        return Step(self.bar, name)

    def close(self) -> None:
        self.bar.close()


class Step:
    def __init__(self, bar: Any, name: str):
        self.bar, self.name = bar, name

    def __enter__(self) -> None:
        self.bar.set_postfix_str(self.name)

    def __exit__(self, *exc: Any) -> None:
        self.bar.update(1)


__all__ = [
    "CSS",
    "DEFERRED_TYPE",
    "NO_DECOMPRESSION",
    "PACKED_TYPE",
    "Steps",
    "deferred",
    "df_html",
    "packed",
    "plotly_html",
]
