"""``dapo-rollout-server``: the HF engine behind the part of SGLang's HTTP API the trainer uses.

A real rollout server for CPU boxes (and small GPUs): ``rollout.mode=server`` talks to it
exactly as to ``python -m sglang.launch_server``, so the trainer's server-mode code path runs
end to end with real generation and a real gloo weight sync::

    python -m dapo_megatron.rollout_server --model-path DIR_OR_GGUF --port 30000 [--num-threads 1]

Endpoints, with the request and response fields of sglang 0.5.11
(``srt/entrypoints/http_server.py``, ``srt/managers/io_struct.py``, ``tokenizer_manager.py``):

* ``POST /generate`` (``GenerateReqInput``): ``input_ids`` (one list: one request, answered with
  one dict; a list of lists: a batch, answered with a list), ``sampling_params`` (a dict for
  every row or one per row), ``return_logprob``, ``rid`` (a string, ``"<rid>_<i>"`` per row of a
  batch, or one per row; default a fresh uuid). Each output is ``{"text" (unless
  ``--skip-tokenizer-init``), "output_ids", "meta_info": {"id", "finish_reason",
  "prompt_tokens", "weight_version", "total_retractions", "input_token_logprobs",
  "output_token_logprobs" ([logprob, token_id, null] per generated token),
  "output_token_logprobs_length", "reasoning_tokens", "completion_tokens", "cached_tokens",
  "e2e_latency"}}``; ``finish_reason`` is ``{"type": "stop", "matched": token}``,
  ``{"type": "length", "length": max_new_tokens}`` or ``{"type": "abort", "message", ...}``.
  ``output_ids`` holds the stop token (SGLang trims it from ``text`` only, unless
  ``no_stop_trim``). Sampling params: ``max_new_tokens`` (128), ``temperature`` (1.0; 0 is
  greedy, as SGLang's ``SamplingParams`` makes it ``top_k=1``), ``top_p``, ``top_k``,
  ``stop_token_ids``, ``ignore_eos``, ``sampling_seed``, ``no_stop_trim``,
  ``skip_special_tokens``, ``spaces_between_special_tokens``, ``stop`` (a string or a list: the
  row ends at the token whose decoded text completes one, the HF engine's rule,
  ``HFEngine.matched_stop_string``; ``finish_reason`` ``{"type": "stop", "matched": <the string>}``
  as SGLang's ``FINISH_MATCHED_STR``, ``output_ids`` keep every token, ``text`` ends before the
  string, or after it with ``no_stop_trim``; needs the tokenizer: refused with
  ``--skip-tokenizer-init``); the others only at their
  defaults (penalties, ``min_p``, ``min_new_tokens``, grammars, ``n`` = 1: the trainer expands
  rows itself). A client that disconnects has its rows aborted, as SGLang does.
  ``"stream": true`` (sglang 0.5.23 ``entrypoints/http_server.py:949-981``): ``text/event-stream``,
  one event ``data: {json}\n\n`` per output, then ``data: [DONE]\n\n``; a batch's events are its
  rows' outputs interleaved as they come, each with ``"index"`` (its row;
  ``tokenizer_manager.py:2214-2231``); a row sends its first token at once, then every
  ``stream_interval`` tokens (``sampling_params.stream_interval``, else ``--stream-interval``),
  each event with the row's tokens and logprobs so far and ``finish_reason`` null (with
  ``--incremental-streaming-output``: the new ones only), and its last event as soon as it ends;
  a failure is an event ``{"error": {"message", "type", "code", "retryable"}}`` before ``[DONE]``
  (the project's client: :mod:`~dapo_megatron.rollout.engines.generate_stream`).
  ``return_routed_experts`` (routing replay; the server launched with
  ``--enable-return-routed-experts``): ``meta_info.routed_experts`` as SGLang sends it, base64 of
  the int32 ``[seqlen - 1, num_layers, topk]`` experts of every token but the last
  (``srt/layers/moe/routed_experts_capturer.py``; :mod:`~dapo_megatron.rollout.engines.routes`);
  with ``routed_experts_start_len`` = s (one per request, in ``[0, input length]``) only the rows
  ``[s, seqlen - 1)``, as SGLang 0.5.23 (``managers/io_struct.py:264-268``): a continued row's routes
  from where its sample's end.
* ``POST /abort_request`` (``AbortReq``: ``rid``, ``abort_all``): as SGLang's tokenizer manager,
  nothing happens unless ``abort_all`` or ``rid`` is the id of a request in flight; then every
  row whose id STARTS with ``rid`` stops (``managers/scheduler.py`` ``abort_request``) and its
  request answers with the tokens and logprobs sampled so far and ``{"type": "abort",
  "message": "Aborted"}`` (``"Abort in waiting queue"`` and no tokens for a row not started).
  As in SGLang (0.5.23 ``managers/scheduler.py:5797-5812``, ``schedule_batch.py:2011``), a
  decoding row runs ONE more decode step and then ends as an abort, even when the token of that
  step is its stop token or its last of ``max_new_tokens`` (the client reads such a row as
  finished: :func:`~dapo_megatron.rollout.engines.sglang_io.row_outcome`).
  Answer: 200, empty body. Unlike SGLang, a request waiting for ``/continue_generation`` is
  aborted too (SGLang leaves it to run after the continue).
* ``POST /pause_generation`` (``mode``: ``"abort"``: every row in flight is aborted and
  answered before this returns; ``"in_place"``: rows stay, decoding stops; ``"retract"`` is
  refused) and ``POST /continue_generation``: ``{"message", "status": "ok"}``. While paused,
  new ``/generate`` requests wait (``tokenizer_manager.py``: ``is_pause_cond``); weight updates run.
* ``POST /flush_cache``: plain text ``"Cache flushed..."`` (200), or ``"Flush cache failed."``
  (400) while rows are in flight (the scheduler's ``is_fully_idle``). The HF engine keeps no
  cache between requests: there is nothing else to flush.
* ``POST /init_weights_update_group`` (``master_address, master_port, rank_offset, world_size,
  group_name, backend``): joins the group as rank ``rank_offset`` (one worker: TP 1), with
  :func:`~dapo_megatron.bridge.servers.init_custom_process_group`, SGLang's own
  construction. ``gloo`` on CPU (``nccl`` needs ``--device cuda``). A group of a name already
  joined is replaced (a restarted trainer joins again).
* ``POST /update_weights_from_distributed`` (``names, dtypes, shapes, group_name, flush_cache,
  abort_all_requests, weight_version, load_format``): every tensor is checked against the
  model (name, shape, dtype name) BEFORE the broadcast is joined; names are the checkpoint's, as
  SGLang's ``load_weights`` takes them (a transformers-5 MoE model's fused experts by their
  per-expert names, ``mlp.experts.{e}.gate_proj.weight``, as views:
  :func:`~dapo_megatron.bridge.receiver.checkpoint_parameters`; ``/get_weights_by_name`` too), so a bad update answers 400
  at once and the sender stops naming this server instead of waiting for it. Then one
  ``broadcast(src=0)`` per tensor in order, or with ``load_format="flattened_bucket"`` ONE
  broadcast of the ``uint8`` buffer that SGLang's ``FlattenedTensorBucket`` would allocate
  (tensors in order, no padding; ``model_runner.py`` ``_update_bucketed_weights_from_distributed``),
  and each tensor is copied into its parameter (a cast only where the dtypes differ: same
  dtype, same bits). ``{"success", "message"}``, 400 on failure. Without a pause, an update
  waits until the rows in flight finish and holds back new ones (SGLang's
  ``model_update_lock``).
* ``--step-delay-s``: the scheduler waits that long after every decode step (answering requests
  meanwhile): a slow server that keeps decoding, for the tests of the client's silence bound.
* ``GET /health`` (200; 503 after the engine failed), ``GET /server_info`` (the server's
  arguments, ``tp_size`` / ``dp_size`` / ``pp_size`` 1, ``weight_version``, ``version``,
  ``internal_states``), ``GET|POST /get_weights_by_name`` (``name``, ``truncate_size``:
  ``param.float().tolist()[:truncate_size]``, as SGLang's models answer it; tests compare weights
  with it), ``POST /destroy_weights_update_group``.

Every malformed request gets ONE 400 ``{"error": {"message"}}`` naming the field and the fix
(SGLang's ``_create_error_response`` form; the project's client reads it with
:func:`~dapo_megatron.platform.http.sglang_error_message`).

Scheduling (:class:`Scheduler`): one thread owns the engine, as SGLang's scheduler process
does: HTTP handlers queue commands; between two decode steps the thread applies them
(submissions, aborts, pauses, weight updates) and runs :meth:`HFEngine.poll` one token at a
time over every row in flight (continuous batching, ``hf_engine.py``). A weight broadcast
blocks that thread, not the HTTP loop (``/health`` answers during a sync).

Sampling seeds: a row with ``sampling_seed`` draws the token at absolute position ``p``
(prompt tokens included) with draw ``p`` of its own generator, so a row aborted and resubmitted
as prompt + prefix continues with exactly the draws it would have made uninterrupted, which
is what SGLang's deterministic sampler gives (``layers/sampler.py``
``multinomial_with_seed``: noise from ``murmur_hash32(seed, position)``). The server therefore
reports ``enable_deterministic_inference: true``. A row without a seed gets one from the
server's generator (``--random-seed``). Outputs equal colocated ``HFEngine`` outputs in
distribution, not draw for draw (that engine counts draws from the first response token).

The package: :mod:`~dapo_megatron.rollout_server.protocol` (the engine, the checked
``/generate`` request), :mod:`~dapo_megatron.rollout_server.scheduler` (the thread that runs the
engine: rows, aborts, pause / continue, weight updates), :mod:`~dapo_megatron.rollout_server.app`
(the HTTP endpoints and the command line, console script ``dapo-rollout-server``). It is a program
of its own beside the trainer: the trainer reaches it over HTTP only.

Design: docs/design.md §2.2 (server mode on CPU).
"""

from dapo_megatron.rollout_server.app import build_app, load_tokenizer, main, parse_args  # noqa: F401
from dapo_megatron.rollout_server.protocol import (BadRequest, ServerEngine, ServerRow, parse_generate,  # noqa: F401
                                                   parse_sampling_params)
from dapo_megatron.rollout_server.scheduler import Scheduler  # noqa: F401
