"""Tiny random Hugging Face models, built offline from their configs, for TransformerBridge.

One entry per architecture that the installed TransformerLens has a bridge adapter for
(``transformer_lens/model_bridge/supported_architectures/``) and that ``transformers`` builds from
a config alone. Every model is small (2 layers, d_model 32-64, vocab 128) so that building it and
its bridge takes well under a second.

Hugging Face initialises weights with std 0.02 and norms at 1 / biases at 0, which keeps MLP
pre-activations near 0, where every activation is nearly linear and a wrong conversion can hide.
:func:`build_hf_model` therefore re-draws every parameter (matrices ``N(0, 1/fan_in)``, norm
weights ``1 + N(0, 0.1)``, biases ``N(0, 0.1)``) so that pre-activations are O(1).

Usage::

    from zoo import ZOO, build_bridge  # with tests/bridge on sys.path
    bridge = build_bridge("llama", dtype=torch.float64)
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch
import transformers

VOCAB = 128
"""Vocabulary size of every zoo model."""


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """One zoo entry.

    Attributes:
        name: Short name (the pytest id).
        architecture: The HF architecture class name; also the bridge adapter's key.
        config: ``transformers`` config class name.
        kwargs: Config overrides (on top of :data:`_COMMON` unless ``common=False``).
        mlp: ``"plain"``, ``"gated"`` or ``"moe"`` (what the checkpoint's MLP is).
        act: The HF activation name (``hidden_act`` / ``activation_function``).
        encoder: True for encoder-only models (BERT): run with ``one_zero_attention_mask``-free
            full attention; logits are the MLM head's.
        common: Start the config from :data:`_COMMON` (Llama-style keyword names).
        hf_class: The ``transformers`` model class when its name differs from ``architecture``.
        broken: Non-empty when the unconverted bridge itself fails to run (why).
        no_fp64: Non-empty when the model cannot run in float64 (why).
        options: ``ConversionOptions`` fields the model needs to convert at all (GPT-OSS:
            ``clamp="check"``); :func:`convert_zoo_bridge` adds them.
    """

    name: str
    architecture: str
    config: str
    kwargs: dict[str, Any]
    mlp: str
    act: str
    encoder: bool = False
    common: bool = True
    hf_class: str = ""
    broken: str = ""
    no_fp64: str = ""
    options: dict[str, Any] = dataclasses.field(default_factory=dict)


_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)

_MOE: dict[str, Any] = dict(num_local_experts=4, num_experts_per_tok=2)

ZOO_LIST: list[ZooModel] = [
    ZooModel("llama", "LlamaForCausalLM", "LlamaConfig", {}, "gated", "silu"),
    ZooModel("mistral", "MistralForCausalLM", "MistralConfig", {}, "gated", "silu"),
    ZooModel("mixtral", "MixtralForCausalLM", "MixtralConfig", dict(_MOE), "moe", "silu"),
    ZooModel("qwen2", "Qwen2ForCausalLM", "Qwen2Config", {}, "gated", "silu"),
    ZooModel("qwen3", "Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=16), "gated", "silu"),
    ZooModel(
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=64,
        ),
        "moe",
        "silu",
    ),
    ZooModel(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, head_dim=16),
        "moe",
        "silu",
    ),
    ZooModel(
        "gemma",
        "GemmaForCausalLM",
        "GemmaConfig",
        dict(head_dim=16, hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh"),
        "gated",
        "gelu_pytorch_tanh",
    ),
    ZooModel(
        "gemma2",
        "Gemma2ForCausalLM",
        "Gemma2Config",
        dict(head_dim=16, sliding_window=4, query_pre_attn_scalar=16),
        "gated",
        "gelu_pytorch_tanh",
    ),
    ZooModel(
        "gemma3",
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        dict(head_dim=16, sliding_window=4, query_pre_attn_scalar=16),
        "gated",
        "gelu_pytorch_tanh",
    ),
    ZooModel("phi3", "Phi3ForCausalLM", "Phi3Config", dict(pad_token_id=0), "gated", "silu"),
    ZooModel("olmo", "OlmoForCausalLM", "OlmoConfig", dict(pad_token_id=0), "gated", "silu"),
    ZooModel("olmo2", "Olmo2ForCausalLM", "Olmo2Config", dict(pad_token_id=0), "gated", "silu"),
    ZooModel(
        "olmoe",
        "OlmoeForCausalLM",
        "OlmoeConfig",
        dict(num_experts=4, num_experts_per_tok=2, pad_token_id=0),
        "moe",
        "silu",
    ),
    ZooModel("stablelm", "StableLmForCausalLM", "StableLmConfig", {}, "gated", "silu"),
    ZooModel("granite", "GraniteForCausalLM", "GraniteConfig", {}, "gated", "silu"),
    ZooModel(
        "gpt2",
        "GPT2LMHeadModel",
        "GPT2Config",
        dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB, n_inner=96),
        "plain",
        "gelu_new",
        common=False,
    ),
    ZooModel(
        "gpt_neox",
        "GPTNeoXForCausalLM",
        "GPTNeoXConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            rotary_pct=0.25,
        ),
        "plain",
        "gelu",
        common=False,
    ),
    ZooModel(
        "gptj",
        "GPTJForCausalLM",
        "GPTJConfig",
        dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB, rotary_dim=8),
        "plain",
        "gelu_new",
        common=False,
    ),
    ZooModel(
        "gpt_neo",
        "GPTNeoForCausalLM",
        "GPTNeoConfig",
        dict(
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            attention_types=[[["global", "local"], 1]],
            window_size=4,
            max_position_embeddings=64,
            vocab_size=VOCAB,
            intermediate_size=96,
        ),
        "plain",
        "gelu_new",
        common=False,
    ),
    ZooModel(
        "opt",
        "OPTForCausalLM",
        "OPTConfig",
        dict(
            hidden_size=64,
            ffn_dim=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            vocab_size=VOCAB,
            word_embed_proj_dim=64,
            pad_token_id=1,
        ),
        "plain",
        "relu",
        common=False,
    ),
    ZooModel(
        "bloom",
        "BloomForCausalLM",
        "BloomConfig",
        dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=VOCAB),
        "plain",
        "bloom_gelu",
        common=False,
    ),
    ZooModel(
        "falcon",
        "FalconForCausalLM",
        "FalconConfig",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=VOCAB,
            new_decoder_architecture=False,
            multi_query=True,
            parallel_attn=True,
            bias=False,
        ),
        "plain",
        "gelu",
        common=False,
    ),
    ZooModel(
        "phi",
        "PhiForCausalLM",
        "PhiConfig",
        dict(partial_rotary_factor=0.5, hidden_act="gelu_new"),
        "plain",
        "gelu_new",
    ),
    ZooModel(
        "starcoder2",
        "Starcoder2ForCausalLM",
        "Starcoder2Config",
        dict(hidden_act="gelu_pytorch_tanh"),
        "plain",
        "gelu_pytorch_tanh",
    ),
    ZooModel(
        "codegen",
        "CodeGenForCausalLM",
        "CodeGenConfig",
        dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB, rotary_dim=8),
        "plain",
        "gelu_new",
        common=False,
        broken="TL's CodeGen attention bridge reads CodeGenAttention.embed_positions, which "
        "transformers 5 no longer has (AttributeError in the unconverted bridge)",
    ),
    ZooModel(
        "gpt_bigcode",
        "GPTBigCodeForCausalLM",
        "GPTBigCodeConfig",
        dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB, n_inner=96),
        "plain",
        "gelu_pytorch_tanh",
        common=False,
    ),
    ZooModel("cohere", "CohereForCausalLM", "CohereConfig", dict(logit_scale=1.0), "gated", "silu"),
    ZooModel(
        "cohere2",
        "Cohere2ForCausalLM",
        "Cohere2Config",
        dict(sliding_window=4, logit_scale=1.0),
        "gated",
        "silu",
    ),
    ZooModel(
        "glm", "GlmForCausalLM", "GlmConfig", dict(head_dim=16, pad_token_id=0), "gated", "silu"
    ),
    ZooModel(
        "glm4", "Glm4ForCausalLM", "Glm4Config", dict(head_dim=16, pad_token_id=0), "gated", "silu"
    ),
    ZooModel(
        "smollm3", "SmolLM3ForCausalLM", "SmolLM3Config", dict(pad_token_id=0), "gated", "silu"
    ),
    ZooModel("olmo3", "Olmo3ForCausalLM", "Olmo3Config", dict(sliding_window=4), "gated", "silu"),
    ZooModel(
        "exaone4", "Exaone4ForCausalLM", "Exaone4Config", dict(sliding_window=4), "gated", "silu"
    ),
    ZooModel("seed_oss", "SeedOssForCausalLM", "SeedOssConfig", dict(head_dim=16), "gated", "silu"),
    ZooModel(
        "ernie4_5", "Ernie4_5ForCausalLM", "Ernie4_5Config", dict(head_dim=16), "gated", "silu"
    ),
    ZooModel(
        "hunyuan_dense",
        "HunYuanDenseV1ForCausalLM",
        "HunYuanDenseV1Config",
        dict(head_dim=16),
        "gated",
        "silu",
    ),
    ZooModel(
        "nemotron", "NemotronForCausalLM", "NemotronConfig", dict(head_dim=16), "plain", "relu2"
    ),
    ZooModel("arcee", "ArceeForCausalLM", "ArceeConfig", {}, "plain", "relu2"),
    ZooModel("apertus", "ApertusForCausalLM", "ApertusConfig", {}, "plain", "xielu"),
    ZooModel("granitemoe", "GraniteMoeForCausalLM", "GraniteMoeConfig", dict(_MOE), "moe", "silu"),
    ZooModel(
        "phimoe",
        "PhiMoEForCausalLM",
        "PhimoeConfig",
        dict(_MOE),
        "moe",
        "silu",
        hf_class="PhimoeForCausalLM",
    ),
    ZooModel(
        "deepseek_v3",
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        dict(
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
        ),
        "moe",
        "silu",
    ),
    ZooModel(
        "gpt_oss",
        "GptOssForCausalLM",
        "GptOssConfig",
        dict(
            _MOE,
            head_dim=16,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        ),
        "moe",
        "silu",
        options=dict(clamp="check"),  # its clamped SwiGLU: exact where the clamp is inactive
    ),
    ZooModel(
        "xglm",
        "XGLMForCausalLM",
        "XGLMConfig",
        dict(
            vocab_size=VOCAB,
            d_model=64,
            ffn_dim=96,
            num_layers=2,
            attention_heads=4,
            max_position_embeddings=64,
        ),
        "plain",
        "gelu",
        common=False,
        no_fp64="transformers' XGLM attention fills with float32's min: RuntimeError in float64",
    ),
    ZooModel(
        "openai_gpt",
        "OpenAIGPTLMHeadModel",
        "OpenAIGPTConfig",
        dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB),
        "plain",
        "gelu",
        common=False,
    ),
    ZooModel(
        "mpt",
        "MptForCausalLM",
        "MptConfig",
        dict(
            d_model=64, n_layers=2, n_heads=4, vocab_size=VOCAB, max_seq_len=64, expansion_ratio=2
        ),
        "plain",
        "gelu",
        common=False,
    ),
    ZooModel(
        "bert",
        "BertForMaskedLM",
        "BertConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
        ),
        "plain",
        "gelu",
        encoder=True,
        common=False,
    ),
]

ZOO: dict[str, ZooModel] = {m.name: m for m in ZOO_LIST}


def make_config(name: str) -> Any:
    """The ``transformers`` config of zoo entry ``name`` (eager attention, tiny sizes)."""
    spec = ZOO[name]
    kwargs = dict(_COMMON, **spec.kwargs) if spec.common else dict(spec.kwargs)
    config_cls: Callable[..., Any] = getattr(transformers, spec.config)
    config = config_cls(**kwargs)
    config._attn_implementation = "eager"
    if spec.mlp == "moe":
        # The default grouped-mm experts kernel has no float64; the eager loop has.
        config._experts_implementation = "eager"
    return config


@torch.no_grad()
def _redraw(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every parameter so MLP pre-activations are O(1) (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    for pname, param in model.named_parameters():
        if param.dim() >= 2:
            fan_in = param.shape[-1]
            if isinstance(model.get_submodule(pname.rsplit(".", 1)[0]), torch.nn.Embedding):
                fan_in = 1
            param.copy_(torch.randn(param.shape, generator=gen) / fan_in**0.5)
        elif "norm" in pname or "ln" in pname.split(".")[-2]:
            if pname.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
        else:
            param.copy_(0.1 * torch.randn(param.shape, generator=gen))


def build_hf_model(name: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> Any:
    """Build zoo entry ``name`` as a random ``transformers`` model in eval mode.

    Args:
        name: A key of :data:`ZOO`.
        dtype: Parameter dtype.
        seed: Seed of the parameter draw.

    Returns:
        ``(hf_model, hf_config)``.
    """
    spec = ZOO[name]
    config = make_config(name)
    model_cls = getattr(transformers, spec.hf_class or spec.architecture)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model_cls(config)
    _redraw(model, seed)
    model = model.to(dtype).eval()
    return model, config


def build_bridge(name: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> Any:
    """Build zoo entry ``name`` and wrap it in a TransformerBridge (offline).

    Returns:
        The ``TransformerBridge``.
    """
    from transformer_lens.model_bridge.sources import build_bridge_from_module

    spec = ZOO[name]
    model, config = build_hf_model(name, dtype, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bridge = build_bridge_from_module(model, spec.architecture, hf_config=config, dtype=dtype)
    return bridge


def dtype_params(names: list[str]) -> list[Any]:
    """``pytest.param(name, dtype)`` for float32 and float64, float64 skipped where the model
    cannot run in it (``no_fp64``)."""
    import pytest

    out = []
    for name in names:
        for dtype in (torch.float32, torch.float64):
            marks = []
            if dtype == torch.float64 and ZOO[name].no_fp64:
                marks = [pytest.mark.skip(reason=ZOO[name].no_fp64)]
            out.append(pytest.param(name, dtype, id=f"{name}-{str(dtype)[6:]}", marks=marks))
    return out


def tokens(batch: int = 2, pos: int = 9, seed: int = 1) -> torch.Tensor:
    """Random token ids ``[batch, pos]`` (no special tokens: ids 2 and up)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (batch, pos), generator=gen)


