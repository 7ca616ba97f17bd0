"""The atlas in Jupyter: :class:`Atlas` reads a site's directory; ``atlas["L1N34"]`` shows the
neuron's page inline (static HTML, no script), ``atlas.search(token)`` lists neurons by token.
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tl_attnonly.atlas.records import parse_label
from tl_attnonly.atlas.site import CENTRES, read_js_data, read_manifest, read_record


def _ctx_html(example: dict[str, Any], vocab: list[str], before: int) -> str:
    """One context: tokens coloured by the neuron-head's self weight, the centre boxed."""
    spans = []
    for j, (token, act, s) in enumerate(zip(example["tokens"], example["acts"], example["self"])):
        if token < 0:
            continue
        text = html.escape(vocab[token].replace("\n", "\u21b5"))
        box = "outline:1px solid #000;" if j == before else ""
        spans.append(f"<span style='background:rgba(220,50,32,{s:.3f});{box}' "
                     f"title='act {act}, self {s}'>{text}</span>")  # fmt: skip
    centre = f"<span style='color:#777'>{example['act']:.3f} </span>"
    return f"<div style='font-family:monospace;white-space:pre'>{centre}{''.join(spans)}</div>"


def _logit_table(rows: list[list[Any]]) -> str:
    cells = "".join(f"<tr><td>{html.escape(repr(t))}</td><td>{v:.3f}</td></tr>" for t, v in rows)
    return f"<table>{cells}</table>"


@dataclass
class NeuronPage:
    """One neuron's record (:func:`~tl_attnonly.atlas.records.neuron_record`), shown inline."""

    record: dict[str, Any]
    vocab: list[str]
    before: int

    def __getitem__(self, key: str) -> Any:
        return self.record[key]

    def _repr_html_(self) -> str:
        d, ctx = self.record, lambda e: _ctx_html(e, self.vocab, self.before)
        parts = [
            f"<h3>{d['index']}</h3><p>fires (pre &gt; 0) on "
            f"{100 * d['activation_frequency']:.3f}% of {d['n_tokens']} tokens; activation "
            f"min {d['act_min']}, max {d['act_max']}, mean {d['act_mean']}</p>",
            "<div style='display:flex;gap:2em'><div><b>top logits</b>"
            f"{_logit_table(d['top_logits'])}</div><div><b>bottom logits</b>"
            f"{_logit_table(d['bottom_logits'])}</div></div><b>top contexts</b> (colour: self "
            "weight)",
            *map(ctx, d["top_examples"]),
        ]
        for name, quadrant in (d["quadrants"] or {}).items():
            parts.append(f"<b>{name}</b> ({quadrant['count']} tokens)")
            parts.extend(map(ctx, quadrant["examples"]))
        for bucket in d["examples_quantiles"]:
            parts.append(f"<b>activation {bucket['range'][0]} to {bucket['range'][1]}</b>")
            parts.extend(map(ctx, bucket["examples"]))
        return "<div>" + "".join(parts) + "</div>"


