"""The neuron-head layer protocol: what every block's MLP says of itself, through both adapters.

Both adapters' ``blocks[l].mlp`` satisfy :class:`~tl_attnonly.mlp_protocol.MLPLayer` (converted,
gated, a mixture of experts); a converted dense layer is a ``NeuronHeadLayerView`` (gated: a
``GatedNeuronHeadLayerView``), an unconverted MLP an ``UnconvertedMLP``; the layers' ``gated`` is
the model's ``gated_mlp`` (``ModelFacts`` computes it from them). An encoder's final hidden states
come through the protocol (``encoder_output``), equal to the ``HookedEncoder``'s own. The tools
(analysis, vis, the report, the CLI) import no component class.
"""

from __future__ import annotations

import pytest
import torch
from kinds import make_bridge
from models import hooked_only

from tl_attnonly.adapt import analysis_model
from tl_attnonly.mlp_protocol import (
    ExpertsLayerView,
    GatedNeuronHeadLayerView,
    MLPLayer,
    NeuronHeadLayerView,
    UnconvertedMLP,
)

#: ``(kind, gated)`` of the models (:func:`_model`): hooked models (TL 3.x only, the tests'
#: ``conftest.make_model``) and bridges (both lines; GPT-2 plain, LLaMA gated).
KINDS = [("hooked", False), ("hooked", True), ("bridge", False), ("bridge", True)]


def _model(kind: str, gated: bool, convert: bool):
    if kind == "bridge":
        return make_bridge("llama_gqa" if gated else "gpt2", convert=convert)
    from conftest import make_model

    import tl_attnonly

    model = make_model("silu", torch.float64, 0, normalization_type="RMS", gated_mlp=gated)
    return tl_attnonly.convert(model) if convert else model


def _params():
    return [
        pytest.param(
            kind, gated, marks=hooked_only("HookedTransformer MLPs") if kind == "hooked" else ()
        )
        for kind, gated in KINDS
    ]


@pytest.mark.parametrize(("kind", "gated"), _params())
def test_converted_layers_are_neuron_head_views_whose_gated_is_the_models(kind, gated):
    model = _model(kind, gated, convert=True)
    adapted = analysis_model(model)
    assert adapted.kind == ("TransformerBridge" if kind == "bridge" else "HookedTransformer")
    assert adapted.cfg.gated_mlp is gated
    for block, layer in zip(adapted.blocks, adapted.neuron_heads):
        mlp = block.mlp
        assert mlp is layer  # the model's own neuron-head layer, not a copy
        assert isinstance(mlp, MLPLayer) and isinstance(mlp, NeuronHeadLayerView)
        assert isinstance(mlp, GatedNeuronHeadLayerView) is gated
        assert not isinstance(mlp, ExpertsLayerView)
        assert mlp.converted and not mlp.is_mixture_of_experts
        assert mlp.gated is gated


@pytest.mark.parametrize(("kind", "gated"), _params())
def test_unconverted_mlps_say_what_they_are_and_have_no_neuron_heads(kind, gated):
    model = _model(kind, gated, convert=False)
    adapted = analysis_model(model, neuron_heads=False)
    assert adapted.cfg.gated_mlp is gated
    assert bool(model.cfg.gated_mlp) is gated
    for block in adapted.blocks:
        mlp = block.mlp
        assert isinstance(mlp, UnconvertedMLP) and isinstance(mlp, MLPLayer)
        assert not isinstance(mlp, NeuronHeadLayerView)
        assert not mlp.converted and not mlp.is_mixture_of_experts
        assert mlp.gated is gated
        assert mlp.module is not None
        with pytest.raises(AttributeError, match="convert the model first"):
            mlp.W_in  # noqa: B018


@hooked_only("NeuronHeadMoE")
def test_a_mixture_of_experts_is_an_experts_view_of_gated_neuron_head_experts():
    from conftest import make_model

    import tl_attnonly

    original = make_model(
        "silu", torch.float64, 0, normalization_type="RMS", num_experts=4, experts_per_token=2
    )
    adapted = analysis_model(tl_attnonly.convert(original), allow_experts=True)
    assert adapted.cfg.gated_mlp  # TransformerLens's experts are gated MLPs
    for block in adapted.blocks:
        mlp = block.mlp
        assert isinstance(mlp, ExpertsLayerView) and not isinstance(mlp, NeuronHeadLayerView)
        assert mlp.converted and mlp.is_mixture_of_experts and mlp.gated
        experts = mlp.expert_list()
        assert all(isinstance(expert, MLPLayer) for expert in experts)
        assert all(expert.converted and expert.gated for expert in experts)
    unconverted = analysis_model(original, neuron_heads=False).blocks[0].mlp
    assert isinstance(unconverted, UnconvertedMLP) and unconverted.is_mixture_of_experts


@hooked_only("AttnOnlyEncoder")
@pytest.mark.filterwarnings("ignore:HookedEncoder is deprecated:DeprecationWarning")
def test_encoder_output_through_the_protocol_is_the_encoders_own():
    from test_encoder import make_encoder, make_inputs

    from tl_attnonly.hooked.encoder import convert_encoder

    encoder = convert_encoder(make_encoder("gelu"), n_heads_per_neuron=2)
    adapted = analysis_model(encoder)
    tokens, token_types, mask = make_inputs()

    def zero_head(z, hook):
        z = z.clone()
        z[:, :, 3] = 0.0
        return z

    hooks = [("blocks.0.mlp.hook_z", zero_head)]
    with torch.no_grad():
        for fwd_hooks in ([], hooks):
            with encoder.hooks(fwd_hooks=fwd_hooks):
                expected = encoder.encoder_output(tokens, token_types, mask)
            with adapted.hooks(fwd_hooks=fwd_hooks):
                actual = adapted.encoder_output(tokens, token_types, mask)
            assert torch.equal(actual, expected)
    assert adapted.is_encoder
    assert adapted.str_tokens(tokens[0]) == [str(int(t)) for t in tokens[0]]  # no tokenizer


def test_a_bridges_mixture_of_experts_is_its_neuron_head_experts():
    from zoo import build_bridge, convert_zoo_bridge

    bridge = build_bridge("mixtral")
    unconverted = analysis_model(bridge, neuron_heads=False)
    assert all(isinstance(block.mlp, UnconvertedMLP) for block in unconverted.blocks)
    assert all(block.mlp.is_mixture_of_experts for block in unconverted.blocks)
    convert_zoo_bridge(bridge)
    adapted = analysis_model(bridge, allow_experts=True)
    assert adapted.cfg.gated_mlp
    for block, layer in zip(adapted.blocks, adapted.neuron_heads):
        assert block.mlp.module is layer and isinstance(block.mlp, ExpertsLayerView)
        assert block.mlp.converted and block.mlp.is_mixture_of_experts and block.mlp.gated


def test_the_analysis_tools_import_no_component_class():
    """analysis, vis, the report and the CLI ask a layer what it is (MLPLayer), never its class."""
    import ast
    import importlib
    import inspect
    from pathlib import Path

    import tl_attnonly

    root = Path(tl_attnonly.__file__).parent
    paths = [*root.glob("report/*.py"), *root.glob("cli*.py"), *root.glob("cli/*.py")]
    paths += [*root.glob("analysis/**/*.py"), *root.glob("vis/**/*.py")]
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "tl_attnonly.components"
            ):
                module = importlib.import_module(node.module)
                found += [
                    f"{path.relative_to(root)}: {alias.name}"
                    for alias in node.names
                    if inspect.isclass(getattr(module, alias.name, None))
                ]
    assert not found
