"""Rollout engines (docs/design.md, "The rollout rooms").

What generates responses: the engine API and the row protocol (:mod:`.engine`), the transformers
engine (:mod:`.hf_engine`, its sampling loop :mod:`.hf_batch`), SGLang in process
(:mod:`.sglang_engine`, :mod:`.sglang_env`, :mod:`.sglang_server_args`), a rollout-TP group of ranks feeding one engine (:mod:`.engine_group`),
server mode as a trainer rank sees it (:mod:`.server_sync`), SGLang's request and response bodies
(:mod:`.sglang_io`) and the one HTTP row client (:mod:`.row_client`, :mod:`.generate_stream`),
routing replay's routes (:mod:`.routes`), which engines exist and which ranks feed them
(:mod:`.layout`) and the one engine builder (:mod:`.factory`). How weights reach them is the
bridge's (:mod:`dapo_megatron.bridge`: buckets, verification, the server sync). Nothing here knows
the trainer's batch or the DAPO keep rule. ``sglang`` itself is imported only when an SGLang engine
is constructed.
"""
