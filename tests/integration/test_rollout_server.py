"""``dapo-rollout-server`` (dapo_megatron/rollout_server/): a real server process on a tiny random
model, driven through the project's own SGLang client functions.

What it must get right, each checked against a value computed here independently: the
logprob of every generated token is the model's ``log_softmax(logits / T)`` at that token;
greedy output is the model's argmax chain; seeded rows repeat; an aborted row returns the
tokens and logprobs it sampled with ``{"type": "abort"}`` and, resubmitted as prompt + prefix,
continues with exactly the tokens of the uninterrupted row; ``pause_generation`` (abort) ends
every row at once and holds new requests until ``continue_generation``; a weight update over
gloo (per tensor and flattened bucket) leaves the server's parameters bit-identical to what was
sent, and the server then generates with them; every bad request is one 400 naming the field.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch

from dapo_megatron.rollout.engines.engine import RowRequest, SamplingParams
from dapo_megatron.platform.http import http_get, http_post
from dapo_megatron.bridge.servers import init_custom_process_group
from dapo_megatron.rollout.engines.sglang_io import (build_generate_request, build_row_request, parse_generate_output,
                                                     parse_row_output)
from rollout_server import RolloutServer, free_port, save_tiny_model

EOS = 2
PROMPTS = [[5, 17, 33, 8], [100, 3, 41], [7, 7, 200, 19, 64]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # max_position_embeddings 4096: room for the long rows the abort tests interrupt
    return save_tiny_model(tmp_path_factory.mktemp("tiny_server_model"), max_position_embeddings=4096)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = RolloutServer(model_dir, tmp_path_factory.mktemp("server_log") / "server.log", "--skip-tokenizer-init")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def local_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _logprobs(model, prompt, response, temperature=1.0):
    """log softmax(logits / T) of each response token, recomputed in one forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(response)])).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1:-1] / temperature, dim=-1)
    return lp[torch.arange(len(response)), torch.tensor(response)].tolist()


def _greedy(model, prompt, steps):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            tok = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(tok)
            if tok == EOS:
                break
    return ids[len(prompt):]


def _post_later(url, path, payload, box, timeout=120):
    """``http_post`` in a thread; the answer (or the error) lands in ``box``."""
    def run():
        try:
            box["out"] = http_post(url, path, payload, timeout)
        except Exception as err:
            box["error"] = err
        box["t"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_generate_logprobs_are_the_models_and_seeded_rows_repeat(server, local_model):
    params = SamplingParams(n=2, temperature=0.8, max_new_tokens=12, seed=11)
    req = build_generate_request(PROMPTS, params, prompt_seeds=[4, 5, 6])
    out = http_post(server.url, "/generate", req, 60)
    assert [o["meta_info"]["id"] for o in out] != [None] * 6 and len({o["meta_info"]["id"] for o in out}) == 6
    got = parse_generate_output(out, len(PROMPTS), params.n)  # the trainer's own parser accepts it
    for prompt, completions in zip(PROMPTS, got):
        for c in completions:
            assert 1 <= len(c.response_ids) <= 12 and c.finish_reason in ("stop", "length")
            assert (c.finish_reason == "stop") == (c.response_ids[-1] == EOS)
            assert c.logprobs == pytest.approx(_logprobs(local_model, prompt, c.response_ids, 0.8), abs=1e-4)
    for o in out:
        meta = o["meta_info"]
        assert meta["completion_tokens"] == len(o["output_ids"]) == meta["output_token_logprobs_length"]
        assert meta["input_token_logprobs"] == [] and meta["weight_version"] == "default"
        fr = meta["finish_reason"]
        assert fr == ({"type": "length", "length": 12} if fr["type"] == "length" else {"type": "stop", "matched": EOS})
    assert parse_generate_output(http_post(server.url, "/generate", req, 60), len(PROMPTS), 2) == got, "seeded"
    # one row alone draws what it drew inside the batch (its seed and position, not its neighbours)
    alone = {"input_ids": PROMPTS[1], "sampling_params": req["sampling_params"][3], "return_logprob": True}
    single = http_post(server.url, "/generate", alone, 60)
    assert isinstance(single, dict) and single["output_ids"] == got[1][1].response_ids

    greedy = http_post(server.url, "/generate", {"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": 10,
                                                                                          "temperature": 0}}, 60)
    assert [o["output_ids"] for o in greedy] == [_greedy(local_model, p, 10) for p in PROMPTS]
    assert "output_token_logprobs" not in greedy[0]["meta_info"], "return_logprob not set"


