"""The literal form (tl_attnonly.literal): plain attention everywhere, same function as before."""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import make_config
from transformer_lens import HookedTransformer

from tl_attnonly.components.literal_attention import LiteralAttention
from tl_attnonly.literal import (
    DEFAULT_OMEGA,
    LiteralBudgetError,
    LiteralTransformer,
    ResidualLayout,
    assemble_sublayer,
    linear_map_sublayer,
    neuron_pattern_compact,
    neuron_sublayer,
    omega_warnings,
    theorem6_tweaked_attention_heads,
    theorem8_activation_heads,
    theorem9_mask_qk,
    to_literal,
)

warnings.filterwarnings("ignore", message="HookedTransformer is deprecated")

D_VOCAB = 50
SILU = SimpleNamespace(b=(1.0,), d=(0.0,), f=(1.0,), e=(0.0,), g=(0.0,))
#: SiLU written as four heads with different scores (b, d) and non-zero value constants on the
#: token (e) and on the bias token (g, summing to 0.7): with p = sigmoid(x), q = sigmoid(2x + 0.7),
#: [p x + (1 - p) 0.3] + [-0.3 (1 - p)] + [0.4 (1 - q)] + [-0.4 (1 - q)] = x sigmoid(x).
SILU_FOUR_HEADS = SimpleNamespace(
    b=(1.0, -1.0, 2.0, -2.0),
    d=(0.0, 0.0, 0.7, -0.7),
    f=(1.0, 0.0, 0.0, 0.0),
    e=(0.0, -0.3, 0.0, -0.4),
    g=(0.3, 0.0, 0.4, 0.0),
)


def make_model(
    norm: str | None = "LN",
    attention_dir: str = "causal",
    dtype: torch.dtype = torch.float64,
    **overrides,
) -> HookedTransformer:
    """A tiny random model with non-trivial norm weights and biases everywhere."""
    kwargs = dict(
        d_mlp=32,
        d_vocab=D_VOCAB,
        init_weights=True,
        normalization_type=norm,
        attention_dir=attention_dir,
    )
    kwargs.update(overrides)
    act_fn = kwargs.pop("act_fn", "silu")
    model = HookedTransformer(make_config(act_fn, dtype, **kwargs))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
            if name.endswith(".w"):  # norm weights
                p.copy_(1.0 + 0.3 * noise)
            elif name.split(".")[-1].startswith("b"):  # every bias, norm biases included
                p.copy_(0.3 * noise)
            elif name.endswith("W_in"):  # pre-activations over a useful range
                p.mul_(3.0)
    return model.eval()


def make_tokens(batch: int = 2, pos: int = 10, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, D_VOCAB, (batch, pos), generator=torch.Generator().manual_seed(seed))


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


# ---------------------------------------------------------------------------- whole model


FP64_CASES = [
    (norm, attention_dir, layout)
    for norm in ("LN", "RMS", None)
    for attention_dir in ("causal", "bidirectional")
    for layout in ("neuron", "split")
] + [("LNPre", "causal", "split"), ("RMSPre", "bidirectional", "neuron")]


@pytest.mark.parametrize("norm, attention_dir, layout", FP64_CASES)
def test_fp64_logits_match_original(norm, attention_dir, layout):
    model = make_model(norm, attention_dir)
    tokens = make_tokens()
    literal = to_literal(model, layout=layout)
    assert isinstance(literal, LiteralTransformer)
    assert literal.W_E.dtype == torch.float64
    assert max_err(literal(tokens), model(tokens)) <= 1e-8


@pytest.mark.parametrize("layout", ["neuron", "split"])
@pytest.mark.parametrize("norm", ["LN", "RMS", None])
def test_fp32_logits_match_original(norm, layout):
    model = make_model(norm, "causal", dtype=torch.float32)
    tokens = make_tokens()
    literal = to_literal(model, layout=layout)
    assert literal.W_E.dtype == torch.float32
    assert max_err(literal(tokens), model(tokens)) <= 1e-3


