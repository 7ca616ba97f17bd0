"""The atlas in Neuronpedia's feature-details format: one JSON file per neuron.

Neuronpedia's graph viewer and circuit-tracer's local server read a feature's details as
``{transcoder_id, index, examples_quantiles, top_logits, bottom_logits, act_min, act_max,
quantile_values, histogram, activation_frequency}``. :func:`neuronpedia_feature` maps an atlas
record (:func:`~tl_attnonly.atlas.records.neuron_record`) onto it:

- ``transcoder_id``: ``"{layer}-{source_set}"`` (Neuronpedia's source naming); ``index``: the
  neuron's index in its layer;
- ``examples_quantiles``: ``"Top activations"`` (the atlas's top contexts), then one
  ``"Subsample Interval {b}"`` per activation bucket that has samples; each example's ``tokens``
  are the window's token texts (tokens outside the row dropped), ``tokens_acts_list`` their
  activations (as the site stores them, in int8 steps; the centre's to 4 decimals),
  ``train_token_ind`` the centre token's place, ``is_repeated_datapoint`` false;
- ``top_logits``, ``bottom_logits``: the token texts of the largest and smallest direct logit
  effects;
- ``quantile_values``: the lower activation edge of each listed subsample interval;
- ``histogram``: the token counts of the atlas's histogram bins (``histogram_edges`` adds the
  edges, an extra field).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tl_attnonly.atlas.site import read_js_data, read_manifest, read_record

#: The quantile name of the top contexts.
TOP_NAME = "Top activations"


def _example(context: dict[str, Any], vocab: list[str], before: int) -> dict[str, Any]:
    inside = [j for j, token in enumerate(context["tokens"]) if token >= 0]
    acts = list(context["acts"])  # as stored (int8 steps); the centre to 4 decimals
    acts[before] = context["act"]
    return {
        "tokens": [vocab[context["tokens"][j]] for j in inside],
        "tokens_acts_list": [acts[j] for j in inside],
        "train_token_ind": inside.index(before),
        "is_repeated_datapoint": False,
    }


def neuronpedia_feature(
    record: dict[str, Any], vocab: list[str], before: int, source_set: str = "mlp-neurons"
) -> dict[str, Any]:
    """The Neuronpedia feature details of one atlas record (module docstring).

    Args:
        record: A neuron's record (:func:`~tl_attnonly.atlas.site.read_record`).
        vocab: Every token's text (the atlas's ``vocab.js``).
        before: Tokens before each context's centre (the atlas's ``before`` option).
        source_set: The source set's name in ``transcoder_id`` (``"{layer}-{source_set}"``).
    """
    quantiles = [
        {
            "quantile_name": TOP_NAME,
            "examples": [_example(c, vocab, before) for c in record["top_examples"]],
        }
    ]
    for b, bucket in enumerate(record["examples_quantiles"]):
        quantiles.append(
            {
                "quantile_name": f"Subsample Interval {b}",
                "examples": [_example(c, vocab, before) for c in bucket["examples"]],
            }
        )
    return {
        "transcoder_id": f"{record['layer']}-{source_set}",
        "index": record["neuron"],
        "examples_quantiles": quantiles,
        "top_logits": [text for text, _ in record["top_logits"]],
        "bottom_logits": [text for text, _ in record["bottom_logits"]],
        "act_min": record["act_min"],
        "act_max": record["act_max"],
        "quantile_values": [bucket["range"][0] for bucket in record["examples_quantiles"]],
        "histogram": [float(c) for c in record["histogram"]["counts"]],
        "histogram_edges": record["histogram"]["edges"],
        "activation_frequency": record["activation_frequency"],
    }  # fmt: skip


def export_neuronpedia(
    atlas_dir: str | Path, out_dir: str | Path, source_set: str = "mlp-neurons"
) -> int:
    """Write every neuron of the atlas in ``atlas_dir`` as ``{out_dir}/{layer}/{index}.json``.

    Returns:
        The number of files written.

    Raises:
        FileNotFoundError: If ``atlas_dir`` holds no finished atlas.
    """
    directory, out = Path(atlas_dir), Path(out_dir)
    meta = read_manifest(directory)
    before, vocab = meta["options"]["before"], read_js_data(directory / "vocab.js")
    written = 0
    for layer in range(meta["manifest"]["n_layers"]):
        folder = out / str(layer)
        folder.mkdir(parents=True, exist_ok=True)
        for neuron in range(meta["manifest"]["d_mlp"]):
            record = read_record(directory, layer, neuron, meta)
            data = neuronpedia_feature(record, vocab, before, source_set)
            (folder / f"{neuron}.json").write_text(json.dumps(data), "utf-8")
            written += 1
    return written


__all__ = ["TOP_NAME", "export_neuronpedia", "neuronpedia_feature"]