def bridge_convert_available() -> bool:
    """Whether this ``tl_attnonly`` can convert a TransformerBridge (``tl_attnonly.bridge``)."""
    import importlib.util

    return importlib.util.find_spec("tl_attnonly.bridge") is not None


def convert_zoo_bridge(bridge: Any, **options: Any) -> Any:
    """``tl_attnonly.convert(bridge, ConversionOptions(**options))`` (no progress bar), with the
    options its zoo model needs (:attr:`ZooModel.options`, found by its architecture) unless
    ``options`` sets them."""
    from tl_attnonly import ConversionOptions, convert

    architecture = type(bridge.original_model).__name__
    needed = next((s.options for s in ZOO.values() if s.architecture == architecture), {})
    return convert(bridge, ConversionOptions(**{**needed, **options}))


#: Exceptions that count as a refusal (raised before anything is changed).
REFUSALS = (NotImplementedError, ValueError)


@dataclasses.dataclass
class Measurement:
    """Converted vs unconverted bridge on one zoo model, in one dtype.

    Attributes:
        verdict: ``"exact"`` (SiLU: one exact head per neuron), ``"exact where the clamp is
            inactive"`` (a clamped SwiGLU's unclamped heads; :attr:`reason` says what the clamp
            check reported on the input), ``"approximate"`` (fitted or
            ``x sigmoid(k x)`` heads), ``"refused"`` (``NotImplementedError`` / ``ValueError``),
            ``"error"`` (any other exception: a defect, not a clear refusal) or
            ``"bridge fails"`` (the unconverted bridge itself does not run).
        max_dlogit: Max |converted - unconverted| logit (``None`` when not converted).
        act_fn: The activation the conversion identified (``""`` when not converted).
        act_error: The heads' max activation error on ``|x| <= 20`` (0 for exact SiLU).
        reason: The refusal's message (or the bridge's own failure).
    """

    verdict: str
    max_dlogit: float | None = None
    act_fn: str = ""
    act_error: float = 0.0
    reason: str = ""


