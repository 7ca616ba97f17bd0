"""TransformerLens 4 tests that fail with every bridge converted, and why.

``nodeid -> reason``, as ``allowlist.py`` for the 3.x run: a failure not listed here fails the run,
and a listed test that passes fails it too (remove the entry). Two kinds of entry:

* **by design**: the converted bridge differs from the original as documented: GELU-family MLPs
  run as K = 4 fitted heads per neuron (approximate, ``docs/activations.md``), exact MLPs agree to
  rounding rather than bit for bit when their heads run one by one, and a converted bridge MLP
  wraps its neuron-head layer, not the Hugging Face / native module (``docs/bridge.md``);
* **fails on the original too**: the same test fails with no bridge converted
  (``run.py --original``), in this harness and environment (the installed transformers and
  torch, ``PYTHONSAFEPATH=1``); not a difference of the converted bridge.
"""

from __future__ import annotations

_GELU = (
    "By design: {model}'s MLPs are GELU (tanh) and run as K = 4 fitted neuron-heads per neuron, "
    "approximate by design (docs/activations.md); {what} differ from the unconverted reference by "
    "{size}, more than the test's {tolerance}."
)
_GEMMA3_VISION = _GELU.format(
    model="Gemma 3", what="the logits", size="up to 4.7e-5", tolerance="atol=1e-6"
)
_GEMMA4 = _GELU.format(model="Gemma 4", what="the logits", size="up to 6.1e-4", tolerance="1e-5")
_GEMMA4_HALF = (
    "By design: Gemma 4's MLPs are GELU (tanh) and run as K = 4 fitted neuron-heads per neuron, "
    "approximate by design (docs/activations.md); the test asks the float16 logits to equal the "
    "unconverted reference's exactly (torch.equal)."
)
_GPT2 = (
    "By design: the tiny GPT-2's MLPs are gelu_new, run as K = 4 fitted neuron-heads per neuron "
    "(approximate, docs/activations.md); its logits differ from the Hugging Face reference by up "
    "to 1.6e-5, more than assert_close's float32 default (atol=1e-5, rtol=1.3e-6)."
)
_GEMMA_FOLD = (
    "By design: Gemma's MLPs are GELU (tanh) and run as K = 4 fitted neuron-heads per neuron, "
    "approximate by design (docs/activations.md); the outputs differ from the unconverted "
    "reference by more than the test allows (log-probabilities by 1.4e-4 where it allows 1e-4; "
    "logits beyond atol=1e-6)."
)
_GATED_DTYPE = (
    "By design: the test checks that compatibility mode's processed gated-MLP path does not call "
    "the gate projection (blocks.0.mlp.gate.hook_in absent from the cache); a converted bridge "
    "runs gated MLPs through its neuron-heads, which call the bridge's own gate projection, so "
    "that hook fires (with the MLP's input). Its logits and dtype checks pass."
)
_NATIVE_CLASS = (
    "By design: the test reads the class (NativeMLP / NativeGatedMLP) or the activation attribute "
    "(.act) of the module a bridge MLP wraps; a converted bridge MLP wraps its neuron-head layer "
    "instead (tl_attnonly.bridge.BridgeNeuronHeadMLP / BridgeGatedNeuronHeadMLP; the native module "
    "is kept aside and unconvert_bridge puts it back)."
)
_GRANITE = (
    "By design: run_with_cache caches the neuron-head hooks, so the SwiGLU heads run one by one; "
    "the logits agree with the unconverted reference to float32 rounding (1.9e-9 to 3.7e-9 on "
    "one of 96 logits), not bit for bit as the test's atol=0 asks (which parameters happen to "
    "agree depends on the CPU: [1.0] fails on every machine seen here, [2.0] on an AVX-512 "
    "EPYC only)."
)
_GRANITE_TEST = (
    "tests/integration/model_bridge/test_granite_embedding_decomposition.py::"
    "test_embedding_hook_exposes_residual_contribution_without_changing_forward"
)
#: Entries whose failure is float rounding that lands on a logit on some CPUs and not on others:
#: a pass there is not a stale entry.
ROUNDING: frozenset[str] = frozenset({f"{_GRANITE_TEST}[2.0]"})
_GENERATE_CACHE = (
    "Fails on the original too: with use_past_kv_cache=True the generated logits differ from the "
    "returned cache's by up to 2.6e-2 on the unconverted bridge (the test expects 1e-6)."
)
_CODEGEN = (
    "Fails on the original too: AttributeError 'CodeGenAttention' object has no attribute "
    "'embed_positions' (the installed transformers' CodeGen)."
)
_SSM = (
    "Fails on the original too: the SSM mixers' hooks the reconstruction reads "
    "(blocks.0.mixer.in_proj/conv1d.hook_out, hook_ssm_dt) are not in the cache with the installed "
    "transformers (no bridge in it has an MLP to convert)."
)
_QWEN35_STATE = (
    "Fails on the original too: no RuntimeError is raised where the test expects one (gated "
    "delta-net state without use_cache=False), with the installed transformers."
)
_FALCON_ALIBI = (
    "Fails on the original too (run.py --original): with transformers 5.25.0 the unconverted "
    "Hugging Face Falcon-RW model's greedy continuation is one token repeated, which the test's "
    "own precondition (a non-degenerate continuation) rejects before any bridge output is compared."
)

