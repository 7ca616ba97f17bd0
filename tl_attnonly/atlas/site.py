"""Writing the atlas's static site: an index, a page per layer, data files of 16 neurons each.

``{dir}/`` holds ``atlas.json`` (the manifest: the model's name and shape, the options, the token
count), ``state.safetensors`` (the mergeable state), ``index.html`` (search by label or token,
over ``index.js``), ``layer_{l}.html`` (a sortable table: firing frequency, min, max, top tokens;
and the layer's firing-frequency density), ``neuron.html`` (``neuron.html#L1N34`` loads
``neurons/L1/S2.js`` and ``vocab.js``) and the per-neuron records
(:func:`~tl_attnonly.atlas.records.neuron_record`), :data:`SHARD` to a file
``neurons/L{l}/S{s}.js``, a JSON object (neuron index -> record) wrapped as
``atlasShard({...});`` so that a page opened from ``file://`` can load it. ``centres.js``
holds, per neuron in the index's order, the centre tokens of its top contexts with their counts
and largest activations (:func:`~tl_attnonly.atlas.records.centre_tokens`), for
:meth:`~tl_attnonly.atlas.notebook.Atlas.search`.
"""

from __future__ import annotations

import functools
import html
import json
import math
from pathlib import Path
from typing import Any

from tl_attnonly.atlas.build import LogitEffect
from tl_attnonly.atlas.records import (
    centre_tokens,
    decode_record,
    edge_list,
    encode_record,
    label,
    neuron_record,
    top_tokens,
)
from tl_attnonly.atlas.templates import (
    INDEX_BODY,
    INDEX_JS,
    LAYER_BODY,
    NEURON_JS,
    page,
)

#: The manifest's file name.
MANIFEST = "atlas.json"
#: The file of every neuron's top-context centre tokens (:meth:`Atlas.search`).
CENTRES = "centres.js"
#: Neurons per data file: ``neurons/L{l}/S{s}.js`` holds neurons ``16 s`` to ``16 s + 15`` (a
#: neuron's record is about 5 kB; a file of 16 loads at once and wastes little of a disk block).
SHARD = 16


def js_data(function: str, data: Any) -> str:
    """``function(<data as JSON>);``."""
    return f"{function}({json.dumps(data, separators=(',', ':'))});\n"


def read_js_data(path: str | Path) -> Any:
    """The JSON object of a file :func:`js_data` wrote."""
    text = Path(path).read_text("utf-8")
    return json.loads(text[text.index("(") + 1 : text.rindex(")")])


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The finished atlas ``directory``'s manifest (``atlas.json``).

    Raises:
        FileNotFoundError: If ``directory`` holds no finished atlas.
    """
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"No atlas in {directory} (no {MANIFEST}).")
    return json.loads(path.read_text("utf-8"))


def check_format(directory: str | Path, meta: dict[str, Any]) -> None:
    """Refuse an atlas written in an earlier site format (a file per neuron, no ``shard`` in
    its manifest ``meta``), naming the command that writes it again.

    Raises:
        ValueError: For such an atlas.
    """
    if "shard" not in meta:
        directory = Path(directory)
        raise ValueError(
            f"The atlas in {directory} was written by an earlier version of tl_attnonly (a file "
            "per neuron); write its site again from its state: tl_attnonly.atlas.write_atlas("
            f"model, AtlasState.load('{directory / 'state.safetensors'}'), '{directory}')."
        )


def shard_file(directory: str | Path, layer: int, neuron: int, shard: int) -> Path:
    """The data file holding neuron ``neuron`` of layer ``layer`` (``shard`` neurons a file)."""
    return Path(directory) / "neurons" / f"L{layer}" / f"S{neuron // shard}.js"


@functools.lru_cache(maxsize=4)
def _read_shard(path: str, stamp: tuple[int, int]) -> dict[str, Any]:
    """A shard file's records (cached by path and ``(mtime_ns, size)``: a loop over the
    neurons of a layer reads each file once)."""
    return read_js_data(path)


def stored_record(
    directory: str | Path, layer: int, neuron: int, meta: dict[str, Any]
) -> dict[str, Any]:
    """Neuron ``neuron`` of layer ``layer``'s record as the atlas ``directory`` stores it
    (:func:`~tl_attnonly.atlas.records.encode_record`); ``meta``: its manifest.

    Raises:
        KeyError: If the atlas has no such neuron (a subset site holds some neurons only).
        ValueError: If the atlas was written in an earlier site format (:func:`check_format`).
    """
    directory = Path(directory)
    missing = KeyError(f"No neuron L{layer}N{neuron} in the atlas in {directory}.")
    check_format(directory, meta)
    path = shard_file(directory, layer, neuron, meta["shard"])
    if not path.is_file():
        raise missing
    stat = path.stat()
    data = _read_shard(str(path), (stat.st_mtime_ns, stat.st_size)).get(str(neuron))
    if data is None:
        raise missing
    return data


def read_record(
    directory: str | Path, layer: int, neuron: int, meta: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Neuron ``neuron`` of layer ``layer``'s record in the finished atlas ``directory``, as
    :func:`~tl_attnonly.atlas.records.neuron_record` made it (contexts unpacked). ``meta``: the
    atlas's manifest (``atlas.json``), read here if not given; a loop over neurons passes it.

    Raises:
        KeyError: If the atlas has no such neuron (a subset site holds some neurons only).
        ValueError: If the atlas was written in an earlier site format (:func:`check_format`).
    """
    if meta is None:
        meta = read_manifest(directory)
    return decode_record(stored_record(directory, layer, neuron, meta), meta["hist_edges"])


