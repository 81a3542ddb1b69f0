"""``dapo-rollout-server``: the HF engine behind the part of SGLang's HTTP API the trainer uses.

A real rollout server for CPU boxes (and small GPUs): ``rollout.mode=server`` talks to it
exactly as to ``python -m sglang.launch_server``, so the trainer's server-mode code path runs
end to end with real generation and a real gloo weight sync::

    python -m dapo_megatron.rollout.engines.server --model-path DIR_OR_GGUF --port 30000 [--num-threads 1]

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
  ``skip_special_tokens``, ``spaces_between_special_tokens``; the others only at their
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
  (``srt/layers/moe/routed_experts_capturer.py``; :mod:`~dapo_megatron.rollout.engines.routes`).
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
  :func:`~dapo_megatron.rollout.engines.sglang_engine.init_custom_process_group`, SGLang's own
  construction. ``gloo`` on CPU (``nccl`` needs ``--device cuda``). A group of a name already
  joined is replaced (a restarted trainer joins again).
* ``POST /update_weights_from_distributed`` (``names, dtypes, shapes, group_name, flush_cache,
  abort_all_requests, weight_version, load_format``): every tensor is checked against the
  model (name, shape, dtype name) BEFORE the broadcast is joined, so a bad update answers 400
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
:func:`~dapo_megatron.rollout.engines.sglang_engine.sglang_error_message`).

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

Design: docs/design.md §2.2 (server mode on CPU).
"""


import argparse
import asyncio
import collections
import json
import logging
import os
import random
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from transformers import AutoTokenizer

from dapo_megatron.platform import collectives
from dapo_megatron.rollout.engines.buckets import dtype_from_name
from dapo_megatron.rollout.engines.engine import RowRequest, RowResult, SamplingParams
from dapo_megatron.rollout.engines.hf_engine import HFEngine
from dapo_megatron.rollout.engines.routes import encode_sglang_routes
from dapo_megatron.rollout.engines.sglang_engine import init_custom_process_group

logger = logging.getLogger("dapo_rollout_server")

#: The SGLang release whose HTTP API this server follows.
SGLANG_API_VERSION = "0.5.11"

#: sampling_params keys with their SGLang defaults (``sampling/sampling_params.py``) that the HF
#: engine cannot honour otherwise: any other value is refused.
_FIXED_SAMPLING = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                   "min_new_tokens": 0, "n": 1, "json_schema": None, "regex": None, "ebnf": None,
                   "structural_tag": None, "stop": None, "stop_regex": None, "custom_params": None,
                   "logit_bias": None}
_FREE_SAMPLING = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos", "sampling_seed",
                  "no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens", "stream_interval"}
#: GenerateReqInput fields accepted at these values only (any other value is refused).
_FIXED_REQUEST = {"text": None, "input_embeds": None, "image_data": None, "video_data": None, "audio_data": None,
                  "top_logprobs_num": None, "token_ids_logprob": None, "return_hidden_states": False,
                  "lora_path": None, "session_params": None, "custom_logit_processor": None}
_FREE_REQUEST = {"input_ids", "sampling_params", "return_logprob", "rid", "logprob_start_len", "stream",
                 "return_text_in_logprobs", "log_metrics", "priority", "routing_key", "extra_key", "no_logs",
                 "custom_labels", "conversation_id", "background", "require_reasoning", "modalities",
                 "routed_dp_rank", "data_parallel_rank", "bootstrap_host", "bootstrap_port", "bootstrap_room",
                 "return_routed_experts"}


class BadRequest(ValueError):
    """A request the server refuses: answered 400 with this message."""


# ---------------------------------------------------------------------------- the engine
@dataclass(frozen=True)
class ServerRow(RowRequest):
    """One row of a ``/generate`` request. ``key`` is its rid; ``prompt_ids`` its whole input.

    Attributes:
        sampling_seed: the row's seed (the request's ``sampling_seed``, else one drawn by the server).
        ignore_eos: the model's EOS ids do not end the row (``stop_token_ids`` still do).
    """

    sampling_seed: int = 0
    ignore_eos: bool = False


class ServerEngine(HFEngine):
    """:class:`~dapo_megatron.rollout.engines.hf_engine.HFEngine` with the server's row semantics:
    position-keyed draws (module docstring) and per-row ``ignore_eos``."""

    def _generator(self, req: ServerRow) -> torch.Generator:
        g = torch.Generator(device=self.device).manual_seed(req.sampling_seed)
        for _ in range(len(req.prompt_ids) + len(req.prefix_ids)):  # one draw per position before the first
            torch.rand(1, dtype=torch.float64, device=self.device, generator=g)
        return g

    def _stop_ids(self, req: ServerRow) -> frozenset:
        stops = frozenset(req.params.stop_token_ids)
        return stops if req.ignore_eos else self.eos_token_ids | stops


# ---------------------------------------------------------------------------- requests
def _as_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{key} must be an integer, got {value!r}")
    return value


