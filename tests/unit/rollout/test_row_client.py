"""The HTTP row client (``rollout/engines/row_client.py``) against a real HTTP server: the SGLang
stand-in (``tests/sglang_standin.py``: response token ``k`` of a row = last input token + 1 + k,
finish ``"length"``) and a port nobody listens on (a dead server).

Cost: one stand-in process (about 2 s to start), a few HTTP round trips.
"""

import pytest

from dapo_megatron.rollout.engines.engine import SamplingParams
from dapo_megatron.rollout.engines.row_client import RowClient
from dapo_megatron.rollout.engines.sglang_io import build_sampling_params
from sglang_standin import StandIn, free_port


@pytest.fixture(scope="module")
def standin():
    server = StandIn()
    yield server.url
    server.stop()


def _expected(last: int, k: int) -> list[int]:
    return [last + 1 + t for t in range(k)]


def test_a_dead_server_is_marked_down_once_and_its_rows_are_retried_on_the_healthy_one(standin):
    dead = f"http://127.0.0.1:{free_port()}"
    downs = []
    client = RowClient([dead, standin], silence_timeout_s=5, timeout_s=5, on_down=downs.append)
    prompts = {i: [7, 10 * (i + 1)] for i in range(5)}
    got, sent = {}, []

    def request(i):
        sent.append(i)
        return i, prompts[i], build_sampling_params(SamplingParams(max_new_tokens=3), seed=i)

    def accept(i, res):
        got[i] = res
        return True

    rounds = []
    retried = client.dispatch(list(prompts), request, accept, 4, between_rounds=lambda: rounds.append(1) or 4)
    assert rounds == [1], "one round of retries"
    assert retried == 3, "rows 0, 2, 4 were dealt to the dead server first"
    assert sent == [0, 1, 2, 3, 4, 0, 2, 4], "the failed rows are sent again, in order, in the next round"
    assert client.health == ["down", "healthy"] and downs == [0] and dead in client.server_errors[0]
    position = {1: 0, 3: 1, 0: 0, 2: 1, 4: 2}  # each row's place in its server's batch (the stand-in's logprob)
    for i, p in prompts.items():
        ids, lps, kind, version = got[i]
        assert (ids, kind, version) == (_expected(p[-1], 3), "length", 4), i
        assert lps == [-0.5 * (position[i] + 1)] * 3, i
    client.mark_down(1, "gone")
    with pytest.raises(RuntimeError, match=r"every rollout server failed.*127\.0\.0\.1.*gone"):
        client.healthy()
    assert downs == [0, 1]


def test_an_aborted_row_continues_after_the_sync_with_the_version_it_left(standin):
    """A row handed back as not finished (a sync's abort) waits for ``between_rounds`` (the sync)
    and is sent again, as the caller builds it then (prompt + its prefix, the remaining budget),
    with the version ``between_rounds`` returns; the servers' answers are the stand-in's, over HTTP."""
    client = RowClient([standin], silence_timeout_s=5, timeout_s=5)
    prefix: list[int] = []
    calls, syncs = [], []

    def request(key):
        return 0, [7, 20] + prefix, build_sampling_params(SamplingParams(max_new_tokens=4 - len(prefix)), seed=1)

    def accept(key, res):
        ids, _, kind, version = res
        calls.append((list(ids), version))
        if not prefix:  # the first answer stands for a row the sync aborted after two tokens
            prefix.extend(ids[:2])
            return False
        return True

    def between_rounds():
        syncs.append(1)
        return 9

    client.dispatch(["row"], request, accept, 8, between_rounds=between_rounds)
    assert syncs == [1]
    assert calls == [([21, 22, 23, 24], 8), ([23, 24], 9)], "continued after its prefix, on the new version"
    assert prefix + calls[-1][0] == _expected(20, 4), "prefix + continuation = the uninterrupted row"


def test_batch_generate_reads_the_streamed_rows(standin):
    params = SamplingParams(n=2, max_new_tokens=3, seed=5)
    prompts = [[1, 2, 3], [40]]
    streamed = RowClient([standin], silence_timeout_s=5, timeout_s=5).generate(0, prompts, params, [0, 1])
    assert [[list(c.response_ids) for c in comps] for comps in streamed] == [[_expected(3, 3)] * 2,
                                                                             [_expected(40, 3)] * 2]
    assert {c.finish_reason for comps in streamed for c in comps} == {"length"}