def _long(prompt, rid, max_new=3000, seed=7):
    row = RowRequest(rid, tuple(prompt), SamplingParams(max_new_tokens=max_new, seed=seed), prompt_seed=0)
    payload = build_row_request(row, rid)  # the trainer's row request: prompt + prefix, rid, seed, logprobs
    payload["sampling_params"]["ignore_eos"] = True  # a row that surely runs until it is aborted
    return row, payload


def test_an_aborted_row_returns_its_partial_output_and_continues_seed_exactly(server, local_model):
    row, payload = _long(PROMPTS[0], "row-000001")
    box = {}
    t = _post_later(server.url, "/generate", payload, box)
    time.sleep(0.8)
    assert http_post(server.url, "/abort_request", {"rid": "row-0000"}, 10) is None, "an unknown rid: nothing"
    assert "out" not in box
    t0 = time.monotonic()
    assert http_post(server.url, "/abort_request", {"rid": "row-000001"}, 10) is None  # 200, empty body
    t.join(30)
    assert box["t"] - t0 < 5, "answered at the abort"
    out = box["out"]
    fr = out["meta_info"]["finish_reason"]
    assert fr["type"] == "abort" and fr["message"] == "Aborted"
    k = len(out["output_ids"])
    assert 0 < k < 3000 and out["meta_info"]["output_token_logprobs_length"] == k
    res = parse_row_output(out, row, version=0, eos_token_ids=frozenset({EOS}))
    # ignore_eos lets the random model sample EOS mid-row; an abort landing right after one is a
    # finished row (the abort-after-EOS rule of sglang_io.row_outcome), any other is continued
    # (about one abort in 250 with this 250-token vocabulary: a suite run on 2026-12-04 drew it)
    assert res.finish_reason == ("stop" if out["output_ids"][-1] == EOS else "abort"), (res.finish_reason, out)
    assert res.response_ids == out["output_ids"] and len(res.logprobs) == k
    assert res.logprobs == pytest.approx(_logprobs(local_model, PROMPTS[0], res.response_ids), abs=1e-4)

    # resubmitted as prompt + prefix (what the async trainer does), it draws what it would have drawn
    cont = RowRequest("row-000002", tuple(PROMPTS[0]), SamplingParams(max_new_tokens=k + 6, seed=7), prompt_seed=0,
                      prefix_ids=tuple(res.response_ids))
    c_payload = build_row_request(cont, "row-000002")
    c_payload["sampling_params"]["ignore_eos"] = True
    assert c_payload["sampling_params"]["max_new_tokens"] == 6
    rest = http_post(server.url, "/generate", c_payload, 60)
    _, full_payload = _long(PROMPTS[0], "row-000003", max_new=k + 6)
    full = http_post(server.url, "/generate", full_payload, 120)
    assert full["output_ids"][:k] == res.response_ids and full["output_ids"][k:] == rest["output_ids"]
    assert [e[0] for e in rest["meta_info"]["output_token_logprobs"]] == pytest.approx(
        [e[0] for e in full["meta_info"]["output_token_logprobs"][k:]], abs=1e-4)


