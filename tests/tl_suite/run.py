"""Run TransformerLens's own test suite on our converted models.

The drop-in check. On TransformerLens 3.x, TransformerLens's tests, written for
``HookedTransformer`` and ``HookedEncoder``, run against :class:`~tl_attnonly.AttnOnlyTransformer`
and :class:`~tl_attnonly.AttnOnlyEncoder` (``tl_suite_plugin.py`` swaps the classes). On
TransformerLens 4.x (no ``HookedTransformer``), its tests run with every ``TransformerBridge``
they build converted right after it is built (``bridge_conversion.py``).

What it does:

1. Fetches the TransformerLens sdist of the *installed* version from the package index
   (``pip download --no-deps --no-binary :all: transformer-lens==<version>``) into a cache
   directory outside the checkout (``--cache-dir``; default ``$XDG_CACHE_HOME/tl_attnonly/tl_suite``
   or ``~/.cache/...``), once per version, and unpacks it. It refuses to go on if the sdist has
   no ``tests/`` directory.
2. Selects the test files. 3.x (:func:`select_test_files`): every ``tests/{unit,integration,
   acceptance}/**/test_*.py`` whose source names ``HookedTransformer`` or ``HookedEncoder``,
   except the TransformerBridge suites (``model_bridge/``: another class, not swapped),
   ``benchmarks/`` (timings), ``unit/test_make_docs.py`` (builds TL's documentation; needs TL's
   docs extra) and ``unit/scripts/`` (TL's maintenance scripts). 4.x
   (:func:`select_bridge_test_files`): the files listed in ``tl4_selection.py`` (the files whose
   tests build bridges that conversion accepts, and why the rest are left out), or with ``--all``
   every file of those directories but the same exclusions (``model_bridge/`` included). Tests
   needing the Hugging Face hub are skipped by the plugin (the run is offline:
   ``HF_HUB_OFFLINE=1``), so what remains are the tests that build models from configs.
3. Runs pytest on them from the unpacked sdist, with TL's own conftest files, without TL's
   ``addopts`` (they need TL's dev plugins: doctest-plus, nbval, the jaxtyping import hook) and
   ``pythonpath`` (it would import the sdist's copy of ``transformer_lens``, not the installed
   one), and with ``-p tl_suite_plugin``. Exit status: pytest's. A failure not on the allow-list
   (``allowlist.py``; ``allowlist_tl4.py`` on 4.x) fails the run; an allow-listed test that
   passes fails it too (stale entry), unless the allow-list names it in ``ROUNDING``.

Usage (from the repository root; the package importable, e.g. ``pip install -e .``)::

    python tests/tl_suite/run.py                 # the drop-in check (CI; either TL line)
    python tests/tl_suite/run.py --original      # the same tests on TransformerLens itself
    python tests/tl_suite/run.py -- -k start_at  # extra pytest arguments after --
    python tests/tl_suite/run.py --all --record bridges.json   # 4.x: the whole suite, writing
                                                 # which bridges each test built (tl4_selection)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SUITE_DIRS = ("tests/unit", "tests/integration", "tests/acceptance")
EXCLUDED_PARTS = ("model_bridge", "benchmarks")
EXCLUDED_FILES = ("tests/unit/test_make_docs.py",)
#: Tests of TransformerLens's maintenance scripts (``scripts/``), not of its models; one of those
#: scripts refuses to run unless ``transformer_lens`` is the sdist's own copy, and this harness
#: tests the installed package.
EXCLUDED_DIRS = ("tests/unit/scripts/",)
NAMES = re.compile(r"\bHooked(Transformer|Encoder)\b")


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tl_attnonly" / "tl_suite"


def fetch_sdist(version: str, cache_dir: Path) -> Path:
    """The unpacked TransformerLens ``version`` sdist (downloaded from the package index once)."""
    root = cache_dir / f"transformer_lens-{version}"
    if (root / "tests").is_dir():
        return root
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as download:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"transformer-lens=={version}",
                "--dest",
                download,
            ],
            check=True,
        )
        archives = list(Path(download).glob("*.tar.gz"))
        if len(archives) != 1:
            raise SystemExit(f"Expected one sdist from pip download, got {archives}.")
        with tarfile.open(archives[0]) as archive:
            members = [m for m in archive.getmembers() if m.name.startswith(root.name + "/")]
            unpacked = Path(download) / "unpacked"
            archive.extractall(unpacked, members=members, filter="data")
        if not (unpacked / root.name / "tests").is_dir():
            raise SystemExit(
                f"The transformer-lens {version} sdist from the package index has no tests/ "
                "directory, so TransformerLens's suite cannot be run from it. Check another "
                "release's sdist, or the package index's source listing for this version."
            )
        os.replace(unpacked / root.name, root)
    return root


def select_test_files(root: Path) -> list[str]:
    """The TL test files this check runs (see the module docstring), relative to ``root``."""
    files = []
    for directory in SUITE_DIRS:
        for path in sorted((root / directory).rglob("test_*.py")):
            relative = path.relative_to(root).as_posix()
            if any(part in EXCLUDED_PARTS for part in path.relative_to(root).parts):
                continue
            if relative in EXCLUDED_FILES or relative.startswith(EXCLUDED_DIRS):
                continue
            if NAMES.search(path.read_text(encoding="utf-8")):
                files.append(relative)
    return files


def select_bridge_test_files(root: Path, everything: bool = False) -> list[str]:
    """The TL 4.x test files this check runs, relative to ``root``: ``tl4_selection.SELECTED``
    (those the sdist has), or with ``everything`` every test file but the exclusions above."""
    if everything:
        return [
            path.relative_to(root).as_posix()
            for directory in SUITE_DIRS
            for path in sorted((root / directory).rglob("test_*.py"))
            if "benchmarks" not in path.relative_to(root).parts
            and path.relative_to(root).as_posix() not in EXCLUDED_FILES
            and not path.relative_to(root).as_posix().startswith(EXCLUDED_DIRS)
        ]
    from tl4_selection import SELECTED

    missing = [name for name in SELECTED if not (root / name).is_file()]
    if missing:
        print(
            f"tl_suite: {len(missing)} selected file(s) are not in this sdist (another "
            f"TransformerLens version?), e.g. {missing[:3]}; re-record tl4_selection.py with --all "
            "--record.",
            file=sys.stderr,
        )
    return [name for name in SELECTED if name not in missing]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    parser.add_argument(
        "--original", action="store_true", help="run on TransformerLens's own classes (baseline)"
    )
    parser.add_argument(
        "--all", action="store_true", help="4.x: every test file, not tl4_selection.py's"
    )
    parser.add_argument(
        "--record", type=Path, help="4.x: write each test's bridge conversions to this JSON file"
    )
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)

    version = importlib.metadata.version("transformer-lens")
    bridges = int(version.split(".")[0]) >= 4
    root = fetch_sdist(version, args.cache_dir)
    files = select_bridge_test_files(root, args.all) if bridges else select_test_files(root)
    what = "every bridge converted" if bridges else "our classes swapped in"
    if args.original:
        what = "TransformerLens as it is"
    print(f"tl_suite: transformer-lens {version}, {len(files)} test files from {root} ({what})")
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    # The installed transformer_lens, not the sdist's copy in the working directory (Python 3.11+
    # leaves the working directory off sys.path with this, and "-o pythonpath=" below drops TL's
    # pythonpath=["."]; the plugin imports transformer_lens first and reports which one ran).
    env["PYTHONSAFEPATH"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), str(REPO), *filter(None, [env.get("PYTHONPATH")])]
    )
    env["TL_SUITE_ORIGINAL"] = "1" if args.original else "0"
    if args.record:
        env["TL_SUITE_RECORD"] = str(args.record.resolve())
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rfEx",
        "-o",
        "addopts=",
        # TL's pythonpath=["."] would put the sdist's copy of transformer_lens first on sys.path
        "-o",
        "pythonpath=",
        "-p",
        "no:cacheprovider",
        "-p",
        "tl_suite_plugin",
        f"--rootdir={root}",
        *files,
        *args.pytest_args,
    ]
    return subprocess.call(command, cwd=root, env=env)


if __name__ == "__main__":
    sys.exit(main())
