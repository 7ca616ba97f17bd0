"""The analysis tools run on a zoo bridge, one cell of the tool table each.

``scripts/architecture_tool_table.py`` builds the table from these (``docs/architecture_tools.md``).
Each tool of :data:`TOOLS` runs once on a tiny task (:class:`Task`: ``[2, 6]`` random tokens, a
copy with two positions changed, a last-position logit difference) on a converted float32 zoo
bridge (:func:`build_converted`), and checks its contract where that costs a forward pass or two
(exact circuit runs, patching against a plain hook, decompositions that sum). :func:`cell` turns
the outcome into the table's text: ``"yes"``, a refusal's first sentence (``NotImplementedError``,
``ValueError`` or ``TypeError`` raised inside ``tl_attnonly``), or ``"error: ..."`` (any other
exception, one of those three raised elsewhere, or a broken contract: a defect).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import re
import shutil
import signal
import sys
import tempfile
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from zoo import ZOO, build_hf_model, convert_zoo_bridge

#: What a tool may raise to refuse (before any work).
REFUSALS = (NotImplementedError, ValueError, TypeError)
#: The tiny task: ``[BATCH, POS]`` tokens, the metric's two tokens.
BATCH, POS = 2, 6
CORRECT, WRONG = 3, 17
#: Where a tool's result is checked against its contract: agreement relative to the values' scale
#: (float32 models; the measured errors of the tools that keep their contract are near 1e-6).
RTOL = 1e-4
#: A tool that runs longer is a defect (a hang; the tools take well under 10 s each here).
CELL_SECONDS = 120.0
_TOKENIZERS = Path(tempfile.mkdtemp(prefix="zoo_tools_tokenizer_"))
atexit.register(shutil.rmtree, _TOKENIZERS, ignore_errors=True)


def expert_patch_by_hand(
    bridge: Any, corrupted: torch.Tensor, cache: Any, layer: int, expert: int, head: int
) -> torch.Tensor:
    """The corrupted run's logits with routed expert ``expert``'s neuron-head ``head`` at
    ``layer`` given its clean ``z`` (``cache``) at the tokens routed to it in both runs, by plain
    hooks: one reads the corrupted run's routing, the other writes the expert's ``hook_z``."""
    from tl_attnonly.analysis.experts.routing import routing_hook_name

    routing = routing_hook_name(layer, bridge)

    def order(index: torch.Tensor) -> list[int]:  # the token of each expert row: slot, then token
        return [t for s in range(index.shape[1]) for t in range(index.shape[0])
                if int(index[t, s]) == expert]  # fmt: skip

    clean_order = order(cache[routing])
    clean_z = cache[f"blocks.{layer}.mlp.experts.{expert}.hook_z"]  # [1, routed, heads, 1]
    seen: dict[str, list[int]] = {}

    def read_routing(index: torch.Tensor, hook: Any) -> None:
        seen["order"] = order(index)

    def patch(z: torch.Tensor, hook: Any) -> torch.Tensor:
        z = z.clone()
        for i, token in enumerate(seen["order"]):
            if token in clean_order:
                z[0, i, head] = clean_z[0, clean_order.index(token), head]
        return z

    hooks = [(routing, read_routing), (f"blocks.{layer}.mlp.experts.{expert}.hook_z", patch)]
    return bridge.run_with_hooks(corrupted, fwd_hooks=hooks)


class WrongResult(Exception):
    """A tool ran but broke its documented contract (a silent defect: counted as an error)."""


def check_contract(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Raise :class:`WrongResult` (``what``) unless ``actual`` equals ``expected`` within
    :data:`RTOL` of ``max(1, max |expected|)``."""
    actual, expected = actual.detach().double(), expected.detach().double()
    scale = max(1.0, float(expected.abs().max()))
    if actual.shape != expected.shape or not bool(
        ((actual - expected).abs() <= RTOL * scale).all()
    ):
        raise WrongResult(f"{what} (beyond {RTOL:g} of the values' scale).")


