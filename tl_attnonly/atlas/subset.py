"""A small site of some neurons of an atlas: the pages of a circuit's neurons, to ship with docs
or a paper where the whole atlas (hundreds of megabytes for SmolLM2) cannot go.

:func:`write_subset` writes the named neurons' records as stored, the neuron page, the
vocabulary, an index, a ``centres.js`` and a page for each layer it touches that list those
neurons only. The result is an atlas like any other (:class:`~tl_attnonly.atlas.notebook.Atlas`
loads it, ``Atlas.search`` searches its neurons); its manifest's ``"subset"`` lists the labels.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tl_attnonly.atlas.records import centre_tokens, decode_record, label, parse_label
from tl_attnonly.atlas.site import (
    check_format,
    layer_row,
    read_js_data,
    read_manifest,
    stored_record,
    write_layer_page,
    write_pages,
    write_shards,
)


def _parse(labels: Iterable[str], n_layers: int, d_mlp: int) -> list[tuple[int, int]]:
    found = []
    for name in labels:
        try:
            layer, neuron = parse_label(name)
        except KeyError:
            layer = neuron = -1
        if not (0 <= layer < n_layers and 0 <= neuron < d_mlp):
            raise KeyError(
                f"{name!r} is not a neuron of this atlas (labels like 'L0N0'; {n_layers} layers "
                f"x {d_mlp} neurons)."
            )
        found.append((layer, neuron))
    return sorted(set(found))


def write_subset(atlas_dir: str | Path, labels: Iterable[str], out_dir: str | Path) -> Path:
    """Write a site of the neurons ``labels`` (``"L12N345"``) of the atlas in ``atlas_dir`` into
    ``out_dir`` (written to a temporary sibling first, then moved into place, replacing what
    was there).

    Args:
        atlas_dir: A finished atlas (:func:`~tl_attnonly.atlas.build_atlas`).
        labels: The neurons to keep, in any order (duplicates once).
        out_dir: The new site's directory.

    Returns:
        ``out_dir`` as a path.

    Raises:
        FileNotFoundError: If ``atlas_dir`` holds no finished atlas.
        ValueError: If it was written in an earlier site format, or ``labels`` is empty.
        KeyError: For a label that is not a neuron of the atlas (nothing is written).
    """
    src, out = Path(atlas_dir), Path(out_dir)
    meta = read_manifest(src)
    check_format(src, meta)
    manifest = meta["manifest"]
    neurons = _parse(labels, manifest["n_layers"], manifest["d_mlp"])
    if not neurons:
        raise ValueError("labels= is empty: name at least one neuron ('L0N0').")
    tmp = out.with_name(out.name + ".tmp-subset")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write(src, meta, neurons, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written
        raise
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def _write(src: Path, meta: dict[str, Any], neurons: list[tuple[int, int]], tmp: Path) -> None:
    """The subset site of ``neurons`` of the atlas ``src`` (manifest ``meta``) into ``tmp``."""
    vocab = read_js_data(src / "vocab.js")
    before = meta["options"]["before"]
    shutil.copy2(src / "vocab.js", tmp / "vocab.js")
    index_rows, centres, layers = [], [], sorted({li for li, _ in neurons})
    for li in layers:
        rows, freqs, stored = [], [], {}
        for i in (i for lj, i in neurons if lj == li):
            stored[i] = stored_record(src, li, i, meta)
            record = decode_record(stored[i], meta["hist_edges"])
            row, tops = layer_row(record, vocab, before)
            rows.append(row)
            freqs.append(record["activation_frequency"])
            centres.append(centre_tokens(record, before))
            index_rows.append([label(li, i), round(freqs[-1], 6), record["act_max"], tops])
        write_shards(tmp / "neurons" / f"L{li}", stored, meta["shard"])
        write_layer_page(tmp, meta["manifest"]["model_name"], li, rows, freqs)
    subset = {**meta, "subset": [label(li, i) for li, i in neurons]}
    write_pages(tmp, subset, index_rows, centres, layers)


__all__ = ["write_subset"]
