"""The TransformerLens 4 test files ``run.py`` runs with every bridge converted (4.x only).

The files of TransformerLens 4.3.0's ``tests/{unit,integration,acceptance}`` in which at least
one ``TransformerBridge`` the tests build was converted. The whole suite (9,663 tests: all but
``benchmarks/`` and ``unit/test_make_docs.py``) was run with every bridge converted, recording
per test how many bridges it (or its fixtures) built and whether each was converted or refused
(what ``run.py --all --record FILE`` does). 715 of the 1,085 bridges built were converted; the
rest were refused by design: mixtures of experts, Phi-3's joint gate-up MLPs, SSM and
encoder-decoder blocks without an MLP component, ReLU-squared activations, MLPs whose activation
or projections conversion cannot read (BERT-style MLPs split across modules, ...), mock models.
Files with no converted bridge test TransformerLens, not the conversion
(``tests/unit/tools/test_attribution_patching.py``, for one, runs on a toy model that is not a
``TransformerBridge``).

Left out for time: ``tests/integration/model_bridge/test_native_training.py`` (4 tests that train
a native model: 358 s of the 1,200 s the 69 files took on the shared 2-core machine); gradients
through the neuron-heads are exercised by the attribution, logit-lens and DLA files here and by
``tests/bridge``.

For another TransformerLens 4.x version ``run.py`` names the listed files its sdist lacks;
re-record with ``--all --record`` and keep the files with a ``"converted"`` count.
"""

from __future__ import annotations

SELECTED: tuple[str, ...] = (
    "tests/integration/model_bridge/test_ast_tiny.py",
    "tests/integration/model_bridge/test_attention_weight_accessors.py",
    "tests/integration/model_bridge/test_bridge_generate_return_cache.py",
    "tests/integration/model_bridge/test_cohere2_nope_no_warning.py",
    "tests/integration/model_bridge/test_cohere_adapter.py",
    "tests/integration/model_bridge/test_exaone4_adapter.py",
    "tests/integration/model_bridge/test_gemma3_adapter.py",
    "tests/integration/model_bridge/test_gemma3_multimodal_tiny.py",
    "tests/integration/model_bridge/test_gemma4_text_adapter.py",
    "tests/integration/model_bridge/test_granite_embedding_decomposition.py",
    "tests/integration/model_bridge/test_hf_generate_eos.py",
    "tests/integration/model_bridge/test_mistral3_adapter.py",
    "tests/integration/model_bridge/test_olmo2_attention_input_state.py",
    "tests/integration/model_bridge/test_parallel_residual_identities.py",
    "tests/integration/model_bridge/test_parent_module_traversal.py",
    "tests/integration/model_bridge/test_positional_weight_accessors.py",
    "tests/integration/model_bridge/test_qwen3_gated_query_weights.py",
    "tests/integration/model_bridge/test_scaled_hook_autograd.py",
    "tests/integration/model_bridge/test_seq2seq_loss.py",
    "tests/integration/model_bridge/test_ssm_effective_attention_dispatch.py",
    "tests/integration/model_bridge/test_stablelm_adapter.py",
    "tests/integration/model_bridge/test_vaultgemma_adapter.py",
    "tests/integration/test_jacobian_lens.py",
    "tests/integration/test_logit_lens.py",
    "tests/unit/model_bridge/compatibility/test_gated_mlp_training.py",
    "tests/unit/model_bridge/compatibility/test_svd_interpreter.py",
    "tests/unit/model_bridge/generalized_components/test_gemma_eager_no_patch.py",
    "tests/unit/model_bridge/generalized_components/test_joint_qkv_attention.py",
    "tests/unit/model_bridge/sources/test_native_init_semantics.py",
    "tests/unit/model_bridge/supported_architectures/test_cohere2_adapter.py",
    "tests/unit/model_bridge/supported_architectures/test_cohere_adapter.py",
    "tests/unit/model_bridge/supported_architectures/test_falcon_adapter.py",
    "tests/unit/model_bridge/supported_architectures/test_gemma_rmsnorm_offset.py",
    "tests/unit/model_bridge/supported_architectures/test_hook_orchestration_parity.py",
    "tests/unit/model_bridge/supported_architectures/test_hunyuan_v1_dense_adapter.py",
    "tests/unit/model_bridge/supported_architectures/test_llada_adapter.py",
    "tests/unit/model_bridge/supported_architectures/test_muse_glimmer_adapter.py",
    "tests/unit/model_bridge/supported_architectures/test_qwen3_5_adapter.py",
    "tests/unit/model_bridge/test_boot_native.py",
    "tests/unit/model_bridge/test_bridge_str.py",
    "tests/unit/model_bridge/test_build_bridge_from_module.py",
    "tests/unit/model_bridge/test_caching_hooks_aliases.py",
    "tests/unit/model_bridge/test_caching_hooks_pos_slice_batch_dim.py",
    "tests/unit/model_bridge/test_caching_remove_batch_dim.py",
    "tests/unit/model_bridge/test_config_flag_assignment.py",
    "tests/unit/model_bridge/test_gated_hooks.py",
    "tests/unit/model_bridge/test_generate_fallback_flags.py",
    "tests/unit/model_bridge/test_generate_stream_args.py",
    "tests/unit/model_bridge/test_loss_attention_mask.py",
    "tests/unit/model_bridge/test_mixed_norm_decomposition.py",
    "tests/unit/model_bridge/test_model_structure_doc.py",
    "tests/unit/model_bridge/test_native_features.py",
    "tests/unit/model_bridge/test_original_model_not_registered.py",
    "tests/unit/model_bridge/test_process_weights_reentry.py",
    "tests/unit/model_bridge/test_reset_hooks_registry.py",
    "tests/unit/model_bridge/test_run_with_hooks_remove_batch_dim.py",
    "tests/unit/model_bridge/test_state_dict_composition.py",
    "tests/unit/model_bridge/test_state_dict_round_trip.py",
    "tests/unit/model_bridge/test_tl_checkpoint_conversion.py",
    "tests/unit/test_activation_cache.py",
    "tests/unit/test_direct_path_patching.py",
    "tests/unit/test_patching.py",
    "tests/unit/test_svd_interpreter_offset_norm.py",
    "tests/unit/test_tracr_conversion.py",
    "tests/unit/test_weight_processing.py",
    "tests/unit/tools/test_direct_logit_attribution.py",
    "tests/unit/tools/test_direct_logit_attribution_final_norm.py",
    "tests/unit/tools/test_logit_lens.py",
)