@dataclasses.dataclass
class Task:
    """One converted zoo bridge and the tiny task its tools run on."""

    bridge: Any
    clean: torch.Tensor
    corrupted: torch.Tensor

    def patching_metric(self, logits: torch.Tensor) -> torch.Tensor:
        """Mean last-position logit difference (``logits -> scalar``)."""
        return (logits[:, -1, CORRECT] - logits[:, -1, WRONG]).mean()

    def discovery_metric(self) -> Any:
        """The same metric, batch-additive, for ``discover_circuit``."""
        from tl_attnonly.analysis import logit_diff_metric

        n = self.clean.shape[0]
        return logit_diff_metric(torch.full((n,), CORRECT), torch.full((n,), WRONG))

    def z_cache(self) -> Any:
        """The clean run's cache of every head's ``z``."""
        from tl_attnonly.hooks import head_names_filter

        return self.bridge.run_with_cache(self.clean, names_filter=head_names_filter("z"))[1]

    def hooked_patch(self, cache: Any, name: str, head: int) -> torch.Tensor:
        """The metric of the corrupted run with head ``head`` of hook ``name`` (a ``z``:
        ``[batch, pos, head, d_head]``) set to its clean value by a plain hook."""

        def patch(z: torch.Tensor, hook: Any) -> torch.Tensor:
            z = z.clone()
            z[:, :, head] = cache[name][:, :, head]
            return z

        with torch.no_grad():
            logits = self.bridge.run_with_hooks(self.corrupted, fwd_hooks=[(name, patch)])
        return self.patching_metric(logits)

    def decomposition_cache(self) -> Any:
        from tl_attnonly.hooks import decomposition_names_filter

        return self.bridge.run_with_cache(self.clean, names_filter=decomposition_names_filter())[1]


def _discover_circuit(task: Task) -> None:
    from tl_attnonly.analysis import HeadGraph, circuit_metrics, discover_circuit

    metric = task.discovery_metric()
    circuit = discover_circuit(
        task.bridge,
        task.clean,
        task.corrupted,
        metric,
        target=0.5,
        ig_steps=2,
        prune_runs=2,
        max_runs=6,
        neurons_per_mlp=2,
        progress=False,
    )
    circuit.report()
    # the exact runs' contract: the full graph is the clean run, the empty graph the corrupted one
    full = HeadGraph(task.bridge).full_mask()
    empty = {key: torch.zeros_like(block) for key, block in full.items()}
    runs = circuit_metrics(task.bridge, [full, empty], task.clean, task.corrupted, metric)
    indices = torch.arange(task.clean.shape[0])
    with torch.no_grad():
        expected = [metric(task.bridge(t), indices) for t in (task.clean, task.corrupted)]
    check_contract(
        torch.tensor(runs),
        torch.tensor([float(value) for value in expected]),
        "the full graph's exact run is not the clean run, or the empty graph's not the "
        "corrupted run",
    )


def _neuron_head_patching(task: Task) -> None:
    from tl_attnonly.analysis import get_act_patch_neuron_heads

    cache = task.z_cache()
    get_act_patch_neuron_heads(
        task.bridge, task.corrupted, cache, task.patching_metric, heads=[0, 1], progress=False
    )
    # its contract: one neuron-head's patch is the bridge run with that head's z patched by a hook
    from tl_attnonly.adapt import analysis_model

    if getattr(analysis_model(task.bridge).neuron_heads[0], "is_mixture_of_experts", False):
        # an expert layer: its heads are its experts' end to end; head 0 is expert 0's head 0
        with torch.no_grad():
            logits = expert_patch_by_hand(task.bridge, task.corrupted, cache, 0, 0, 0)
        expected = task.patching_metric(logits).reshape(1)
    else:
        expected = task.hooked_patch(cache, "blocks.0.mlp.hook_z", 0).reshape(1)
    one = get_act_patch_neuron_heads(
        task.bridge,
        task.corrupted,
        cache,
        task.patching_metric,
        layers=[0],
        heads=[0],
        level="head",
        progress=False,
    )
    check_contract(
        one.flatten(),
        expected,
        "a neuron-head's patch is not the run with its z patched",
    )


def _attention_head_patching(task: Task) -> None:
    from tl_attnonly.analysis import get_act_patch_all_heads

    n_heads = task.bridge.cfg.n_heads
    heads = [
        f"L{layer}H{head}" for layer in range(task.bridge.cfg.n_layers) for head in range(n_heads)
    ]
    cache = task.z_cache()
    scores, _ = get_act_patch_all_heads(
        task.bridge, task.corrupted, cache, task.patching_metric, heads=heads, progress=False
    )
    # its contract: each entry is the bridge run with that head's z patched by a hook
    check_contract(
        torch.as_tensor(scores)[1].reshape(1),
        task.hooked_patch(cache, "blocks.0.attn.hook_z", 1).reshape(1),
        "an attention head's patch is not the run with its z patched",
    )