@pytest.mark.parametrize("layout", ["neuron", "split"])
@pytest.mark.parametrize("mask", ["ordinary", "causal_ordinary"])
def test_ordinary_mask_options_match_original(mask, layout):
    model = make_model("LN", "causal")
    tokens = make_tokens()
    literal = to_literal(model, layout=layout, mask=mask)
    assert max_err(literal(tokens), model(tokens)) <= 1e-8
    modes = {m.mask_mode for _, m in literal.sublayers()}
    assert modes == ({"allowed"} if mask == "ordinary" else {"causal", "none"})


def test_omega_mask_has_no_mask_at_all():
    literal = to_literal(make_model())
    assert {m.mask_mode for _, m in literal.sublayers()} == {"none"}


def test_ordinary_mask_does_not_use_omega():
    model = make_model("LN", "causal")
    tokens = make_tokens()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # mask="ordinary" must not warn about omega either
        literal = to_literal(model, omega=1.0, mask="ordinary")
    assert literal.omega is None
    assert max_err(literal(tokens), model(tokens)) <= 1e-8


@pytest.mark.parametrize(
    "overrides",
    [
        dict(positional_embedding_type="rotary", rotary_dim=4, normalization_type="RMS"),
        dict(
            positional_embedding_type="rotary",
            rotary_dim=8,
            rotary_adjacent_pairs=True,
            normalization_type="LN",
        ),
        dict(n_heads=4, d_head=4, n_key_value_heads=2, normalization_type="RMS"),
        dict(normalization_type="LN", final_rms=True),
    ],
    ids=["rotary", "rotary_adjacent", "gqa", "final_rms"],
)
def test_more_architectures_match(overrides):
    model = make_model(**overrides)
    tokens = make_tokens()
    assert max_err(to_literal(model)(tokens), model(tokens)) <= 1e-8


def test_shorter_max_len_and_loss():
    model = make_model()
    tokens = make_tokens(pos=6)
    literal = to_literal(model, max_len=6)
    assert literal.layout.n_pos == 7
    assert max_err(literal(tokens), model(tokens)) <= 1e-8
    assert abs(literal(tokens, return_type="loss").item() - model(tokens, "loss").item()) < 1e-8
    with pytest.raises(ValueError, match="max_len"):
        literal(make_tokens(pos=7))


def test_general_heads_with_bias_token_values():
    """K = 4 heads per neuron, non-zero d, e and g (g moved to the output bias): still exact."""
    model = make_model("LN")
    tokens = make_tokens()
    _, ref = model.run_with_cache(tokens)
    for layout in ("neuron", "split"):
        literal = to_literal(model, layout=layout, coefficients=SILU_FOUR_HEADS)
        logits, cache = literal.run_with_cache(tokens)
        assert max_err(logits, model(tokens)) <= 1e-8
        assert cache["blocks.0.mlp.hook_pattern"].shape[1] >= 4 * 32
        for layer in range(2):
            assert max_err(cache[f"blocks.{layer}.mlp.hook_post"], ref["post", layer]) <= 1e-10


# ---------------------------------------------------------------------------- invariants


@pytest.mark.parametrize("layout", ["neuron", "split"])
def test_bias_token_residual_never_changes(layout):
    """Every sublayer writes exactly 0 at the bias token; hidden coordinates end each layer at 0."""
    literal = to_literal(make_model("LN"), layout=layout)
    _, cache = literal.run_with_cache(make_tokens())
    lay = literal.layout
    bias_embedding = torch.zeros(lay.d_resid, dtype=torch.float64)
    bias_embedding[lay.bias_row] = 1.0
    names = [n for n in cache.keys() if "hook_resid" in n]
    assert len(names) >= 6
    for name in names:
        assert torch.equal(cache[name][:, 0], bias_embedding.expand(2, -1)), name
    if layout == "split":
        for layer in range(2):
            hidden = cache[f"blocks.{layer}.hook_resid_post"][:, :, lay.d_model : lay.pos_start]
            assert torch.equal(hidden, torch.zeros_like(hidden))


