"""Streamed ``/generate`` (rollout/engines/generate_stream.py) against a real, slow
``dapo-rollout-server`` (``--step-delay-s``: it keeps decoding, a quarter second per token), and
the one reading of an aborted row (``sglang_io.row_outcome``) on the async path.

* Issue 36 item 3: a batch that takes ~3 s on a server that sends progress is not failed by a
  1 s bound: the bound is on silence, not on total time; the tokens and logprobs are those the
  same engine samples unthrottled, in-process (its position-keyed seeds); a server that stops
  sending (SIGSTOP) fails after the bound, named with its ``/health`` answer. The server streams
  ``--incremental-streaming-output`` (new tokens per event); test_rollout_server.py's server
  streams SGLang's default (all tokens so far): the client reads both.
* Issue 36 item 8: a row that a sync's ``/pause_generation`` (mode abort) stops one decode step
  before its EOS, or before its budget, comes back ``"abort"`` with that EOS (the budget's last
  token) as its last token (SGLang's scheduler decodes once more and sets the abort before the
  EOS and length checks); the async controller's ``RowClient.generate_rows`` reads it as
  ``"stop"`` (``"length"``), not as a partial row to continue past its EOS.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time

import pytest

from dapo_megatron.rollout.engines.row_client import RowClient, ServerFailure
from dapo_megatron.rollout.engines.engine import SamplingParams, sample_seed
from dapo_megatron.rollout.engines.generate_stream import StreamedGenerate, stream_generate, wait_streams
from dapo_megatron.rollout_server import ServerEngine, parse_generate
from dapo_megatron.platform.http import http_get, http_post
from dapo_megatron.rollout.engines.sglang_io import build_sampling_params, with_progress
from rollout_server import RolloutServer, save_tiny_model

STEP_DELAY_S = 0.25  # per decode step: 12 tokens take ~3 s
MAX_NEW = 12
SILENCE_S = 1.0
PROMPTS = [[5, 17, 33, 8], [100, 3, 41], [7, 7, 200, 19, 64]]
PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_NEW, seed=3)
EOS_ROW = ([9, 81, 4], 424242)  # the item-8 row: prompt and sampling seed; its 4th token is made the EOS


def _rows():
    """``(input ids, sampling_params)`` of the batch, seeded per response as the controller does."""
    return [(list(p), build_sampling_params(PARAMS, sample_seed(PARAMS.seed, i, j)))
            for i, p in enumerate(PROMPTS) for j in range(PARAMS.n)]


def _reference(engine, rows):
    """What the server's engine samples for ``rows``, in-process, unthrottled: ``(ids, logprobs, kind)``."""
    body = {"input_ids": [ids for ids, _ in rows], "sampling_params": [sp for _, sp in rows], "rid": [
        f"ref-{k}" for k in range(len(rows))]}
    _, srows, _ = parse_generate(body, engine.vocab_size, 4096, random.Random(0))
    engine.submit(srows)
    got = {r.key: r for r in engine.poll()}
    return [(list(got[f"ref-{k}"].response_ids), list(got[f"ref-{k}"].logprobs), got[f"ref-{k}"].finish_reason)
            for k in range(len(rows))]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny random model whose EOS is the 4th token the item-8 row samples (found with EOS 2 ignored)."""
    path = save_tiny_model(tmp_path_factory.mktemp("stream_model"), max_position_embeddings=4096)
    probe = ServerEngine(path, num_threads=1)
    prompt, seed = EOS_ROW
    ids, _, _ = _reference(probe, [(prompt, {"max_new_tokens": 8, "sampling_seed": seed, "ignore_eos": True})])[0]
    eos = ids[3]
    assert eos not in ids[:3], "the 4th token must be the first occurrence of the EOS"
    for name in ("config.json", "generation_config.json"):
        f = f"{path}/{name}"
        try:
            cfg = json.load(open(f))
        except FileNotFoundError:
            continue
        cfg["eos_token_id"] = eos
        json.dump(cfg, open(f, "w"))
    return path, eos, ids[:4]


@pytest.fixture(scope="module")
def engine(model):
    return ServerEngine(model[0], num_threads=1)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    s = RolloutServer(model[0], tmp_path_factory.mktemp("stream_log") / "server.log", "--skip-tokenizer-init",
                      "--step-delay-s", str(STEP_DELAY_S), "--incremental-streaming-output")
    yield s
    s.stop()


def test_a_slow_batch_that_keeps_decoding_outlives_a_shorter_silence_bound_with_the_same_tokens(server, engine):
    rows = _rows()
    want = _reference(engine, rows)
    t0 = time.monotonic()
    got = RowClient([server.url], silence_timeout_s=SILENCE_S, timeout_s=10,
                    eos_token_ids=list(engine.eos_token_ids)).generate_rows([(0, ids, sp) for ids, sp in rows], 5)
    took = time.monotonic() - t0
    assert not [g for g in got if isinstance(g, ServerFailure)], got
    assert took > 2.5 * SILENCE_S, f"the batch took {took:.1f} s: it must outlast the silence bound"
    assert [(ids, kind) for ids, _, kind, _ in got] == [(ids, kind) for ids, _, kind in want]
    for (_, lps, _, version), (_, ref, _) in zip(got, want):
        assert lps == pytest.approx(ref, abs=1e-5) and version == 5  # the server reports "default": the fallback
    # the answer of a non-streamed request bounded by the same 1 s: what the silence bound replaces
    with pytest.raises(RuntimeError, match="did not answer within 1 s"):
        http_post(server.url, "/generate", {"input_ids": [ids for ids, _ in rows],
                                            "sampling_params": [sp for _, sp in rows]}, SILENCE_S)


def test_a_server_that_stops_sending_fails_after_the_silence_bound_naming_it(server, engine):
    ids, sp = _rows()[0]
    stream = StreamedGenerate(server.url, {"input_ids": [ids], "sampling_params": [with_progress(sp)]},
                              connect_timeout_s=10)
    time.sleep(2 * STEP_DELAY_S)
    server.process.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        wait_streams([stream], SILENCE_S, health_timeout_s=0.5)
        waited = time.monotonic() - t0
    finally:
        server.process.send_signal(signal.SIGCONT)
    assert stream.result is None and waited < SILENCE_S + 2.0, waited
    assert f"SGLang server {server.url}/generate: no bytes for" in stream.error, stream.error
    assert "rollout.server_silence_timeout_s=1" in stream.error and "/health" in stream.error, stream.error
    deadline = time.monotonic() + 10  # the server saw its client go and aborted the row
    while http_get(server.url, "/server_info", 5)["internal_states"][0]["num_running_reqs"] and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    assert http_get(server.url, "/server_info", 5)["internal_states"][0]["num_running_reqs"] == 0


def _pause_when(server, tokens: int, start) -> None:
    """Start the request (``start()``), wait until its one row decoded ``tokens`` tokens, then a
    sync's ``/pause_generation`` (abort) lands before the next decode step; continue after."""
    start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        running = http_get(server.url, "/server_info", 5)["internal_states"][0]["running_tokens"]
        if list(running.values()) == [tokens]:
            break
        time.sleep(0.01)
    else:
        pytest.fail(f"the row never had {tokens} tokens running")
    http_post(server.url, "/pause_generation", {"mode": "abort"}, 10)
    http_post(server.url, "/continue_generation", {}, 10)


