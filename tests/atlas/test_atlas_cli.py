"""``tl-attnonly atlas``: a site from a corpus file, and clear errors that write nothing."""

from __future__ import annotations

import json

import pytest

from tl_attnonly import cli
from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER
from tl_attnonly.atlas import Atlas
from tl_attnonly.cli import main

SMALL = ["--max-rows", "3", "--max-len", "24", "--batch-size", "2", "--k", "3", "--no-progress"]
KINDS = [pytest.param([], id="default"), pytest.param(["--bridge"], id="bridge")]


@pytest.mark.parametrize("kind", KINDS)
def test_atlas_from_text_and_jsonl(kind, tmp_path, capsys):
    if not kind and not HAS_HOOKED_TRANSFORMER:
        kind = ["--bridge"]  # the default on TransformerLens 4.x
    text = tmp_path / "docs.txt"
    text.write_text("def add(a, b):\n\n    return a + b\nclass Foo:\n    pass\n")
    out = tmp_path / "site"
    assert main(["atlas", "--corpus", str(text), "--out", str(out), *SMALL, *kind]) == 0
    assert "index.html" in capsys.readouterr().out
    atlas = Atlas.load(out)
    assert atlas.manifest["model_name"] == "tiny-stdlib-silu"
    assert atlas.meta["n_rows"] == 3  # three non-empty lines, one row each
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text(json.dumps({"text": "import os\nprint(os.sep)"}) + "\n")
    # the same model's atlas may be rewritten in place
    assert main(["atlas", "--corpus", str(jsonl), "--out", str(out), *SMALL, *kind]) == 0
    assert Atlas.load(out).meta["n_rows"] == 1


@pytest.mark.parametrize(
    "content, message",
    [(None, "no such file"), ("\n  \n", "is empty"), ('{"txt": 1}\n', 'no "text"')],
)
def test_bad_corpus_writes_nothing(content, message, tmp_path, capsys):
    corpus = tmp_path / ("c.jsonl" if content and "txt" in content else "c.txt")
    if content is not None:
        corpus.write_text(content)
    out = tmp_path / "site"
    assert main(["atlas", "--corpus", str(corpus), "--out", str(out), *SMALL]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_out_with_another_models_atlas(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_has_hooked_transformer", lambda: HAS_HOOKED_TRANSFORMER)
    out = tmp_path / "site"
    out.mkdir()
    other = {"manifest": {"model_name": "gpt2", "n_layers": 12, "d_mlp": 3072}}
    (out / "atlas.json").write_text(json.dumps(other))
    (out / "index.html").write_text("theirs")
    assert main(["atlas", "--out", str(out), *SMALL]) == 2
    assert "another model (gpt2" in capsys.readouterr().err
    assert (out / "index.html").read_text() == "theirs"
    assert sorted(p.name for p in out.iterdir()) == ["atlas.json", "index.html"]


def test_out_with_other_files(tmp_path, capsys):
    out = tmp_path / "site"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["atlas", "--out", str(out), *SMALL]) == 2
    assert "holds no atlas" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_named_offline_corpora(tmp_path, capsys):
    from tl_attnonly.atlas.corpora import CORPORA

    out = tmp_path / "site"
    assert main(["atlas", "--corpus", "python-docs", "--out", str(out), *SMALL, "--bridge"]) == 0
    assert Atlas.load(out).meta["n_rows"] == 3
    docs = list(CORPORA["python-docs"]())
    assert len(docs) > 50 and all(d.strip() for d in docs)
    source = CORPORA["python-source"]()
    assert "import" in "".join(next(source) for _ in range(20))


def test_hugging_face_dataset_folder(tmp_path, capsys):
    """``hf:FOLDER`` streams a local dataset's ``text`` (the hub's ids go the same way); a
    dataset that cannot be read is refused before anything is written."""
    pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    folder.mkdir()
    rows = [{"text": "def f(x):\n    return x + 1\n"}, {"text": "import sys\nprint(sys.argv)"}]
    (folder / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "site"
    assert main(["atlas", "--corpus", f"hf:{folder}", "--out", str(out), *SMALL, "--bridge"]) == 0
    assert Atlas.load(out).meta["n_rows"] == 2
    missing = tmp_path / "none"
    assert main(["atlas", "--corpus", f"hf:{tmp_path / 'nothing'}", "--out", str(missing),
                 *SMALL, "--bridge"]) == 2  # fmt: skip
    assert "Cannot load the dataset" in capsys.readouterr().err and not missing.exists()
