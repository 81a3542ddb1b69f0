"""SGLang engine pieces that need no GPU: request building, response parsing, bucketing,
metadata order, error reporting, and the server-mode client over a real HTTP round trip
with a real (gloo) weight-update process group.

The server in the dist test is a small stand-in written here that follows SGLang's HTTP
contract (the receiving side of ``/update_weights_from_distributed`` allocates each tensor
from (name, dtype, shape) and receives one ``broadcast(src=0)`` per tensor, in order);
the client under test is ``SGLangServerEngine``.
"""

import base64
import json
import multiprocessing as mp
import socket
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from dapo_megatron.rollout.buckets import bucket_metadata, dtype_from_name, dtype_name, iter_buckets
from dapo_megatron.rollout.engine import ParamSpec, SamplingParams
from dapo_megatron.rollout.sglang_engine import (
    SGLangServerEngine,
    build_generate_request,
    check_result,
    distributed_update_request,
    http_post,
    parse_generate_output,
)


# ------------------------------------------------------------------ bucketing
def named(sizes, dtypes=None):
    dtypes = dtypes or [torch.float32] * len(sizes)
    return [(f"t{i}", torch.zeros(s, dtype=d)) for i, (s, d) in enumerate(zip(sizes, dtypes))]


def test_iter_buckets_bounds_and_order():
    items = named([10, 10, 10, 30, 5, 5], [torch.float32, torch.bfloat16, torch.float32, torch.float32,
                                            torch.bfloat16, torch.float32])
    bytes_ = [40, 20, 40, 120, 10, 20]
    buckets = list(iter_buckets(iter(items), bucket_bytes=64))
    names = [[n for n, _ in b] for b in buckets]
    assert [n for b in names for n in b] == [n for n, _ in items], "order kept, nothing dropped, no dtype grouping"
    for b in buckets:
        size = sum(bytes_[int(n[1:])] for n, _ in b)
        assert size <= 64 or len(b) == 1, "only a single oversized tensor may exceed the bound"
    assert names == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]
    assert [n for n, *_ in bucket_metadata(buckets[0])] == ["t0", "t1"]
    assert bucket_metadata(buckets[0])[1] == ("t1", (10,), torch.bfloat16)


def test_iter_buckets_is_lazy():
    pulled = []

    def gen():
        for i in range(6):
            pulled.append(i)
            yield (f"t{i}", torch.zeros(4))  # 16 bytes each

    it = iter_buckets(gen(), bucket_bytes=32)
    first = next(it)
    assert [n for n, _ in first] == ["t0", "t1"] and pulled == [0, 1], "at most one bucket held"


def test_iter_buckets_errors():
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(iter_buckets(named([1]), 0))
    with pytest.raises(ValueError, match=r"\(str, torch.Tensor\) pairs"):
        list(iter_buckets([("a", [1, 2])], 10))


def test_dtype_names_roundtrip():
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        assert dtype_from_name(dtype_name(dt)) is dt
    assert dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_from_name("Tensor")


# ------------------------------------------------------------------ requests / responses
def test_generate_request_rows_and_seeds():
    p = SamplingParams(n=3, temperature=0.9, top_p=0.7, top_k=-1, max_new_tokens=5, stop_token_ids=(2, 9), seed=4)
    req = build_generate_request([[1, 2, 3], [4]], p)
    assert req["input_ids"] == [[1, 2, 3]] * 3 + [[4]] * 3
    assert req["return_logprob"] is True
    sps = req["sampling_params"]
    assert len(sps) == 6
    assert all(sp["max_new_tokens"] == 5 and sp["temperature"] == 0.9 and sp["top_p"] == 0.7 and sp["top_k"] == -1
               and sp["stop_token_ids"] == [2, 9] and sp["no_stop_trim"] is True for sp in sps)
    seeds = [sp["sampling_seed"] for sp in sps]
    assert len(set(seeds)) == 6, "every response row needs its own seed"
    assert seeds == [sp["sampling_seed"] for sp in build_generate_request([[1, 2, 3], [4]], p)["sampling_params"]]
    assert "sampling_seed" not in build_generate_request([[1]], SamplingParams(seed=None))["sampling_params"][0]
    json.dumps(req)  # the payload is plain JSON
    with pytest.raises(ValueError, match=r"prompt_ids\[0\]"):
        build_generate_request([[]], p)