@pytest.mark.parametrize("case", ["right after its EOS", "at its budget"])
def test_a_row_aborted_right_after_its_eos_or_at_its_budget_is_finished_not_continued(server, model, engine, case):
    _, eos, eos_tokens = model
    prompt, seed = EOS_ROW
    if case == "right after its EOS":
        sp, want_ids, want_kind = {"max_new_tokens": MAX_NEW, "sampling_seed": seed}, eos_tokens, "stop"
    else:
        sp = build_sampling_params(SamplingParams(max_new_tokens=3), seed)
        want_ids, want_kind = eos_tokens[:3], "length"
    assert _reference(engine, [(prompt, sp)])[0][::2] == (want_ids, want_kind)
    n = len(want_ids)

    # what the server answers: the abort lands one step before the row's end, the row decodes that
    # last token (the EOS, or the budget's last) and ends as "abort"
    box = {}
    _pause_when(server, n - 1, lambda: box.setdefault("s", StreamedGenerate(
        server.url, {"input_ids": [prompt], "sampling_params": [with_progress(sp)], "return_logprob": True},
        connect_timeout_s=10)))
    wait_streams([box["s"]], SILENCE_S, 5)
    raw = box["s"].result[0]
    assert raw["meta_info"]["finish_reason"]["type"] == "abort" and raw["output_ids"] == want_ids, raw

    # the async controller's request of the same row reads it as finished
    out = {}
    _pause_when(server, n - 1, lambda: threading.Thread(target=lambda: out.setdefault("r", RowClient(
        [server.url], silence_timeout_s=SILENCE_S, timeout_s=10, eos_token_ids=[eos]).generate_rows([(0, prompt, sp)], 1)),
        daemon=True).start())
    deadline = time.monotonic() + 20
    while "r" not in out and time.monotonic() < deadline:
        time.sleep(0.05)
    ids, lps, kind, _ = out["r"][0]
    assert (ids, kind) == (want_ids, want_kind), "a row the sync ended at its EOS / budget is not a partial row"
    assert lps == pytest.approx(_reference(engine, [(prompt, sp)])[0][1], abs=1e-5)


def test_stream_generate_reports_a_refused_request_with_the_servers_message(server):
    with pytest.raises(RuntimeError, match=r"returned HTTP 400: .*sampling_params\.top_p must be in \(0, 1\]"):
        stream_generate(server.url, {"input_ids": [[1, 2]], "sampling_params": {"top_p": 0}}, silence_s=SILENCE_S,
                        connect_timeout_s=10)
    with pytest.raises(RuntimeError, match="unreachable"):
        stream_generate("http://127.0.0.1:9", {"input_ids": [[1]]}, silence_s=SILENCE_S, connect_timeout_s=2)