def test_patterns_are_those_of_the_original_heads():
    model = make_model("LN", "causal")
    tokens = make_tokens()
    _, ref = model.run_with_cache(tokens)
    literal = to_literal(model)
    _, cache = literal.run_with_cache(tokens)
    for layer in range(2):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"]  # [batch, 2 + 1, 11, 11]
        assert pattern.shape == (2, 3, 11, 11)
        assert max_err(pattern[:, :2, 1:, 1:], ref["pattern", layer]) <= 1e-12
        assert torch.equal(pattern[:, :2, 1:, 0], torch.zeros_like(pattern[:, :2, 1:, 0]))
        eye = torch.eye(11, dtype=torch.float64).expand(2, 11, 11)
        assert torch.equal(pattern[:, 2], eye)  # the b_O head attends only to itself
        bias_row = torch.zeros(2, 2, 11, dtype=torch.float64)
        bias_row[..., 0] = 1.0
        assert torch.equal(pattern[:, :2, 0], bias_row)  # the bias query sees only itself


def test_theorem9_block_penalises_only_disallowed_pairs():
    allowed = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    q_block, k_block = theorem9_mask_qk(allowed, 50.0)
    assert torch.equal(q_block, torch.where(allowed, 0.0, -50.0).double())
    assert torch.equal(k_block, torch.eye(3, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_allowed_scores_carry_no_omega(dtype):
    """A neuron-head's allowed scores are exactly (q, 0): no omega-sized rounding on them."""
    model = make_model("LN", dtype=dtype)
    _, cache = to_literal(model).run_with_cache(make_tokens())
    for layer in range(2):
        p = f"blocks.{layer}.mlp."
        q = cache[p + "hook_q"][:, 1:, :32, 0].transpose(1, 2)  # [batch, head, pos]
        compact = neuron_pattern_compact(cache[p + "hook_attn_scores"], 32)
        assert torch.equal(compact[..., 0], q)
        assert torch.equal(compact[..., 1], torch.zeros_like(q))
        scores = cache[p + "hook_attn_scores"][:, :32]
        disallowed = ~to_literal(model).blocks[layer].mlp.allowed_pattern(11)[:32]
        assert (scores[:, disallowed] < -DEFAULT_OMEGA / 2).all()


@pytest.mark.parametrize("layout", ["neuron", "split"])
def test_mlp_hooks_match_original(layout):
    model = make_model("RMS")
    tokens = make_tokens()
    _, ref = model.run_with_cache(tokens)
    _, cache = to_literal(model, layout=layout).run_with_cache(tokens)
    for layer in range(2):
        assert max_err(cache[f"blocks.{layer}.mlp.hook_pre"], ref["pre", layer]) <= 1e-10
        assert max_err(cache[f"blocks.{layer}.mlp.hook_post"], ref["post", layer]) <= 1e-10
        mlp_out = cache[f"blocks.{layer}.hook_mlp_out"][:, 1:, :16]
        assert max_err(mlp_out, ref["mlp_out", layer]) <= 1e-10


@pytest.mark.parametrize("layout", ["neuron", "split"])
def test_neuron_heads_agree_with_structured_form(layout):
    """Same hook names; q, k, v, scores, pattern, z, pre, post agree with tl_attnonly.convert."""
    from tl_attnonly import convert

    model = make_model("LN")
    tokens = make_tokens()
    structured = convert(model)
    _, s_cache = structured.run_with_cache(tokens)
    literal = convert(model, form="literal", layout=layout)
    assert isinstance(literal, LiteralTransformer) and literal.layout_name == layout
    _, l_cache = literal.run_with_cache(tokens)
    n_heads = structured.blocks[0].mlp.n_neuron_heads
    for layer in range(2):
        p = f"blocks.{layer}.mlp."
        s_names = {n for n in s_cache.keys() if n.startswith(p)}
        assert s_names and s_names <= set(l_cache.keys())
        for kind in ("pattern", "attn_scores"):
            compact = neuron_pattern_compact(l_cache[p + f"hook_{kind}"], n_heads)
            assert max_err(compact, s_cache[p + f"hook_{kind}"]) <= 1e-10, kind
        for kind in ("q", "k", "v", "z"):
            real_part = l_cache[p + f"hook_{kind}"][:, 1:, :n_heads, :1]
            assert max_err(real_part, s_cache[p + f"hook_{kind}"]) <= 1e-10, kind
        for kind in ("pre", "post"):
            assert max_err(l_cache[p + f"hook_{kind}"], s_cache[p + f"hook_{kind}"]) <= 1e-10


@pytest.mark.parametrize("layout", ["neuron", "split"])
def test_editing_hook_post_reaches_the_output(layout):
    model = make_model("LN")
    tokens = make_tokens()

    def ablate(post, hook):
        post = post.clone()
        post[..., 3] = 0.0
        post[..., 7] *= 2.0
        return post

    hooks = [("blocks.0.mlp.hook_post", ablate)]
    expected = model.run_with_hooks(tokens, fwd_hooks=hooks)
    assert max_err(expected, model(tokens)) > 1e-3  # the edit matters
    literal = to_literal(model, layout=layout)
    assert max_err(literal.run_with_hooks(tokens, fwd_hooks=hooks), expected) <= 1e-8


def test_editing_hook_pre():
    model = make_model("LN")
    tokens = make_tokens()

    def shift(pre, hook):
        return pre + 1.5

    hooks = [("blocks.1.mlp.hook_pre", shift)]
    expected = model.run_with_hooks(tokens, fwd_hooks=hooks)
    split = to_literal(model, layout="split")
    assert max_err(split.run_with_hooks(tokens, fwd_hooks=hooks), expected) <= 1e-8
    with pytest.raises(NotImplementedError, match="hook_pre is read-only"):
        to_literal(model, layout="neuron").run_with_hooks(tokens, fwd_hooks=hooks)


def test_summary_reports_width_and_heads():
    model = make_model()
    D, M, N, dh = 16, 32, 12, 8
    split = to_literal(model, layout="split").summary()
    assert split["D_prime"] == D + 2 * M + N + 1
    assert split["D_prime_post"] == D + M + N + 1
    assert split["sublayers_per_layer"] == 4
    assert split["heads"] == {
        "attn": 2 + 1,
        "mlp_in": math.ceil(M / dh),
        "mlp": M,
        "mlp_out": math.ceil(D / dh) + 2 * math.ceil(M / dh),
    }
    neuron = to_literal(model, layout="neuron").summary()
    assert neuron["D_prime"] == D + N + 1
    assert neuron["heads"] == {"attn": 3, "mlp": M + 1}


# ---------------------------------------------------------------------------- omega, budget


def test_small_omega_is_visibly_wrong_default_is_not():
    model = make_model("LN")
    tokens = make_tokens()
    with pytest.warns(UserWarning, match="too small"):
        small = to_literal(model, omega=4.0)
    assert max_err(small(tokens), model(tokens)) > 1e-2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        default = to_literal(model)
    assert default.omega == DEFAULT_OMEGA
    assert max_err(default(tokens), model(tokens)) <= 1e-8


def test_fp16_overflowing_omega_warns_and_gives_nan():
    model = make_model("LN", dtype=torch.float32)
    with pytest.warns(UserWarning, match="overflows torch.float16"):
        literal = to_literal(model, omega=70000.0, dtype=torch.float16)
    assert torch.isnan(literal(make_tokens())).all()
    assert omega_warnings(65504.0, torch.float16, 13) == []
    assert omega_warnings(DEFAULT_OMEGA, torch.float16, 13) == []
    assert omega_warnings(DEFAULT_OMEGA, torch.bfloat16, 13) == []


def test_budget_refusals_name_size_and_override():
    model = make_model()
    with pytest.raises(LiteralBudgetError, match=r"GiB of weights.*budget_bytes="):
        to_literal(model, budget_bytes=10_000)
    literal = to_literal(model)
    tokens = make_tokens(batch=2, pos=10)
    need = literal.pattern_bytes(2, 10)
    assert need == 2 * 11 * 11 * 8 * (3 + 33) * 2
    literal.budget_bytes = need - 1
    with pytest.raises(LiteralBudgetError, match=r"O\(d_mlp \* N\^2\).*budget_bytes"):
        literal(tokens)
    literal.budget_bytes = need
    literal(tokens)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(parallel_attn_mlp=True), "parallel"),
        (dict(positional_embedding_type="alibi"), "alibi"),
        (dict(positional_embedding_type="shortformer"), "shortformer"),
        (dict(gated_mlp=True), "Gated"),
    ],
)
def test_unsupported_models_are_refused(overrides, match):
    model = make_model(**overrides)
    with pytest.raises(NotImplementedError, match=match):
        to_literal(model)