def sglang_item(ids, logprobs, reason, with_output_ids=True):
    fr = {"type": reason, "matched": ids[-1]} if reason == "stop" else {"type": reason, "length": len(ids)}
    if reason == "abort":
        fr = {"type": "abort", "message": "client disconnected"}
    item = {"text": "", "meta_info": {"finish_reason": fr, "prompt_tokens": 3, "completion_tokens": len(ids),
                                      "output_token_logprobs": [[lp, t, None] for t, lp in zip(ids, logprobs)]}}
    if with_output_ids:
        item["output_ids"] = list(ids)
    return item


def test_parse_generate_output():
    items = [sglang_item([5, 2], [-0.5, -0.25], "stop"), sglang_item([7, 7, 7], [-1.0, -2.0, -3.0], "length"),
             sglang_item([9], [-0.125], "stop", with_output_ids=False), sglang_item([4, 4], [0.0, -1.5], "length")]
    out = parse_generate_output(items, num_prompts=2, n=2)
    assert out[0][0] == ([5, 2], [-0.5, -0.25], "stop")
    assert out[0][1] == ([7, 7, 7], [-1.0, -2.0, -3.0], "length")
    assert out[1][0].response_ids == [9] and out[1][1].finish_reason == "length"
    with pytest.raises(RuntimeError, match="3 outputs, expected 2 prompts x n=2"):
        parse_generate_output(items[:3], 2, 2)
    with pytest.raises(RuntimeError, match="row 1 finished with 'abort': client disconnected"):
        parse_generate_output([items[0], sglang_item([1], [-1.0], "abort")], 1, 2)
    bad = sglang_item([1, 2], [-1.0, -1.0], "stop")
    del bad["meta_info"]["output_token_logprobs"]
    with pytest.raises(RuntimeError, match="return_logprob=True"):
        parse_generate_output([bad], 1, 1)
    bad = sglang_item([1, 2], [-1.0, -1.0], "stop")
    bad["output_ids"] = [1, 2, 3]
    with pytest.raises(RuntimeError, match="disagree"):
        parse_generate_output([bad], 1, 1)


def test_check_result():
    check_result((True, "ok"), "x")
    check_result({"success": True}, "x")
    check_result(None, "x")
    with pytest.raises(RuntimeError, match="SGLang update_weights_from_tensor failed: no param foo"):
        check_result((False, "no param foo"), "update_weights_from_tensor")
    with pytest.raises(RuntimeError, match="/flush_cache failed: busy"):
        check_result({"success": False, "message": "busy"}, "/flush_cache")


def test_distributed_update_request_keeps_bucket_order():
    bucket = [("b", torch.zeros(2, 3, dtype=torch.bfloat16)), ("a", torch.zeros(4)), ("c", torch.zeros(1, dtype=torch.float16))]
    req = distributed_update_request(bucket, "g")
    assert req == {"names": ["b", "a", "c"], "dtypes": ["bfloat16", "float32", "float16"],
                   "shapes": [[2, 3], [4], [1]], "group_name": "g", "flush_cache": False}


# ------------------------------------------------------------------ server mode over HTTP + gloo
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(http_port, ready):
    """SGLang-contract stand-in server (runs in a spawned process)."""
    from dapo_megatron.rollout.buckets import dtype_from_name
    from dapo_megatron.rollout.sglang_engine import init_custom_process_group

    state = {"group": None, "received": [], "flushes": 0}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def reply(self, code, obj):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            if self.path == "/generate":
                out = []
                for row, (ids, sp) in enumerate(zip(req["input_ids"], req["sampling_params"])):
                    resp = [ids[-1] + 1 + k for k in range(sp["max_new_tokens"])]
                    out.append({"output_ids": resp, "meta_info": {
                        "finish_reason": {"type": "length", "length": len(resp)},
                        "output_token_logprobs": [[-0.5 * (row + 1), t, None] for t in resp]}})
                self.reply(200, out)
            elif self.path == "/init_weights_update_group":
                state["group"] = init_custom_process_group(
                    req["backend"], f"tcp://{req['master_address']}:{req['master_port']}", req["world_size"],
                    req["rank_offset"], req["group_name"])
                self.reply(200, {"success": True, "message": "ok"})
            elif self.path == "/update_weights_from_distributed":
                for name, dt, shape in zip(req["names"], req["dtypes"], req["shapes"]):
                    t = torch.empty(shape, dtype=dtype_from_name(dt))
                    torch.distributed.broadcast(t, src=0, group=state["group"])
                    # the raw bytes go back (base64): the client compares them bit for bit
                    raw = base64.b64encode(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).decode()
                    state["received"].append((name, raw, list(t.shape), dt))
                self.reply(200, {"success": True, "message": "ok"})
            elif self.path == "/flush_cache":
                state["flushes"] += 1
                self.reply(200, {"success": True})
            elif self.path == "/received":
                self.reply(200, {"received": state["received"], "flushes": state["flushes"]})
            elif self.path == "/release_memory_occupation":
                self.reply(400, {"success": False, "message": "server not launched with --enable-memory-saver"})
            else:
                self.reply(404, {"error": self.path})

    server = ThreadingHTTPServer(("127.0.0.1", http_port), Handler)
    ready.set()
    server.serve_forever()