def _direct_logit_attribution(task: Task) -> None:
    from tl_attnonly.analysis import head_logit_attrs

    head_logit_attrs(
        task.decomposition_cache(),
        torch.full((BATCH,), CORRECT),
        torch.full((BATCH,), WRONG),
        pos_slice=-1,
    )
    # its contract: with the embeddings and biases the rows sum to the logit difference less a
    # constant (the final norm's bias and b_U), the same at every position of every prompt
    logits, cache = task.bridge.run_with_cache(task.clean)
    attrs = head_logit_attrs(
        cache,
        torch.full((BATCH, POS), CORRECT),
        torch.full((BATCH, POS), WRONG),
        incl_embeds_and_bias=True,
    )
    cap = float(getattr(task.bridge.cfg, "output_logits_soft_cap", 0.0) or 0.0)
    if cap > 0:  # soft-capped logits (Gemma 2): the attributions are to the logits before the cap
        logits = cap * torch.atanh(logits.double() / cap)
    offset = attrs.sum(0) - (logits[..., CORRECT] - logits[..., WRONG])  # [batch, pos]
    check_contract(
        offset,
        offset.flatten()[0].expand_as(offset),
        "the components do not sum to the logit difference less a constant",
    )


def _residual_decomposition(task: Task) -> None:
    from tl_attnonly.analysis import decompose_resid_heads

    stack = decompose_resid_heads(task.decomposition_cache(), layer=task.bridge.cfg.n_layers)
    # its contract: the components sum to the last block's resid_post
    last = task.bridge.cfg.n_layers - 1
    _, cache = task.bridge.run_with_cache(task.clean)
    # the residual stream after the last block: where the bridge does not alias it (OpenAI GPT's
    # blocks do not fire hook_out), the final norm's input, or the unembedding's without one
    names = (f"blocks.{last}.hook_resid_post", f"blocks.{last}.hook_out", "ln_final.hook_in")
    found = [name for name in names if name in cache.cache_dict] + ["unembed.hook_in"]
    check_contract(
        stack.sum(0),
        cache[found[0]],
        "the components do not sum to the residual stream",
    )


def _summaries(task: Task) -> None:
    from tl_attnonly.analysis import summarize_neuron_heads

    summarize_neuron_heads(
        task.bridge, [task.clean[0], task.clean[1]], max_len=POS, token_stats=False, progress=False
    )


def _attention_view(task: Task) -> None:
    from tl_attnonly.vis import neuron_head_attention_view

    neuron_head_attention_view(task.bridge, 0, task.clean[0], top_k=2)


def _attribute_then_patch(task: Task) -> None:
    from tl_attnonly.analysis import attribute_then_patch

    attribute_then_patch(
        task.bridge, task.clean, task.corrupted, task.patching_metric, k=2, progress=False
    )


def _report(task: Task) -> None:
    from tl_attnonly.report import write_demo_report

    prompt = " ".join(f"w{int(t)}" for t in task.clean[0])
    with tempfile.TemporaryDirectory() as directory:
        write_demo_report(
            None,
            task.bridge,
            prompt,
            Path(directory) / "report.html",
            equivalence={},
            top_k=2,
            square_k=1,
            progress=False,
        )


#: Column -> (what it calls, the tool).
TOOLS: dict[str, tuple[str, Callable[[Task], None]]] = {
    "discover_circuit": ("`discover_circuit(...)` and its `report()`", _discover_circuit),
    "neuron-head patching": ("`get_act_patch_neuron_heads`", _neuron_head_patching),
    "attention-head patching": (
        "`get_act_patch_all_heads(heads=[every L{l}H{h}])`",
        _attention_head_patching,
    ),
    "direct logit attribution": ("`head_logit_attrs`", _direct_logit_attribution),
    "residual decomposition": ("`decompose_resid_heads`", _residual_decomposition),
    "summaries": ("`summarize_neuron_heads`", _summaries),
    "attention view": ("`tl_attnonly.vis.neuron_head_attention_view`", _attention_view),
    "attribute_then_patch": (
        "`attribute_then_patch` (attribution patching)",
        _attribute_then_patch,
    ),
    "HTML report": ("`tl_attnonly.report.write_demo_report`", _report),
}


