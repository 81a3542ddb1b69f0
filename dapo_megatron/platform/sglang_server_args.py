"""The ``sglang.Engine`` keyword arguments of the pinned SGLang, for checking
``rollout.engine_kwargs`` on machines without SGLang (CPU, config validation).

``sglang.Engine(**kwargs)`` builds ``sglang.srt.server_args.ServerArgs(**kwargs)``
(sglang 0.5.23 ``python/sglang/srt/entrypoints/engine.py:297``, ``Engine.__init__``:
``self.server_args_class(**kwargs)``), so its
arguments are the fields of that record. Since 0.5.2x ``ServerArgs`` is no dataclass: it is a
``msgspec.Struct`` assembled from the namespace classes of ``srt/arg_groups/fields/*.py``
(``server_args.py:522-563``: ``collect_input_fields(_INPUT_NAMESPACES)`` then
``msgspec.defstruct("ServerArgs", ...)``), and ``ServerArgs(**kwargs)`` with an unknown key raises
``TypeError: Unexpected keyword argument 'x'`` (msgspec's constructor). :data:`SERVER_ARGS_FIELDS`
lists its fields for sglang 0.5.23 (546, three of them underscore-prefixed bookkeeping fields that
are still constructor arguments). Where SGLang is importable the installed ``ServerArgs``'s own
fields are used instead (:func:`engine_argument_names`); :func:`record_field_names` reads them
from a msgspec Struct (``__struct_fields__``, what ``msgspec.structs.fields`` reads) or a
dataclass (sglang <= 0.5.1x) and RAISES for anything else, so a future change of form is an
error naming the class, never a silent fall back to this list. :func:`check_engine_kwargs` checks
``rollout.engine_kwargs`` against them here, so the config loads without the engines.

Against 0.5.11 the list gained 203 fields and lost 25, among them every piecewise-CUDA-graph
knob (``disable_piecewise_cuda_graph``, ``piecewise_cuda_graph_*``, ``enforce_piecewise_cuda_graph``;
now ``cuda_graph_backend_prefill`` / ``disable_prefill_cuda_graph``, ``arg_groups/fields/exec_.py``
``ExecGraph``), ``cuda_graph_bs`` / ``cuda_graph_max_bs`` (now ``*_decode`` / ``*_prefill``),
``torchao_config``, ``enable_nan_detection`` and the ``nsa_*`` backends (now ``dsa_*``).

Regenerate for another pin (the wheel's own ``ServerArgs``, imported on a CPU machine: the module
needs only msgspec, orjson, pybase64, pyzmq and IPython/traitlets besides torch)::

    pip download --no-deps sglang==X -d /tmp/sgl && unzip -q /tmp/sgl/sglang-*.whl -d /tmp/sgl/src
    pip install --target /tmp/sgl/lib msgspec orjson pybase64 pyzmq ipython traitlets
    cd /tmp/sgl/src && PYTHONPATH=/tmp/sgl/lib:. python - <<'PY'
    import msgspec, sglang.srt.server_args as s
    print(sorted(f.name for f in msgspec.structs.fields(s.ServerArgs)))
    PY

then set :data:`SGLANG_VERSION`; ``tests/unit/platform/test_sglang_server_args.py`` pins fields
that exist only in the new list and ones it dropped.

Design: docs/design.md §6 (SGLang in the trainer's process); §2.3 says why it is the platform's.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Optional

SGLANG_VERSION = "0.5.23"

SERVER_ARGS_FIELDS = frozenset({
    "_radix_eviction_policy_explicitly_set", "_speculative_draft_quantization_explicitly_set",
    "_swa_full_tokens_ratio_explicitly_set", "abort_on_priority_when_disabled", "admin_api_key",
    "allow_auto_truncate", "allowed_media_domains", "api_key", "asr_max_buffer_seconds",
    "asr_max_concurrent_sessions", "attention_backend", "attn_cp_size", "attn_dp_size", "aux_hidden_state_capture",
    "base_gpu_id", "batch_notify_size", "bf16_gemm_backend", "boundary_reduction", "bucket_e2e_request_latency",
    "bucket_inter_token_latency", "bucket_time_to_first_token", "c128_page_size", "chat_template",
    "checkpoint_engine_wait_weights_before_ready", "chunked_prefill_size", "completion_template",
    "constrained_json_disable_any_whitespace", "constrained_json_max_whitespace_cnt",
    "constrained_json_whitespace_pattern", "context_length", "cp_strategy", "cpu_offload_gb", "crash_dump_folder",
    "cuda_graph_backend_decode", "cuda_graph_backend_prefill", "cuda_graph_bs_decode", "cuda_graph_bs_prefill",
    "cuda_graph_config", "cuda_graph_max_bs_decode", "cuda_graph_max_bs_prefill", "cuda_graph_max_seq_len_prefill",
    "cuda_graph_prefill_max_context", "custom_sigquit_handler", "custom_weight_loader", "dcp_comm_backend",
    "dcp_replicate_q_proj", "dcp_size", "debug_cuda_graph", "debug_tensor_dump_input_file",
    "debug_tensor_dump_layers", "debug_tensor_dump_output_folder", "decode_attention_backend", "decode_log_interval",
    "decoupled_spec_bind_endpoint", "decoupled_spec_connect_endpoints", "decoupled_spec_rank", "decoupled_spec_role",
    "decrypted_config_file", "decrypted_draft_config_file", "deepep_config", "deepep_dispatcher_output_dtype",
    "deepep_mode", "deepep_v2_mode", "default_chat_template_kwargs", "default_priority_value",
    "delete_ckpt_after_loading", "detokenizer_worker_num", "device", "disable_aiter_allreduce_fusion_in_decode",
    "disable_aiter_allreduce_fusion_in_prefill", "disable_attn_tp_gather", "disable_chunked_prefix_cache",
    "disable_cuda_graph", "disable_cuda_graph_padding", "disable_custom_all_reduce", "disable_decode_cuda_graph",
    "disable_fast_image_processor", "disable_flashinfer_autotune", "disable_flashinfer_cutlass_moe_fp4_allgather",
    "disable_hybrid_swa_memory", "disable_outlines_disk_cache", "disable_overlap_schedule",
    "disable_prefill_cuda_graph", "disable_priority_preemption", "disable_radix_cache",
    "disable_shared_experts_fusion", "disable_tokenizer_batch_decode", "disaggregation_bootstrap_port",
    "disaggregation_decode_allocation_policy", "disaggregation_decode_enable_offload_kvcache",
    "disaggregation_decode_enable_radix_cache", "disaggregation_decode_extra_slots",
    "disaggregation_decode_host_receive_threshold", "disaggregation_decode_polling_interval",
    "disaggregation_decode_retraction_backup", "disaggregation_enable_kv_checksum", "disaggregation_ib_device",
    "disaggregation_mode", "disaggregation_transfer_backend", "dist_init_addr", "dist_timeout", "dllm_algorithm",
    "dllm_algorithm_config", "dllm_fdfo", "download_dir", "dp_size", "dsa_decode_backend",
    "dsa_paged_mqa_logits_backend", "dsa_prefill_backend", "dsa_topk_backend", "dsa_triton_union",
    "dsv4_attn_backend", "dsv4_prefill_backend", "dtype", "dwdp_size", "dynamic_batch_tokenizer_batch_size",
    "dynamic_batch_tokenizer_batch_timeout", "elastic_ep_backend", "elastic_ep_initial_size",
    "elastic_ep_scale_timeout", "enable_adaptive_dispatch_to_encoder", "enable_aiter_allreduce_fusion",
    "enable_amd_monokernel", "enable_attn_tp_input_scattered", "enable_broadcast_mm_inputs_process",
    "enable_cache_report", "enable_cp_decode_attn_tp", "enable_cp_tp_group_sharing", "enable_cudagraph_gc",
    "enable_custom_logit_processor", "enable_decoder_swa_bounded_replay", "enable_deepseek_v4_fp4_indexer",
    "enable_dense_mlp_attn_tp", "enable_deterministic_inference", "enable_dp_attention",
    "enable_dp_attention_local_control_broadcast", "enable_dp_lm_head", "enable_draft_weights_cpu_backup",
    "enable_dsa_cache_layer_split", "enable_dsa_fused_indexer", "enable_dynamic_batch_tokenizer",
    "enable_dynamic_chunking", "enable_elastic_expert_backup", "enable_encoder_swa_bounded_replay", "enable_eplb",
    "enable_flashinfer_allreduce_fusion", "enable_flexkv", "enable_forward_pass_metrics", "enable_fp32_lm_head",
    "enable_fused_moe_sum_all_reduce", "enable_fused_qk_norm_rope", "enable_hierarchical_cache", "enable_hisparse",
    "enable_http2", "enable_http_worker_reuseport", "enable_int8_mamba_checkpoint", "enable_kv_cache_sharding",
    "enable_layernorm_sp", "enable_layerwise_nvtx_marker", "enable_lean_attention", "enable_linear_replayssm",
    "enable_linear_replayssm_spec", "enable_linker_mla_dedup", "enable_lmcache", "enable_lora",
    "enable_lora_overlap_loading", "enable_mamba_cache_stochastic_rounding", "enable_megamoe_for_layernorm_sp",
    "enable_memory_saver", "enable_metrics", "enable_metrics_for_all_schedulers", "enable_mfu_metrics", "enable_mis",
    "enable_mixed_chunk", "enable_mm_global_cache", "enable_mscclpp", "enable_multi_layer_eagle", "enable_multimodal",
    "enable_nccl_nvls", "enable_nvidia_megakernel", "enable_p2p_check", "enable_page_major_kv_layout",
    "enable_paged_experts", "enable_pd_role_switch", "enable_pdmux", "enable_precise_embedding_interpolation",
    "enable_prefill_cp", "enable_prefill_delayer", "enable_prefix_mm_cache", "enable_priority_scheduling",
    "enable_profile_cuda_graph", "enable_quant_communications", "enable_request_time_stats_logging",
    "enable_response_store", "enable_return_aux_hidden_states", "enable_return_hidden_states",
    "enable_return_indexer_topk", "enable_return_routed_experts", "enable_scattered_sconv",
    "enable_session_radix_cache", "enable_shared_experts_attn_tp", "enable_single_batch_overlap",
    "enable_ssl_refresh", "enable_streaming_session", "enable_strict_thinking", "enable_symm_mem",
    "enable_tf32_matmul", "enable_tokenizer_batch_encode", "enable_torch_compile", "enable_torch_compile_debug_mode",
    "enable_torch_symm_mem", "enable_tp_lm_head_all_to_all", "enable_trace", "enable_two_batch_overlap",
    "enable_unified_cache_external_linker", "enable_unified_memory", "enable_w4a4_mxfp4_megamoe", "enable_waterfill",
    "enable_watermark", "enable_weights_cpu_backup", "encoder_bootstrap_port", "encoder_only",
    "encoder_register_urls", "encoder_transfer_backend", "encoder_urls",
    "enforce_disable_flashinfer_allreduce_fusion", "enforce_shared_experts_fusion", "engine_info_bootstrap_port",
    "ep_dispatch_algorithm", "ep_join_mode", "ep_join_rank_offset", "ep_num_redundant_experts", "ep_size",
    "eplb_algorithm", "eplb_min_rebalancing_utilization_threshold", "eplb_rebalance_layers_per_chunk",
    "eplb_rebalance_num_iterations", "expert_balancedness_report_mode", "expert_distribution_recorder_buffer_size",
    "expert_distribution_recorder_mode", "experts_shared_outer_loras", "export_metrics_to_file",
    "export_metrics_to_file_dir", "extra_metric_labels", "fastapi_root_path", "file_storage_path",
    "flashinfer_a2a_dispatch_type", "flashinfer_allreduce_fusion_backend", "flashinfer_autotune_skip_ops",
    "flashinfer_mla_disable_ragged", "flashinfer_mxfp4_moe_precision", "flexkv_config_file", "forward_hooks",
    "forward_pass_metrics_ipc_name", "forward_pass_metrics_worker_id", "fp4_gemm_runner_backend",
    "fp8_gemm_runner_backend", "fuseep_mode", "gated_launch_port", "gc_threshold", "gc_warning_threshold_secs",
    "generation_tokens_buckets", "gpu_id_step", "grammar_backend", "grpc_mode", "grpc_port",
    "grpc_response_timeout_secs", "grpc_worker_threads", "hf_chat_template_name", "hicache_host_memory_fraction",
    "hicache_host_memory_mode", "hicache_io_backend", "hicache_mem_layout", "hicache_ratio", "hicache_size",
    "hicache_storage_backend", "hicache_storage_backend_extra_config", "hicache_storage_prefetch_policy",
    "hicache_storage_prefetch_retry_max_attempts", "hicache_storage_prefetch_retry_poll_interval",
    "hicache_write_policy", "hisparse_config", "host", "http2_initial_connection_window_size",
    "http2_max_concurrent_streams", "image_processor_backend", "incremental_streaming_output", "init_expert_location",
    "int8_mamba_ckpt_size", "is_embedding", "json_model_override_args", "kt_cpuinfer",
    "kt_max_deferred_experts_per_token", "kt_method", "kt_num_gpu_experts", "kt_threadpool_count", "kt_weight_path",
    "kv_cache_dtype", "kv_canary", "kv_canary_real_data", "kv_canary_sweep_interval", "kv_events_config",
    "language_model_only", "language_only", "limit_mm_data_per_request", "linear_attn_backend",
    "linear_attn_decode_backend", "linear_attn_prefill_backend", "linear_attn_verify_backend",
    "linear_replayssm_cache_len", "lmcache_config_file", "load_balance_method", "load_format",
    "load_publish_endpoint", "load_snapshot_publish_interval", "log_level", "log_level_http", "log_requests",
    "log_requests_format", "log_requests_level", "log_requests_target", "lora_backend", "lora_drain_wait_threshold",
    "lora_eviction_policy", "lora_paths", "lora_strict_loading", "lora_target_modules", "lora_use_virtual_experts",
    "mamba_backend", "mamba_cache_philox_rounds", "mamba_full_memory_ratio", "mamba_max_states_per_path",
    "mamba_radix_cache_strategy", "mamba_ssm_dtype", "mamba_track_interval", "max_ep_size", "max_loaded_loras",
    "max_lora_chunk_size", "max_lora_rank", "max_loras_per_batch", "max_mamba_cache_size", "max_prefill_tokens",
    "max_queued_requests", "max_running_requests", "max_total_tokens", "media_url_max_file_size_mb",
    "mem_fraction_static", "min_free_slots_delay", "mlx_enable_sampling", "mm_attention_backend",
    "mm_enable_dp_encoder", "mm_feature_transport", "mm_global_cache_backend", "mm_io_worker_num",
    "mm_preprocess_cache_size_mb", "mm_process_config", "mm_processor_worker_num", "model_checksum",
    "model_config_parser", "model_impl", "model_loader_extra_config", "model_path", "modelexpress_config",
    "modelopt_checkpoint_restore_path", "modelopt_checkpoint_save_path", "modelopt_export_path", "modelopt_quant",
    "moe_a2a_backend", "moe_dense_tp_size", "moe_dp_size", "moe_runner_backend", "mooncake_ib_device",
    "msprobe_dump_config", "nccl_port", "nnodes", "node_rank", "num_continuous_decode_steps",
    "num_reserved_decode_tokens", "numa_node", "offload_group_size", "offload_mode", "offload_num_in_group",
    "offload_prefetch_step", "optimistic_prefill_attempts", "otlp_service_name", "otlp_traces_endpoint", "page_size",
    "paged_experts_num_resident", "pdmux_config_path", "ple_offload_backend", "ple_offload_dir",
    "ple_offload_embedding", "port", "pp_async_batch_depth", "pp_max_micro_batch_size", "pp_size", "pre_warm_nccl",
    "preferred_sampling_params", "prefill_attention_backend", "prefill_decode_interval",
    "prefill_decode_interval_min_bs", "prefill_delayer_forward_passes_buckets", "prefill_delayer_max_delay_ms",
    "prefill_delayer_max_delay_passes", "prefill_delayer_queue_min_ratio",
    "prefill_delayer_token_usage_low_watermark", "prefill_delayer_wait_seconds_buckets",
    "prefill_kv_cache_dequant_dtype", "prefill_max_requests", "prefill_only_disable_kv_cache",
    "priority_scheduling_preemption_threshold", "prompt_tokens_buckets", "qsa_indexer_dtype", "quantization",
    "quantization_param_path", "quantize_and_serve", "radix_cache_backend", "radix_eviction_policy",
    "radix_eviction_policy_config", "random_seed", "reasoning_parser", "remote_instance_weight_loader_backend",
    "remote_instance_weight_loader_seed_instance_ip", "remote_instance_weight_loader_seed_instance_service_port",
    "remote_instance_weight_loader_send_weights_group_ports",
    "remote_instance_weight_loader_start_seed_via_transfer_engine", "retraction_policy",
    "return_aux_hidden_state_layer_ids", "return_hidden_states_mode", "return_input_ids", "return_output_ids",
    "revision", "rl_on_policy_target", "rl_quant_profile", "sampling_backend", "sampling_defaults",
    "sampling_mask_max_tokens", "schedule_conservativeness", "schedule_low_priority_values_first", "schedule_policy",
    "scheduler_recv_interval", "served_model_name", "shared_experts_tp_size", "show_time_cost", "sidecar",
    "sidecar_args", "skip_server_warmup", "skip_tokenizer_init", "sleep_on_idle", "sm_group_num", "smg_grpc_mode",
    "smg_http_sidecar_port", "soft_watchdog_timeout", "spec_trace_dir", "speculative_accept_threshold_acc",
    "speculative_accept_threshold_single", "speculative_adaptive", "speculative_adaptive_config",
    "speculative_algorithm", "speculative_attention_mode", "speculative_boundary_reduction",
    "speculative_dflash_block_size", "speculative_domino_candidate_pool_size", "speculative_draft_attention_backend",
    "speculative_draft_kv_cache_dtype", "speculative_draft_load_format", "speculative_draft_model_path",
    "speculative_draft_model_quantization", "speculative_draft_model_revision", "speculative_draft_sink_size",
    "speculative_draft_window_size", "speculative_dsa_topk_backend",
    "speculative_dspark_align_verify_tokens_to_graph_tier", "speculative_dspark_block_size",
    "speculative_dspark_confidence_sts_path", "speculative_dspark_sps_table_path", "speculative_eagle_topk",
    "speculative_enable_w4a4_mxfp4_megamoe", "speculative_moe_a2a_backend", "speculative_moe_runner_backend",
    "speculative_ngram_capacity", "speculative_ngram_external_corpus_max_tokens",
    "speculative_ngram_external_corpus_path", "speculative_ngram_external_sam_budget", "speculative_ngram_match_type",
    "speculative_ngram_max_bfs_breadth", "speculative_ngram_max_trie_depth", "speculative_ngram_min_bfs_breadth",
    "speculative_num_draft_tokens", "speculative_num_steps", "speculative_token_map",
    "speculative_use_block_verification", "speculative_use_rejection_sampling", "ssl_ca_certs", "ssl_certfile",
    "ssl_keyfile", "ssl_keyfile_password", "startup_weight_load_mode", "stat_loggers", "stream_interval",
    "stream_response_default_include_usage", "strip_thinking_cache", "swa_full_tokens_ratio", "swa_prefix_tails",
    "tbo_token_distribution_threshold", "tokenizer_backend", "tokenizer_metrics_allowed_custom_labels",
    "tokenizer_metrics_custom_labels_header", "tokenizer_mode", "tokenizer_path", "tokenizer_worker_num",
    "tool_call_parser", "tool_server", "torch_compile_max_bs", "tp_size", "trace_modules",
    "triton_attention_num_kv_splits", "triton_attention_reduce_in_fp32", "triton_attention_split_tile_size",
    "trust_mm_content_hashes", "trust_remote_code", "trust_request_chat_template",
    "unified_cache_external_linker_backend", "unified_cache_external_linker_config", "uno_lora_path", "use_ray",
    "uses_mamba_radix_cache", "uvicorn_access_log_exclude_prefixes", "warmups", "watchdog_timeout",
    "watermark_config", "watermark_context_window", "watermark_default_enabled", "watermark_enforce_all",
    "watermark_key", "watermark_key_b", "watermark_max_probability", "watermark_mixing_probability",
    "weight_cache_mode", "weight_cache_socket", "weight_cache_timeout", "weight_loader_disable_mmap",
    "weight_loader_drop_cache_after_load", "weight_loader_prefetch_checkpoints", "weight_loader_prefetch_num_threads",
    "weight_version",
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


def record_field_names(cls) -> frozenset:
    """The constructor fields of a ``ServerArgs`` class: a ``msgspec.Struct`` (sglang 0.5.23:
    ``__struct_fields__``, the tuple ``msgspec.structs.fields`` reads) or a dataclass (sglang
    <= 0.5.1x).

    Raises:
        RuntimeError: ``cls`` is neither (SGLang changed the form of ``ServerArgs`` again: read
            its source and teach this function, rather than checking against a stale list).
    """
    names = getattr(cls, "__struct_fields__", None)
    if isinstance(names, tuple) and names and all(isinstance(n, str) for n in names):
        return frozenset(names)
    if dataclasses.is_dataclass(cls):
        return frozenset(f.name for f in dataclasses.fields(cls))
    raise RuntimeError(f"cannot read the fields of {getattr(cls, '__module__', '?')}."
                       f"{getattr(cls, '__qualname__', cls)!r}: neither a msgspec.Struct nor a dataclass; "
                       "dapo_megatron/platform/sglang_server_args.py must learn its new form (the pinned "
                       f"sglang {SGLANG_VERSION} list would be stale)")


def engine_argument_names() -> tuple[frozenset, str]:
    """``(names, source)``: the keyword arguments ``sglang.Engine`` accepts.

    The fields of the installed ``sglang.srt.server_args.ServerArgs`` when SGLang is installed
    (:func:`record_field_names`), else those of the pinned version's source
    (:data:`SERVER_ARGS_FIELDS`).

    Raises:
        RuntimeError: SGLang is installed but its ``ServerArgs`` does not import, or its fields
            cannot be read: never the pinned list in place of the installed one.
    """
    try:
        import sglang  # lazy: a GPU-image package, absent on CPU machines
    except ImportError:  # not installed (CPU machines): the pinned list
        return SERVER_ARGS_FIELDS, f"sglang {SGLANG_VERSION} ServerArgs (pinned list)"
    version = getattr(sglang, "__version__", "?")
    try:
        from sglang.srt.server_args import ServerArgs  # lazy: only where sglang is installed
    except Exception as err:  # installed but broken: say so, do not check against another version's list
        raise RuntimeError(f"sglang {version} is installed but sglang.srt.server_args does not import "
                           f"({type(err).__name__}: {err}); cannot check rollout.engine_kwargs") from err
    return record_field_names(ServerArgs), f"sglang {version} ServerArgs"


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


#: ``rollout.engine_kwargs`` that choose the prefill-phase CUDA graph (sglang 0.5.23
#: ``arg_groups/fields/exec_.py`` ``ExecGraph``; ``arg_groups/cuda_graph_hook.py:60-71`` folds them
#: into ``cuda_graph_config.prefill.backend``)
PREFILL_GRAPH_ARGS = ("cuda_graph_backend_prefill", "disable_prefill_cuda_graph", "cuda_graph_config")


def colocated_graph_kwargs(engine_kwargs: dict, enable_memory_saver: bool,
                           env: Optional[dict] = None) -> dict:
    """Engine arguments a colocated engine (one that sleeps) adds for its CUDA graphs:
    ``{"disable_prefill_cuda_graph": True}`` unless the user chose the prefill graph.

    Why (issue 36 item 4): sglang 0.5.23 captures a prefill ("breakable", the successor of
    0.5.11's piecewise) CUDA graph by default on CUDA (``model_executor/cuda_graph_config.py:
    119-123,152-154``: ``default_prefill_backend``). That backend refuses the memory saver: with
    ``enable_memory_saver`` and ``SGLANG_MEMORY_SAVER_CUDA_GRAPH=1`` (which the colocated engine
    sets, :func:`~dapo_megatron.platform.sglang_env.engine_launch_env`) its ``__init__``
    raises ``NotImplementedError("Breakable CUDA graph is not compatible with memory saver mode")``
    (``model_executor/runner_backend/breakable_cuda_graph_backend.py:84-94``; the auto-disable of
    ``arg_groups/cuda_graph_hook.py:136-256`` has no memory-saver rule), so the engine would not
    start; without the variable its graph pool lives outside the memory saver and stays resident
    through every ``sleep()``. The decode graphs (``full`` backend) are captured under the saver's
    ``cuda_graph`` tag (``runner_backend/full_cuda_graph_backend.py:121-124,187-192``, with a CPU
    backup of the pool) and released by sleep, as before. Cost: prefill runs eagerly (rollout
    prefill is a small share of decode-bound generation). An engine without the memory saver (evaluation) keeps SGLang's default.

    Raises:
        ValueError: ``cuda_graph_backend_prefill: breakable`` on a colocated engine whose graphs
            are captured under the memory saver (SGLang's NotImplementedError at start, said here).
    """
    if not enable_memory_saver:
        return {}
    chosen = [k for k in PREFILL_GRAPH_ARGS if k in engine_kwargs]
    if not chosen:
        return {"disable_prefill_cuda_graph": True}
    from dapo_megatron.platform.sglang_env import cuda_graphs_released  # sglang_env imports torch; config loading imports this module without it

    if engine_kwargs.get("cuda_graph_backend_prefill") == "breakable" and cuda_graphs_released(env):
        raise ValueError("rollout.engine_kwargs.cuda_graph_backend_prefill=breakable: SGLang's breakable CUDA graph "
                         "does not start under the memory saver that sleep() needs (sglang 0.5.23 "
                         "breakable_cuda_graph_backend.py); use 'full' or 'disabled' (or set "
                         "SGLANG_MEMORY_SAVER_CUDA_GRAPH=0 and accept graphs resident through sleep)")
    return {}