def measure(name: str, dtype: torch.dtype, **options: Any) -> Measurement:
    """Build zoo entry ``name``'s bridge, run it, convert it (in place) and run it again.

    Args:
        name: A key of :data:`ZOO`.
        dtype: Dtype of the model and the comparison.
        **options: :class:`tl_attnonly.ConversionOptions` fields.

    Returns:
        The :class:`Measurement`.
    """
    spec = ZOO[name]
    if spec.broken:
        return Measurement("bridge fails", reason=spec.broken)
    bridge = build_bridge(name, dtype)
    toks = tokens()
    with torch.no_grad():
        reference = bridge(toks)
    try:
        converted = convert_zoo_bridge(bridge, **options)
    except REFUSALS as error:
        return Measurement("refused", reason=f"{type(error).__name__}: {error}")
    except Exception as error:  # a crash is not a refusal: recorded as a defect
        return Measurement("error", reason=f"{type(error).__name__}: {error}")
    from tl_attnonly.bridge import neuron_head_layers

    layers = neuron_head_layers(converted)
    coefficients = layers[0].coefficients
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the clamp check's warning: its record is read below
        logits = converted(toks)
    exact = coefficients.method == "exact"
    max_dlogit = (logits - reference).abs().max().item()
    verdict, reason = "exact" if exact else "approximate", ""
    clamped = [layer for layer in layers if getattr(layer, "clamp", None) is not None]
    if clamped:
        verdict = "exact where the clamp is inactive"
        count = sum(layer.clamp_count for layer in clamped)
        change = max(layer.clamp_max_change for layer in clamped)
        reason = f"clamp check on this input: acted on {count} expert activations" + (
            f", max activation change {change:.1e}, max dlogit {max_dlogit:.1e}"
            if count
            else " (inactive: exact)"
        )
    return Measurement(
        verdict,
        max_dlogit=max_dlogit,
        act_fn=coefficients.activation,
        act_error=0.0 if exact else coefficients.max_abs_error(),
        reason=reason,
    )
