"""The builder: :func:`to_literal`, with its support and memory-budget checks."""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any, cast

import torch
import torch.nn as nn
from torch import Tensor
from transformer_lens import HookedTransformer, HookedTransformerConfig
from transformer_lens.components import (
    MLP,
    AbstractAttention,
    GatedMLP,
    LayerNorm,
    LayerNormPre,
    RMSNorm,
    RMSNormPre,
    TransformerBlock,
)

from tl_attnonly._compat import rotary_base
from tl_attnonly._types import CoefficientsLike
from tl_attnonly.activations import max_score_magnitude
from tl_attnonly.components.literal_attention import LiteralAttention
from tl_attnonly.literal.gated import (
    DEFAULT_PRODUCT_RANGE,
    check_product_range,
    default_product_eps,
    gated_activation_heads,
    product_heads,
)
from tl_attnonly.literal.layout import LiteralBudgetError, ResidualLayout
from tl_attnonly.literal.modules import LiteralBlock, LiteralNeuronLayer, PartialNorm
from tl_attnonly.literal.omega import DEFAULT_OMEGA, omega_warnings
from tl_attnonly.literal.support import check_literal_supported
from tl_attnonly.literal.theorems import (
    SublayerHeads,
    allowed_pattern,
    fold_norm,
    linear_map_sublayer,
    neuron_sublayer,
    theorem3_neuron_head,
    theorem6_tweaked_attention_heads,
    theorem8_activation_heads,
    theorem9_mask_qk,
)
from tl_attnonly.literal.transformer import LiteralTransformer
from tl_attnonly.options import (
    ConversionOptions,
    LayoutName,
    LiteralOptions,
    check_convertible,
    overflow_warning,
)


def _norm_parts(norm: nn.Module) -> tuple[Tensor | None, Tensor | None, bool | None]:
    """(weight, bias, center) of a TransformerLens norm; center ``None`` means no norm."""
    if isinstance(norm, LayerNorm):
        return norm.w, norm.b, True
    if isinstance(norm, LayerNormPre):
        return None, None, True
    if isinstance(norm, RMSNorm):
        return norm.w, None, False
    if isinstance(norm, RMSNormPre):
        return None, None, False
    if isinstance(norm, nn.Identity):
        return None, None, None
    raise NotImplementedError(f"Unsupported normalisation module {type(norm).__name__}")


def _partial_norm(norm: nn.Module, d_model: int, eps: float) -> nn.Module:
    center = _norm_parts(norm)[2]
    return nn.Identity() if center is None else PartialNorm(d_model, eps, center)


def sublayer_head_counts(
    cfg: HookedTransformerConfig, layout: LayoutName, n_heads_per_neuron: int, linear_d_head: int
) -> dict[str, int]:
    """Heads in each sublayer of one literal layer (see also :meth:`LiteralTransformer.summary`).

    Args:
        cfg: The original model's config.
        layout: ``"neuron"`` or ``"split"``.
        n_heads_per_neuron: ``K``.
        linear_d_head: Internal dimension of the linear-map heads.

    Returns:
        ``{"attn": n_heads + 1, "mlp": d_mlp K + 1}`` (neuron layout) or ``{"attn": n_heads + 1,
        "mlp_in": ceil(M / d), "mlp": M K, "mlp_out": ceil(D / d) + 2 ceil(M / d)}`` (split).
    """
    M, D, d = cfg.d_mlp or 0, cfg.d_model, linear_d_head
    if layout == "neuron":
        return {"attn": cfg.n_heads + 1, "mlp": M * n_heads_per_neuron + 1}
    if cfg.gated_mlp:
        return {
            "attn": cfg.n_heads + 1,
            "mlp_in": 2 * math.ceil(M / d),
            "mlp_prod": M + 1,
            "mlp": M * n_heads_per_neuron,
            "mlp_out": math.ceil(D / d) + 4 * math.ceil(M / d),
        }
    return {
        "attn": cfg.n_heads + 1,
        "mlp_in": math.ceil(M / d),
        "mlp": M * n_heads_per_neuron,
        "mlp_out": math.ceil(D / d) + 2 * math.ceil(M / d),
    }


