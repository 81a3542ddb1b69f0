"""The ``sglang.Engine`` keyword arguments of the pinned SGLang, for checking
``rollout.engine_kwargs`` on machines without SGLang (CPU, config validation).

``sglang.Engine(**kwargs)`` builds ``sglang.srt.server_args.ServerArgs(**kwargs)``
(``python/sglang/srt/entrypoints/engine.py``, ``Engine.__init__``), so its arguments are
the fields of that dataclass. :data:`SERVER_ARGS_FIELDS` lists them for sglang
0.5.11, read from ``python/sglang/srt/server_args.py`` of the
``sglang-0.5.11-cp312-cp312-manylinux_2_34_x86_64.whl`` wheel (the annotated class
attributes of ``class ServerArgs``, 368 fields). Where SGLang is importable the
real ``dataclasses.fields(ServerArgs)`` is used instead
(:func:`engine_argument_names`), and :func:`check_engine_kwargs` checks ``rollout.engine_kwargs``
against them here, so the config loads without the engines.

Regenerate for another pin::

    pip download --no-deps sglang==X -d /tmp/sgl && unzip -q /tmp/sgl/*.whl -d /tmp/sgl/src
    python - <<'PY'
    import ast
    tree = ast.parse(open("/tmp/sgl/src/sglang/srt/server_args.py").read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ServerArgs")
    print([s.target.id for s in cls.body if isinstance(s, ast.AnnAssign)])
    PY

Design: docs/design.md §6 (SGLang in the trainer's process).
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Optional

SGLANG_VERSION = "0.5.11"

SERVER_ARGS_FIELDS = frozenset({
    "model_path", "tokenizer_path", "tokenizer_mode", "tokenizer_backend", "tokenizer_worker_num",
    "skip_tokenizer_init", "load_format", "model_loader_extra_config", "trust_remote_code", "context_length",
    "is_embedding", "enable_multimodal", "revision", "model_impl", "host", "port", "fastapi_root_path",
    "grpc_mode", "skip_server_warmup", "warmups", "nccl_port", "checkpoint_engine_wait_weights_before_ready",
    "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_keyfile_password", "enable_ssl_refresh", "enable_http2",
    "dtype", "quantization", "quantization_param_path", "kv_cache_dtype", "enable_fp32_lm_head",
    "modelopt_quant", "modelopt_checkpoint_restore_path", "modelopt_checkpoint_save_path",
    "modelopt_export_path", "quantize_and_serve", "rl_quant_profile", "mem_fraction_static",
    "max_running_requests", "max_queued_requests", "max_total_tokens", "chunked_prefill_size",
    "enable_dynamic_chunking", "max_prefill_tokens", "prefill_max_requests", "schedule_policy",
    "enable_priority_scheduling", "disable_priority_preemption", "default_priority_value",
    "abort_on_priority_when_disabled", "schedule_low_priority_values_first",
    "priority_scheduling_preemption_threshold", "schedule_conservativeness", "page_size",
    "swa_full_tokens_ratio", "disable_hybrid_swa_memory", "radix_eviction_policy", "enable_prefill_delayer",
    "prefill_delayer_max_delay_passes", "prefill_delayer_token_usage_low_watermark",
    "prefill_delayer_forward_passes_buckets", "prefill_delayer_wait_seconds_buckets", "device", "tp_size",
    "pp_size", "pp_max_micro_batch_size", "pp_async_batch_depth", "stream_interval", "batch_notify_size",
    "stream_response_default_include_usage", "incremental_streaming_output", "enable_streaming_session",
    "random_seed", "constrained_json_whitespace_pattern", "constrained_json_disable_any_whitespace",
    "watchdog_timeout", "soft_watchdog_timeout", "dist_timeout", "download_dir", "model_checksum",
    "base_gpu_id", "gpu_id_step", "sleep_on_idle", "use_ray", "custom_sigquit_handler", "log_level",
    "log_level_http", "log_requests", "log_requests_level", "log_requests_format", "log_requests_target",
    "uvicorn_access_log_exclude_prefixes", "crash_dump_folder", "show_time_cost", "enable_metrics",
    "grpc_http_sidecar_port", "enable_mfu_metrics", "enable_metrics_for_all_schedulers",
    "tokenizer_metrics_custom_labels_header", "tokenizer_metrics_allowed_custom_labels", "extra_metric_labels",
    "bucket_time_to_first_token", "bucket_inter_token_latency", "bucket_e2e_request_latency",
    "prompt_tokens_buckets", "generation_tokens_buckets", "gc_warning_threshold_secs", "decode_log_interval",
    "enable_request_time_stats_logging", "kv_events_config", "enable_trace", "otlp_traces_endpoint",
    "export_metrics_to_file", "export_metrics_to_file_dir", "api_key", "admin_api_key", "served_model_name",
    "weight_version", "chat_template", "hf_chat_template_name", "completion_template", "file_storage_path",
    "enable_cache_report", "reasoning_parser", "strip_thinking_cache", "tool_call_parser", "tool_server",
    "sampling_defaults", "dp_size", "load_balance_method", "attn_cp_size", "moe_dp_size", "dist_init_addr",
    "nnodes", "node_rank", "json_model_override_args", "preferred_sampling_params", "enable_lora",
    "enable_lora_overlap_loading", "max_lora_rank", "lora_target_modules", "lora_paths", "max_loaded_loras",
    "max_loras_per_batch", "lora_eviction_policy", "lora_backend", "max_lora_chunk_size",
    "experts_shared_outer_loras", "lora_use_virtual_experts", "lora_strict_loading", "attention_backend",
    "decode_attention_backend", "prefill_attention_backend", "sampling_backend", "grammar_backend",
    "mm_attention_backend", "fp8_gemm_runner_backend", "fp4_gemm_runner_backend", "nsa_prefill_backend",
    "nsa_decode_backend", "disable_flashinfer_autotune", "mamba_backend", "speculative_algorithm",
    "speculative_draft_model_path", "speculative_draft_model_revision", "speculative_draft_load_format",
    "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
    "speculative_dflash_block_size", "speculative_dflash_draft_window_size",
    "speculative_accept_threshold_single", "speculative_accept_threshold_acc", "speculative_token_map",
    "speculative_attention_mode", "speculative_draft_attention_backend", "speculative_moe_runner_backend",
    "speculative_moe_a2a_backend", "speculative_draft_model_quantization", "speculative_adaptive",
    "speculative_adaptive_config", "speculative_skip_dp_mlp_sync", "speculative_ngram_min_bfs_breadth",
    "speculative_ngram_max_bfs_breadth", "speculative_ngram_match_type", "speculative_ngram_max_trie_depth",
    "speculative_ngram_capacity", "speculative_ngram_external_corpus_path",
    "speculative_ngram_external_sam_budget", "speculative_ngram_external_corpus_max_tokens",
    "enable_multi_layer_eagle", "ep_size", "moe_a2a_backend", "moe_runner_backend", "record_nolora_graph",
    "flashinfer_mxfp4_moe_precision", "enable_flashinfer_allreduce_fusion",
    "enforce_disable_flashinfer_allreduce_fusion", "enable_aiter_allreduce_fusion", "deepep_mode",
    "ep_num_redundant_experts", "ep_dispatch_algorithm", "init_expert_location", "enable_eplb",
    "eplb_algorithm", "eplb_rebalance_num_iterations", "eplb_rebalance_layers_per_chunk",
    "eplb_min_rebalancing_utilization_threshold", "expert_distribution_recorder_mode",
    "expert_distribution_recorder_buffer_size", "enable_expert_distribution_metrics", "deepep_config",
    "moe_dense_tp_size", "elastic_ep_backend", "enable_elastic_expert_backup", "mooncake_ib_device",
    "elastic_ep_rejoin", "max_mamba_cache_size", "mamba_ssm_dtype", "mamba_full_memory_ratio",
    "mamba_scheduler_strategy", "mamba_track_interval", "linear_attn_backend", "linear_attn_decode_backend",
    "linear_attn_prefill_backend", "enable_hierarchical_cache", "hicache_ratio", "hicache_size",
    "hicache_write_policy", "hicache_io_backend", "hicache_mem_layout", "hicache_storage_backend",
    "hicache_storage_prefetch_policy", "hicache_storage_backend_extra_config", "enable_hisparse",
    "hisparse_config", "enable_lmcache", "kt_weight_path", "kt_method", "kt_cpuinfer", "kt_threadpool_count",
    "kt_num_gpu_experts", "kt_max_deferred_experts_per_token", "dllm_algorithm", "dllm_algorithm_config",
    "cpu_offload_gb", "offload_group_size", "offload_num_in_group", "offload_prefetch_step", "offload_mode",
    "enable_mis", "disable_radix_cache", "cuda_graph_max_bs", "cuda_graph_bs", "disable_cuda_graph",
    "disable_cuda_graph_padding", "enable_breakable_cuda_graph", "enable_profile_cuda_graph",
    "enable_cudagraph_gc", "debug_cuda_graph", "enable_layerwise_nvtx_marker", "enable_nccl_nvls",
    "enable_symm_mem", "disable_flashinfer_cutlass_moe_fp4_allgather", "enable_tokenizer_batch_encode",
    "disable_tokenizer_batch_decode", "disable_outlines_disk_cache", "disable_custom_all_reduce",
    "enable_mscclpp", "enable_torch_symm_mem", "pre_warm_nccl", "disable_overlap_schedule",
    "enable_mixed_chunk", "enable_dp_attention", "enable_dp_attention_local_control_broadcast",
    "enable_dp_lm_head", "enable_two_batch_overlap", "enable_single_batch_overlap",
    "tbo_token_distribution_threshold", "enable_torch_compile", "disable_piecewise_cuda_graph",
    "enforce_piecewise_cuda_graph", "enable_torch_compile_debug_mode", "torch_compile_max_bs",
    "piecewise_cuda_graph_max_tokens", "piecewise_cuda_graph_tokens", "piecewise_cuda_graph_compiler",
    "torchao_config", "enable_nan_detection", "enable_p2p_check", "triton_attention_reduce_in_fp32",
    "triton_attention_num_kv_splits", "triton_attention_split_tile_size", "num_continuous_decode_steps",
    "delete_ckpt_after_loading", "enable_memory_saver", "enable_weights_cpu_backup",
    "enable_draft_weights_cpu_backup", "allow_auto_truncate", "enable_custom_logit_processor",
    "flashinfer_mla_disable_ragged", "disable_shared_experts_fusion", "enforce_shared_experts_fusion",
    "disable_chunked_prefix_cache", "disable_fast_image_processor", "keep_mm_feature_on_device",
    "enable_return_hidden_states", "enable_return_routed_experts", "scheduler_recv_interval", "numa_node",
    "enable_deterministic_inference", "rl_on_policy_target", "enable_attn_tp_input_scattered", "gc_threshold",
    "enable_nsa_prefill_context_parallel", "nsa_prefill_cp_mode", "enable_fused_qk_norm_rope",
    "enable_precise_embedding_interpolation", "enable_fused_moe_sum_all_reduce",
    "enable_prefill_context_parallel", "prefill_cp_mode", "enable_dynamic_batch_tokenizer",
    "dynamic_batch_tokenizer_batch_size", "dynamic_batch_tokenizer_batch_timeout",
    "debug_tensor_dump_output_folder", "debug_tensor_dump_layers", "debug_tensor_dump_input_file",
    "debug_tensor_dump_inject", "disaggregation_mode", "disaggregation_transfer_backend",
    "disaggregation_bootstrap_port", "disaggregation_ib_device", "disaggregation_decode_enable_radix_cache",
    "disaggregation_decode_enable_offload_kvcache", "num_reserved_decode_tokens",
    "disaggregation_decode_polling_interval", "encoder_only", "language_only", "encoder_transfer_backend",
    "encoder_urls", "enable_adaptive_dispatch_to_encoder", "custom_weight_loader", "weight_loader_disable_mmap",
    "weight_loader_prefetch_checkpoints", "weight_loader_prefetch_num_threads",
    "remote_instance_weight_loader_seed_instance_ip",
    "remote_instance_weight_loader_seed_instance_service_port",
    "remote_instance_weight_loader_send_weights_group_ports", "remote_instance_weight_loader_backend",
    "remote_instance_weight_loader_start_seed_via_transfer_engine", "engine_info_bootstrap_port",
    "modelexpress_config", "enable_pdmux", "pdmux_config_path", "sm_group_num",
    "enable_broadcast_mm_inputs_process", "enable_prefix_mm_cache", "mm_enable_dp_encoder", "mm_process_config",
    "limit_mm_data_per_request", "enable_mm_global_cache", "decrypted_config_file",
    "decrypted_draft_config_file", "forward_hooks", "enable_quant_communications", "msprobe_dump_config",
})

#: Engine arguments the engine sets itself, and where the user sets them instead.
MANAGED_ENGINE_ARGS = {
    "model_path": "model.hf_path",
    "dtype": "model.params_dtype",
    "tp_size": "the engine's tensor parallel size (tp_size)",
    "mem_fraction_static": "rollout.gpu_memory_utilization",
    "enable_memory_saver": "enable_memory_saver (needed for sleep / wake_up)",
    "base_gpu_id": "the GPU of this rank (LOCAL_RANK % torch.cuda.device_count())",
    "enable_deterministic_inference": "rollout.deterministic",
}


def engine_argument_names() -> tuple[frozenset, str]:
    """``(names, source)``: the keyword arguments ``sglang.Engine`` accepts.

    The fields of the installed ``sglang.srt.server_args.ServerArgs`` when SGLang imports,
    else those of the pinned version's source
    (:data:`SERVER_ARGS_FIELDS`).
    """
    try:  # sglang needs CUDA: imported here, where a CPU machine falls back to the pinned list
        from sglang.srt.server_args import ServerArgs
        import sglang

        return frozenset(f.name for f in dataclasses.fields(ServerArgs)), f"sglang {sglang.__version__} ServerArgs"
    except Exception:  # not installed, or no CUDA to import it: the pinned list
        return SERVER_ARGS_FIELDS, f"sglang {SGLANG_VERSION} ServerArgs (pinned list)"


def check_engine_kwargs(engine_kwargs: Optional[dict], key: str = "rollout.engine_kwargs") -> dict:
    """Check extra ``sglang.Engine`` arguments; returns them as a plain dict.

    Raises:
        ValueError: a key the engine sets itself (naming the setting to use instead), or a
            key that is no ``sglang.Engine`` argument (with close names), naming ``key.<name>``.
    """
    kwargs = dict(engine_kwargs or {})
    names, source = engine_argument_names()
    for name in kwargs:
        if name in MANAGED_ENGINE_ARGS:
            raise ValueError(f"{key}.{name} is set by dapo-megatron from {MANAGED_ENGINE_ARGS[name]}; remove it")
        if name not in names:
            close = difflib.get_close_matches(name, sorted(names), n=3)
            raise ValueError(f"{key}.{name} is not an sglang.Engine argument (a field of {source})"
                             + (f"; did you mean {', '.join(close)}?" if close else "")
                             + "; see `python -m sglang.launch_server --help` for the list")
    return kwargs
