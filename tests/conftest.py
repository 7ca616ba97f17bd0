"""A zoo of small random TransformerLens models, built offline from HookedTransformerConfig.

The analysis and vis tests take these configs through ``tests/models.py``: the HookedTransformer
made here on TransformerLens 3.x, a TransformerBridge of the same architecture on 4.x."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import settings

try:
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    HAS_HOOKED_TRANSFORMER = True
except ImportError:  # TransformerLens 4.x: TransformerBridge only (tests/bridge runs there)
    HAS_HOOKED_TRANSFORMER = False

warnings.filterwarnings("ignore", message="HookedTransformer is deprecated")

# The config fuzz test's long run: pytest -m slow --hypothesis-profile=tl-attnonly-fuzz
settings.register_profile("tl-attnonly-fuzz", max_examples=2000)

D_VOCAB = 61

#: name -> HookedTransformerConfig overrides. Together they cover the architectures the
#: conversion must handle (issue: LN, LNPre, RMS, RMSPre, none, learned/rotary positions,
#: parallel attn+mlp, GQA, bidirectional, use_hook_mlp_in, use_attn_result).
ZOO: dict[str, dict] = {
    "ln_learned": dict(normalization_type="LN"),
    "lnpre": dict(normalization_type="LNPre"),
    "rms_rotary": dict(normalization_type="RMS", positional_embedding_type="rotary", rotary_dim=8),
    "rmspre": dict(normalization_type="RMSPre"),
    "no_norm": dict(normalization_type=None),
    "parallel_neox": dict(
        normalization_type="LN",
        parallel_attn_mlp=True,
        positional_embedding_type="rotary",
        rotary_dim=4,
    ),
    "gqa": dict(normalization_type="RMS", n_heads=4, d_head=4, n_key_value_heads=2),
    "bidirectional": dict(normalization_type="LN", attention_dir="bidirectional"),
    "hook_mlp_in_attn_result": dict(
        normalization_type="LN", use_hook_mlp_in=True, use_attn_result=True
    ),
}

_LLAMA = dict(
    normalization_type="RMS",
    positional_embedding_type="rotary",
    rotary_dim=4,
    rotary_adjacent_pairs=False,
    n_heads=4,
    d_head=4,
    n_key_value_heads=2,
    final_rms=True,
    gated_mlp=True,
)
_GEMMA = dict(
    _LLAMA,
    act_fn="gelu_pytorch_tanh",
    use_normalization_before_and_after=True,
    attn_scores_soft_cap=5.0,
    output_logits_soft_cap=3.0,
    use_local_attn=True,
    window_size=3,
    attn_types=["global", "local"],
)

#: name -> overrides of gated-MLP configs mirroring TransformerLens's gated model families (act_fn
#: silu unless given). Issue 13: LLaMA/Mistral RMS+rotary+GQA; Qwen2 QKV biases (every TL attention
#: has b_Q/b_K/b_V, made non-zero by randomize_); Gemma 2 GeGLU tanh + norms before and after + soft
#: caps + local windows; Gemma 3 qk-norm; OLMo-2 post-norm; Phi-3.
GATED_ZOO: dict[str, dict] = {
    "llama": _LLAMA,
    "mistral_window": dict(_LLAMA, use_local_attn=True, window_size=3, attn_types=["local"] * 2),
    "qwen2": dict(_LLAMA, rotary_base=1_000_000),
    "gemma2": _GEMMA,
    "gemma3": dict(_GEMMA, use_qk_norm=True, rotary_base_local=10_000),
    "olmo2": dict(_LLAMA, n_key_value_heads=None, original_architecture="Olmo2ForCausalLM"),
    "phi3": dict(_LLAMA, n_key_value_heads=None, rotary_dim=4),
    "reglu_ln": dict(normalization_type="LN", act_fn="relu", gated_mlp=True),
}


def make_config(
    act_fn: str = "silu", dtype: torch.dtype = torch.float64, seed: int = 0, **overrides
) -> HookedTransformerConfig:
    kwargs = dict(
        n_layers=2,
        d_model=16,
        n_heads=2,
        d_head=8,
        d_mlp=24,
        d_vocab=D_VOCAB,
        n_ctx=12,
        act_fn=act_fn,
        seed=seed,
        dtype=dtype,
        device="cpu",
    )
    kwargs.update(overrides)
    return HookedTransformerConfig(**kwargs)


def randomize_(model: HookedTransformer, seed: int = 0) -> HookedTransformer:
    """Make every LN weight/bias and every bias non-trivial, so nothing passes by accident."""
    g = torch.Generator().manual_seed(seed + 1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
            if name.endswith(".w"):  # norm scales
                p.copy_(1.0 + 0.3 * noise)
            elif name.split(".")[-1].startswith("b"):  # biases (b_in, b_out, b_Q, ...)
                p.copy_(0.3 * noise)
            elif name.endswith(("W_in", "W_gate")):  # pre-activations over a useful range
                p.mul_(3.0)
    return model


def make_model(
    act_fn: str = "silu", dtype: torch.dtype = torch.float64, seed: int = 0, **overrides
) -> HookedTransformer:
    model = HookedTransformer(make_config(act_fn, dtype, seed, **overrides))
    return randomize_(model, seed).eval()


def make_tokens(batch: int = 2, pos: int = 10, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, D_VOCAB, (batch, pos), generator=torch.Generator().manual_seed(seed))


#: Tokens whose mean logit is the patching tests' metric.
PATCH_TARGETS = torch.tensor([3, 17, 42])


def patch_metric(logits: torch.Tensor) -> torch.Tensor:
    """Mean logit of a few tokens over every position: sensitive to every position's stream."""
    return logits[..., PATCH_TARGETS].mean()