def _as_float(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{key} must be a number, got {value!r}")
    return float(value)


@dataclass
class RowSpec:
    """What the response of one row needs besides the engine's output."""

    rid: str
    max_new_tokens: int
    return_logprob: bool
    no_stop_trim: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    return_routed_experts: bool = False
    stream_interval: Optional[int] = None  # sampling_params.stream_interval (None: the server's --stream-interval)


def parse_sampling_params(sp: Any, key: str, vocab_size: int, rng: random.Random) -> tuple[SamplingParams, dict]:
    """One row's ``sampling_params`` → ``(SamplingParams, extras)``; ``extras`` holds
    ``max_new_tokens`` (may be 0), ``ignore_eos``, ``sampling_seed`` and the text options.

    Raises:
        BadRequest: an unknown key, a value outside SGLang's ranges (``SamplingParams.verify``), or
            a feature the HF engine does not have, naming ``key.<field>``.
    """
    sp = {} if sp is None else sp
    if not isinstance(sp, dict):
        raise BadRequest(f"{key} must be a JSON object, got {type(sp).__name__}")
    unknown = sorted(set(sp) - _FREE_SAMPLING - set(_FIXED_SAMPLING))
    if unknown:
        raise BadRequest(f"{key} has unknown field(s) {unknown}; accepted: {sorted(_FREE_SAMPLING | set(_FIXED_SAMPLING))}")
    for name, default in _FIXED_SAMPLING.items():
        value = sp.get(name, default)
        if value is not None and value != default and not (name == "stop" and value in ([], "")):
            raise BadRequest(f"{key}.{name}={value!r} is not supported by dapo-rollout-server (only {default!r}): "
                             "the HF engine samples with temperature / top_p / top_k only"
                             + ("; expand the n rows client side" if name == "n" else ""))
    max_new = _as_int(sp.get("max_new_tokens", 128), f"{key}.max_new_tokens")
    if max_new < 0:
        raise BadRequest(f"{key}.max_new_tokens must be at least 0, got {max_new}")
    def given(name, default):  # SGLang reads an explicit null as the default
        return default if sp.get(name) is None else sp[name]

    temperature = _as_float(given("temperature", 1.0), f"{key}.temperature")
    top_p = _as_float(given("top_p", 1.0), f"{key}.top_p")
    top_k = _as_int(given("top_k", -1), f"{key}.top_k")
    if temperature < 0:
        raise BadRequest(f"{key}.temperature must be non-negative, got {temperature}")
    if temperature < 1e-6:  # SGLang's SamplingParams: greedy
        temperature, top_k = 1.0, 1
    if not 0.0 < top_p <= 1.0:
        raise BadRequest(f"{key}.top_p must be in (0, 1], got {top_p}")
    if top_k < 1 and top_k != -1:
        raise BadRequest(f"{key}.top_k must be -1 (disable) or at least 1, got {top_k}")
    stops = sp.get("stop_token_ids") or []
    if not isinstance(stops, list) or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size
                                          for t in stops):
        raise BadRequest(f"{key}.stop_token_ids must be a list of token ids in [0, {vocab_size}), got {stops!r}")
    seed = sp.get("sampling_seed")
    if seed is None:
        seed = rng.getrandbits(63)
    seed = _as_int(seed, f"{key}.sampling_seed")
    if not 0 <= seed < 2**64:
        raise BadRequest(f"{key}.sampling_seed must be in [0, 2**64), got {seed}")
    params = SamplingParams(n=1, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max(1, max_new),
                            stop_token_ids=tuple(stops), seed=None)
    extras = {"max_new_tokens": max_new, "ignore_eos": bool(sp.get("ignore_eos", False)), "sampling_seed": seed % 2**63,
              "no_stop_trim": bool(sp.get("no_stop_trim", False)),
              "skip_special_tokens": bool(sp.get("skip_special_tokens", True)),
              "spaces_between_special_tokens": bool(sp.get("spaces_between_special_tokens", True))}
    interval = sp.get("stream_interval")
    if interval is not None and _as_int(interval, f"{key}.stream_interval") < 1:
        raise BadRequest(f"{key}.stream_interval must be at least 1, got {interval}")
    extras["stream_interval"] = interval
    return params, extras


def parse_generate(body: Any, vocab_size: int, context_length: int, rng: random.Random, *,
                   records_routes: bool = False) -> tuple[bool, list[ServerRow], list[RowSpec]]:
    """A ``/generate`` body → ``(single, rows, specs)`` (``single``: answer one dict, not a list).

    Raises:
        BadRequest: naming the field: no ``input_ids``, an empty or out-of-vocabulary row, a row
            longer than the context, a ``rid`` list of the wrong length or with duplicates, an
            unsupported field (text input, streaming, top logprobs, prompt logprobs...).
    """
    if not isinstance(body, dict):
        raise BadRequest(f"the /generate body must be a JSON object (GenerateReqInput), got {type(body).__name__}")
    unknown = sorted(set(body) - _FREE_REQUEST - set(_FIXED_REQUEST))
    if unknown:
        raise BadRequest(f"/generate got unknown field(s) {unknown} (sglang {SGLANG_API_VERSION} GenerateReqInput)")
    for name, default in _FIXED_REQUEST.items():
        if body.get(name, default) not in (default, None):
            raise BadRequest(f"/generate {name}={repr(body[name])[:80]} is not supported by dapo-rollout-server: "
                             + ("send input_ids (tokenize client side)" if name == "text" else
                                "only token-id requests are served"))
    if not isinstance(body.get("stream", False), bool):
        raise BadRequest(f"stream must be true or false, got {body['stream']!r}")
    ids = body.get("input_ids")
    if ids is None:
        raise BadRequest("/generate needs input_ids (a list of token ids, or a list of such lists for a batch)")
    if not isinstance(ids, list) or not ids:
        raise BadRequest(f"input_ids must be a non-empty list, got {str(ids)[:80]}")
    single = not isinstance(ids[0], list)
    batch = [ids] if single else ids
    for i, row in enumerate(batch):
        where = "input_ids" if single else f"input_ids[{i}]"
        if not isinstance(row, list) or not row:
            raise BadRequest(f"{where} must be a non-empty list of token ids")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in row):
            bad = [t for t in row if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size][:5]
            raise BadRequest(f"{where} holds {bad} outside the vocabulary [0, {vocab_size})")
    lp_start = body.get("logprob_start_len")
    if lp_start not in (None, -1) and not (isinstance(lp_start, int) and all(lp_start >= len(r) for r in batch)):
        raise BadRequest(f"logprob_start_len={lp_start!r}: prompt logprobs are not served (use -1: output tokens only)")
    n = len(batch)
    sps = body.get("sampling_params")
    if isinstance(sps, list):
        if len(sps) != n:
            raise BadRequest(f"sampling_params has {len(sps)} entries for {n} rows of input_ids")
    else:
        sps = [sps] * n
    ret_lp = body.get("return_logprob") or False
    ret_lp = ret_lp if isinstance(ret_lp, list) else [ret_lp] * n
    if len(ret_lp) != n:
        raise BadRequest(f"return_logprob has {len(ret_lp)} entries for {n} rows of input_ids")
    routed = body.get("return_routed_experts", False)
    if not isinstance(routed, bool):
        raise BadRequest(f"return_routed_experts must be true or false, got {routed!r}")
    if routed and not records_routes:
        raise BadRequest("return_routed_experts=true needs the server launched with --enable-return-routed-experts")
    rid = body.get("rid")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(n)]
    elif isinstance(rid, str):
        rids = [rid] if single else [f"{rid}_{i}" for i in range(n)]  # io_struct.py _normalize_rid
    elif isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        if len(rid) != n:
            raise BadRequest("The specified rids length mismatch with the batch_size for batch processing "
                             f"({len(rid)} rids, {n} rows).")
        rids = list(rid)
    else:
        raise BadRequest("The rid should be a string or a list of strings.")
    if len(set(rids)) != len(rids):
        dup = sorted({r for r in rids if rids.count(r) > 1})
        raise BadRequest(f"Duplicate request IDs detected within the request: {dup}")
    rows, specs = [], []
    for i, (row, sp) in enumerate(zip(batch, sps)):
        key = "sampling_params" if not isinstance(body.get("sampling_params"), list) else f"sampling_params[{i}]"
        params, ex = parse_sampling_params(sp, key, vocab_size, rng)
        if len(row) >= context_length:
            raise BadRequest(f"The input ({len(row)} tokens) is longer than the model's context length "
                             f"({context_length} tokens).")
        if len(row) + ex["max_new_tokens"] > context_length:
            raise BadRequest(f"Requested token count exceeds the model's maximum context length of {context_length} "
                             f"tokens: {len(row)} input tokens + max_new_tokens={ex['max_new_tokens']}; lower "
                             "max_new_tokens or the prompt length")
        rows.append(ServerRow(key=rids[i], prompt_ids=tuple(row), params=params, prompt_seed=0,
                              sampling_seed=ex["sampling_seed"], ignore_eos=ex["ignore_eos"]))
        specs.append(RowSpec(rids[i], ex["max_new_tokens"], bool(ret_lp[i]), ex["no_stop_trim"],
                             ex["skip_special_tokens"], ex["spaces_between_special_tokens"], routed,
                             ex["stream_interval"]))
    return single, rows, specs


