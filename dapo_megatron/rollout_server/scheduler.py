"""``dapo-rollout-server``'s scheduler: the one thread that runs the engine (continuous batching
of the submitted rows, streamed outputs, aborts by rid prefix, pause / continue, weight updates
over the trainer's process group; :mod:`dapo_megatron.rollout_server`).

Design: docs/design.md §2.2 (server mode on CPU).
"""

import collections
import logging
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch

from dapo_megatron.platform import collectives
from dapo_megatron.bridge.buckets import dtype_from_name
from dapo_megatron.rollout.engines.engine import RowResult
from dapo_megatron.bridge.receiver import checkpoint_parameters
from dapo_megatron.rollout.engines.routes import encode_sglang_routes
from dapo_megatron.bridge.servers import init_custom_process_group

logger = logging.getLogger("dapo_rollout_server")
from dapo_megatron.rollout_server.protocol import BadRequest, RowSpec, ServerEngine, ServerRow, _as_int

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
        if tokenizer is not None:  # stop strings: the HF engine's rule on this text (HFEngine.matched_stop_string)
            engine.set_stop_decoder(lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
        self.weight_sync_timeout_s = float(weight_sync_timeout_s)
        self.stream_interval = int(stream_interval)
        self.incremental = bool(incremental_streaming_output)
        self.step_delay_s = float(step_delay_s)
        self._next_step = 0.0  # monotonic time before which no decode step runs (step_delay_s)
        self._to_finish: set[str] = set()  # running rows aborted: finished after one more decode step
        # by checkpoint name, as SGLang's load_weights takes them: a transformers-5 MoE model's fused experts
        # as per-expert views (mlp.experts.{e}.gate_proj.weight ...), router biases included
        self.params = dict(checkpoint_parameters(engine.model))
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
        matched = None
        if res.finish_reason == "stop" and row.params.stop and tokens and tokens[-1] not in self.engine._stop_ids(row):
            matched = self.engine.matched_stop_string(row.params.stop, tokens)
        if matched is not None:
            # sglang managers/schedule_batch.py FINISH_MATCHED_STR.to_json (lines 140-150 at 000eaff):
            # {"type": "stop", "matched": <the stop string>}; output_ids keep every token
            finish = {"type": "stop", "matched": matched}
        elif res.finish_reason == "stop":
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
            shown = tokens[:-1] if matched is None and finish["type"] == "stop" and not spec.no_stop_trim else tokens
            text = self.tokenizer.decode(shown, skip_special_tokens=spec.skip_special_tokens)
            if matched is not None and matched in text:
                # sglang managers/detokenizer_manager.py trim_matched_stop: the text ends before the
                # stop string, or after it with no_stop_trim
                cut = text.find(matched)
                text = text[:cut + len(matched)] if spec.no_stop_trim else text[:cut]
            out["text"] = text
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
        # SGLang's answer (srt/models/llama.py LlamaForCausalLM.get_weights_by_name:
        # ``weight.cpu().to(torch.float32).numpy().tolist()[:truncate_size]``): the first truncate_size rows.
        # Sliced before the conversion, the same list without the whole tensor as Python floats (SmolLM2's
        # embedding: 28 M of them, seconds a call)
        return self.params[name].detach()[:size].cpu().to(torch.float32).numpy().tolist()

    def state(self) -> dict:
        return {"weight_version": self.weight_version, "weight_update_groups": sorted(self.groups),
                "paused": self.paused, "num_running_reqs": self.engine.num_in_flight,
                # dapo-rollout-server's own: the tokens each decoding row sampled so far, by rid
                "running_tokens": {k: len(t) for k, (t, _) in self.engine.running_rows().items()},
                "num_waiting_reqs": sum(len(r.rows) for r in self._waiting())}


