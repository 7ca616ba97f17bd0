"""``scripts/atlas_circuit_neurons.py`` on the bundled model: a saved circuit's strongest named
neurons in a table read from the atlas (the same figures as the atlas's records), and their pages
as a subset site."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from helpers import BATCH, bundled, corpus_rows  # noqa: E402

from tl_attnonly.analysis import Circuit, discover_circuit, logit_diff_metric  # noqa: E402
from tl_attnonly.atlas import Atlas, AtlasOptions, build_atlas  # noqa: E402
from tl_attnonly.atlas.records import parse_label  # noqa: E402

SCRIPTS = Path(__file__).parents[2] / "scripts"


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_script_tables_a_circuits_named_neurons_from_the_atlas(tmp_path, capsys):
    sys.path.insert(0, str(SCRIPTS))
    import atlas_circuit_neurons as script

    model = bundled("bridge")
    rows = corpus_rows(model)
    opts = AtlasOptions(k=4, before=3, after=2, max_len=48)
    build_atlas(model, rows, tmp_path / "atlas", options=opts, batch_size=BATCH, progress=False)
    clean = torch.stack([r[:12] for r in rows[:4]])
    corrupted = torch.stack([r[:12] for r in rows[4:8]])
    metric = logit_diff_metric(clean[:, -1] * 0 + 10, clean[:, -1] * 0 + 11)
    circuit = discover_circuit(model, clean, corrupted, metric, neurons_per_mlp=3,
                               gate_value=False, progress=False)  # fmt: skip
    circuit.save(tmp_path / "circuit")
    script.main(["--circuit", str(tmp_path / "circuit"), "--atlas", str(tmp_path / "atlas"),
                 "--top", "2", "--pages", str(tmp_path / "pages"), "--link", "p"])  # fmt: skip
    out = capsys.readouterr().out
    named = script.strongest_named(Circuit.load(tmp_path / "circuit"), 2)
    assert len(named) == 2
    atlas = Atlas.load(tmp_path / "atlas")
    for name in named:
        record = atlas[name].record
        row = next(line for line in out.splitlines() if line.startswith(f"| [{name}](p/"))
        assert f"{100 * record['activation_frequency']:.2f}%" in row
        assert f"`{record['top_logits'][0][0]!r}`" in row
    assert Atlas.load(tmp_path / "pages").meta["subset"] == sorted(named, key=parse_label)