# ---------------------------------------------------------------------------- the scheduler
class _Generate:
    """One ``/generate`` call in the scheduler: its rows, their results, the HTTP handler's future
    (non-streamed) or the queue of its events (streamed: ``("row", dict)``, ``("error", dict)``,
    then None)."""

    def __init__(self, single: bool, rows: list[ServerRow], specs: list[RowSpec], loop, future, events=None):
        self.single, self.rows, self.specs, self.loop, self.future = single, rows, specs, loop, future
        self.events = events  # an asyncio.Queue of the HTTP loop: the request is streamed
        self.results: dict[str, tuple[RowResult, str]] = {}  # rid -> (result, weight version)
        self.index = {row.key: i for i, row in enumerate(rows)}
        self.sent = {row.key: 0 for row in rows}  # tokens of each row sent in events so far
        self.failed = False  # streamed: an error event ended it
        self.t0 = time.monotonic()

    @property
    def stream(self) -> bool:
        return self.events is not None

    def emit(self, item) -> None:
        """Queue a stream event for the HTTP loop (from the scheduler thread)."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)

    @property
    def rids(self) -> list[str]:
        return [r.key for r in self.rows]

    def done(self) -> bool:
        return len(self.results) == len(self.rows)


def _resolve(loop, future, value=None, error: Optional[BaseException] = None) -> None:
    """Set an asyncio future from the scheduler thread."""
    def apply():
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(value)
    loop.call_soon_threadsafe(apply)


class Scheduler:
    """The thread that owns the engine (module docstring). Commands come from the HTTP loop
    through :meth:`call` (control, answered by the thread) and :meth:`generate`.

    Args:
        engine: the :class:`ServerEngine`.
        tokenizer: decodes ``text`` (None: ``--skip-tokenizer-init``, no ``text`` field).
        weight_sync_timeout_s: timeout of the weight-update groups this server joins.
        stream_interval: ``--stream-interval``: a streamed row's tokens per event (a row's
            ``sampling_params.stream_interval`` overrides it).
        incremental_streaming_output: ``--incremental-streaming-output``: a streamed event carries
            the row's new tokens only, not all so far.
        step_delay_s: ``--step-delay-s``: the thread waits this long after every decode step
            (still answering commands): a slow server that keeps decoding, for tests.
    """

    def __init__(self, engine: ServerEngine, tokenizer=None, weight_sync_timeout_s: float = 600.0, *,
                 stream_interval: int = 1, incremental_streaming_output: bool = False, step_delay_s: float = 0.0):
        self.engine = engine
        self.tokenizer = tokenizer
        self.weight_sync_timeout_s = float(weight_sync_timeout_s)
        self.stream_interval = int(stream_interval)
        self.incremental = bool(incremental_streaming_output)
        self.step_delay_s = float(step_delay_s)
        self._next_step = 0.0  # monotonic time before which no decode step runs (step_delay_s)
        self._to_finish: set[str] = set()  # running rows aborted: finished after one more decode step
        self.params = dict(engine.model.named_parameters(remove_duplicate=False))
        self.weight_version = "default"
        self.groups: dict[str, Any] = {}
        self.paused = False
        self.failed: Optional[str] = None  # the engine raised: /health answers 503
        self._cv = threading.Condition()
        self._inbox: collections.deque = collections.deque()  # commands from the HTTP loop
        self._ordered: collections.deque = collections.deque()  # generates and weight updates, in order
        self._held: list[_Generate] = []  # generates that arrived while paused
        self._running: dict[str, _Generate] = {}  # rid of a row in the engine -> its request
        self.thread = threading.Thread(target=self._loop, name="dapo-rollout-scheduler", daemon=True)
        self.thread.start()

    # ---- from the HTTP loop ---------------------------------------------------------
    def _post(self, item) -> None:
        with self._cv:
            self._inbox.append(item)
            self._cv.notify()

    def generate(self, request: _Generate) -> None:
        self._post(("generate", request))

    def call(self, fn: Callable[[], Any], loop, future, ordered: bool = False) -> None:
        """Run ``fn()`` on the scheduler thread and set ``future`` to its result (or error);
        ``ordered``: a weight operation, run in arrival order once no row is in flight
        (or while paused)."""
        self._post(("ordered" if ordered else "now", (fn, loop, future)))

    # ---- the thread -------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._inbox and not self._can_work():
                    left = self._next_step - time.monotonic()
                    self._cv.wait(left if left > 0 and self.engine.num_in_flight and not self.paused else None)
                inbox, self._inbox = list(self._inbox), collections.deque()
            for kind, item in inbox:
                if kind == "generate":
                    self._ordered.append(("generate", item))
                elif kind == "ordered":
                    self._ordered.append(("weights", item))
                else:
                    self._run_call(*item)
            self._dispatch()
            if self.engine.num_in_flight and not self.paused and time.monotonic() >= self._next_step:
                self._step()
                self._next_step = time.monotonic() + self.step_delay_s

    def _can_work(self) -> bool:
        """Something to do without a new command: rows to decode (once ``step_delay_s`` after the
        last step passed), or queued work that can start (a generate is always started or held; a
        weight operation once idle or paused)."""
        if self.engine.num_in_flight and not self.paused:
            if time.monotonic() >= self._next_step:
                return True
        return bool(self._ordered) and (self._ordered[0][0] == "generate" or self.paused
                                        or not self.engine.num_in_flight)

    def _run_call(self, fn, loop, future) -> None:
        try:
            _resolve(loop, future, fn())
        except BaseException as err:  # answered to the caller (400 with the message)
            _resolve(loop, future, error=err)

    def _dispatch(self) -> None:
        """Start queued work in order: generates unless paused (then held for continue), weight
        operations once no row is in flight (SGLang's writer lock), or at once while paused."""
        while self._ordered:
            kind, item = self._ordered[0]
            if kind == "generate":
                self._ordered.popleft()
                if self.paused:
                    self._held.append(item)
                else:
                    self._start(item)
            else:
                if self.engine.num_in_flight and not self.paused:
                    return  # decode until the running rows finish; later generates wait behind it
                self._ordered.popleft()
                self._run_call(*item)

    def _start(self, request: _Generate) -> None:
        rows = []
        for row, spec in zip(request.rows, request.specs):
            if row.key in request.results:  # aborted while it waited
                continue
            if spec.max_new_tokens == 0:  # SGLang allows a prefill-only request: nothing to sample
                self._record(request, RowResult(row.key, [], [], "length", 0))
            else:
                rows.append(row)
        try:
            self.engine.submit(rows)
        except ValueError as err:  # a rid already in flight
            self._fail(request, BadRequest(str(err)))
            return
        for row in rows:
            self._running[row.key] = request
        self._finish_if_done(request)

    def _step(self) -> None:
        try:
            results = self.engine.poll(max_tokens=1)
            if self._to_finish:  # aborted running rows end after this step, whatever they sampled in it
                # (sglang 0.5.23 managers/scheduler.py:5797-5812 sets req.to_finish and "the request will
                # still run one decode forward pass"; schedule_batch.py:2011 update_finish_state applies it
                # BEFORE the EOS and length checks, so the row is an abort even if that token is its EOS)
                results = [r._replace(finish_reason="abort") if r.key in self._to_finish else r for r in results]
                results += self.engine.abort([k for k in self._to_finish if k in self.engine.running_rows()])
                self._to_finish.clear()
        except Exception as err:  # the engine is broken: fail what runs, stay up for control calls
            self.failed = f"{type(err).__name__}: {err}"
            logger.error("engine step failed:\n%s", traceback.format_exc())
            self._to_finish.clear()
            for res in self.engine.abort():
                request = self._running.pop(res.key, None)
                if request is not None:
                    self._fail(request, RuntimeError(f"generation failed: {self.failed}"))
            return
        self._deliver(results)
        self._stream_progress()

    def _stream_progress(self) -> None:
        """Send the progress events of the streamed rows still decoding: a row's first token at once,
        then every ``stream_interval`` tokens (sglang 0.5.23
        ``managers/scheduler_components/output_streamer.py:453-468``)."""
        running = None
        for key, request in self._running.items():
            if not request.stream:
                continue
            if running is None:
                running = self.engine.running_rows()
            if key not in running:
                continue
            tokens, logprobs = running[key]
            sent, i = request.sent[key], request.index[key]
            interval = request.specs[i].stream_interval or self.stream_interval
            if len(tokens) > sent and (interval == 1 or len(tokens) - sent >= interval or sent == 0):
                self._emit_row(request, i, list(tokens), list(logprobs), None)

    def _emit_row(self, request: _Generate, i: int, tokens: list, logprobs: list, out: Optional[dict]) -> None:
        """One stream event of row ``i``: its last output dict ``out``, or a progress event of its
        ``tokens`` so far (``finish_reason`` None). SGLang's default sends the row's tokens so far
        (``tokenizer_manager.py:2676-2700``), ``--incremental-streaming-output`` the new ones only
        (sliced as ``_slice_streaming_output_meta_info``, line 364); a batch's events carry ``index``
        (``_stream_batch_responses``, line 2224)."""
        row, spec = request.rows[i], request.specs[i]
        if out is None:
            meta: dict[str, Any] = {"id": spec.rid, "finish_reason": None, "prompt_tokens": len(row.prompt_ids),
                                    "weight_version": self.weight_version, "total_retractions": 0}
            if spec.return_logprob:
                meta["input_token_logprobs"] = []
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logprobs, tokens)]
                meta["output_token_logprobs_length"] = len(tokens)
            meta.update({"reasoning_tokens": 0, "completion_tokens": len(tokens), "cached_tokens": 0})
            out = {}
            if self.tokenizer is not None:
                out["text"] = self.tokenizer.decode(tokens, skip_special_tokens=spec.skip_special_tokens)
            out["output_ids"], out["meta_info"] = tokens, meta
        sent = request.sent[row.key]
        if self.incremental and sent:
            out = {**out, "output_ids": out["output_ids"][sent:]}
            if "output_token_logprobs" in out["meta_info"]:
                out["meta_info"] = {**out["meta_info"],
                                    "output_token_logprobs": out["meta_info"]["output_token_logprobs"][sent:]}
        request.sent[row.key] = len(tokens)
        if not request.single:
            out = {**out, "index": i}
        request.emit(("row", out))

    def _record(self, request: _Generate, res: RowResult) -> None:
        """Row ``res.key`` of ``request`` ended: its result (streamed: its last event at once)."""
        request.results[res.key] = (res, self.weight_version)
        if request.stream:
            i = request.index[res.key]
            try:
                out = self._output(request.rows[i], request.specs[i], res, self.weight_version, request.t0)
            except Exception as err:  # decoding text failed
                self._fail(request, err)
                return
            self._emit_row(request, i, list(res.response_ids), list(res.logprobs), out)

    def _fail(self, request: _Generate, err: BaseException) -> None:
        """The request failed: its future's error, or (streamed) an error event and the end of the
        stream (sglang 0.5.23 ``entrypoints/http_server.py:957-975``)."""
        if not request.stream:
            _resolve(request.loop, request.future, error=err)
            return
        code = 400 if isinstance(err, BadRequest) else 500
        request.emit(("error", {"error": {"message": str(err), "type": "invalid_request_error", "code": code,
                                          "retryable": False}}))
        request.emit(None)
        request.events = None  # nothing more is sent; later results of its rows are dropped
        request.failed = True

    def _deliver(self, results: Sequence[RowResult]) -> None:
        for res in results:
            request = self._running.pop(res.key, None)
            if request is None:
                continue
            self._record(request, res)
            self._finish_if_done(request)

    def _finish_if_done(self, request: _Generate) -> None:
        if not request.done() or request.failed:
            return
        if request.stream:
            request.emit(None)
            return
        try:
            out = [self._output(row, spec, *request.results[row.key], request.t0)
                   for row, spec in zip(request.rows, request.specs)]
        except Exception as err:  # decoding text failed
            _resolve(request.loop, request.future, error=err)
            return
        _resolve(request.loop, request.future, out[0] if request.single else out)

    def _output(self, row: ServerRow, spec: RowSpec, res: RowResult, version: str, t0: float) -> dict:
        """One row's SGLang output dict (module docstring)."""
        tokens = list(res.response_ids)
        if res.finish_reason == "stop":
            finish = {"type": "stop", "matched": tokens[-1]}
        elif res.finish_reason == "length":
            finish = {"type": "length", "length": spec.max_new_tokens}
        else:  # scheduler.py abort_request: FINISH_ABORT(); tokenizer_manager.py _handle_abort_req for a queued row
            finish = ({"type": "abort", "message": "Aborted", "status_code": None, "err_type": None} if tokens
                      else {"type": "abort", "message": "Abort in waiting queue"})
        meta: dict[str, Any] = {"id": spec.rid, "finish_reason": finish, "prompt_tokens": len(row.prompt_ids),
                                "weight_version": version, "total_retractions": 0}
        if spec.return_logprob:
            meta["input_token_logprobs"] = []  # logprob_start_len = -1: output tokens only
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(res.logprobs, tokens)]
            meta["output_token_logprobs_length"] = len(tokens)
        if spec.return_routed_experts and res.routes is not None:
            meta["routed_experts"] = encode_sglang_routes(res.routes)
        meta.update({"reasoning_tokens": 0, "completion_tokens": len(tokens), "cached_tokens": 0,
                     "e2e_latency": time.monotonic() - t0})
        out: dict[str, Any] = {}
        if self.tokenizer is not None:
            shown = tokens[:-1] if finish["type"] == "stop" and not spec.no_stop_trim else tokens
            out["text"] = self.tokenizer.decode(shown, skip_special_tokens=spec.skip_special_tokens)
        out["output_ids"] = tokens
        out["meta_info"] = meta
        return out

    # ---- commands (run on the thread) -----------------------------------------------
    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        """``/abort_request``: see the module docstring for the rules."""
        known = set(self._running) | {r for req in self._waiting() for r in req.rids}
        if not abort_all and rid not in known:
            return  # tokenizer_manager.py abort_request: an unknown rid is ignored
        match = (lambda r: True) if abort_all else (lambda r: r.startswith(rid))
        self._abort_running([r for r in self._running if match(r)])
        if abort_all:
            return  # as SGLang: abort_all reaches the scheduler's rows only
        for request in self._waiting():  # not started yet: answered with no tokens
            for row in request.rows:
                if match(row.key) and row.key not in request.results:
                    self._record(request, RowResult(row.key, [], [], "abort", 0))
            if request.done():
                self._drop_waiting(request)
                self._finish_if_done(request)

    def _abort_running(self, rids: Sequence[str]) -> None:
        """Abort rows the engine holds as SGLang's scheduler does: a queued row at once, with no
        tokens; a decoding row after one more decode step (:meth:`_step`), at once when paused
        (no step would come)."""
        decoding = self.engine.running_rows() if not self.paused else {}
        self._deliver(self.engine.abort([r for r in rids if r not in decoding]))
        self._to_finish.update(r for r in rids if r in decoding)

    def abort_rows(self, rids: Sequence[str]) -> None:
        """Stop exactly these rows (a client that disconnected), wherever they are."""
        rids = set(rids)
        self._to_finish -= rids
        self._deliver(self.engine.abort([r for r in self._running if r in rids]))
        for request in self._waiting():
            for row in request.rows:
                if row.key in rids and row.key not in request.results:
                    self._record(request, RowResult(row.key, [], [], "abort", 0))
            if request.done():
                self._drop_waiting(request)
                self._finish_if_done(request)

    def _waiting(self) -> list[_Generate]:
        return self._held + [item for kind, item in self._ordered if kind == "generate"]

    def _drop_waiting(self, request: _Generate) -> None:
        if request in self._held:
            self._held.remove(request)
        else:
            self._ordered = collections.deque(e for e in self._ordered if e[1] is not request)

    def pause(self, mode: str) -> None:
        if mode not in ("abort", "in_place", "retract"):
            raise BadRequest(f"Invalid mode: {mode!r}. Expected one of ['abort', 'retract', 'in_place'].")
        if mode == "retract":
            raise BadRequest("pause_generation mode 'retract' is not supported by dapo-rollout-server (the HF engine "
                             "keeps no KV cache to recompute): use 'abort' or 'in_place'")
        if mode == "abort":  # tokenizer_manager.py pause_generation: abort_request(abort_all=True) until idle
            self._abort_running(list(self._running))
            if self._to_finish:
                self._step()  # the aborted rows' one more decode step: every row answers before this returns
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        for request in reversed(self._held):  # in arrival order, before anything that came later
            self._ordered.appendleft(("generate", request))
        self._held = []

    def flush(self) -> bool:
        return self.engine.num_in_flight == 0  # scheduler.py flush_cache: only when fully idle

    def init_group(self, req: dict) -> dict:
        for key in ("master_address", "master_port", "rank_offset", "world_size"):
            if key not in req:
                raise BadRequest(f"/init_weights_update_group needs {key} (InitWeightsUpdateGroupReqInput)")
        name, backend = str(req.get("group_name", "weight_update_group")), str(req.get("backend", "nccl"))
        rank, world = _as_int(req["rank_offset"], "rank_offset"), _as_int(req["world_size"], "world_size")
        if not 0 < rank < world:
            raise BadRequest(f"rank_offset={rank} must be in [1, world_size={world}): rank 0 is the sender")
        if backend == "nccl" and self.engine.device.type != "cuda":
            raise BadRequest("backend 'nccl' needs a CUDA device; this dapo-rollout-server runs on "
                             f"{self.engine.device}: create the group with backend 'gloo'")
        if name in self.groups:  # a restarted trainer joins again under the same name
            self._destroy(name)
        try:
            self.groups[name] = init_custom_process_group(
                backend, f"tcp://{req['master_address']}:{int(req['master_port'])}", world, rank, name,
                timeout=timedelta(seconds=self.weight_sync_timeout_s))
        except Exception as err:
            return {"success": False, "message": f"Failed to initialize custom process group: {err}."}
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def destroy_group(self, req: dict) -> dict:
        name = str(req.get("group_name", "weight_update_group"))
        if name not in self.groups:
            return {"success": False, "message": f"no weight-update group named {name!r} (joined: {sorted(self.groups)})"}
        self._destroy(name)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def _destroy(self, name: str) -> None:
        group = self.groups.pop(name)
        try:
            torch.distributed.destroy_process_group(group)
        except Exception as err:  # a broken group: drop it anyway
            logger.warning("destroying weight-update group %s: %s", name, err)

    def update_weights(self, req: dict) -> dict:
        """``/update_weights_from_distributed``: checks, then the broadcast(s), then the copies."""
        names, dtypes, shapes = req.get("names"), req.get("dtypes"), req.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)) \
                or not len(names) == len(dtypes) == len(shapes) or not names:
            raise BadRequest("/update_weights_from_distributed needs names, dtypes and shapes: three lists of one "
                             "length (one entry per tensor, in broadcast order)")
        name = str(req.get("group_name", "weight_update_group"))
        if name not in self.groups:
            raise BadRequest(f"weight-update group {name!r} is not initialized (joined: {sorted(self.groups)}); "
                             "call /init_weights_update_group first")
        load_format = req.get("load_format")
        if load_format not in (None, "flattened_bucket"):
            raise BadRequest(f"load_format={load_format!r}: dapo-rollout-server receives per-tensor broadcasts "
                             "(null) or one 'flattened_bucket'")
        tensors = []
        for n, d, s in zip(names, dtypes, shapes):
            param = self.params.get(n)
            if param is None:
                hints = [p for p in self.params if p.endswith(str(n).rsplit(".", 1)[-1])][:3]
                raise BadRequest(f"update_weights_from_distributed: {n!r} is no parameter of the served model"
                                 + (f" (similar: {hints})" if hints else ""))
            try:
                dtype = dtype_from_name(str(d))
            except ValueError as err:
                raise BadRequest(f"update_weights_from_distributed: {n!r}: {err}") from None
            if not isinstance(s, list) or tuple(s) != tuple(param.shape):
                raise BadRequest(f"update_weights_from_distributed: {n!r} has shape {s} but the served model's "
                                 f"parameter has {list(param.shape)}: is the server serving the trainer's model?")
            tensors.append((n, dtype, tuple(s)))
        if load_format == "flattened_bucket":  # FlattenedTensorBucket: the tensors' bytes in order, no padding
            offset = 0
            for n, dtype, s in tensors:
                if offset % torch.empty((), dtype=dtype).element_size():
                    raise BadRequest(f"flattened bucket: {n!r} would start at byte {offset}, not a multiple of its "
                                     f"{dtype} element size")
                offset += torch.Size(s).numel() * torch.empty((), dtype=dtype).element_size()
        if req.get("abort_all_requests"):
            self._to_finish.clear()
            self._deliver(self.engine.abort(list(self._running)))
        group, device = self.groups[name], self.engine.device
        try:
            if load_format == "flattened_bucket":
                flat = torch.empty(offset, dtype=torch.uint8, device=device)
                collectives.broadcast(flat, src=0, group=group)
                received, start = [], 0
                for n, dtype, s in tensors:
                    nbytes = torch.Size(s).numel() * torch.empty((), dtype=dtype).element_size()
                    received.append((n, flat[start:start + nbytes].view(dtype).reshape(s)))
                    start += nbytes
            else:
                received = []
                for n, dtype, s in tensors:
                    t = torch.empty(s, dtype=dtype, device=device)
                    collectives.broadcast(t, src=0, group=group)
                    received.append((n, t))
            with torch.no_grad():
                for n, t in received:
                    self.params[n].copy_(t)
        except Exception as err:  # the weights may be partly updated now; the sender knows (its sync failed)
            return {"success": False, "message": f"Failed to update parameter online: {err}"}
        if req.get("weight_version") is not None:
            self.weight_version = str(req["weight_version"])
        return {"success": True, "message": "Succeeded to update parameter online."}

    def get_weights(self, req: dict) -> list:
        name = req.get("name")
        if name not in self.params:
            raise BadRequest(f"get_weights_by_name: {name!r} is no parameter of the served model")
        size = _as_int(req.get("truncate_size", 100), "truncate_size")
        return self.params[name].detach().cpu().to(torch.float32).numpy().tolist()[:size]

    def state(self) -> dict:
        return {"weight_version": self.weight_version, "weight_update_groups": sorted(self.groups),
                "paused": self.paused, "num_running_reqs": self.engine.num_in_flight,
                # dapo-rollout-server's own: the tokens each decoding row sampled so far, by rid
                "running_tokens": {k: len(t) for k, (t, _) in self.engine.running_rows().items()},
                "num_waiting_reqs": sum(len(r.rows) for r in self._waiting())}


