"""Saved circuits' named neurons, explained by a neuron atlas: a table each and their pages.

For the ``--top`` named neurons of each circuit (``Circuit.save``; the SmolLM2 scripts'
``--save-circuit``) whose outgoing circuit edges have the largest summed ``|score|``, prints a
markdown table from the atlas (``tl-attnonly atlas``): the summed score, where the neuron writes
in the circuit, its firing frequency and largest activation, the tokens its top contexts centre
on, its top context (the centre token in brackets) and its direct logit effect (the tokens its
output raises and lowers most). With ``--pages DIR`` it also writes a small site of those
neurons' atlas pages, every circuit's in one (:func:`tl_attnonly.atlas.write_subset`), and
``--link PREFIX`` makes each label in the table a link to ``PREFIX/neuron.html#L{l}N{i}``.

Usage::

    python scripts/atlas_circuit_neurons.py --circuit DIR [DIR ...] --atlas ATLAS_DIR [--top 24]
        [--pages DIR] [--link PREFIX]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from circuit_smollm2_ioi import mlp_sources, strongest_named  # noqa: E402

from tl_attnonly.analysis import Circuit  # noqa: E402
from tl_attnonly.atlas import Atlas  # noqa: E402
from tl_attnonly.atlas.records import top_tokens  # noqa: E402


def _text(vocab: list[str], tokens: list[int], centre: int) -> str:
    parts = []
    for j, t in enumerate(tokens):
        if t < 0:
            continue
        s = vocab[t].replace("\n", "\\n").replace("|", "\\|").replace("`", "'")
        parts.append(f"[{s}]" if j == centre else s)
    return "".join(parts).strip()


def _tokens(rows: list, n: int) -> str:
    return ", ".join(f"`{t!r}`".replace("|", "\\|") for t, _ in rows[:n])


def neuron_table(circuit: Circuit, atlas: Atlas, top: int, link: str | None = None) -> str:
    """The markdown table of the module docstring."""
    frame = circuit.edges()
    names = strongest_named(circuit, top)
    before = atlas.meta["options"]["before"]
    lines = [
        "| neuron | out score | writes to | fires | act max | top contexts centre on | "
        "top context | raises | lowers |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        out = frame[frame.source == name]
        targets = out.assign(a=out.score.abs()).sort_values("a", ascending=False)
        where = ", ".join(f"{r.target}{':' + r.input if r.input else ''}"
                          for r in targets.head(3).itertuples())  # fmt: skip
        record = atlas[name].record
        centres = ", ".join(f"`{t!r}`" for t in top_tokens(record, atlas.vocab, before))
        first = record["top_examples"][0] if record["top_examples"] else None
        example = f"`{_text(atlas.vocab, first['tokens'], before)}`" if first else ""
        label = f"[{name}]({link}/neuron.html#{name})" if link else name
        lines.append(
            f"| {label} | {out.score.abs().sum():.3f} | {where} | "
            f"{100 * record['activation_frequency']:.2f}% | {record['act_max']:.2f} | "
            f"{centres.replace('|', chr(92) + '|')} | {example} | "
            f"{_tokens(record['top_logits'], 4)} | {_tokens(record['bottom_logits'], 4)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--circuit", required=True, nargs="+", help="saved circuits' directories")
    parser.add_argument("--atlas", required=True, help="the model's atlas (tl-attnonly atlas)")
    parser.add_argument("--top", type=int, default=24, help="named neurons shown per circuit")
    parser.add_argument("--pages", default=None, help="write their pages' site here")
    parser.add_argument("--link", default=None, help="link each label to PREFIX/neuron.html#...")
    args = parser.parse_args(argv)
    atlas = Atlas.load(args.atlas)
    print(f"atlas: {atlas!r}")
    shown: list[str] = []
    for path in args.circuit:
        circuit = Circuit.load(path)
        print(f"\n{path}: faithfulness {circuit.faithfulness:.3f}; {mlp_sources(circuit)}\n")
        print(neuron_table(circuit, atlas, args.top, args.link))
        shown += strongest_named(circuit, args.top)
    if args.pages:
        atlas.subset(shown, args.pages)
        print(f"\n{len(set(shown))} neuron pages written to {args.pages} (open index.html)")


if __name__ == "__main__":
    main()