def test_abort_by_rid_stops_that_row_of_a_batch_only(server):
    payload = {"input_ids": [PROMPTS[0], PROMPTS[1]], "rid": ["grp-a", "grp-b"], "return_logprob": True,
               "sampling_params": [{"max_new_tokens": 3000, "ignore_eos": True, "sampling_seed": 1},
                                   {"max_new_tokens": 20, "ignore_eos": True, "sampling_seed": 2}]}
    box = {}
    t = _post_later(server.url, "/generate", payload, box)
    time.sleep(0.8)
    http_post(server.url, "/abort_request", {"rid": "grp-a"}, 10)
    t.join(30)
    a, b = box["out"]
    assert a["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(a["output_ids"]) < 3000
    assert b["meta_info"]["finish_reason"] == {"type": "length", "length": 20} and len(b["output_ids"]) == 20


def test_streamed_rows_poll_abort_and_continue_exactly_as_uninterrupted(server, local_model):
    """RowClient's streamed rows (the streamed rollout's rows on one server, rollout/engines/row_client.py): a short
    group answers at a poll, a long group is aborted mid-way with its partial tokens, and its
    rows, resubmitted after their prefix, end with exactly the tokens of the uninterrupted rows
    (the server seeds draws by position); logprobs are the model's."""
    from dapo_megatron.rollout.engines.row_client import RowClient

    # top_k=4: the EOS is rarely among a random model's 4 likeliest tokens, so the long rows run on
    long_params, short_params = SamplingParams(max_new_tokens=3000, top_k=4, seed=11), SamplingParams(max_new_tokens=3)

    def rows(prompt, seed, params, prefixes=None):
        return [RowRequest((seed, j), tuple(prompt), params, seed, j, prefix_ids=tuple(prefixes[j]) if prefixes else ())
                for j in range(2)]

    def uninterrupted(row):
        out = http_post(server.url, "/generate", build_row_request(row, f"ref-{row.key}"), 120)
        return out["output_ids"], [e[0] for e in out["meta_info"]["output_token_logprobs"]]

    # the long group: rows whose uninterrupted responses run >= 1500 tokens (picked by seed)
    seed = next((ps for ps in range(20) if all(len(uninterrupted(r)[0]) >= 1500 for r in rows(PROMPTS[0], ps,
                                                                                               long_params))), None)
    assert seed is not None, "no seed gives long responses: the abort would find nothing running"
    long_rows, short_rows = rows(PROMPTS[0], seed, long_params), rows(PROMPTS[1], 1000, short_params)
    client = RowClient([server.url], silence_timeout_s=120, timeout_s=10, eos_token_ids=[EOS], rid_prefix="t")
    client.submit(short_rows + long_rows)
    assert client.num_in_flight == 4
    got = []
    deadline = time.monotonic() + 30
    while len(got) < 2 and time.monotonic() < deadline:
        got += client.poll(max_tokens=1, version=3)
    assert sorted(r.key for r in got) == [(1000, 0), (1000, 1)] and client.num_in_flight == 2
    for r, row in zip(sorted(got), short_rows):
        assert r.version == 3 and r.finish_reason in ("stop", "length") and 0 < len(r.response_ids) <= 3
        assert r.response_ids == uninterrupted(row)[0]
        assert r.logprobs == pytest.approx(_logprobs(local_model, PROMPTS[1], r.response_ids), abs=1e-4)
    aborted = sorted(client.abort(version=3))
    assert [r.key for r in aborted] == [row.key for row in long_rows] and client.num_in_flight == 0
    assert all(r.finish_reason == "abort" and 0 < len(r.response_ids) < 1500 for r in aborted), aborted
    client.submit(rows(PROMPTS[0], seed, long_params, [r.response_ids for r in aborted]))
    rest = {r.key: r for r in client.poll()}  # until every row answers
    for row, r in zip(long_rows, aborted):
        ids, logprobs = uninterrupted(row)
        assert r.response_ids + rest[row.key].response_ids == ids, row.key
        assert r.logprobs + rest[row.key].logprobs == pytest.approx(logprobs, abs=1e-5), row.key


def test_pause_aborts_every_row_and_holds_new_requests_until_continue(server):
    _, payload = _long(PROMPTS[2], "p-1")
    first = {}
    t1 = _post_later(server.url, "/generate", payload, first)
    time.sleep(0.8)
    with pytest.raises(RuntimeError, match=r"/flush_cache returned HTTP 400: Flush cache failed"):
        http_post(server.url, "/flush_cache", None, 10, text=True)  # rows in flight: refused, as SGLang does
    assert http_post(server.url, "/pause_generation", {"mode": "abort"}, 30) == {
        "message": "Generation paused successfully.", "status": "ok"}
    t1.join(30)  # the server answered the row before pause returned; the client thread may still be reading it
    assert "out" in first, "pause(abort) answers every row in flight"
    assert first["out"]["meta_info"]["finish_reason"]["type"] == "abort" and first["out"]["output_ids"]
    assert http_post(server.url, "/flush_cache", None, 10, text=True).startswith("Cache flushed.")
    held = {}
    t2 = _post_later(server.url, "/generate", {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 4}}, held)
    time.sleep(1.0)
    assert not held, "a request sent while paused waits for continue_generation"
    info = http_post(server.url, "/continue_generation", {}, 10)
    assert info == {"message": "Generation continued successfully.", "status": "ok"}
    t2.join(30)
    t1.join(1)
    assert held["out"]["meta_info"]["finish_reason"]["type"] in ("length", "stop")


