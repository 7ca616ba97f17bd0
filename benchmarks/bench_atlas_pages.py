"""How long an atlas neuron page takes to show in a real browser: headless Chromium (selenium and
chromedriver, as ``tests/atlas/test_atlas_browser.py`` starts it), pages opened from ``file://``.

For each site, every ``--stride``-th neuron of its index is opened ``--repeats`` times, each time
by a fresh navigation (``about:blank`` first), and the time from the navigation's start to the
first top context in the DOM is read in the page (``performance.now()`` when a
``MutationObserver``, installed before the page's scripts, sees it): the page's HTML, ``vocab.js``,
the neuron's shard, inflating and unpacking its record and rendering it. Also printed: the
``load`` event's time (the page and the scripts it added while parsing). The first page opened of
each site is printed apart (the browser's caches hold nothing of that site yet).

Sites: ``test`` (the bundled model over the 8 rows of 48 tokens of the atlas tests, their
options: ``k=4``, 3 tokens before and 2 after, a bridge), ``smollm2-subset`` (the 48 SmolLM2
neurons shipped in ``docs/assets/atlas_smollm2``, ``Atlas.subset`` of the million-token atlas:
a shard there holds only the kept neurons), or any atlas folder.

Run: ``python benchmarks/bench_atlas_pages.py [--sites test smollm2-subset DIR] [--stride 32]
[--repeats 3]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "atlas"))

from browser import CHROME, chrome, close, shown_neuron, url  # noqa: E402

LOAD_END = "return performance.getEntriesByType('navigation')[0].loadEventEnd"


def test_site(out: Path) -> Path:
    """The atlas tests' site (``tests/atlas/test_atlas_pages.py``'s fixture) in ``out``."""
    from helpers import BATCH, bundled, corpus_rows

    from tl_attnonly.atlas import AtlasOptions, build_atlas

    model = bundled("bridge")
    opts = AtlasOptions(k=4, before=3, after=2, max_len=48)
    build_atlas(model, corpus_rows(model), out, options=opts, batch_size=BATCH, progress=False)
    return out


def time_site(driver, site: Path, stride: int, repeats: int) -> dict[str, list[float]]:
    """ms to the first top context and to ``load``, per neuron page opened."""
    from tl_attnonly.atlas.site import read_js_data

    labels = [n[0] for n in read_js_data(site / "index.js")["neurons"]][::stride]
    shown, loaded = [], []
    for _ in range(repeats):
        for label in labels:
            driver.get("about:blank")
            driver.get(url(site / "neuron.html", f"#{label}"))
            shown.append(shown_neuron(driver, label))
            loaded.append(driver.execute_script(LOAD_END))
    return {"shown": shown, "load": loaded, "labels": labels}


def summary(ms: list[float]) -> str:
    return (f"median {statistics.median(ms):.1f} ms, min {min(ms):.1f}, max {max(ms):.1f} "
            f"({len(ms)} pages)")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sites", nargs="+", default=["test", "smollm2-subset"])
    parser.add_argument("--stride", type=int, default=32, help="every N-th neuron of the index")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    version = subprocess.run([CHROME, "--version"], capture_output=True, text=True).stdout
    print(f"{version.strip()}, headless; {platform.machine()}, {os.cpu_count()} CPUs, load "
          f"average {os.getloadavg()[0]:.1f}; python {platform.python_version()}")  # fmt: skip
    driver = chrome()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.sites:
                if name == "test":
                    site = test_site(Path(tmp) / "atlas")
                elif name == "smollm2-subset":
                    site = ROOT / "docs" / "assets" / "atlas_smollm2"
                else:
                    site = Path(name)
                times = time_site(driver, site, args.stride if name == "test" else 1, args.repeats)
                first = times["shown"][0]
                print(f"{name} ({site}): {len(times['labels'])} neurons x {args.repeats}")
                print(f"  first top context in the DOM: {summary(times['shown'][1:])}; the first "
                      f"page of the site: {first:.1f} ms")  # fmt: skip
                print(f"  load event: {summary(times['load'][1:])}")
    finally:
        close(driver)


if __name__ == "__main__":
    main()
