"""A stand-in SGLang HTTP server for the CPU tests of the server mode (a real HTTP server on
127.0.0.1 in its own process, joining real gloo process groups).

It follows SGLang 0.5.11's HTTP contract (``python/sglang/srt/entrypoints/http_server.py``,
``managers/io_struct.py``) for the endpoints the trainer calls:

* ``GET /health`` → 200 with an empty body (503 when made unhealthy); ``GET /server_info`` →
  the server's arguments (``tp_size``, ``dp_size``, ``pp_size``, flags, ``version``);
* ``POST /generate`` → one output dict per row (``meta_info.output_token_logprobs``,
  ``finish_reason``; with ``"stream": true`` one SSE event per row, as SGLang 0.5.23), response token ``k`` of a row = last prompt token + 1 + k;
* ``POST /init_weights_update_group`` → joins the named group as ``rank_offset`` (TP 1);
* ``POST /update_weights_from_distributed`` → without ``load_format``: one tensor allocated
  from (name, dtype, shape) and one ``broadcast(src=0)`` per tensor, in order; with
  ``load_format="flattened_bucket"``: the bucket SGLang builds from the announced metadata
  (SGLang's own ``FlattenedTensorBucket`` where installed, else its documented layout) and ONE
  broadcast of its flat buffer, then the reconstructed tensors (``model_runner.py``
  ``_update_bucketed_weights_from_distributed``). Received tensors are kept as raw bytes, so a
  test compares them bit for bit (``POST /received``);
* ``POST /flush_cache`` → plain text; ``/pause_generation`` / ``/continue_generation`` →
  ``{"message", "status": "ok"}``; ``/release_memory_occupation`` / ``/resume_memory_occupation``
  → JSON null (releasing ``weights`` answers 400 as a busy server does).

Test controls: ``POST /control`` with ``{"healthy": false}`` (health answers 503),
``{"hang_health": true}`` (health never answers), ``{"fail_next_update": "message"}`` (the next
weight update answers 400 ``{"success": false}`` without joining the broadcast) or
``{"server_info": {...}}`` (fields merged into ``/server_info``'s answer),
``{"digest_only": true}`` (keep each received tensor's sha256, not its bytes),
``{"generate_delay_s": 4.5}`` (``/generate`` answers that much later); ``{"reset": true}``
forgets everything received and every control set. ``/received`` also lists every route
called, in order, as ``calls``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import multiprocessing as mp
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from dapo_megatron.platform.distributed import free_port


def _raw(t: torch.Tensor, digest: bool = False) -> str:
    data = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest() if digest else base64.b64encode(data).decode()


def serve(http_port: int, ready, tp_size: int = 1) -> None:
    """Run the stand-in (in a spawned process) until terminated."""
    import sglang_reference
    from dapo_megatron.bridge.buckets import dtype_from_name
    from dapo_megatron.bridge.servers import init_custom_process_group

    tensor_bucket = sglang_reference.install_tensor_bucket()
    # SGLang's scheduler is one loop taking one request at a time (sglang 0.5.11
    # managers/scheduler.py: the request dispatcher, InitWeightsUpdateGroupReqInput and
    # UpdateWeightsFromDistributedReqInput included): a group init or a weight update blocks
    # every other one until its collective is done. The stand-in does the same.
    scheduler = threading.Lock()
    state = {"groups": {}, "received": [], "flushes": 0, "memory": [], "control": [], "healthy": True,
             "hang_health": False, "fail_next_update": None, "flat_broadcasts": 0, "server_info": {}, "calls": [],
             "digest_only": False, "generate_delay_s": 0.0}

    def flattened_receive(names, dtypes, shapes, group):
        named = [(n, torch.empty(s, dtype=dtype_from_name(d))) for n, d, s in zip(names, dtypes, shapes)]
        if tensor_bucket is not None:
            bucket = tensor_bucket.FlattenedTensorBucket(named_tensors=named)
            flat = bucket.get_flattened_tensor()
            torch.distributed.broadcast(flat, src=0, group=group)
            return bucket.reconstruct_tensors()
        flat = torch.cat([t.flatten().view(torch.uint8) for _, t in named])
        torch.distributed.broadcast(flat, src=0, group=group)
        out, off = [], 0
        for n, t in named:
            nb = t.numel() * t.element_size()
            out.append((n, flat[off:off + nb].view(t.dtype).reshape(t.shape)))
            off += nb
        return out

    def receive(req):
        """The tensors of one /update_weights_from_distributed, received as SGLang's worker does."""
        group = state["groups"][req.get("group_name", "weight_update_group")]
        if req.get("load_format") == "flattened_bucket":
            state["flat_broadcasts"] += 1
            return flattened_receive(req["names"], req["dtypes"], req["shapes"], group)
        tensors = []
        for name, dt, shape in zip(req["names"], req["dtypes"], req["shapes"]):
            t = torch.empty(shape, dtype=dtype_from_name(dt))
            torch.distributed.broadcast(t, src=0, group=group)
            tensors.append((name, t))
        return tensors

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def reply(self, code, obj):
            body = json.dumps(obj).encode() if obj is not ... else b""
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def reply_text(self, code, text):  # sglang 0.5.11 http_server.py /flush_cache: a plain-text Response
            body = text.encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            state["calls"].append(self.path)
            if self.path == "/health":
                while state["hang_health"]:
                    time.sleep(0.1)
                self.reply(200 if state["healthy"] else 503, ...)
            elif self.path == "/server_info":
                self.reply(200, {"tp_size": tp_size, "dp_size": 1, "pp_size": 1, "enable_memory_saver": True,
                                 "enable_weights_cpu_backup": False, "enable_deterministic_inference": False,
                                 "version": "0.5.11", **state["server_info"]})
            else:
                self.reply(404, {"detail": "Not Found"})

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            if self.path not in ("/received", "/control"):
                state["calls"].append(self.path)
            if self.path == "/generate":
                time.sleep(state["generate_delay_s"])  # a long generation (test control)
                out = []
                for row, (ids, sp) in enumerate(zip(req["input_ids"], req["sampling_params"])):
                    resp = [ids[-1] + 1 + k for k in range(sp["max_new_tokens"])]
                    out.append({"output_ids": resp, "meta_info": {
                        "finish_reason": {"type": "length", "length": len(resp)}, "completion_tokens": len(resp),
                        "output_token_logprobs": [[-0.5 * (row + 1), t, None] for t in resp]}})
                if not req.get("stream"):
                    self.reply(200, out)
                    return
                # SGLang 0.5.23's streamed /generate (entrypoints/http_server.py:949-981): one SSE event per
                # row (its "index" in the batch; here each row's whole output in one event), then [DONE]
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for row, o in enumerate(out):
                    self.wfile.write(b"data: " + json.dumps({**o, "index": row}).encode() + b"\n\n")
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            elif self.path == "/init_weights_update_group":
                with scheduler:
                    state["groups"][req["group_name"]] = init_custom_process_group(
                        req["backend"], f"tcp://{req['master_address']}:{req['master_port']}", req["world_size"],
                        req["rank_offset"], req["group_name"])
                self.reply(200, {"success": True, "message": "Succeeded to initialize custom process group."})
            elif self.path == "/update_weights_from_distributed":
                if state["fail_next_update"] is not None:
                    message, state["fail_next_update"] = state["fail_next_update"], None
                    self.reply(400, {"success": False, "message": message})
                    return
                with scheduler:
                    tensors = receive(req)
                for name, t in tensors:
                    state["received"].append((name, _raw(t, state["digest_only"]), list(t.shape),
                                              str(t.dtype).removeprefix("torch."), req.get("group_name")))
                self.reply(200, {"success": True, "message": "Succeeded to update parameter online."})
            elif self.path == "/flush_cache":
                state["flushes"] += 1
                self.reply_text(200, "Cache flushed.\nPlease check backend logs for more details. "
                                     "(When there are running or waiting requests, the operation will not be "
                                     "performed.)\n")
            elif self.path in ("/pause_generation", "/continue_generation"):
                state["control"].append((self.path, req.get("mode")))
                self.reply(200, {"message": "Generation paused successfully." if "pause" in self.path
                                 else "Generation continued successfully.", "status": "ok"})
            elif self.path == "/received":
                self.reply(200, {"received": state["received"], "flushes": state["flushes"],
                                 "memory": state["memory"], "control": state["control"],
                                 "flat_broadcasts": state["flat_broadcasts"], "calls": state["calls"]})
            elif self.path == "/control":
                if req.pop("reset", False):  # a fresh server for the next test
                    for group in state["groups"].values():  # torch refuses a second group of one name
                        torch.distributed.destroy_process_group(group)
                    state["groups"].clear()
                    state.update(received=[], flushes=0, memory=[], control=[], healthy=True, hang_health=False,
                                 fail_next_update=None, flat_broadcasts=0, server_info={}, calls=[],
                                 digest_only=False, generate_delay_s=0.0)
                state.update(req)
                self.reply(200, None)
            elif self.path in ("/release_memory_occupation", "/resume_memory_occupation"):
                if "weights" in req.get("tags", []) and self.path.startswith("/release"):
                    # _create_error_response of an exception raised in the scheduler
                    self.reply(400, {"error": {"message": "release_memory_occupation should be called only "
                                                          "when server is idle."}})
                else:
                    state["memory"].append((self.path, req.get("tags")))
                    self.reply(200, None)  # the endpoint returns None: JSON null
            else:
                self.reply(404, {"error": self.path})

    server = ThreadingHTTPServer(("127.0.0.1", http_port), Handler)
    ready.set()
    server.serve_forever()


class StandIn:
    """A running stand-in server: ``url`` and its process (``stop()`` kills it)."""

    def __init__(self, tp_size: int = 1, wait: bool = True):
        ctx = mp.get_context("spawn")
        port = free_port()
        self._ready = ctx.Event()
        self.process = ctx.Process(target=serve, args=(port, self._ready, tp_size), daemon=True)
        self.process.start()
        self.url = f"http://127.0.0.1:{port}"
        if wait:
            self.wait_ready()

    def wait_ready(self) -> "StandIn":
        """Block until it serves (stand-ins made with ``wait=False`` start in parallel)."""
        if not self._ready.wait(60):
            self.stop()
            raise RuntimeError("stand-in server did not start")
        return self

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
        self.process.join(10)