@pytest.mark.parametrize("path, body, message", [
    ("/generate", {"sampling_params": {}}, "/generate needs input_ids"),
    ("/generate", {"input_ids": [[1, 2], []]}, "input_ids[1] must be a non-empty list"),
    ("/generate", {"input_ids": [1, 250]}, "input_ids holds [250] outside the vocabulary [0, 250)"),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_token": 3}}, "unknown field(s) ['max_new_token']"),
    ("/generate", {"input_ids": [1], "sampling_params": {"n": 4}}, "sampling_params.n=4 is not supported"),
    ("/generate", {"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p must be in (0, 1]"),
    ("/generate", {"input_ids": [1], "stream": "yes"}, "stream must be true or false"),
    ("/generate", {"text": "hi"}, "text='hi' is not supported by dapo-rollout-server: send input_ids (tokenize client side)"),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 5000}},
     "exceeds the model's maximum context length of 4096"),
    ("/generate", {"input_ids": [[1], [2]], "rid": ["x"]}, "rids length mismatch"),
    ("/generate", {"input_ids": [[1], [2]], "rid": ["x", "x"]}, "Duplicate request IDs"),
    ("/pause_generation", {"mode": "retract"}, "mode 'retract' is not supported"),
    ("/update_weights_from_distributed", {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[250, 64]],
                                          "group_name": "nope"}, "weight-update group 'nope' is not initialized"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                    "world_size": 2, "group_name": "g", "backend": "nccl"},
     "backend 'nccl' needs a CUDA device"),
], ids=lambda v: v if isinstance(v, str) and v.startswith("/") else None)
def test_a_bad_request_gets_one_400_naming_the_field(server, path, body, message):
    with pytest.raises(RuntimeError) as err:
        http_post(server.url, path, body, 10)
    assert f"{path} returned HTTP 400: " in str(err.value) and message in str(err.value), str(err.value)


def _weights(url, name, numel_rows):
    return torch.tensor(http_post(url, "/get_weights_by_name", {"name": name, "truncate_size": numel_rows}, 60),
                        dtype=torch.float32)


def test_weight_update_over_gloo_is_bitwise_and_generation_uses_it(server, model_dir):
    from transformers import AutoModelForCausalLM

    from dapo_megatron.bridge.buckets import bucket_metadata, dtype_name
    from dapo_megatron.bridge.flat_bucket import FlatBucketPacker
    from dapo_megatron.bridge.servers import distributed_update_request

    new_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(123)
    with torch.no_grad():
        for p in new_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    named = [(n, p.detach().clone()) for n, p in new_model.named_parameters()]
    half = len(named) // 2
    port, name = free_port(), "test_weights"
    box = {}
    t = _post_later(server.url, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": name, "backend": "gloo"}, box)
    group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, name, timeout=timedelta(seconds=60))
    t.join(60)
    assert box["out"] == {"success": True, "message": "Succeeded to initialize custom process group."}
    try:
        # a shape the model does not have: refused at once, the broadcast never joined, the group intact
        with pytest.raises(RuntimeError, match=r"'model.norm.weight' has shape \[65\] but the served model's "
                                               r"parameter has \[64\]"):
            http_post(server.url, "/update_weights_from_distributed",
                      {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[65]], "group_name": name}, 10)
        # the first half one broadcast per tensor (no load_format), the rest as flattened buckets
        box = {}
        t = _post_later(server.url, "/update_weights_from_distributed",
                        distributed_update_request(bucket_metadata(named[:half]), name), box)
        for _, tensor in named[:half]:
            torch.distributed.broadcast(tensor, src=0, group=group)
        t.join(60)
        assert box["out"]["success"], box
        buckets = 0
        for bucket in FlatBucketPacker(40_000).buckets(named[half:]):
            box = {}
            t = _post_later(server.url, "/update_weights_from_distributed", {
                "names": bucket.names, "dtypes": [dtype_name(e.dtype) for e in bucket.entries],
                "shapes": [list(e.shape) for e in bucket.entries], "group_name": name,
                "load_format": "flattened_bucket", "flush_cache": False, "weight_version": "v1"}, box)
            torch.distributed.broadcast(bucket.flat, src=0, group=group)
            t.join(60)
            assert box["out"] == {"success": True, "message": "Succeeded to update parameter online."}, box
            buckets += 1
        assert buckets >= 2
        for n, tensor in named:  # bit for bit
            got = _weights(server.url, n, tensor.shape[0])
            assert torch.equal(got.view(torch.int32), tensor.view(torch.int32)), n
        out = http_post(server.url, "/generate", {"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": 8,
                                                                                          "temperature": 0}}, 60)
        assert [o["output_ids"] for o in out] == [_greedy(new_model, p, 8) for p in PROMPTS]
        assert out[0]["meta_info"]["weight_version"] == "v1"
        state = http_get(server.url, "/server_info", 10)
        assert state["weight_version"] == "v1" and name in state["internal_states"][0]["weight_update_groups"]
    finally:
        torch.distributed.destroy_process_group(group)
