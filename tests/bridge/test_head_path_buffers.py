"""The head path (``fused=False``) writes a step's result into the previous step's memory only
where no hook holds that memory: hooks see, keep and edit the same values as when every step has
memory of its own, and the output is the same bit for bit."""

from __future__ import annotations

import pytest
import torch
from bridge_models import make_bridge, make_tokens

import tl_attnonly
from tl_attnonly import ConversionOptions
from tl_attnonly.bridge import neuron_head_layers
from tl_attnonly.components.neuron_head_base import DERIVABLE_HOOKS

#: (architecture, config overrides): plain K = 1 (exact SiLU), plain K = 4 (GELU, a nonzero
#: bias-token value), gated K = 1 (SwiGLU), gated K = 4 (GeGLU).
CASES = {
    "gpt2-silu": ("gpt2", {"activation_function": "silu"}),
    "gpt2-gelu_new": ("gpt2", {}),
    "llama-swiglu": ("llama", {}),
    "gemma-geglu": ("gemma", {}),
}
#: Which hook points hold what they see (the others have no hook, so their memory is reused).
HELD = {
    "all": ("pre", "q", "k", "v", "attn_scores", "pattern", "z", "post"),
    "pre": ("pre",),
    "q, v": ("q", "v"),
    "attn_scores": ("attn_scores",),
    "pattern": ("pattern",),
    "z": ("z",),
}


@pytest.fixture(autouse=True)
def _restore_grad_mode():
    enabled = torch.is_grad_enabled()
    yield
    torch.set_grad_enabled(enabled)


def _converted(case: str, dtype: torch.dtype):
    arch, overrides = CASES[case]
    bridge = make_bridge(arch, dtype, **overrides)
    return tl_attnonly.convert(bridge, ConversionOptions(fused=False))


#: Memory is reused only where autograd records nothing; with it, every step has its own.
GRAD = {"no_grad": False, "grad": True}


@pytest.mark.parametrize("grad", sorted(GRAD))
@pytest.mark.parametrize("held", sorted(HELD))
@pytest.mark.parametrize("case", sorted(CASES))
def test_held_tensors_are_never_overwritten(case, held, grad):
    """A hook that keeps the very tensor it sees (no copy) still holds, after the forward pass,
    what a copying hook saw; that value is what ``derive_activation`` recomputes; and the output
    is the one of the pass with no hook at all (where scores, pattern and z share memory)."""
    bridge = _converted(case, torch.float32)
    tokens = make_tokens()
    torch.set_grad_enabled(GRAD[grad])  # restored by _restore_grad_mode
    free = bridge(tokens)
    kept: dict[str, torch.Tensor] = {}
    copied: dict[str, torch.Tensor] = {}

    def keep(name):  # by the name it was added under (a bridge alias, e.g. mlp.hook_pre)
        return lambda tensor, hook: kept.__setitem__(name, tensor)

    def copy(name):
        return lambda tensor, hook: copied.__setitem__(name, tensor.clone())

    inputs = ("pre", "pre_linear")
    names = [
        f"blocks.{layer}.mlp.hook_{name}"
        for layer in range(2)
        for name in dict.fromkeys(HELD[held] + inputs)
    ]
    names = [name for name in names if name in bridge.hook_dict]
    fwd_hooks = [(name, keep(name)) for name in names if name.split("hook_")[-1] in HELD[held]]
    fwd_hooks += [(name, copy(name)) for name in names]
    hooked = bridge.run_with_hooks(tokens, fwd_hooks=fwd_hooks)
    assert torch.equal(hooked, free)
    assert kept and set(kept) <= set(copied)
    for name, tensor in kept.items():
        assert torch.equal(tensor, copied[name]), name
    for layer_index, layer in enumerate(neuron_head_layers(bridge)):
        prefix = f"blocks.{layer_index}.mlp."
        derive_inputs = {hook: copied[prefix + hook] for hook in layer.derive_inputs}
        for name in DERIVABLE_HOOKS:
            if prefix + f"hook_{name}" in kept:
                derived = layer.derive_activation(name, **derive_inputs)
                assert torch.equal(derived, kept[prefix + f"hook_{name}"]), prefix + name


def _edit_heads(tensor: torch.Tensor) -> None:
    """Scale the second quarter of the neuron-heads by -1.5 (dim 1 for scores and patterns,
    ``[batch, head, pos, 2]``, dim 2 for the rest, ``[batch, pos, head, 1]``), in place."""
    dim = 1 if tensor.shape[-1] == 2 else 2
    n = tensor.shape[dim]
    tensor.narrow(dim, n // 4, n // 4).mul_(-1.5)


@pytest.mark.parametrize("grad", sorted(GRAD))
@pytest.mark.parametrize("name", ["q", "v", "attn_scores", "pattern", "z"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_in_place_edits_equal_returned_edits(case, name, grad):
    """An edit of one neuron-head quantity made in place has exactly the effect of the same edit
    returned as a new tensor (its neighbours have no hook, so their memory is reused)."""
    bridge = _converted(case, torch.float64)
    tokens = make_tokens()
    torch.set_grad_enabled(GRAD[grad])
    hook_name = f"blocks.0.mlp.hook_{name}"

    def returned(tensor, hook):
        tensor = tensor.clone()
        _edit_heads(tensor)
        return tensor

    def in_place(tensor, hook):
        _edit_heads(tensor)

    reference = bridge(tokens)
    by_return = bridge.run_with_hooks(tokens, fwd_hooks=[(hook_name, returned)])
    by_edit = bridge.run_with_hooks(tokens, fwd_hooks=[(hook_name, in_place)])
    assert (by_return - reference).abs().max() > 1e-6  # the edit matters
    assert torch.equal(by_edit, by_return)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_global_module_hook_keeps_what_it_saw(case):
    """A hook registered for every module (``register_module_forward_hook``) sees each
    neuron-head hook point's value and may keep it: then no step writes into that memory."""
    bridge = _converted(case, torch.float32)
    layer = neuron_head_layers(bridge)[0]
    watched = {getattr(layer, f"hook_{name}"): name for name in DERIVABLE_HOOKS}
    inputs = {getattr(layer, hook): hook for hook in layer.derive_inputs}
    kept: dict[str, torch.Tensor] = {}
    copied: dict[str, torch.Tensor] = {}

    def keep(module, args, output):
        if module in watched:
            kept[watched[module]] = output
        elif module in inputs:
            copied[inputs[module]] = output.clone()

    handle = torch.nn.modules.module.register_module_forward_hook(keep)
    try:
        with torch.no_grad():
            bridge(make_tokens())
    finally:
        handle.remove()
    assert set(kept) == set(DERIVABLE_HOOKS)
    for name, tensor in kept.items():
        assert torch.equal(tensor, layer.derive_activation(name, **copied)), name
