"""Errors that name what is wrong (layer out of range, no PNG exporter); full-height PNGs."""

from __future__ import annotations

import importlib.util
import struct
import warnings

import pytest
import torch
from models import make_converted

import tl_attnonly.vis.export as export
from tl_attnonly.vis import neuron_head_attention_view, patching_heatmap, save_figure


@pytest.fixture(scope="module")
def cache():
    converted = make_converted("silu", dtype=torch.float32)
    tokens = torch.randint(0, 61, (1, 9), generator=torch.Generator().manual_seed(0))
    _, cache = converted.run_with_cache(tokens)
    return cache


STR_TOKENS = [f"t{i}" for i in range(9)]


def test_a_layer_out_of_range_is_named(cache):
    with pytest.raises(IndexError, match=r"layer 5 is out of range: the model has 2 layers"):
        neuron_head_attention_view(cache, 5, STR_TOKENS, top_k=2)
    with pytest.raises(IndexError, match=r"layer -1 is out of range"):
        neuron_head_attention_view(cache.model, -1, torch.tensor([1, 2, 3]))


def test_png_without_kaleido_names_the_package_even_with_chromium(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "kaleido" else real_find_spec(name, *args),
    )
    monkeypatch.setattr(export, "find_chromium", lambda: "/usr/bin/chromium")
    with pytest.warns(RuntimeWarning, match="kaleido package is not installed") as record:
        path = save_figure(patching_heatmap(torch.ones(2, 3)), tmp_path / "fig.png")
    assert "tl-attnonly[png]" in str(record[0].message)
    assert "install chromium" not in str(record[0].message)
    assert path == tmp_path / "fig.html" and path.exists()


def test_view_png_without_chromium_names_it(tmp_path, monkeypatch, cache):
    monkeypatch.setattr(export, "find_chromium", lambda: None)
    view = neuron_head_attention_view(cache, 0, STR_TOKENS, top_k=2)
    with pytest.warns(RuntimeWarning, match="no Chrome/Chromium executable on PATH"):
        path = save_figure(view, tmp_path / "view.png")
    assert path.suffix == ".html"


def _png_size(path) -> tuple[int, int]:
    return struct.unpack(">II", path.read_bytes()[16:24])


@pytest.mark.slow
def test_view_png_is_not_cut_at_800_px(tmp_path, cache):
    if export.find_chromium() is None:
        pytest.skip("no chromium on PATH")
    view = neuron_head_attention_view(cache, 0, STR_TOKENS, top_k=24)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = save_figure(view, tmp_path / "view.png", width=700, scale=1)
    width, height = _png_size(path)
    assert width == 700
    # the whole view (24 thumbnails, then the zoomed head), not the old fixed 800 px
    assert height > 1200