def test_bad_options_are_refused():
    model = make_model()
    with pytest.raises(ValueError, match="layout"):
        to_literal(model, layout="four")
    with pytest.raises(ValueError, match="mask"):
        to_literal(model, mask="none")


# ---------------------------------------------------------------------------- seed demo


def _augment(X: torch.Tensor, lay: ResidualLayout, where: slice) -> torch.Tensor:
    """[bias token; X] with X in ``where`` and one-hot positions: [1, 1 + N, d_resid]."""
    n = X.shape[0]
    resid = torch.zeros(1, n + 1, lay.d_resid, dtype=torch.float64)
    resid[0, 1:, where] = X
    resid[0, torch.arange(n + 1), lay.pos_start + torch.arange(n + 1)] = 1.0
    return resid


def test_seed_demo_linear_map():
    """Theorem 7 (+ 9): X -> X W by self-attending heads; 20 x 30 random, fp64."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(20, 30, generator=g, dtype=torch.float64)
    W = torch.randn(30, 30, generator=g, dtype=torch.float64)
    lay = ResidualLayout(d_model=30, d_mlp=0, n_pos=21, hidden=False)
    W_full = torch.zeros(lay.d_resid, 30, dtype=torch.float64)
    W_full[lay.model_dims] = W
    spec = linear_map_sublayer([(W_full, lay.model_dims)], lay, d_head=8)
    heads = assemble_sublayer(
        spec, lay, "omega", DEFAULT_OMEGA, causal=False, use_attn_result=False
    )
    assert heads.n_heads == 4 and heads.mask_mode == "none"
    out = heads(_augment(X, lay, lay.model_dims))[0]
    assert max_err(out[1:, lay.model_dims], X @ W) < 1e-10
    assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_seed_demo_silu():
    """Theorem 8 (+ 9): entry-wise SiLU, one head per coordinate; 20 x 30 random, fp64."""
    X = 3 * torch.randn(20, 30, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    lay = ResidualLayout(d_model=0, d_mlp=30, n_pos=21, hidden=True)
    spec = neuron_sublayer(
        theorem8_activation_heads(SILU, 30), lay, lay.pre_dims, lay.post_dims, None
    )
    heads = assemble_sublayer(
        spec, lay, "omega", DEFAULT_OMEGA, causal=False, use_attn_result=False
    )
    assert heads.n_heads == 30
    out = heads(_augment(X, lay, lay.pre_dims))[0]
    assert max_err(out[1:, lay.post_dims], F.silu(X)) < 1e-10
    assert torch.equal(out[:, lay.pre_dims], torch.zeros_like(out[:, lay.pre_dims]))


def test_seed_demo_augmented_attention():
    """Theorem 6's tweak (+ 9): a causal head is unchanged by the bias token; 20 x 30, fp64."""
    g = torch.Generator().manual_seed(2)
    X = torch.randn(20, 30, generator=g, dtype=torch.float64)
    W_Q, W_K, W_V = (torch.randn(1, 30, 8, generator=g, dtype=torch.float64) for _ in range(3))
    W_O = torch.randn(1, 8, 30, generator=g, dtype=torch.float64)
    scores = (X @ W_Q[0]) @ (X @ W_K[0]).T / math.sqrt(8)
    scores = scores.masked_fill(~torch.ones(20, 20, dtype=torch.bool).tril(), float("-inf"))
    expected = torch.softmax(scores, -1) @ X @ W_V[0] @ W_O[0]

    lay = ResidualLayout(d_model=30, d_mlp=0, n_pos=21, hidden=False)
    zeros = torch.zeros(1, 8, dtype=torch.float64)
    spec = theorem6_tweaked_attention_heads(
        W_Q, zeros, W_K, zeros, W_V, zeros, W_O, torch.zeros(30), lay, attn_scale=math.sqrt(8)
    )
    heads = assemble_sublayer(spec, lay, "omega", DEFAULT_OMEGA, causal=True, use_attn_result=False)
    assert isinstance(heads, LiteralAttention) and heads.mask_mode == "none"
    out = heads(_augment(X, lay, lay.model_dims))[0]
    assert max_err(out[1:, lay.model_dims], expected) < 1e-10
    assert torch.equal(out[0], torch.zeros_like(out[0]))