def first_sentence(message: str) -> str:
    """The first sentence of an error message, on one line, safe in a Markdown table."""
    text = " ".join(message.split()).replace("|", "/")
    return re.split(r"(?<=[.!?])\s+(?=[A-Z`(])", text)[0]


def word_tokenizer(vocab: int) -> Any:
    """A word-level tokenizer over ``vocab`` words ``w0 ...`` (the report shows tokens), offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    directory = _TOKENIZERS / str(vocab)
    if not directory.exists():  # TransformerLens reloads it from its name_or_path
        words = {f"w{i}": i for i in range(vocab)}
        tokenizer = Tokenizer(models.WordLevel(words, unk_token="w1"))
        tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        PreTrainedTokenizerFast(
            tokenizer_object=tokenizer,
            unk_token="w1",
            bos_token="w0",
            eos_token="w0",
            pad_token="w0",
        ).save_pretrained(directory)
    return PreTrainedTokenizerFast.from_pretrained(directory)


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """``[BATCH, POS]`` random tokens (ids 2 and up) and a copy with two positions changed."""
    generator = torch.Generator().manual_seed(1)
    clean = torch.randint(2, 128, (BATCH, POS), generator=generator)
    corrupted = clean.clone()
    corrupted[:, 1] = (clean[:, 1] + 11 - 2) % 126 + 2
    corrupted[:, -2] = (clean[:, -2] + 5 - 2) % 126 + 2
    return clean, corrupted


def build_converted(name: str) -> Any:
    """Zoo model ``name`` as a converted float32 bridge with a word tokenizer."""
    from transformer_lens.model_bridge.sources import build_bridge_from_module

    spec = ZOO[name]
    model, config = build_hf_model(name, torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bridge = build_bridge_from_module(
            model,
            spec.architecture,
            hf_config=config,
            dtype=torch.float32,
            tokenizer=word_tokenizer(config.vocab_size),
        )
    return convert_zoo_bridge(bridge)


class CellTimeout(Exception):
    """A tool ran past :data:`CELL_SECONDS` (a hang: counted as an error)."""


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`CellTimeout` in the block after ``seconds`` (where ``SIGALRM`` exists and
    this is the main thread; elsewhere no limit)."""
    if not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise CellTimeout(f"the tool ran past {seconds:g} s.")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def cell(tool: Callable[[Task], None], task: Task | None) -> str:
    """``"yes"``, the refusal's first sentence, or ``"error: ..."`` (with the traceback's last
    lines on stderr). The bridge's hooks are removed afterwards (permanent ones kept), so that a
    tool that failed half-way leaves none for the next."""
    try:
        with warnings.catch_warnings(), _time_limit(CELL_SECONDS):
            warnings.simplefilter("ignore")
            tool(task)  # type: ignore[arg-type]  # the tests' fake tools take None
    except WrongResult as wrong:
        return f"error: wrong result: {wrong}"
    except REFUSALS as refusal:
        if not raised_by_the_package(refusal):  # torch's, pandas', or a call that no longer fits
            return error_text(refusal)
        return refusal_text(refusal)
    except Exception as error:  # noqa: BLE001 - a defect, recorded, not raised
        return error_text(error)
    finally:
        if task is not None:
            task.bridge.reset_hooks(including_permanent=False)
    return "yes"


def raised_by_the_package(error: BaseException) -> bool:
    """Whether ``error`` was raised in ``tl_attnonly`` (a refusal is; a library's own
    ``ValueError`` deep in a computation, or a ``TypeError`` of a call here, is a defect)."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and "tl_attnonly" in Path(frames[-1].filename).parts


def refusal_text(error: BaseException) -> str:
    """``"Type: first sentence"`` (a ``KeyError``'s key without its quotes)."""
    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    return first_sentence(f"{type(error).__name__}: {text}")


def error_text(error: Exception) -> str:
    """``"error: ..."``, with the traceback's last lines on stderr."""
    lines = traceback.format_exc().strip().splitlines()[-8:]
    print("\n".join(lines), file=sys.stderr)
    return "error: " + refusal_text(error)
