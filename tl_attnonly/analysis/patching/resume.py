"""Re-running the corrupted input from a layer on, many batch copies at a time.

Exact patching of an activation in layer ``l`` leaves everything before layer ``l`` as in the
corrupted run, so the patched runs can start at layer ``l`` from the corrupted residual stream
(TransformerLens's ``forward(resid, start_at_layer=l)``) instead of from the tokens. Several
patches share a pass as copies of the batch (the rows of a batch never interact), and a budget
bounds the memory of those copies.

In a causal decoder a patch that changes the residual stream only at positions ``>= p`` leaves
every earlier position as in the corrupted run, in every later layer. Such a pass runs positions
``p..`` only, attending to the corrupted run's keys and values of positions ``< p``
(TransformerLens's frozen key-value cache, filled once by a run of the prefix); the logits of
positions ``< p`` are the corrupted run's.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from jaxtyping import Float, Int

from tl_attnonly._types import FwdHooks, Metric
from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.metric_reads import checked_logit_positions
from tl_attnonly.hooks import block_act_name, exact_names_filter
from tl_attnonly.protocol import ModelLike

#: Default memory budget (bytes) of the batch copies of one patched pass.
PATCH_BUDGET = 1 << 30

#: Most patches a pass takes when ``patches_per_pass`` is chosen from the budget.
MAX_AUTO_PATCHES_PER_PASS = 256

_BLOCK_RE = re.compile(r"^blocks\.(\d+)\.")


def hook_layer(name: str) -> int | None:
    """The block index of ``blocks.{l}.*`` hook names, ``None`` for the others (embeddings...)."""
    match = _BLOCK_RE.match(name)
    return int(match.group(1)) if match else None


def can_resume(model: object) -> bool:
    """Whether ``model`` runs from a given layer (a decoder; see
    :meth:`~tl_attnonly.protocol.AttnOnlyModel.layer_runs`)."""
    return analysis_model(model, neuron_heads=False).can_resume


def additive_mlp_out(model: ModelLike) -> bool:
    """Whether an MLP's output is added to the residual stream as it is (no norm after it), so
    that a change of ``hook_post`` by ``delta`` changes ``resid_post`` by ``delta @ W_out``."""
    model = analysis_model(model, neuron_heads=False)
    return model.can_resume and not model.cfg.post_norm


def bytes_per_copy(model: ModelLike, batch: int, pos: int) -> int:
    """An estimate of the activation memory one copy of a ``[batch, pos]`` input needs in a pass
    with the neuron-head path of one layer hooked: logits, residual streams, the per-head
    temporaries of one neuron-head layer and one layer's attention pattern."""
    model = analysis_model(model, neuron_heads=False)
    cfg = model.cfg
    itemsize = torch.empty(0, dtype=cfg.dtype).element_size()
    per_token = (
        cfg.d_vocab_out
        + 8 * cfg.d_model
        + (2 + 8 * model.n_heads_per_neuron) * (cfg.d_mlp or 0)
        + 3 * cfg.n_heads * pos
    )
    return batch * pos * per_token * itemsize


