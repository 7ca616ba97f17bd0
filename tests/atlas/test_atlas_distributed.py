"""Ranks split the corpus and merge to one process's atlas, bit for bit: as shards in one process,
and as two gloo ranks under ``torchrun`` running ``tl-attnonly atlas``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from helpers import MAX_LEN, bundled, corpus_rows  # noqa: E402
from test_atlas_state import OPTS, assert_same  # noqa: E402

from tl_attnonly.atlas import collect_atlas  # noqa: E402
from tl_attnonly.cli import main  # noqa: E402


def test_shards_merge_to_one_pass():
    model = bundled("bridge")
    rows = corpus_rows(model)  # 8 rows: 4 batches of 2, interleaved over 2 and 3 shards
    whole = collect_atlas(model, rows, options=OPTS, batch_size=2)
    for world in (2, 3):
        parts = [collect_atlas(model, rows, options=OPTS, batch_size=2, shard=(r, world))
                 for r in range(world)]  # fmt: skip
        assert sum(int(p.n_tokens) for p in parts) == int(whole.n_tokens)
        merged = parts[0]
        for part in parts[1:]:
            merged = merged.merge(part)
        assert_same(merged, whole)
    with pytest.raises(ValueError, match="rank < world"):
        collect_atlas(model, rows, options=OPTS, shard=(2, 2))


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}  # fmt: skip


def test_torchrun_two_ranks_equal_one_process(tmp_path, capsys):
    args = ["atlas", "--max-rows", "12", "--max-len", str(MAX_LEN), "--batch-size", "2",
            "--k", "4", "--no-progress", "--bridge"]  # fmt: skip
    one, two = tmp_path / "one", tmp_path / "two"
    assert main([*args, "--out", str(one)]) == 0
    capsys.readouterr()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "tl_attnonly.cli", *args, "--out", str(two)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "2 ranks" in run.stdout and run.stdout.count("Atlas of") == 1  # rank 0 reports
    a, b = load_file(str(one / "state.safetensors")), load_file(str(two / "state.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    files_one, files_two = _files(one), _files(two)
    assert files_one.keys() == files_two.keys()  # no rank checkpoints left behind
    differ = [name for name in files_one if files_one[name] != files_two[name]]
    assert differ == [], differ
