"""What NxD Inference's ``NeuronConfig`` takes, and the LMI keys it does not: plain tables.

``NEURON_CONFIG_FIELDS`` are the keyword arguments ``models/config.py`` reads with ``kwargs.pop`` at
4bcdc54 (0.9.0); 0.8.0 (cd3abf3) takes the same but one. A key outside them the library only logs as
"Unexpected keyword arguments" and drops, so the plan names it at start-up instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

# NeuronConfig / MoENeuronConfig / OnDeviceSamplingConfig keyword arguments read by ``kwargs.pop`` in
# models/config.py at 4bcdc54. Anything else in override_neuron_config is silently dropped by the
# library, so it is named at start-up instead.
NEURON_CONFIG_FIELDS = frozenset(
    """batch_size padding_side allow_input_truncation seq_len n_active_tokens n_positions on_cpu
    output_logits torch_dtype overrides_torch_dtype cast_type rpl_reduce_dtype attention_dtype
    max_context_length max_new_tokens max_length vocab_parallel enable_cte_modular_flow
    layer_boundary_markers fused_qkv sequence_parallel_enabled weight_gather_seq_len_threshold attn_cls
    ctx_batch_size tkg_batch_size max_batch_size is_continuous_batching kv_cache_batch_size
    kv_cache_padding_size on_device_sampling_config disable_argmax_kernel async_mode enable_bucketing
    buckets bucket_n_active_tokens context_encoding_buckets prefix_buckets token_generation_buckets
    token_generation_batches quantized quantized_checkpoints_path quantization_type quantization_dtype
    quantization_block_size quantization_block_axis quantization_scale_dtype is_mxfp4_compute
    is_full_model_shuffled modules_to_not_convert kv_cache_quant speculation_length spec_batch_size
    enable_fused_speculation enable_eagle_speculation eagle_rolling_buffer_kernel_enabled is_eagle3
    is_eagle_draft enable_eagle_draft_input_norm token_tree_config is_medusa medusa_speculation_length
    num_medusa_heads medusa_tree is_block_kv_layout pa_num_blocks pa_block_size is_prefix_caching
    windowed_context_encoding_size chunked_prefill_config kv_quant_config tensor_replacement_config
    tensor_capture_config lora_config tp_degree cp_degree mlp_cp_degree attention_dp_degree pp_degree
    ep_degree save_sharded_checkpoint skip_sharding enable_ve_data_parallel qk_layernorm pre_rope_rmsnorm
    world_size start_rank_id local_ranks_size flash_decoding_enabled disable_kv_cache_tiling
    k_cache_transposed attn_kernel_enabled strided_context_parallel_kernel_enabled qkv_kernel_enabled
    qkv_nki_kernel_enabled qkv_cte_nki_kernel_fuse_rope qkv_kernel_nbsd_layout mlp_kernel_enabled
    mlp_tkg_nki_kernel_enabled fused_rmsnorm_skip_gamma mlp_kernel_fuse_residual_add
    qkv_kernel_fuse_residual_add quantized_mlp_kernel_enabled out_proj_kernel_enabled
    activation_quantization_type attn_tkg_nki_kernel_enabled attn_tkg_builtin_kernel_enabled
    attn_block_tkg_nki_kernel_enabled attn_block_tkg_nki_kernel_cache_update
    attn_block_tkg_nki_kernel_cascaded_attention attn_block_tkg_nki_kernel_use_online_softmax
    attn_block_tkg_nki_kernel_disable_gpsimd_sb2sb attn_block_cte_nki_kernel_enabled
    rmsnorm_quantize_kernel_enabled quantize_clamp_bound moe_fused_nki_kernel_enabled
    router_topk_nki_kernel_enabled expert_mlp_nki_kernel_enabled shared_mlp_nki_kernel_enabled
    lm_head_pad lm_head_pad_alignment_size cc_pipeline_tiling_factor seq_len_threshold_for_cc_tiling
    target enable_spill_reload_dge weights_to_skip_layout_optimization dma_order_config
    apply_seq_ids_mask skip_warmup scratchpad_page_size padded_hidden_size padded_intermediate_size
    switch_cc ep_dispatch_cc_option logical_neuron_cores logical_nc_config skip_vision
    capacity_factor glu_mlp glu_type hidden_act_scaling_factor hidden_act_bias gate_clamp_upper_limit
    gate_clamp_lower_limit up_clamp_upper_limit up_clamp_lower_limit use_index_calc_kernel
    moe_mask_padded_tokens early_expert_affinity_modulation disable_normalize_top_k_affinities
    fused_shared_experts shared_experts_sequence_parallel_enabled return_expert_index
    return_router_logits hybrid_sharding_config moe_tp_degree moe_ep_degree
    transpose_shared_experts_weights blockwise_matmul_config router_config""".split()  # noqa: SIM905
)
# 0.8.0 (cd3abf3) takes the same keywords but one.
NEURON_CONFIG_FIELDS_0_8 = NEURON_CONFIG_FIELDS - {"enable_ve_data_parallel"}
# Keys that say where files go, not what is compiled: kept out of the cache key.
LOCATION_FIELDS = frozenset({"quantized_checkpoints_path"})
# LMI keys the NxD Inference backend does not take, and why (reported once at start-up).
NOT_TAKEN: Mapping[str, str] = MappingProxyType(
    {
        "group_query_attention": "NxD Inference chooses GQA sharding itself (KV heads replicated up to "
        "tp_degree, or converted to MHA when tp % kv_heads != 0)",
        "neuron_optimize_level": "NxD Inference builds its own compiler arguments (get_compiler_args); "
        "set them through override_neuron_config where the application exposes them",
        "enable_saturate_infinity": "a transformers-neuronx compiler flag",
        "enable_mixed_precision_accumulation": "a transformers-neuronx compiler flag",
        "batch_size": "continuous batching compiles max_rolling_batch_size rows (ctx_batch_size=1)",
    }
)
NOT_TAKEN_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "group_query_attention": None,
        "neuron_optimize_level": None,
        "enable_saturate_infinity": False,
        "enable_mixed_precision_accumulation": False,
        "batch_size": None,
    }
)
