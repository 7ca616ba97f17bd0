"""mkdocs hook: one API reference page per module of ``tl_attnonly``, made at build time.

The pages follow the package as it is on disk, so moving a module moves its page and no list of
modules has to be kept by hand. Each page is one mkdocstrings directive (``::: module``), which
renders the module's docstrings (Google style); a package's page shows its docstring and links to
its modules. The pages go into the nav under "API reference" (``docs/api/index.md`` is the section's
own page). Packages in ``SKIP`` get no page (with everything under them).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "tl_attnonly"
#: Packages left out of the reference (and the nav).
SKIP: set[str] = set()
#: The nav entry whose children are the generated pages.
SECTION = "API reference"
#: A Sphinx cross-reference role in the docstrings (``:func:`name```), as Markdown renders it.
ROLE_HTML = re.compile(
    r":(?:py:)?(?:func|class|mod|meth|attr|data|exc|obj|const):<code>(~?)([\w.]+)</code>"
)
ROLE_TEXT = re.compile(r":(?:py:)?\w+:`~?([^`]+)`")


def _modules() -> list[tuple[str, Path, bool]]:
    """``(dotted name, path, is_package)`` for every module under the package, sorted."""
    found = []
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        name = ".".join(parts)
        if any(name == s or name.startswith(s + ".") for s in SKIP):
            continue
        found.append((name, path, is_package))
    return sorted(found, key=lambda m: m[0])


def _summary(path: Path) -> str:
    """First line of the module's docstring, for the index page."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    line = doc.strip().splitlines()[0] if doc.strip() else ""
    return ROLE_TEXT.sub(r"`\1`", line).replace("|", "\\|")


def _uri(name: str) -> str:
    return f"api/{name}.md"


def _page(name: str, is_package: bool, children: list[str]) -> str:
    lines = [f"# `{name}`", ""]
    if is_package:
        lines += [f"::: {name}", "    options:", "      members: false", ""]
        if children:
            lines += ["## Modules", ""]
            lines += [f"- [`{child}`]({child}.md)" for child in children]
            lines.append("")
    else:
        lines += [f"::: {name}", ""]
    return "\n".join(lines)


def _children(name: str, names: list[str]) -> list[str]:
    depth = name.count(".") + 1
    return [n for n in names if n.startswith(name + ".") and n.count(".") == depth]


def _nav_tree(name: str, names: list[str], packages: set[str]) -> list:
    """Nav entries for ``name``'s children: modules as pages, packages as sections."""
    entries: list = []
    for child in _children(name, names):
        short = child.rsplit(".", 1)[-1]
        if child in packages:
            entries.append({short: [_uri(child), *_nav_tree(child, names, packages)]})
        else:
            entries.append({short: _uri(child)})
    return entries


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    modules = _modules()
    names = [m[0] for m in modules]
    packages = {m[0] for m in modules if m[2]}
    tree = [{PACKAGE: _uri(PACKAGE)}, *_nav_tree(PACKAGE, names, packages)]
    for entry in config.nav or []:
        if isinstance(entry, dict) and SECTION in entry:
            section = entry[SECTION]
            if isinstance(section, str):
                section = [section]
            entry[SECTION] = [*section, *tree]
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    modules = _modules()
    names = [m[0] for m in modules]
    rows = ["| module | what it is |", "|---|---|"]
    for name, path, is_package in modules:
        children = _children(name, names) if is_package else []
        files.append(File.generated(config, _uri(name), content=_page(name, is_package, children)))
        rows.append(f"| [`{name}`]({name}.md) | {_summary(path)} |")
    index = files.get_file_from_path("api/index.md")
    if index is not None:
        # the hand-written intro, then the table of every module
        text = Path(index.abs_src_path).read_text(encoding="utf-8")
        files.remove(index)
        content = text + "\n" + "\n".join(rows) + "\n"
        files.append(File.generated(config, "api/index.md", content=content))
    return files


def on_page_content(html: str, page: Page, **kwargs: object) -> str:
    """Turn the docstrings' Sphinx roles (``:func:`name```) into links where the target is known.

    A bare name is looked up in the page's own module; the link is optional, so a name that is not
    documented stays plain code (``~`` shows the last component only, as in Sphinx).
    """
    uri = page.file.src_uri
    module = uri[len("api/") : -len(".md")] if uri.startswith("api/") else ""

    def link(match: re.Match[str]) -> str:
        tilde, target = match.groups()
        shown = target.rsplit(".", 1)[-1] if tilde else target
        ident = target if "." in target or not module else f"{module}.{target}"
        return f'<autoref identifier="{ident}" optional><code>{shown}</code></autoref>'

    return ROLE_HTML.sub(link, html)