@pytest.fixture()
def sglang_standin():
    ctx = mp.get_context("spawn")
    port = free_port()
    ready = ctx.Event()
    proc = ctx.Process(target=_serve, args=(port, ready), daemon=True)
    proc.start()
    assert ready.wait(60), "stand-in server did not start"
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.join(10)


def server_specs():
    specs = {"model.embed_tokens.weight": ParamSpec((8, 4), torch.float32),
             "model.layers.0.mlp.up_proj.weight": ParamSpec((6, 4), torch.bfloat16),
             "model.norm.weight": ParamSpec((4,), torch.float32)}
    return specs, {"lm_head.weight": "model.embed_tokens.weight"}


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_server_engine_http_generate_and_distributed_weight_sync(sglang_standin):
    eng = SGLangServerEngine(sglang_standin, server_specs(), device="cpu", timeout_s=60, update_bucket_mb=1)
    out = eng.generate([[10, 11], [20]], SamplingParams(n=2, max_new_tokens=3))
    assert [c.response_ids for c in out[0]] == [[12, 13, 14]] * 2 and out[1][1].response_ids == [21, 22, 23]
    assert out[1][1].logprobs == [-2.0] * 3 and out[0][0].finish_reason == "length"

    eng.init_weights_update_group("127.0.0.1", free_port(), world_size=2, group_name="wug", backend="gloo")
    g = torch.Generator().manual_seed(0)
    tensors = [("model.norm.weight", torch.randn(4, generator=g)),
               ("model.embed_tokens.weight", torch.randn(8, 4, generator=g)),
               ("model.layers.0.mlp.up_proj.weight", torch.randn(6, 4, generator=g).to(torch.bfloat16))]
    eng.update_weights(tensors, version=5)
    assert eng.weight_version == 5
    got = http_post(sglang_standin, "/received", None, timeout=30)
    assert [r[0] for r in got["received"]] == [n for n, _ in tensors], "same metadata order on both sides"
    for (name, t), (rname, raw, rshape, rdt) in zip(tensors, got["received"]):
        assert rshape == list(t.shape) and rdt == dtype_name(t.dtype)
        # bitwise, element by element: a permuted, transposed or re-rounded tensor fails here
        sent = t.contiguous().view(-1).view(torch.uint8)
        assert torch.equal(torch.frombuffer(bytearray(base64.b64decode(raw)), dtype=torch.uint8), sent), name
    assert got["flushes"] == 1

    # checks before anything is sent: unknown name, wrong shape, never-updated parameter
    with pytest.raises(KeyError, match="model.layers.0.mlp.gate_proj.weight"):
        eng.update_weights([("model.layers.0.mlp.gate_proj.weight", torch.zeros(6, 4))], version=6)
    eng.abort_weight_update()
    with pytest.raises(RuntimeError, match=r"never updated: model\.layers\.0\.mlp\.up_proj\.weight, model\.norm\.weight"):
        eng.update_weights([("lm_head.weight", torch.zeros(8, 4))], version=6)
    assert eng.weight_version == 5
    with pytest.raises(RuntimeError, match="HTTP 400.*enable-memory-saver"):
        eng.sleep()


def test_server_engine_reports_unreachable_server():
    eng = SGLangServerEngine(f"http://127.0.0.1:{free_port()}", server_specs(), device="cpu", timeout_s=5)
    with pytest.raises(RuntimeError, match="unreachable"):
        eng.generate([[1]], SamplingParams(max_new_tokens=1))
    with pytest.raises(ValueError, match="base_url"):
        SGLangServerEngine("localhost:30000", server_specs())