def _check_weight_budget(
    cfg: HookedTransformerConfig,
    lay: ResidualLayout,
    K: int,
    layout: LayoutName,
    mask: str,
    linear_d_head: int,
    budget_bytes: int,
) -> None:
    """Refuse before allocating: W_Q, W_K, W_V, W_O of every sublayer, built in float64."""
    counts = sublayer_head_counts(cfg, layout, K, linear_d_head)
    # (real q/k dims, value dims) per head
    dims = {"attn": (cfg.d_head, cfg.d_head), "mlp": (1, 1), "mlp_prod": (1, 1)}
    extra_qk = 0 if mask == "ordinary" else lay.n_pos
    per_layer = sum(
        h * lay.d_resid * (2 * (dims.get(name, (0, linear_d_head))[0] + extra_qk)
                           + 2 * dims.get(name, (0, linear_d_head))[1])
        for name, h in counts.items()
    )  # fmt: skip
    size = 8 * cfg.n_layers * per_layer
    if size > budget_bytes:
        raise LiteralBudgetError(
            f"The literal form of this model needs about {size / 2**30:.2f} GiB of weights "
            f"(D'={lay.d_resid}, {sum(counts.values())} heads per layer, each with "
            f"{extra_qk} one-hot position dimensions in W_Q/W_K, built in float64): above "
            f"budget_bytes={budget_bytes} ({budget_bytes / 2**30:.2f} GiB). Lower max_len=..., "
            "use mask='ordinary' (no position dimensions in W_Q/W_K), or pass budget_bytes=...."
        )


def assemble_sublayer(
    spec: SublayerHeads,
    layout: ResidualLayout,
    mask: str,
    omega: float,
    causal: bool,
    use_attn_result: bool,
    rotary_adjacent_pairs: bool = False,
    module_cls: type = LiteralAttention,
    **module_kwargs: Any,
) -> LiteralAttention:
    """Turn a sublayer's heads into a :class:`LiteralAttention`, masks included.

    Args:
        spec: The heads' real parts.
        layout: The augmented residual stream.
        mask: ``"omega"`` (masks written into ``W_Q``/``W_K`` by :func:`theorem9_mask_qk`),
            ``"causal_ordinary"`` (only the model's causal mask is an ordinary mask) or
            ``"ordinary"`` (ordinary masks only).
        omega: The penalty.
        causal: Whether the model's own heads are causal.
        use_attn_result: Materialise per-head results.
        rotary_adjacent_pairs: GPT-J style rotary pairs.
        module_cls: :class:`LiteralAttention` or a subclass.
        **module_kwargs: Passed to ``module_cls``.

    Returns:
        The module, in float64.
    """
    n_pos = layout.n_pos
    allowed = torch.stack([allowed_pattern(k, n_pos, causal) for k in spec.kinds])
    if mask == "ordinary":
        W_Q, W_K, mask_mode = spec.W_Q, spec.W_K, "allowed"
    else:
        if mask == "causal_ordinary":
            in_weights = [allowed_pattern(k, n_pos, causal=False) for k in spec.kinds]
            mask_mode = "causal" if causal and "attn" in spec.kinds else "none"
        else:
            in_weights, mask_mode = list(allowed), "none"
        blocks = [theorem9_mask_qk(a, omega) for a in in_weights]
        H, R = spec.n_heads, layout.d_resid
        q_mask = torch.zeros(H, R, n_pos, dtype=torch.float64)
        k_mask = torch.zeros(H, R, n_pos, dtype=torch.float64)
        q_mask[:, layout.pos_dims] = torch.stack([b[0] for b in blocks])[spec.head_kind]
        k_mask[:, layout.pos_dims] = torch.stack([b[1] for b in blocks])[spec.head_kind]
        W_Q = torch.cat([spec.W_Q, q_mask], dim=-1)
        W_K = torch.cat([spec.W_K, k_mask], dim=-1)
    module = module_cls(
        spec.n_heads,
        layout.d_resid,
        W_Q.shape[-1],
        spec.W_V.shape[-1],
        n_pos,
        n_mask_kinds=len(spec.kinds),
        mask_mode=mask_mode,
        rotary_dim=spec.rotary_dim,
        rotary_adjacent_pairs=rotary_adjacent_pairs,
        use_attn_result=use_attn_result,
        dtype=torch.float64,
        **module_kwargs,
    )
    with torch.no_grad():
        module.W_Q.copy_(W_Q)
        module.W_K.copy_(W_K)
        module.W_V.copy_(spec.W_V)
        module.W_O.copy_(spec.W_O)
        module.allowed.copy_(allowed)
        module.head_kind.copy_(spec.head_kind)
    return module