# ---------------------------------------------------------------------------- HTTP
def build_app(scheduler: Scheduler, server_args: dict, context_length: int, random_seed: int):
    """The FastAPI app of the endpoints above (module docstring)."""
    app = FastAPI(title="dapo-rollout-server")
    rng = random.Random(random_seed)
    engine = scheduler.engine

    def error(message: str, status: int = 400) -> JSONResponse:  # http_server.py _create_error_response
        return JSONResponse({"error": {"message": message}}, status_code=status)

    async def body_of(request: Request) -> dict:
        raw = await request.body()
        if not raw.strip():
            return {}
        try:
            obj = json.loads(raw)
        except ValueError as err:
            raise BadRequest(f"{request.url.path}: the body is not JSON ({err})") from None
        if not isinstance(obj, dict):
            raise BadRequest(f"{request.url.path}: the body must be a JSON object, got {type(obj).__name__}")
        return obj

    async def on_thread(fn, ordered: bool = False):
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        scheduler.call(fn, loop, future, ordered=ordered)
        return await future

    async def handle(request: Request, work, ordered: bool = False):
        """Run ``work(body)`` on the scheduler thread; a :class:`BadRequest` answers 400 with its message."""
        try:
            body = await body_of(request)
            return JSONResponse(await on_thread(lambda: work(body), ordered))
        except BadRequest as err:
            return error(str(err))

    async def weight_call(request: Request, work):
        """A weight operation, answered ``{"success", "message"}`` (400 when not successful), as
        SGLang's weight endpoints are; queued behind the rows in flight (``Scheduler.call``)."""
        try:
            body = await body_of(request)
            result = await on_thread(lambda: work(body), ordered=True)
        except BadRequest as err:  # refused before any collective is joined
            result = {"success": False, "message": str(err)}
        return JSONResponse(result, status_code=200 if result.get("success") else 400)

    @app.get("/health")
    @app.get("/health_generate")
    async def health():
        if scheduler.failed or not scheduler.thread.is_alive():
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        state = await on_thread(scheduler.state)
        return JSONResponse({**server_args, "weight_version": state["weight_version"], "internal_states": [state],
                             "version": f"dapo-rollout-server (sglang {SGLANG_API_VERSION} HTTP API)"})

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        try:
            body = await body_of(request)
            single, rows, specs = parse_generate(body, engine.vocab_size, context_length, rng,
                                                 records_routes=engine.records_routes)
        except BadRequest as err:
            return error(str(err))
        if scheduler.failed:
            return error(f"the engine failed earlier ({scheduler.failed}); restart the server", 503)
        loop = asyncio.get_running_loop()
        if body.get("stream"):
            return stream(_Generate(single, rows, specs, loop, None, asyncio.Queue()))
        future = loop.create_future()
        scheduler.generate(_Generate(single, rows, specs, loop, future))
        while True:  # tokenizer_manager.py _wait_one_response: a client gone has its request aborted
            done, _ = await asyncio.wait({future}, timeout=1.0)
            if done:
                break
            if await request.is_disconnected():
                scheduler.call(lambda: scheduler.abort_rows([row.key for row in rows]), loop, loop.create_future())
                return Response(status_code=499)
        try:
            return JSONResponse(future.result())
        except BadRequest as err:
            return error(str(err))
        except Exception as err:
            return error(str(err), 500)

    def stream(request: _Generate) -> StreamingResponse:
        """A streamed ``/generate``: ``data: {json}\n\n`` per event, then ``data: [DONE]\n\n`` (sglang
        0.5.23 ``entrypoints/http_server.py:949-981``); a client gone has its rows aborted."""
        events = request.events
        scheduler.generate(request)

        async def body():
            ended = False
            try:
                while True:
                    item = await events.get()
                    if item is None:
                        ended = True
                        break
                    yield b"data: " + json.dumps(item[1]).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
            finally:
                if not ended:
                    rids = [row.key for row in request.rows]
                    scheduler.call(lambda: scheduler.abort_rows(rids), request.loop, request.loop.create_future())

        return StreamingResponse(body(), media_type="text/event-stream")

    @app.post("/abort_request")
    async def abort_request(request: Request):
        def work(body):
            rid = body.get("rid") or ""
            if not isinstance(rid, str):
                raise BadRequest(f"/abort_request rid must be a string, got {rid!r}")
            scheduler.abort(rid, bool(body.get("abort_all", False)))

        try:
            body = await body_of(request)
            await on_thread(lambda: work(body))
        except BadRequest as err:
            return error(str(err))
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        try:
            body = await body_of(request)
            await on_thread(lambda: scheduler.pause(body.get("mode", "abort")))
        except BadRequest as err:
            return error(str(err))
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation():
        await on_thread(scheduler.resume)
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        if await on_thread(scheduler.flush):
            return Response("Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                            "waiting requests, the operation will not be performed.)\n", status_code=200)
        return Response("Flush cache failed.\n", status_code=400)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        return await weight_call(request, scheduler.init_group)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        return await weight_call(request, scheduler.destroy_group)

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        return await weight_call(request, scheduler.update_weights)

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request):
        return await handle(request, scheduler.get_weights, ordered=True)

    return app


