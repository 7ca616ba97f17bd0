"""Receivers of path patching (tl_attnonly.analysis.path_patching.parse_receiver)."""

from __future__ import annotations

import pytest

from tl_attnonly.analysis.path_patching import Receiver, parse_receiver
from tl_attnonly.hooks import HeadRef


@pytest.mark.parametrize(
    ("ref", "inputs"),
    [(HeadRef("attn", 1, 0), "qkv"), (HeadRef("neuron", 0, 5), "qv")],
)
def test_a_head_ref_receives_all_its_inputs(ref, inputs):
    # A HeadRef is a NamedTuple: it must not be read as a (label, inputs) pair.
    assert parse_receiver(ref) == Receiver(ref, inputs)


def test_a_pair_names_the_inputs():
    ref = HeadRef("attn", 1, 0)
    assert parse_receiver((ref, "kq")) == Receiver(ref, "qk")
    assert parse_receiver(("L2N17.1", "v"), n_heads_per_neuron=2) == Receiver(
        HeadRef("neuron", 2, 35), "v"
    )
    with pytest.raises(ValueError, match="subset of 'qv'"):
        parse_receiver((HeadRef("neuron", 0, 1), "k"))