def patches_per_pass_for(
    model: ModelLike,
    batch: int,
    pos: int,
    patches_per_pass: int | None,
    max_bytes: int,
) -> int:
    """``patches_per_pass`` checked against ``max_bytes``, or chosen from it when ``None``.

    Raises:
        MemoryError: If one copy (or the ``patches_per_pass`` copies asked for) would exceed the
            budget, naming what to change.
    """
    model = analysis_model(model, neuron_heads=False)
    per_copy = bytes_per_copy(model, batch, pos)
    if patches_per_pass is None:
        if per_copy > max_bytes:
            raise MemoryError(
                f"One patched pass over the [batch={batch}, pos={pos}] input needs about "
                f"{per_copy / 2**20:.1f} MiB of activations (logits of {model.cfg.d_vocab_out} "
                f"tokens, residual streams, per-head temporaries), more than max_bytes="
                f"{max_bytes / 2**20:.1f} MiB. Raise max_bytes, or patch a smaller batch or "
                "fewer positions."
            )
        return max(1, min(MAX_AUTO_PATCHES_PER_PASS, max_bytes // per_copy))
    if patches_per_pass < 1:
        raise ValueError(f"patches_per_pass must be >= 1 (or None: from max_bytes), got "
                         f"{patches_per_pass}.")  # fmt: skip
    if patches_per_pass * per_copy > max_bytes:
        raise MemoryError(
            f"patches_per_pass={patches_per_pass} copies of the [batch={batch}, pos={pos}] input "
            f"need about {patches_per_pass * per_copy / 2**20:.1f} MiB of activations, more than "
            f"max_bytes={max_bytes / 2**20:.1f} MiB. Pass patches_per_pass=None (chosen from the "
            f"budget: {max(1, max_bytes // per_copy)} here), a smaller value, or raise max_bytes."
        )
    return patches_per_pass


class LayerRuns:
    """The corrupted run's residual stream at every layer, and runs that resume from it.

    Args:
        model: A converted decoder (an :class:`~tl_attnonly.AttnOnlyTransformer` or a converted
            ``TransformerBridge``; see :meth:`~tl_attnonly.protocol.AttnOnlyModel.layer_runs`).
        corrupted_tokens: ``[batch, pos]``.
        extra_names: Further hooks to cache from the corrupted run (e.g. neuron-head ``z``).
        metric: The metric the runs' logits are for: where it declares the one position per row
            it reads (``logit_positions``, :mod:`~tl_attnonly.analysis.metric_reads`), only those
            positions are unembedded (:meth:`read_only`).

    Raises:
        ValueError: If ``metric`` reads logits at other positions than it declares.
    """

    def __init__(
        self,
        model: ModelLike,
        corrupted_tokens: Int[torch.Tensor, "batch pos"],
        extra_names: Sequence[str] = (),
        metric: Metric | None = None,
    ):
        model = analysis_model(model, neuron_heads=False)
        if not model.can_resume:
            raise TypeError(f"{type(model.model).__name__} cannot start a forward pass at a layer.")
        self.model = model
        self.batch = corrupted_tokens.shape[0]
        n_layers = model.cfg.n_layers
        names = [block_act_name("resid_pre", li) for li in range(n_layers)]
        names.append(block_act_name("resid_post", n_layers - 1))
        self.tokens = corrupted_tokens
        self._runner = model.layer_runs(corrupted_tokens)
        with torch.no_grad():
            self.logits, self.cache = model.run_with_cache(
                corrupted_tokens, names_filter=exact_names_filter(*names, *extra_names)
            )
        #: Whether passes may skip unchanged leading positions (see the module docstring).
        self.prefix_reuse = self._runner.prefix_reuse
        #: ``[batch]``: the one position per row whose logits the runs compute (the others
        #: NaN); ``None``: every position's.
        self.logit_positions: Int[torch.Tensor, " batch"] | None = None
        if metric is not None:
            self.read_only(metric)

    def read_only(self, metric: Metric) -> None:
        """From now on, compute only the logits ``metric`` declares it reads (its
        ``logit_positions``, checked on the corrupted run's logits), the other positions NaN; a
        metric that declares none: every position's. The unembedding is a large part of a run
        from a late block (SmolLM2: 49,152 x 576 per position, several blocks' arithmetic).

        Raises:
            ValueError: If ``metric`` reads logits at other positions than it declares.
        """
        self.logit_positions = checked_logit_positions(metric, self.logits)

    def resid(self, layer: int) -> Float[torch.Tensor, "batch pos d_model"]:
        """The corrupted residual stream entering block ``layer`` (``n_layers``: the final one)."""
        n_layers = self.model.cfg.n_layers
        if layer == n_layers:
            return self.cache[block_act_name("resid_post", n_layers - 1)]
        return self.cache[block_act_name("resid_pre", layer)]

    def run(
        self,
        resid: Float[torch.Tensor, "copies_batch pos d_model"],
        layer: int,
        fwd_hooks: FwdHooks = (),  # type: ignore[assignment]
        first_pos: int = 0,
    ) -> Float[torch.Tensor, "copies_batch pos d_vocab"]:
        """Logits of ``resid`` (copies of the batch, stacked on the batch axis) run from block
        ``layer`` on (``n_layers``: only the final norm and the unembedding).

        ``first_pos``: ``resid`` equals the corrupted residual stream at every position before
        it, so where :attr:`prefix_reuse` holds only positions ``first_pos..`` are run. Where
        :attr:`logit_positions` is set, only those positions' logits are computed (the others
        NaN).
        """
        return self._runner.run(
            resid,
            layer,
            list(fwd_hooks),
            first_pos,
            self.logits,
            logit_positions=self.logit_positions,
        )


def run_copies(
    model: ModelLike,
    runs: LayerRuns | None,
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    copies: int,
    fwd_hooks: FwdHooks,
) -> Float[torch.Tensor, "copies_batch pos d_vocab"]:
    """Logits of ``copies`` copies of the corrupted batch with ``fwd_hooks`` (named hooks that
    edit each copy's rows): from the earliest hooked block when every hook is in a block and
    ``runs`` is given, else a full forward pass."""
    model = analysis_model(model, neuron_heads=False)
    layers = [hook_layer(name) if isinstance(name, str) else None for name, _ in fwd_hooks]
    if runs is not None and fwd_hooks and None not in layers:
        first = min(layer for layer in layers if layer is not None)
        return runs.run(runs.resid(first).repeat(copies, 1, 1), first, fwd_hooks)
    with torch.no_grad():
        return model.run_with_hooks(corrupted_tokens.repeat(copies, 1), fwd_hooks=fwd_hooks)


def metric_of_copies(
    patching_metric: Metric, logits: Float[torch.Tensor, "copies_batch pos d_vocab"], batch: int
) -> list[float]:
    """``patching_metric`` of each copy's ``[batch, pos, d_vocab]`` slice of ``logits``."""
    return [
        float(patching_metric(logits[start : start + batch]).item())
        for start in range(0, logits.shape[0], batch)
    ]


__all__ = [
    "MAX_AUTO_PATCHES_PER_PASS",
    "metric_of_copies",
    "run_copies",
    "PATCH_BUDGET",
    "LayerRuns",
    "additive_mlp_out",
    "bytes_per_copy",
    "can_resume",
    "hook_layer",
    "patches_per_pass_for",
]