class Atlas:
    """A neuron atlas on disk (what :func:`~tl_attnonly.atlas.run.build_atlas` wrote).

    Example:
        >>> atlas = Atlas.load("tl_attnonly_atlas")  # doctest: +SKIP
        >>> atlas["L1N34"]  # the neuron's page, inline  # doctest: +SKIP
        >>> atlas.search(" return")  # doctest: +SKIP
    """

    def __init__(self, directory: Path, meta: dict[str, Any]):
        self.directory = directory
        self.meta = meta
        self.manifest: dict[str, Any] = meta["manifest"]
        self._vocab: list[str] | None = None
        self._index: dict[str, Any] | None = None
        self._centres: list[list[float]] | None = None

    @classmethod
    def load(cls, directory: str | Path) -> Atlas:
        """The atlas in ``directory``.

        Raises:
            FileNotFoundError: If ``directory`` holds no finished atlas.
        """
        directory = Path(directory)
        return cls(directory, read_manifest(directory))

    @property
    def vocab(self) -> list[str]:
        """Every token's text."""
        if self._vocab is None:
            self._vocab = read_js_data(self.directory / "vocab.js")
        return self._vocab

    def __getitem__(self, label: str) -> NeuronPage:
        """The page of neuron ``label`` (``"L1N34"``).

        Raises:
            KeyError: For a label not of this atlas.
        """
        try:
            record = read_record(self.directory, *parse_label(label), self.meta)
        except KeyError:
            raise KeyError(f"No neuron {label!r} in this atlas (labels like 'L0N0').") from None
        return NeuronPage(record, self.vocab, self.meta["options"]["before"])

    def search(self, token: str) -> Any:
        """The neurons whose top contexts centre most often on ``token`` (its text, with or
        without surrounding spaces): a DataFrame with ``label``, ``layer``, ``neuron``,
        ``count`` (top contexts centred on it), ``max_act`` (their largest activation) and
        ``activation_frequency``, most first. Reads the site's ``centres.js`` and ``index.js``
        (one file each, not a file per neuron)."""
        import pandas as pd

        ids = {i for i, t in enumerate(self.vocab) if t == token or t.strip() == token.strip()}
        index = self.index["neurons"]
        centres = self.centres
        rows = []
        for (name, freq, *_), flat in zip(index, centres, strict=True):
            hits = [(flat[j + 1], flat[j + 2]) for j in range(0, len(flat), 3) if flat[j] in ids]
            if hits:
                layer, neuron = parse_label(name)
                count = sum(int(c) for c, _ in hits)
                rows.append((name, layer, neuron, count, max(a for _, a in hits), freq))
        columns = ["label", "layer", "neuron", "count", "max_act", "activation_frequency"]
        frame = pd.DataFrame(rows, columns=columns)
        return frame.sort_values(["count", "max_act"], ascending=False, ignore_index=True)

    @property
    def index(self) -> dict[str, Any]:
        """The site's ``index.js``: ``layers`` and per neuron ``[label, firing frequency,
        act_max, top tokens]``."""
        if self._index is None:
            self._index = read_js_data(self.directory / "index.js")
        return self._index

    @property
    def centres(self) -> list[list[float]]:
        """Per neuron (the index's order) its top contexts' centre tokens, flat ``[id, count,
        act, ...]`` (:func:`~tl_attnonly.atlas.records.centre_tokens`)."""
        path = self.directory / CENTRES
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: this atlas was written before Atlas.search read it; "
                "write its site again with tl_attnonly.atlas.write_atlas(model, state, out)."
            )
        if self._centres is None:
            self._centres = read_js_data(path)
        return self._centres

    def subset(self, labels: Iterable[str], out_dir: str | Path) -> Atlas:
        """A site of the neurons ``labels`` alone (a circuit's, say) in ``out_dir``, loaded
        (:func:`~tl_attnonly.atlas.subset.write_subset`)."""
        from tl_attnonly.atlas.subset import write_subset

        return Atlas.load(write_subset(self.directory, labels, out_dir))

    def to_neuronpedia(self, out_dir: str | Path, source_set: str = "mlp-neurons") -> int:
        """Every neuron in Neuronpedia's feature-details format, as
        ``{out_dir}/{layer}/{index}.json`` (:mod:`tl_attnonly.atlas.neuronpedia`); returns the
        number of files."""
        from tl_attnonly.atlas.neuronpedia import export_neuronpedia

        return export_neuronpedia(self.directory, out_dir, source_set)

    def __repr__(self) -> str:
        m = self.manifest
        return (f"Atlas({m['model_name']}: {m['n_layers']} layers x {m['d_mlp']} neurons, "
                f"{self.meta['n_tokens']} tokens, {self.directory})")  # fmt: skip


__all__ = ["Atlas", "NeuronPage"]
