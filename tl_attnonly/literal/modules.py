"""Literal-form modules besides plain attention: the partial norm, the neuron layer, a block."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from jaxtyping import Float
from torch import Tensor
from transformer_lens.hook_points import HookPoint

from tl_attnonly.components.literal_attention import LiteralAttention


class PartialNorm(nn.Module):
    """``LNPre``/``RMSPre`` on the first ``d_norm`` coordinates; the rest pass through unchanged.

    The one part of a literal sublayer that is not attention: the original model normalises its
    ``D`` coordinates before each sublayer, and so must the literal form (weights and biases of
    the norm are folded into the heads). On the bias token (original coordinates all 0) it
    returns 0.

    Args:
        d_norm: Number of leading coordinates normalised (``D``).
        eps: As in TransformerLens.
        center: Subtract the mean first (LayerNorm) or not (RMSNorm).
    """

    def __init__(self, d_norm: int, eps: float, center: bool):
        super().__init__()
        self.d_norm = d_norm
        self.eps = eps
        self.center = center
        self.hook_scale = HookPoint()  # [batch, pos, 1]
        self.hook_normalized = HookPoint()  # [batch, pos, d_norm]

    def forward(
        self, x: Float[torch.Tensor, "batch pos d_resid"]
    ) -> Float[torch.Tensor, "batch pos d_resid"]:
        head, tail = x[..., : self.d_norm], x[..., self.d_norm :]
        if head.dtype not in (torch.float32, torch.float64):
            head = head.float()  # as TransformerLens: half precision norms in float32
        if self.center:
            head = head - head.mean(-1, keepdim=True)
        scale = self.hook_scale((head.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        head = self.hook_normalized(head / scale).to(x.dtype)
        return torch.cat([head, tail], dim=-1)

    def extra_repr(self) -> str:
        return f"d_norm={self.d_norm}, eps={self.eps}, center={self.center}"


class LiteralNeuronLayer(LiteralAttention):
    """The neuron-heads of one MLP layer, as plain attention, plus ``hook_pre``/``hook_post``.

    Head ``h = i * K + k`` is head ``k`` of neuron ``i`` (as in the structured form); in the
    ``"neuron"`` layout a last bias head writes ``b_out``. The two MLP hooks are read off the real
    positions:

    * ``hook_pre`` ``[batch, pos, d_mlp]``: in the split layout the hidden pre-activation
      coordinates of the input (editing it edits what the heads read); in the neuron layout no
      pre-activation exists in the computation, so it is computed beside it for inspection and
      editing it raises ``NotImplementedError`` (edit ``hook_q``/``hook_v`` instead).
    * ``hook_post`` ``[batch, pos, d_mlp]``: ``sum_k z`` plus the bias-token constants ``sum_k
      g_k``, i.e. the activation. An edit reaches the output (its difference is written through
      the neuron's output weights), as in TransformerLens.

    A gated MLP (``linear_start`` given; split layout) has TransformerLens's hooks too:
    ``hook_pre`` is the gate ``g`` and ``hook_pre_linear`` the linear branch ``u`` (both read-only
    here: the product heads before this sublayer have already used them; edit the hidden
    coordinates of ``blocks.{l}.hook_resid_hidden`` instead), and ``hook_post`` is
    ``act(g) u + b_in`` (``post_offset`` holds ``b_in``).

    Args:
        *args: As for :class:`LiteralAttention`.
        d_mlp: Neurons ``M``.
        n_heads_per_neuron: ``K``.
        pre_start: First hidden pre-activation coordinate (split layout), else ``None``.
        linear_start: First hidden linear-branch coordinate (gated split layout), else ``None``.
        **kwargs: As for :class:`LiteralAttention`.
    """

    pre_read: torch.Tensor
    post_offset: torch.Tensor
    post_write: torch.Tensor

    def __init__(
        self,
        *args: Any,
        d_mlp: int,
        n_heads_per_neuron: int,
        pre_start: int | None,
        linear_start: int | None = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        if linear_start is not None and pre_start is None:
            raise ValueError("A gated neuron layer (linear_start) needs pre_start (split layout).")
        self.d_mlp = d_mlp
        self.n_heads_per_neuron = n_heads_per_neuron
        self.n_neuron_heads = d_mlp * n_heads_per_neuron
        self.pre_start = pre_start
        self.linear_start = linear_start
        dtype = self.W_Q.dtype
        # [d_resid, d_mlp]: how the neuron layout reads pre-activations (for hook_pre only).
        self.register_buffer("pre_read", torch.zeros(self.d_model, d_mlp, dtype=dtype))
        # [d_mlp]: sum_k g_k, added to sum_k z to give the activation.
        self.register_buffer("post_offset", torch.zeros(d_mlp, dtype=dtype))
        # [d_mlp, d_resid]: where each neuron's activation is written (for hook_post edits).
        self.register_buffer("post_write", torch.zeros(d_mlp, self.d_model, dtype=dtype))
        self.hook_pre = HookPoint()  # [batch, pos, d_mlp]
        if linear_start is not None:
            self.hook_pre_linear = HookPoint()  # [batch, pos, d_mlp]
        self.hook_post = HookPoint()  # [batch, pos, d_mlp]

    def forward(
        self, x: Float[torch.Tensor, "batch pos d_resid"]
    ) -> Float[torch.Tensor, "batch pos d_resid"]:
        real = x[:, 1:]
        if self.pre_start is not None:
            pre = real[..., self.pre_start : self.pre_start + self.d_mlp]
        else:
            pre = real @ self.pre_read
        hooked_pre = self.hook_pre(pre)  # [batch, pos, d_mlp]
        if self.linear_start is not None:
            linear = real[..., self.linear_start : self.linear_start + self.d_mlp]
            hooked_linear = self.hook_pre_linear(linear)  # [batch, pos, d_mlp]
            if hooked_pre is not pre or hooked_linear is not linear:
                raise NotImplementedError(
                    "hook_pre / hook_pre_linear are read-only in the gated literal form: the "
                    "product heads (blocks.{l}.mlp_prod) have already read g and u. Edit them "
                    "where both are read: the hidden coordinates (layout.pre_dims, "
                    "layout.linear_dims) of blocks.{l}.hook_resid_hidden."
                )
        if hooked_pre is not pre:
            if self.pre_start is None:
                raise NotImplementedError(
                    "hook_pre is read-only in the literal 'neuron' layout (there the neuron-heads "
                    "read the residual stream directly); edit hook_q / hook_v, or use "
                    "layout='split' where pre-activations are residual coordinates."
                )
            x = x.clone()
            x[:, 1:, self.pre_start : self.pre_start + self.d_mlp] = hooked_pre
        z = self.attend(x)
        batch, n = z.shape[0], z.shape[1] - 1
        per_head = z[:, 1:, : self.n_neuron_heads, 0]
        post = per_head.reshape(batch, n, self.d_mlp, self.n_heads_per_neuron).sum(-1)
        post = post + self.post_offset
        hooked_post = self.hook_post(post)  # [batch, pos, d_mlp]
        out = self.project(z)
        if hooked_post is not post:
            delta = _pad_bias_row((hooked_post - post) @ self.post_write)
            out = out + delta
        return out


def _pad_bias_row(x: Float[Tensor, "batch pos d"]) -> Float[Tensor, "batch pos_plus_1 d"]:
    """Prepend a zero row for the bias token: ``[batch, pos, d] -> [batch, 1 + pos, d]``."""
    return torch.cat([x.new_zeros(x.shape[0], 1, x.shape[2]), x], dim=1)


class LiteralBlock(nn.Module):
    """One layer of the literal form: 2 sublayers (neuron layout), 4 (split) or 5 (gated split).

    Hooks (all over the augmented sequence and residual, ``[batch, 1 + pos, d_resid]``):
    ``hook_resid_pre``, ``hook_attn_out``, ``hook_resid_mid``, ``hook_mlp_out`` (everything the MLP
    sublayers add), ``hook_resid_post``; split layout also ``hook_resid_hidden`` (after ``mlp_in``)
    and ``hook_resid_act`` (after ``mlp``); gated split layout also ``hook_resid_product`` (after
    ``mlp_prod``).

    Args:
        ln1: Norm before ``attn`` (:class:`PartialNorm` or identity).
        attn: The model's own heads (Theorem 6 tweak) and the ``b_O`` head.
        ln2: Norm before the MLP's first sublayer.
        mlp: The neuron-heads (Theorem 3) or the activation heads (Theorem 8).
        mlp_in: Split layout: the ``W_in`` heads (Theorem 7).
        mlp_out: Split layout: the ``W_out`` heads (Theorem 7), which also clear the hidden
            coordinates.
        mlp_prod: Gated split layout: the product heads (``~ g * u``), between ``mlp_in`` and
            ``mlp``.
    """

    def __init__(
        self,
        ln1: nn.Module,
        attn: LiteralAttention,
        ln2: nn.Module,
        mlp: LiteralNeuronLayer,
        mlp_in: LiteralAttention | None = None,
        mlp_out: LiteralAttention | None = None,
        mlp_prod: LiteralAttention | None = None,
    ):
        super().__init__()
        if mlp_prod is not None and mlp_in is None:
            raise ValueError("mlp_prod (gated MLP) needs the split layout's mlp_in / mlp_out.")
        self.ln1, self.attn, self.ln2 = ln1, attn, ln2
        if mlp_in is not None:
            self.mlp_in = mlp_in
        if mlp_prod is not None:
            self.mlp_prod = mlp_prod
        self.mlp = mlp
        if mlp_out is not None:
            self.mlp_out = mlp_out
        self.split = mlp_in is not None
        self.gated = mlp_prod is not None
        self.hook_resid_pre = HookPoint()  # [batch, pos, d_resid]
        self.hook_attn_out = HookPoint()  # [batch, pos, d_resid]
        self.hook_resid_mid = HookPoint()  # [batch, pos, d_resid]
        if self.split:
            self.hook_resid_hidden = HookPoint()  # [batch, pos, d_resid]
            self.hook_resid_act = HookPoint()  # [batch, pos, d_resid]
        if self.gated:
            self.hook_resid_product = HookPoint()  # [batch, pos, d_resid]
        self.hook_mlp_out = HookPoint()  # [batch, pos, d_resid]
        self.hook_resid_post = HookPoint()  # [batch, pos, d_resid]

    def sublayers(self) -> list[tuple[str, LiteralAttention]]:
        """``(name, module)`` of every attention sublayer, in order."""
        if self.gated:
            names = ["attn", "mlp_in", "mlp_prod", "mlp", "mlp_out"]
        else:
            names = ["attn", "mlp_in", "mlp", "mlp_out"] if self.split else ["attn", "mlp"]
        return [(name, getattr(self, name)) for name in names]

    def forward(
        self, resid: Float[torch.Tensor, "batch pos d_resid"]
    ) -> Float[torch.Tensor, "batch pos d_resid"]:
        resid_pre = self.hook_resid_pre(resid)
        attn_out = self.hook_attn_out(self.attn(self.ln1(resid_pre)))
        resid_mid = self.hook_resid_mid(resid_pre + attn_out)
        if not self.split:
            mlp_out = self.mlp(self.ln2(resid_mid))
        else:
            written_in = self.mlp_in(self.ln2(resid_mid))
            resid_hidden = self.hook_resid_hidden(resid_mid + written_in)
            if self.gated:
                written_prod = self.mlp_prod(resid_hidden)
                resid_prod = self.hook_resid_product(resid_hidden + written_prod)
                written_in = written_in + written_prod
            else:
                resid_prod = resid_hidden
            written_act = self.mlp(resid_prod)
            resid_act = self.hook_resid_act(resid_prod + written_act)
            mlp_out = written_in + written_act + self.mlp_out(resid_act)
        mlp_out = self.hook_mlp_out(mlp_out)
        return self.hook_resid_post(resid_mid + mlp_out)


__all__ = [
    "LiteralBlock",
    "LiteralNeuronLayer",
    "PartialNorm",
]