ALLOWED_FAILURES: dict[str, str] = {
    "tests/unit/model_bridge/supported_architectures/test_falcon_adapter.py::"
    "TestFalconALiBiCachedGeneration::test_cached_generation_matches_hf": _FALCON_ALIBI,
    **{
        "tests/integration/model_bridge/test_gemma3_multimodal_tiny.py::"
        f"test_image_layernorm_identity_hooks_preserve_logits[{norm}-{way}-{hook}]": _GEMMA3_VISION
        for norm in ("encoder_layers.0.ln1", "encoder_layers.0.ln2", "post_layernorm")
        for way in ("fwd", "bwd")
        for hook in ("hook_scale", "hook_normalized")
    },
    "tests/integration/model_bridge/test_gemma4_text_adapter.py::TestGemma4TextBridge::"
    "test_forward_matches_hf": _GEMMA4,
    **{
        "tests/integration/model_bridge/test_parent_module_traversal.py::"
        f"test_dtype_conversion_updates_unmapped_leaf_parameters[{way}]": _GEMMA4_HALF
        for way in ("bridge-half", "parent-to")
    },
    "tests/integration/model_bridge/test_seq2seq_loss.py::test_causal_loss_uses_explicit_labels": (
        _GPT2
    ),
    "tests/integration/model_bridge/test_seq2seq_loss.py::"
    "test_causal_labels_support_hf_tuple_output": _GPT2,
    "tests/unit/model_bridge/supported_architectures/test_gemma_rmsnorm_offset.py::"
    "test_gemma1_offset_fold_log_softmax_parity": _GEMMA_FOLD,
    "tests/unit/model_bridge/supported_architectures/test_gemma_rmsnorm_offset.py::"
    "test_gemma3_native_forward_parity_with_perturbed_norms": _GEMMA_FOLD,
    f"{_GRANITE_TEST}[1.0]": _GRANITE,
    f"{_GRANITE_TEST}[2.0]": _GRANITE,
    **{
        "tests/unit/test_weight_processing.py::"
        f"test_compat_gated_mlp_follows_dtype_change[{arch}-dtype{i}]": _GATED_DTYPE
        for arch in ("Phi3ForCausalLM", "Qwen2ForCausalLM", "StableLmForCausalLM")
        for i in (0, 1)
    },
    **{
        f"tests/unit/model_bridge/test_native_features.py::{name}": _NATIVE_CLASS
        for name in (
            "test_gated_mlp_swaps_module_class_and_bridge",
            "test_gated_mlp_honors_act_fn",
            "test_gated_mlp_default_is_plain",
            "test_llama_shaped_config_works_end_to_end",
        )
    },
    # --- fails on the original too ---
    **{
        "tests/integration/model_bridge/test_bridge_generate_return_cache.py::"
        "TestGenerateReturnCacheAttentionMask::test_returned_cache_preserves_generation_context"
        f"[False-True-mask_dtype{i}-{mask}]": _GENERATE_CACHE
        for i in (0, 1)
        for mask in ("mask_values0", "mask_values1", "mask_values2", "None")
    },
    **{
        f"tests/integration/model_bridge/test_parallel_residual_identities.py::{name}[codegen]": (
            _CODEGEN
        )
        for name in ("test_parallel_block_omits_resid_mid", "test_parallel_residual_decomposition")
    },
    **{
        f"tests/integration/model_bridge/test_ssm_effective_attention_dispatch.py::{name}": _SSM
        for name in (
            "TestCanonicalHookVocabulary::test_mamba1_hook_ssm_dt_alias",
            "TestComputeSSMEffectiveAttention::test_granite_returns_dict",
            "TestComputeSSMEffectiveAttention::test_mamba2_stacks_and_matches_direct",
            "TestComputeSSMEffectiveAttention::test_nemotronh_dispatch_and_passthrough_contract",
            "TestComputeSSMEffectiveAttention::test_per_state_coord_mamba1",
            "TestComputeSsmStateDispatch::test_granite_returns_per_ssm_layer_dict",
            "TestComputeSsmStateDispatch::test_mamba1_reachable_via_cache",
            "TestComputeSsmStateDispatch::test_mamba2_reachable_via_cache",
        )
    },
    **{
        "tests/unit/model_bridge/supported_architectures/test_qwen3_5_adapter.py::"
        f"{name}::test_requires_use_cache_false": _QWEN35_STATE
        for name in (
            "TestQwen3_5GatedDeltaNetEffectiveAttention",
            "TestQwen3_5GatedDeltaNetState",
        )
    },
    "tests/integration/test_jacobian_lens.py::"
    "test_fit_attributes_short_prompt_warning_to_caller_frame": (
        "Fails on the original too: its subprocess imports tests.integration, which the harness's "
        "PYTHONSAFEPATH=1 (kept so that the installed transformer_lens is the one tested) takes "
        "off sys.path: ModuleNotFoundError."
    ),
    **{
        "tests/unit/test_activation_cache.py::"
        f"test_compute_head_results_matches_wide_float32_gradients[{flag}]": (
            "Fails on the original too, at teardown: monkeypatch cannot restore "
            "torch.backends.cuda.matmul.allow_tf32, an attribute the installed CPU build of torch "
            "does not have (the test itself passes)."
        )
        for flag in ("False", "True")
    },
    "tests/unit/test_direct_path_patching.py::"
    "test_old_module_star_import_binds_the_moved_names_and_warns": (
        "Fails on the original too: the namespace the star import is executed in also holds "
        "__warningregistry__ (Python's record of the warning), which the test's exact comparison "
        "does not expect."
    ),
}
