"""Rollout engines and their weight transports (docs/design.md, "The rollout rooms").

What generates responses and how new weights reach it: the engine API (:mod:`.engine`), the
transformers engine (:mod:`.hf_engine`), SGLang in process or behind HTTP
(:mod:`.sglang_engine`, :mod:`.sglang_env`, :mod:`.sglang_server_args`), a rollout-TP group
of ranks feeding one engine (:mod:`.engine_group`), separate servers and the NCCL sync into
them (:mod:`.server_sync`; the weight buckets both transports send are the bridge's,
:mod:`dapo_megatron.bridge.buckets`, :mod:`dapo_megatron.bridge.flat_bucket`), which engines exist and which ranks feed them (:mod:`.layout`), the one
engine builder (:mod:`.factory`) and the CPU stand-in of an SGLang server,
``dapo-rollout-server`` (:mod:`.server`). Nothing here knows the trainer's batch or the DAPO
keep rule. ``sglang`` itself is imported only when an SGLang engine is constructed.
"""
