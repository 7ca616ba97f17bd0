"""A reused run is bound to its task by identity (model, tokens, metric, positions), extras by
equality (:func:`tl_attnonly.analysis.task.same_binding`)."""

from __future__ import annotations

import torch
from conftest import make_tokens
from models import make_converted

from tl_attnonly.analysis import logit_diff_metric
from tl_attnonly.analysis.task import BOUND_BY_IDENTITY, DiscoveryTask, same_binding

CLEAN, CORRUPTED = make_tokens(2, 5, seed=0), make_tokens(2, 5, seed=1)
METRIC = logit_diff_metric(torch.tensor([1, 2]), torch.tensor([3, 4]))


def test_a_binding_holds_its_identity_entries_first():
    task = DiscoveryTask.make(make_converted("silu"), CLEAN, CORRUPTED, METRIC)
    binding = task.binding()
    assert len(binding) == BOUND_BY_IDENTITY
    assert same_binding(binding, task.binding())
    assert same_binding(binding + ("extra", 1), task.binding() + ("extra", 1))
    assert not same_binding(binding + ("extra", 1), binding + ("extra", 2))


def test_equal_but_distinct_tokens_or_metric_are_another_binding():
    task = DiscoveryTask.make(make_converted("silu"), CLEAN, CORRUPTED, METRIC)
    binding = task.binding()
    for index, other in ((1, task.clean.clone()), (2, task.corrupted.clone()), (3, lambda x: x)):
        changed = binding[:index] + (other,) + binding[index + 1 :]
        assert not same_binding(binding, changed)
    assert not same_binding(binding, task.replace(positions=object()).binding())