def patch_token_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """(clean, corrupted) tokens ``[2, 10]`` for the patching tests: two positions (2, 6) differ."""
    clean = make_tokens(seed=0)
    corrupted = clean.clone()
    corrupted[:, 2] = (clean[:, 2] + 11) % D_VOCAB
    corrupted[:, 6] = (clean[:, 6] + 5) % D_VOCAB
    return clean, corrupted


@pytest.fixture(params=sorted(ZOO))
def zoo_name(request) -> str:
    return request.param


@pytest.fixture
def tokens() -> torch.Tensor:
    return make_tokens()


def fused_magnitude(coefficients, x: torch.Tensor) -> torch.Tensor:
    """``sum_k (|f_k x| + |e_k| + 2 |g_k|)``: the scale the fused path's rounding is bound by."""
    c = coefficients
    return sum(abs(f) * x.abs() + abs(e) + 2 * abs(g) for f, e, g in zip(c.f, c.e, c.g))


if not HAS_HOOKED_TRANSFORMER:

    class _NeedsHookedTransformer(pytest.Module):
        """A test module that skips (instead of failing to collect) on TransformerLens 4.x when
        it imports HookedTransformer, HookedEncoder or TL 3.x's component tree."""

        def _getobj(self):
            try:
                return super()._getobj()
            except self.CollectError as error:
                message = str(error)
                markers = (
                    "removed in TransformerLens 4.0",  # TL's own pointer (HookedTransformer, ...)
                    "transformer_lens.components",  # TL 3.x's component tree
                    "needs TransformerLens's HookedTransformer",  # tl_attnonly's refusals
                )
                if any(marker in message for marker in markers):
                    pytest.skip(
                        "needs HookedTransformer (TransformerLens 3.x); on 4.x only "
                        "TransformerBridge conversion (tests/bridge) applies",
                        allow_module_level=True,
                    )
                raise

    def pytest_pycollect_makemodule(module_path, parent):
        return _NeedsHookedTransformer.from_parent(parent, path=module_path)

    _TL3_ONLY = (
        "removed in TransformerLens 4.0",
        "needs TransformerLens's HookedTransformer",
        "which TransformerLens 4.x removed",  # tl_attnonly's refusals (bundled model, CLI)
        "name 'HookedTransformer' is not defined",
        "name 'HookedTransformerConfig' is not defined",
        "No module named 'transformer_lens.components'",
        "No module named 'transformer_lens.loading_from_pretrained'",
        "No module named 'transformer_lens.pretrained'",
    )

    def _needs_hooked_transformer(error: BaseException | None) -> bool:
        seen = set()
        while error is not None and id(error) not in seen:
            seen.add(id(error))
            if any(marker in str(error) for marker in _TL3_ONLY):
                return True
            error = error.__cause__ or error.__context__
        return False

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item, call):
        """On TransformerLens 4.x, a test that fails only because it needs HookedTransformer
        (or TL 3.x's component tree) is reported as skipped, with that reason."""
        outcome = yield
        report = outcome.get_result()
        if call.excinfo is None or report.passed or "bridge" in item.path.parts:
            return  # tests/bridge must pass on 4.x: never turned into skips
        if _needs_hooked_transformer(call.excinfo.value):
            report.outcome = "skipped"
            report.longrepr = (
                str(item.path),
                item.location[1] or 0,
                "Skipped: needs HookedTransformer (TransformerLens 3.x)",
            )