def _rotary_tables(attn: AbstractAttention, max_len: int) -> tuple[Tensor, Tensor]:
    """TransformerLens's own rotary tables for positions ``0..max_len-1``, in float64."""
    cfg = attn.cfg
    if attn.rotary_cos.shape[0] >= max_len:
        return attn.rotary_cos[:max_len].double(), attn.rotary_sin[:max_len].double()
    sin, cos = attn.calculate_sin_cos_rotary(
        cfg.rotary_dim or 0, max_len, base=rotary_base(attn), dtype=torch.float64
    )
    return cos, sin


def _coefficients(
    model: HookedTransformer,
    conversion: ConversionOptions | None,
    coefficients: CoefficientsLike | None,
) -> CoefficientsLike:
    if coefficients is not None:
        return coefficients
    options = conversion if conversion is not None else ConversionOptions()
    check_convertible(model.cfg, options)
    return options.coefficients(model.cfg.act_fn)


def to_literal(
    model: HookedTransformer,
    options: LiteralOptions | None = None,
    *,
    conversion: ConversionOptions | None = None,
    **overrides: Any,
) -> LiteralTransformer:
    """Build the literal attention-only form of ``model`` (Huben & Morris 2023, Thms 3, 6-9).

    Args:
        model: A TransformerLens ``HookedTransformer`` (not modified).
        options: A :class:`~tl_attnonly.LiteralOptions` (omega, layout, mask, max_len, dtype,
            budget, ...; see there); default ``LiteralOptions()``.
        conversion: A :class:`tl_attnonly.ConversionOptions` (heads per neuron, ReLU sharpness);
            ignored when ``coefficients`` are given.
        **overrides: Fields of :class:`~tl_attnonly.LiteralOptions` given by keyword, replacing
            those of ``options``: ``to_literal(model, layout="split", max_len=32)``.

    Returns:
        A :class:`LiteralTransformer`.

    Raises:
        NotImplementedError, ValueError: For unsupported models or options, before any work.
        TypeError: For an unknown option, or options that are not a ``LiteralOptions``.
        LiteralBudgetError: If the weights would exceed ``budget_bytes``.

    Example:
        >>> literal = to_literal(model, LiteralOptions(layout="split"), max_len=16)
    """
    if options is not None and not isinstance(options, LiteralOptions):
        raise TypeError(
            f"to_literal(model, options): options must be a tl_attnonly.LiteralOptions, got "
            f"{type(options).__name__} {options!r}. Give single options by keyword: "
            "to_literal(model, omega=..., layout=..., mask=...)."
        )
    opts = (options or LiteralOptions()).with_overrides(**overrides)
    layout, mask, tol, budget_bytes = opts.layout, opts.mask, opts.tol, opts.budget_bytes
    check_literal_supported(model, layout)
    coefs = _coefficients(model, conversion, opts.coefficients)
    cfg = copy.deepcopy(model.cfg)
    dtype = opts.dtype or cfg.dtype
    product_eps = opts.product_eps
    if cfg.gated_mlp:
        if product_eps is None:
            product_eps = default_product_eps(dtype)
        message = check_product_range(product_eps, DEFAULT_PRODUCT_RANGE, dtype)
        if message is not None:
            warnings.warn(message, stacklevel=2)
    omega = DEFAULT_OMEGA if opts.omega is None else float(opts.omega)
    max_len = cfg.n_ctx if opts.max_len is None else int(opts.max_len)
    if not 1 <= max_len <= cfg.n_ctx:
        raise ValueError(f"max_len must be in [1, n_ctx={cfg.n_ctx}], got {max_len}")
    lay = ResidualLayout(
        cfg.d_model,
        cfg.d_mlp or 0,
        max_len + 1,
        hidden=layout == "split",
        gated=bool(cfg.gated_mlp),
    )
    if mask != "ordinary":
        max_score = max_score_magnitude(coefs).score  # its rounding eats into omega
        for message in omega_warnings(omega, dtype, lay.n_pos, tol, max_score=max_score):
            warnings.warn(message, stacklevel=2)
    overflow = overflow_warning(coefs, dtype, scores=True)  # an inf score makes softmax NaN
    if overflow is not None:
        warnings.warn(overflow, RuntimeWarning, stacklevel=2)
    dh_lin = opts.linear_d_head or cfg.d_head
    _check_weight_budget(cfg, lay, len(coefs.b), layout, mask, dh_lin, budget_bytes)
    build = _Builder(cfg, lay, coefs, mask, omega, opts.use_attn_result, dh_lin, product_eps)
    with torch.no_grad():
        blocks = [build.block(block, max_len, layout) for block in model.blocks]
        final = model.ln_final if cfg.normalization_type is not None else nn.Identity()
        wf, bf, _ = _norm_parts(final)
        W_U, b_U = fold_norm(model.unembed.W_U, model.unembed.b_U, wf, bf)
        unembed = copy.deepcopy(model.unembed)
        unembed.W_U = nn.Parameter(W_U)
        unembed.b_U = nn.Parameter(b_U)
        W_pos = None
        if cfg.positional_embedding_type == "standard":
            W_pos = model.pos_embed.W_pos[:max_len].double().clone()
        literal = LiteralTransformer(
            cfg,
            lay,
            layout,
            blocks,
            model.embed.W_E.double().clone(),
            W_pos,
            _partial_norm(final, cfg.d_model, cfg.eps),
            unembed,
            None if mask == "ordinary" else omega,
            mask,
            budget_bytes,
        )
    literal.tokenizer = model.tokenizer
    cfg.dtype = dtype
    return literal.to(dtype)


