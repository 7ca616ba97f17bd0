"""``tl-attnonly demo --atlas DIR`` and ``write_demo_report(atlas=...)``: the circuit section's
figure, its list of pages and the circuit's report link the circuit's MLP nodes to their pages in
a neuron atlas of the model; a folder that is no atlas site, or the atlas of another model, is
refused before any work, naming the option."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

from tl_attnonly.cli import EXIT_USAGE, main

RUN_AND_REFUSE = "the demo loaded a model before checking --atlas"


@pytest.fixture(scope="module")
def atlas(tmp_path_factory) -> Path:
    """A small atlas of the bundled model (a converted bridge: both TransformerLens lines)."""
    import tl_attnonly
    from tl_attnonly.atlas import AtlasOptions, build_atlas
    from tl_attnonly.bundled import load_bundled_bridge

    out = tmp_path_factory.mktemp("report-atlas") / "atlas"
    model = tl_attnonly.convert(load_bundled_bridge())
    build_atlas(model, None, out, options=AtlasOptions(k=2, max_len=32), max_rows=2,
                progress=False)  # fmt: skip
    return out


def _circuit_section(path: Path) -> str:
    text = path.read_text(encoding="utf-8")
    return re.search(r'<section id="circuit">(.*?)</section>', text, flags=re.S).group(1)


def _first_figure(section: str) -> tuple[list[dict], dict]:
    """The traces and layout of the section's first ``Plotly.newPlot`` call (the circuit's)."""
    decoder = json.JSONDecoder()
    pos = section.index("Plotly.newPlot(") + len("Plotly.newPlot(")
    values = []
    for _ in range(3):  # the div id, the traces, the layout
        while section[pos] in " \n\t,":
            pos += 1
        value, pos = decoder.raw_decode(section, pos)
        values.append(value)
    return values[1], values[2]


def test_the_demos_circuit_links_its_mlp_nodes_to_the_atlas(atlas, tmp_path):
    report = tmp_path / "report.html"
    code = main(["demo", "--no-progress", "--bridge", "--report", str(report), "--atlas",
                 str(atlas)])  # fmt: skip
    assert code == 0
    section = _circuit_section(report)
    base = atlas.resolve().as_uri()
    traces, layout = _first_figure(section)
    links = layout["meta"]["atlas_links"]
    labels = [label for t in traces if t.get("mode") == "markers+text" for label in t["customdata"]]
    mlp = [label for label in labels if label.endswith("MLP")]
    assert mlp, "the demo's circuit has no MLP node to link"
    assert links == {label: f"{base}/layer_{label[1:-3]}.html" for label in mlp}
    for trace in traces:
        if trace.get("mode") != "markers+text":
            continue
        for label, text, hover in zip(trace["customdata"], trace["text"], trace["hovertext"]):
            if label in links:
                assert text in ("", f'<a href="{links[label]}">{label}</a>'), text
                assert hover.endswith(f"atlas page: {links[label]}")
            else:
                assert "<a" not in text and "atlas page" not in hover
    assert "gd.layout.meta || {}).atlas_links" in section  # the handler (file:// links)
    for label, url in links.items():  # the list under the figure, and the circuit's report
        assert f'<a href="{url}">{label}</a>' in section
        assert re.search(rf"^  {label} +{re.escape(url)}$", section, flags=re.M)
    assert "atlas pages of its named neurons and MLP nodes" in section


def _refused(argv: list[str], capsys, monkeypatch) -> str:
    """The demo's message for ``argv``, refused with exit code 2 before any model is loaded."""
    demo = importlib.import_module("tl_attnonly.cli.demo")  # the module (cli.demo: the function)

    def no_load(*args, **kwargs):
        raise AssertionError(RUN_AND_REFUSE)

    monkeypatch.setattr(demo, "_demo_loader", no_load)
    assert main(argv) == EXIT_USAGE
    return capsys.readouterr().err


def test_the_demo_refuses_a_folder_that_is_no_atlas(tmp_path, capsys, monkeypatch):
    report = tmp_path / "report.html"
    argv = ["demo", "--no-progress", "--report", str(report), "--atlas"]
    err = _refused([*argv, str(tmp_path / "missing")], capsys, monkeypatch)
    assert "--atlas" in err and "no such folder" in err
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("not an atlas")
    err = _refused([*argv, str(plain)], capsys, monkeypatch)
    assert f"--atlas {plain} is not a neuron atlas site (no atlas.json or index.html" in err
    assert "tl-attnonly atlas --out" in err
    (plain / "index.html").write_text("<html></html>")  # a site, but not finished: no manifest
    err = _refused([*argv, str(plain)], capsys, monkeypatch)
    assert "(no atlas.json:" in err
    (plain / "atlas.json").write_text("[1, 2]")
    err = _refused([*argv, str(plain)], capsys, monkeypatch)
    assert "is not an atlas manifest" in err
    assert not report.exists()


def test_the_demo_refuses_the_atlas_of_another_model(atlas, tmp_path, capsys, monkeypatch):
    report = tmp_path / "report.html"
    argv = ["demo", "--model", "smollm2", "--report", str(report), "--atlas", str(atlas)]
    err = _refused(argv, capsys, monkeypatch)
    assert (
        f"--atlas {atlas} is the atlas of tiny-stdlib-silu (2 layers x 512 neurons), not of "
        "SmolLM2-135M-Instruct, the model the demo draws" in err
    )
    assert "tl-attnonly atlas smollm2 --out" in err
    assert not report.exists()


def test_write_demo_report_refuses_an_atlas_of_another_shape_before_any_work(atlas, tmp_path):
    """The library's own check (a ``Path``): no site, or a manifest of another shape."""
    import tl_attnonly
    from tl_attnonly.bundled import load_bundled_bridge
    from tl_attnonly.report import write_demo_report

    converted = tl_attnonly.convert(load_bundled_bridge())
    path = tmp_path / "x.html"
    with pytest.raises(ValueError, match=r"atlas='.*empty': no neuron atlas site there"):
        (tmp_path / "empty").mkdir()
        write_demo_report(None, converted, "x", path, equivalence={}, atlas=tmp_path / "empty")
    other = tmp_path / "other"
    other.mkdir()
    (other / "index.html").write_text("<html></html>")
    meta = json.loads((atlas / "atlas.json").read_text("utf-8"))
    meta["manifest"]["d_mlp"] = 1024
    (other / "atlas.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"is the atlas of another model .*d_mlp 1024 here 512"):
        write_demo_report(None, converted, "x", path, equivalence={}, atlas=other)
    assert not path.exists()


def test_the_command_lines_copies_of_the_atlas_names_are_the_packages():
    """The demo checks ``--atlas`` without importing torch, with copies of these names."""
    from tl_attnonly.atlas.site import MANIFEST
    from tl_attnonly.bundled import BUNDLED_MODEL_NAME
    from tl_attnonly.cli.common import ATLAS_MANIFEST
    from tl_attnonly.cli.demo import DEMO_MODEL_NAMES
    from tl_attnonly.smollm2 import SMOLLM2_NAME

    assert ATLAS_MANIFEST == MANIFEST
    assert DEMO_MODEL_NAMES == {"bundled": BUNDLED_MODEL_NAME, "smollm2": SMOLLM2_NAME}