def write_shards(folder: Path, stored: dict[int, dict[str, Any]], shard: int) -> None:
    """Write the encoded records ``stored`` (neuron index -> record) of one layer into
    ``folder``, ``shard`` neurons a file, each ``atlasShard({"34": {...}, ...});``."""
    folder.mkdir(parents=True, exist_ok=True)
    files: dict[int, dict[str, Any]] = {}
    for i in sorted(stored):
        files.setdefault(i // shard, {})[str(i)] = stored[i]
    for s, records in files.items():
        (folder / f"S{s}.js").write_text(js_data("atlasShard", records), "utf-8")


def _density(freqs: list[float]) -> str:
    """An SVG bar chart of the neurons per bin of ``log10`` firing frequency (never: first)."""
    bins = [0] * 8  # 0, [1e-6,1e-5), ..., [0.1, 1]
    for f in freqs:
        bins[0 if f <= 0 else min(7, max(1, 7 + math.floor(math.log10(f))))] += 1
    names = ["never", "<1e-5", "1e-5", "1e-4", "1e-3", "1e-2", "1e-1", "1"]
    top = max(bins) or 1
    heights = [round(60 * c / top) for c in bins]
    bars = "".join(
        f"<rect x='{i * 50}' y='{60 - heights[i]}' width='44' height='{heights[i]}'"
        f" fill='#1a5fb4'><title>{names[i]}: {c}</title></rect>"
        f"<text x='{i * 50}' y='75' font-size='10'>{names[i]}</text>"
        for i, c in enumerate(bins)
    )
    return f"<svg width='400' height='80'>{bars}</svg>"


def write_site(
    out: Path,
    state: Any,
    logits: LogitEffect,
    vocab: list[str],
    max_len: int,
) -> None:
    """Write the site of ``state`` (an :class:`~tl_attnonly.atlas.build.AtlasState`) into the
    directory ``out`` (created).

    Args:
        out: The directory.
        state: The atlas's state.
        logits: Per layer, :func:`~tl_attnonly.atlas.build.logit_effect`.
        vocab: Every token's text.
        max_len: The row length of the state's global token indices.
    """
    out.mkdir(parents=True, exist_ok=True)
    manifest, opts = state.manifest, state.options
    n_tokens = int(state.n_tokens)
    edges = edge_list(opts)
    meta = {"manifest": manifest, "options": opts.to_dict(), "n_tokens": n_tokens,
            "n_rows": state.n_rows, "max_len": max_len, "hist_edges": edges,
            "shard": SHARD}  # fmt: skip
    state.save(out / "state.safetensors")
    (out / "vocab.js").write_text(js_data("atlasVocab", vocab), "utf-8")
    index_rows, centres = [], []
    for li, layer_state in enumerate(state.layers):
        cpu = _to_cpu(layer_state)
        top_v, top_i, bot_v, bot_i = (t.cpu() for t in logits[li])
        layer_logits = (top_v, top_i, bot_v, bot_i)
        rows, freqs, stored = [], [], {}
        for i in range(manifest["d_mlp"]):
            record = neuron_record(cpu, li, i, opts=opts, max_len=max_len, n_tokens=n_tokens,
                                   logits=layer_logits, vocab=vocab)  # fmt: skip
            stored[i] = encode_record(record, manifest["d_vocab"])
            row, tops = layer_row(record, vocab, opts.before)
            rows.append(row)
            freqs.append(record["activation_frequency"])
            centres.append(centre_tokens(record, opts.before))
            index_rows.append([label(li, i), round(freqs[-1], 6), record["act_max"], tops])
        write_shards(out / "neurons" / f"L{li}", stored, SHARD)
        write_layer_page(out, manifest["model_name"], li, rows, freqs)
    write_pages(out, meta, index_rows, centres, list(range(manifest["n_layers"])))


def layer_row(record: dict[str, Any], vocab: list[str], before: int) -> tuple[str, list[str]]:
    """The record's row of its layer page's table, and its top tokens."""
    i, name = record["neuron"], record["index"]
    tops = top_tokens(record, vocab, before)
    freq = record["activation_frequency"]
    cells = " | ".join(html.escape(t) for t in tops)
    row = (
        f"<tr><td data-v='{i}'><a href='neuron.html#{name}'>{name}</a>"
        f"</td><td data-v='{freq}'>{100 * freq:.3f}%</td><td>{record['act_max']}</td>"
        f"<td>{record['act_min']}</td><td>{cells}</td></tr>"
    )
    return row, tops


def write_layer_page(out: Path, model_name: str, li: int, rows: list[str], freqs: list[float]):
    """``layer_{li}.html``: the density of ``freqs`` and the table of ``rows``."""
    body = LAYER_BODY.format(model=html.escape(model_name), layer=li, density=_density(freqs),
                             rows="".join(rows))  # fmt: skip
    (out / f"layer_{li}.html").write_text(page(f"layer {li}", body), "utf-8")


def write_pages(
    out: Path, meta: dict[str, Any], index_rows: list, centres: list, layers: list[int]
) -> None:
    """The index (``index.html``, ``index.js``), ``centres.js``, ``neuron.html`` and, last (it
    marks the site complete), the manifest ``meta``."""
    manifest, opts = meta["manifest"], meta["options"]
    index = {"layers": layers, "neurons": index_rows}
    (out / "index.js").write_text(js_data("atlasIndex", index), "utf-8")
    (out / CENTRES).write_text(js_data("atlasCentres", centres), "utf-8")
    name = manifest["model_name"]
    if "subset" in meta:
        name = f"{name}, {len(index_rows)} of its neurons"
    body = INDEX_BODY.format(model=html.escape(name), n_tokens=meta["n_tokens"],
                             n_layers=manifest["n_layers"], d_mlp=manifest["d_mlp"])  # fmt: skip
    (out / "index.html").write_text(page("neuron atlas", body, INDEX_JS), "utf-8")
    neuron_body = "<div id='main'>loading...</div>"
    page_meta = {"before": opts["before"], "edges": meta["hist_edges"], "shard": meta["shard"]}
    data = f"var META={json.dumps(page_meta)};"
    (out / "neuron.html").write_text(page("neuron", neuron_body, NEURON_JS, data), "utf-8")
    (out / MANIFEST).write_text(json.dumps(meta, indent=1), "utf-8")  # last: marks it complete


def _to_cpu(layer_state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: ({f: t.cpu() for f, t in v.items()} if isinstance(v, dict) else v.cpu())
        for k, v in layer_state.items()
    }


__all__ = [
    "CENTRES",
    "MANIFEST",
    "SHARD",
    "check_format",
    "js_data",
    "layer_row",
    "read_js_data",
    "read_manifest",
    "read_record",
    "shard_file",
    "stored_record",
    "write_layer_page",
    "write_pages",
    "write_shards",
    "write_site",
]