class _Builder:
    """Builds the literal sublayers of one original layer (state shared by all layers)."""

    def __init__(
        self,
        cfg: HookedTransformerConfig,
        layout: ResidualLayout,
        coefficients: CoefficientsLike,
        mask: str,
        omega: float,
        use_attn_result: bool,
        linear_d_head: int,
        product_eps: float | None = None,
    ):
        self.cfg, self.lay, self.coefs = cfg, layout, coefficients
        self.mask, self.omega, self.use_attn_result = mask, omega, use_attn_result
        self.linear_d_head = linear_d_head
        self.product_eps = product_eps
        self.causal = cfg.attention_dir == "causal"
        self.K = len(coefficients.b)
        self.g_sum = float(sum(coefficients.g))

    def assemble(self, spec: SublayerHeads, **kwargs: Any) -> LiteralAttention:
        return assemble_sublayer(
            spec, self.lay, self.mask, self.omega, self.causal, self.use_attn_result, **kwargs
        )

    def block(self, block: TransformerBlock, max_len: int, layout: str) -> LiteralBlock:
        """The literal form of one TransformerLens block."""
        D, eps = self.cfg.d_model, self.cfg.eps
        ln1, ln2 = _partial_norm(block.ln1, D, eps), _partial_norm(block.ln2, D, eps)
        attn = self.attention(block, max_len)
        w2, b2, _ = _norm_parts(block.ln2)
        if self.lay.gated:
            return LiteralBlock(ln1, attn, ln2, *self.gated_mlp(cast(GatedMLP, block.mlp), w2, b2))
        mlp = cast(MLP, block.mlp)  # a plain MLP: check_convertible refused the other classes
        W_in, b_in = fold_norm(mlp.W_in, mlp.b_in, w2, b2)  # [D, M], [M]
        W_out, b_out = mlp.W_out.double(), mlp.b_out.double()  # [M, D], [D]
        if layout == "neuron":
            return LiteralBlock(ln1, attn, ln2, self.neuron_heads(W_in, b_in, W_out, b_out))
        mlp_in, activation, mlp_out = self.split_mlp(W_in, b_in, W_out, b_out)
        return LiteralBlock(ln1, attn, ln2, activation, mlp_in=mlp_in, mlp_out=mlp_out)

    def attention(self, block: TransformerBlock, max_len: int) -> LiteralAttention:
        """The model's own heads, tweaked (Theorem 6), plus the ``b_O`` head."""
        a, cfg = block.attn, self.cfg
        w1, b1, _ = _norm_parts(block.ln1)
        rotary_dim = (cfg.rotary_dim or 0) if cfg.positional_embedding_type == "rotary" else 0
        spec = theorem6_tweaked_attention_heads(
            a.W_Q, a.b_Q, a.W_K, a.b_K, a.W_V, a.b_V, a.W_O, a.b_O, self.lay,
            float(a.attn_scale), w1, b1, rotary_dim,
        )  # fmt: skip
        attn = self.assemble(spec, rotary_adjacent_pairs=bool(cfg.rotary_adjacent_pairs))
        if rotary_dim:
            cos, sin = _rotary_tables(a, max_len)
            # augmented position p uses original position p - 1 (the bias token's is masked)
            attn.rotary_cos.copy_(torch.cat([cos[:1], cos]))
            attn.rotary_sin.copy_(torch.cat([sin[:1], sin]))
        return attn

    def neuron_heads(
        self, W_in: Tensor, b_in: Tensor, W_out: Tensor, b_out: Tensor
    ) -> LiteralNeuronLayer:
        """Neuron layout: one sublayer of ``d_mlp * K`` neuron-heads (Theorem 3) + ``b_out``."""
        lay, M = self.lay, W_in.shape[1]
        heads = theorem3_neuron_head(W_in.T, b_in, W_out, self.coefs)
        spec = neuron_sublayer(heads, lay, lay.model_dims, lay.model_dims, b_out)
        neurons = cast(LiteralNeuronLayer, self.assemble(
            spec, module_cls=LiteralNeuronLayer, d_mlp=M, n_heads_per_neuron=self.K,
            pre_start=None,
        ))  # fmt: skip
        neurons.pre_read[lay.model_dims] = W_in
        neurons.pre_read[lay.real_rows] = b_in
        neurons.post_write[:, lay.model_dims] = W_out
        neurons.post_offset.fill_(self.g_sum)
        return neurons

    def split_mlp(
        self, W_in: Tensor, b_in: Tensor, W_out: Tensor, b_out: Tensor
    ) -> tuple[LiteralAttention, LiteralNeuronLayer, LiteralAttention]:
        """Split layout: ``W_in`` heads (Thm 7), activation heads (Thm 8), ``W_out`` heads."""
        lay, M, D = self.lay, W_in.shape[1], W_in.shape[0]
        R, real, dh = lay.d_resid, lay.real_rows, self.linear_d_head
        # 1. pre <- normalised x W_in + b_in
        W_map_in = torch.zeros(R, M, dtype=torch.float64)
        W_map_in[lay.model_dims], W_map_in[real] = W_in, b_in
        mlp_in = self.assemble(linear_map_sublayer([(W_map_in, lay.pre_dims)], lay, dh))
        # 2. post <- act(pre) - sum_k g_k
        spec = neuron_sublayer(
            theorem8_activation_heads(self.coefs, M), lay, lay.pre_dims, lay.post_dims, None
        )
        activation = cast(LiteralNeuronLayer, self.assemble(
            spec, module_cls=LiteralNeuronLayer, d_mlp=M, n_heads_per_neuron=self.K,
            pre_start=lay.pre_dims.start,
        ))  # fmt: skip
        activation.post_offset.fill_(self.g_sum)
        activation.post_write[:, lay.post_dims] = torch.eye(M, dtype=torch.float64)
        # 3. x <- post W_out + b_out (+ the g constants); pre, post <- 0
        W_map_out = torch.zeros(R, D, dtype=torch.float64)
        W_map_out[lay.post_dims] = W_out
        W_map_out[real] = b_out + self.g_sum * W_out.sum(0)
        clear_pre = torch.zeros(R, M, dtype=torch.float64)
        clear_pre[lay.pre_dims] = -torch.eye(M, dtype=torch.float64)
        clear_post = torch.zeros(R, M, dtype=torch.float64)
        clear_post[lay.post_dims] = -torch.eye(M, dtype=torch.float64)
        maps = [(W_map_out, lay.model_dims), (clear_pre, lay.pre_dims), (clear_post, lay.post_dims)]
        mlp_out = self.assemble(linear_map_sublayer(maps, lay, dh))
        return mlp_in, activation, mlp_out

    def gated_mlp(
        self, mlp: GatedMLP, norm_w: Tensor | None, norm_b: Tensor | None
    ) -> tuple[LiteralNeuronLayer, LiteralAttention, LiteralAttention, LiteralAttention]:
        """Gated split layout: ``W_gate``/``W_in``, product, activation and ``W_out`` heads.

        TransformerLens's ``GatedMLP``: ``post = act(x W_gate) * (x W_in) + b_in``,
        ``out = post W_out + b_out`` (``b_in`` is added after the product: here it goes into the
        ``W_out`` heads' bias, and into ``post_offset`` so that ``hook_post`` equals TL's).

        Returns:
            ``(mlp, mlp_in, mlp_out, mlp_prod)`` in :class:`LiteralBlock`'s argument order.
        """
        lay, M = self.lay, self.lay.d_mlp
        R, real, dh = lay.d_resid, lay.real_rows, self.linear_d_head
        W_gate, c_gate = fold_norm(mlp.W_gate, None, norm_w, norm_b)  # [D, M], [M]
        W_in, c_in = fold_norm(mlp.W_in, None, norm_w, norm_b)
        b_in, W_out, b_out = mlp.b_in.double(), mlp.W_out.double(), mlp.b_out.double()
        # 1. g <- normalised x W_gate, u <- normalised x W_in
        maps = []
        for W, c, write in ((W_gate, c_gate, lay.pre_dims), (W_in, c_in, lay.linear_dims)):
            W_map = torch.zeros(R, M, dtype=torch.float64)
            W_map[lay.model_dims], W_map[real] = W, c
            maps.append((W_map, write))
        mlp_in = self.assemble(linear_map_sublayer(maps, lay, dh))
        # 2. p <- (2 / eps) tanh(eps g u / 2) ~ g u
        if self.product_eps is None:
            raise ValueError("A gated MLP needs product_eps (to_literal chooses it).")
        mlp_prod = self.assemble(product_heads(lay, self.product_eps))
        # 3. post <- act(g) u (the activation heads read g, p and u)
        activation = cast(LiteralNeuronLayer, self.assemble(
            gated_activation_heads(self.coefs, lay), module_cls=LiteralNeuronLayer, d_mlp=M,
            n_heads_per_neuron=self.K, pre_start=lay.pre_dims.start,
            linear_start=lay.linear_dims.start,
        ))  # fmt: skip
        activation.post_offset.copy_(b_in)
        activation.post_write[:, lay.post_dims] = torch.eye(M, dtype=torch.float64)
        # 4. x <- post W_out + b_in W_out + b_out; g, u, p, post <- 0
        W_map_out = torch.zeros(R, self.cfg.d_model, dtype=torch.float64)
        W_map_out[lay.post_dims] = W_out
        W_map_out[real] = b_out + b_in @ W_out
        out_maps = [(W_map_out, lay.model_dims)]
        for dims in (lay.pre_dims, lay.linear_dims, lay.product_dims, lay.post_dims):
            clear = torch.zeros(R, M, dtype=torch.float64)
            clear[dims] = -torch.eye(M, dtype=torch.float64)
            out_maps.append((clear, dims))
        mlp_out = self.assemble(linear_map_sublayer(out_maps, lay, dh))
        return activation, mlp_in, mlp_out, mlp_prod


__all__ = [
    "assemble_sublayer",
    "sublayer_head_counts",
    "to_literal",
]
