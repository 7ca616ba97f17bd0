"""Figure layout: colour-bar ticks that do not overlap, room for rotated token labels."""

from __future__ import annotations

import torch
from models import make_converted

from tl_attnonly.vis import neuron_activity_heatmap, patching_heatmap
from tl_attnonly.vis.figures import _LABEL_PX


def _plot_px(fig) -> float:
    margin = fig.layout.margin
    return fig.layout.height - margin.t - margin.b


def test_short_heatmaps_have_few_colorbar_ticks():
    for n_layers in (1, 2, 3):
        fig = patching_heatmap(torch.randn(n_layers, 4))
        nticks = fig.data[0].colorbar.nticks
        assert nticks is not None and 3 <= nticks
        assert _plot_px(fig) / nticks >= 25, (n_layers, nticks, _plot_px(fig))


def test_rotated_token_labels_have_room_between_panels():
    converted = make_converted("silu", dtype=torch.float32)
    tokens = torch.randint(0, 61, (1, 9), generator=torch.Generator().manual_seed(0))
    _, cache = converted.run_with_cache(tokens)
    fig = neuron_activity_heatmap(cache, None, [f"token{i}" for i in range(9)], top_k=12)
    domains = [fig.layout.yaxis.domain, fig.layout.yaxis2.domain]
    gap = (
        (min(domains[0]) - max(domains[1]))
        if min(domains[0]) > max(domains[1])
        else (min(domains[1]) - max(domains[0]))
    )
    gap_px = gap * _plot_px(fig)
    assert gap_px >= _LABEL_PX, gap_px
    assert fig.layout.margin.b >= _LABEL_PX
    assert fig.layout.xaxis.automargin and fig.layout.xaxis2.automargin
