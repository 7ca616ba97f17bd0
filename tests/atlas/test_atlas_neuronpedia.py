"""The Neuronpedia export validates against (a transcription of) Neuronpedia's feature-details
schema, and says what the atlas says: the same neuron, contexts, logits and statistics."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from helpers import BATCH, bundled, corpus_rows  # noqa: E402
from test_atlas_state import OPTS  # noqa: E402

from tl_attnonly.atlas import Atlas, build_atlas  # noqa: E402
from tl_attnonly.atlas.neuronpedia import TOP_NAME  # noqa: E402
from tl_attnonly.atlas.site import read_record  # noqa: E402

SCHEMA = json.loads((Path(__file__).parent / "data" / "neuronpedia_feature_details.schema.json")
                    .read_text("utf-8"))  # fmt: skip


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = bundled("bridge")
    site = tmp_path_factory.mktemp("site")
    build_atlas(model, corpus_rows(model), site, options=OPTS, batch_size=BATCH, progress=False)
    out = tmp_path_factory.mktemp("neuronpedia")
    assert Atlas.load(site).to_neuronpedia(out) == 2 * 512
    return Atlas.load(site), out


def test_every_file_validates(exported):
    atlas, out = exported
    validator = jsonschema.Draft7Validator(SCHEMA)
    files = sorted(out.rglob("*.json"))
    assert len(files) == 2 * 512
    for path in files:
        validator.validate(json.loads(path.read_text("utf-8")))
    broken = json.loads(files[0].read_text("utf-8"))
    del broken["index"]
    with pytest.raises(jsonschema.ValidationError, match="index"):
        validator.validate(broken)


def test_export_says_what_the_atlas_says(exported):
    atlas, out = exported
    record = read_record(atlas.directory, 1, 34)
    data = json.loads((out / "1" / "34.json").read_text("utf-8"))
    assert data["index"] == 34 and data["transcoder_id"] == "1-mlp-neurons"
    assert data["act_max"] == record["act_max"] and data["act_min"] == record["act_min"]
    assert data["activation_frequency"] == record["activation_frequency"]
    assert data["top_logits"] == [text for text, _ in record["top_logits"]]
    assert sum(data["histogram"]) == record["n_tokens"]
    top = data["examples_quantiles"][0]
    assert top["quantile_name"] == TOP_NAME
    assert len(top["examples"]) == len(record["top_examples"])
    for example, context in zip(top["examples"], record["top_examples"]):
        centre = example["train_token_ind"]
        assert example["tokens_acts_list"][centre] == context["act"]
        assert example["tokens"][centre] == atlas.vocab[context["tokens"][OPTS.before]]
        assert len(example["tokens"]) == sum(t >= 0 for t in context["tokens"])
    assert len(data["examples_quantiles"]) == 1 + len(record["examples_quantiles"])
    assert data["quantile_values"] == [q["range"][0] for q in record["examples_quantiles"]]
