"""``dapo-rollout-server``'s HTTP endpoints (FastAPI) and command line (console script
``dapo-rollout-server``, ``python -m dapo_megatron.rollout_server``; :mod:`dapo_megatron.rollout_server`).

Design: docs/design.md §2.2 (server mode on CPU).
"""

import argparse
import asyncio
import json
import logging
import os
import random
import time
from typing import Optional, Sequence

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from transformers import AutoTokenizer


logger = logging.getLogger("dapo_rollout_server")
from dapo_megatron.rollout_server.protocol import SGLANG_API_VERSION, BadRequest, ServerEngine, parse_generate
from dapo_megatron.rollout_server.scheduler import Scheduler, _Generate

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
                                                 records_routes=engine.records_routes,
                                                 decodes_text=scheduler.tokenizer is not None)
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