# ---------------------------------------------------------------------------- command line
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The server's flags (SGLang's names where it has one)."""
    p = argparse.ArgumentParser(
        prog="dapo-rollout-server",
        description="The HF rollout engine behind the SGLang HTTP API subset dapo-megatron's server mode uses "
                    "(rollout.mode=server, rollout.server_urls=[http://HOST:PORT]).")
    p.add_argument("--model-path", required=True,
                   help="HF model directory, or a .gguf file (de-quantised on load)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="parameter dtype (float32 on CPU; use the trainer's model.params_dtype for bitwise syncs)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda / cuda:<i>")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch CPU threads of the engine (default: torch's; 1 when pinned to one core)")
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="load no tokenizer: outputs carry output_ids only, no text (SGLang's flag)")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="record every token's experts (MoE models) for requests with return_routed_experts (R3)")
    p.add_argument("--random-seed", type=int, default=0, help="seeds the draws of rows sent without sampling_seed")
    p.add_argument("--context-length", type=int, default=None,
                   help="longest input + max_new_tokens (default: the config's max_position_embeddings)")
    p.add_argument("--weight-sync-timeout-s", type=float, default=600.0,
                   help="timeout of the weight-update process groups this server joins, seconds")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="a streamed row's tokens per event (SGLang's flag; a request's sampling_params.stream_interval "
                        "overrides it)")
    p.add_argument("--incremental-streaming-output", action="store_true",
                   help="a streamed event carries the row's new tokens only, not all so far (SGLang's flag)")
    p.add_argument("--step-delay-s", type=float, default=0.0,
                   help="wait this long after every decode step, still answering requests (a slow server, for tests)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="uvicorn's log level; 'info' logs one access line per request")
    args = p.parse_args(argv)
    if args.num_threads is not None and args.num_threads < 1:
        p.error(f"--num-threads must be >= 1, got {args.num_threads}")
    if args.stream_interval < 1:
        p.error(f"--stream-interval must be >= 1, got {args.stream_interval}")
    if args.step_delay_s < 0:
        p.error(f"--step-delay-s must be >= 0, got {args.step_delay_s}")
    if not os.path.exists(args.model_path):
        p.error(f"--model-path {args.model_path}: no such file or directory")
    return args


def load_tokenizer(model_path: str):
    """The checkpoint's tokenizer (a ``.gguf`` path: the one inside the GGUF).

    Raises:
        SystemExit: none loads, with the fix (``--skip-tokenizer-init``) in the message.
    """
    path, kwargs = model_path, {}
    if model_path.endswith(".gguf"):
        path, gguf = os.path.split(model_path)
        kwargs = {"gguf_file": gguf}
    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except Exception as err:
        raise SystemExit(f"dapo-rollout-server: no tokenizer loads from --model-path {model_path} ({err}); pass "
                         "--skip-tokenizer-init to serve token ids only (the trainer needs no text)") from None


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Load the model, start the scheduler thread, serve HTTP until terminated."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    dtype = getattr(torch, args.dtype)
    t0 = time.monotonic()
    engine = ServerEngine(args.model_path, dtype=dtype, device=args.device, num_threads=args.num_threads,
                          record_routes=args.enable_return_routed_experts)
    tokenizer = None if args.skip_tokenizer_init else load_tokenizer(args.model_path)
    context = args.context_length or int(getattr(engine.model.config, "max_position_embeddings", 0) or 2**31 - 1)
    scheduler = Scheduler(engine, tokenizer, weight_sync_timeout_s=args.weight_sync_timeout_s,
                          stream_interval=args.stream_interval,
                          incremental_streaming_output=args.incremental_streaming_output, step_delay_s=args.step_delay_s)
    server_args = {**{k.replace("-", "_"): v for k, v in vars(args).items()}, "tp_size": 1, "dp_size": 1,
                   "pp_size": 1, "enable_memory_saver": False, "enable_weights_cpu_backup": False,
                   "enable_deterministic_inference": True, "context_length": context,
                   "served_model_name": args.model_path, "vocab_size": engine.vocab_size}
    logger.info("loaded %s (%s, vocab %d, context %d) in %.1f s; serving on http://%s:%d", args.model_path,
                args.dtype, engine.vocab_size, context, time.monotonic() - t0, args.host, args.port)
    app = build_app(scheduler, server_args, context, args.random_seed)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_keep_alive=30)


if __name__ == "__main__":
    main()
