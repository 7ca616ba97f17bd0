"""run_with_derived_cache: CacheRunOptions and run_with_cache's keywords give identical caches."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, make_tokens

from tl_attnonly import convert
from tl_attnonly.hooked.derived_cache import CacheRunOptions, run_with_derived_cache
from tl_attnonly.hooked.model import AttnOnlyTransformer


@pytest.fixture(scope="module")
def model():
    return convert(make_model("gelu", torch.float64))


def _run(model, **kwargs):
    run = super(AttnOnlyTransformer, model).run_with_cache
    return run_with_derived_cache(model, run, (make_tokens(),), **kwargs)


KEYWORDS = [
    dict(names_filter=lambda n: "mlp" in n, pos_slice=-1, remove_batch_dim=False),
    dict(names_filter=["blocks.0.mlp.hook_z", "blocks.1.mlp.hook_pattern"], device="cpu"),
    dict(pos_slice=[0, 2], return_cache_object=False),
]


@pytest.mark.parametrize("kw", KEYWORDS, ids=range(len(KEYWORDS)))
def test_options_and_keywords_give_identical_caches(model, kw):
    out_kw, cache_kw = _run(model, **kw)
    out_opt, cache_opt = _run(model, options=CacheRunOptions(**kw))
    torch.testing.assert_close(out_opt, out_kw, rtol=0, atol=0)
    dict_kw = cache_kw if isinstance(cache_kw, dict) else cache_kw.cache_dict
    dict_opt = cache_opt if isinstance(cache_opt, dict) else cache_opt.cache_dict
    assert list(dict_opt) == list(dict_kw)
    for name in dict_kw:
        torch.testing.assert_close(dict_opt[name], dict_kw[name], rtol=0, atol=0)
    # The options matter (the test can fail): the default run caches other entries or shapes.
    _, plain = _run(model)
    assert list(plain.cache_dict) != list(dict_kw) or any(
        plain[n].shape != dict_kw[n].shape for n in dict_kw
    )


def test_a_keyword_replaces_the_option_and_forward_keywords_pass_through(model):
    _, cache = _run(
        model, options=CacheRunOptions(pos_slice=0), pos_slice=-1, stop_at_layer=1
    )
    _, expected = _run(model, pos_slice=-1, stop_at_layer=1)
    assert list(cache.cache_dict) == list(expected.cache_dict)
    assert not any(name.startswith("blocks.1.") for name in cache.cache_dict)
    for name in expected.cache_dict:
        torch.testing.assert_close(cache[name], expected[name], rtol=0, atol=0)
