"""RolloutController's one dispatch / retry loop (``_dispatch``), through its two users: validation
(``generate_validation``) and a generation batch (``_generate_batch``), with a fake ``/generate``
in place of the servers (``generate=``).

The fake answers each row with tokens derived from its ``sampling_seed`` alone, so a row
retried on another server answers what it would have answered on its first: what the real
servers do (the draws are keyed on the seed and the position).
"""

from types import SimpleNamespace

import pytest

from dapo_megatron.rollout.async_rollout import RolloutController
from dapo_megatron.rollout.engines.row_client import ServerFailure
from dapo_megatron.rollout.engines.engine import SamplingParams, sample_seed
from dapo_megatron.rollout.sampling.config import BufferConfig

URLS = ["http://a", "http://b", "http://c"]


def _tokens(seed: int, k: int = 3) -> list[int]:
    return [(seed >> (8 * t)) % 1000 for t in range(k)]


class _Servers:
    """``generate(rows, version)`` of ``RowClient.generate_rows``: per row its tokens, or a
    ServerFailure for every row of a server in ``dead``; every call recorded."""

    def __init__(self, dead=(), abort_once=False):
        self.dead, self.abort_once, self.calls = set(dead), abort_once, []

    def __call__(self, rows, version):
        self.calls.append([(e, sp["sampling_seed"], sp["max_new_tokens"], len(ids)) for e, ids, sp in rows])
        out = []
        for e, ids, sp in rows:
            if e in self.dead:
                out.append(ServerFailure(e, f"rollout server {URLS[e]}: connection refused"))
            elif self.abort_once:  # the first round: one token each, then aborted (a sync's abort)
                out.append((_tokens(sp["sampling_seed"], 1), [-0.5], "abort", version))
            else:
                out.append((_tokens(sp["sampling_seed"], sp["max_new_tokens"]), [-0.5] * sp["max_new_tokens"],
                            "stop", version))
        self.abort_once = False
        return out


def _controller(servers, urls=URLS) -> RolloutController:
    cfg = BufferConfig(train_batch_size=1, n=2, gen_batch_size=2, max_num_gen_batches=1)
    selector = SimpleNamespace(config=cfg, begin=lambda version: None)
    return RolloutController(selector, lambda: [], urls, SamplingParams(n=2, max_new_tokens=3, seed=5),
                             silence_timeout_s=1.0, version=4, policy_version=4, generate=servers)


PARAMS = SamplingParams(n=3, temperature=0.7, top_p=0.9, max_new_tokens=3, seed=1 + 7919 * 2)
PROMPTS = [[1, 2], [3], [4, 5, 6], [7], [8, 9]]


def _expected():
    return [[_tokens(sample_seed(PARAMS.seed, i, j)) for j in range(PARAMS.n)] for i in range(len(PROMPTS))]


def _validate(ctrl):
    ctrl.pause()
    try:
        out = ctrl.generate_validation(PROMPTS, PARAMS)
    finally:
        ctrl.resume()
    return [[list(c.response_ids) for c in comps] for comps in out]


def test_validation_rows_are_seeded_per_problem_and_response_and_dealt_by_problem():
    servers = _Servers()
    assert _validate(_controller(servers)) == _expected()
    (call,) = servers.calls  # one round, every server at once
    assert [e for e, *_ in call] == [i % 3 for i in range(len(PROMPTS)) for _ in range(PARAMS.n)]
    assert [seed for _, seed, *_ in call] == [sample_seed(PARAMS.seed, i, j) for i in range(len(PROMPTS))
                                              for j in range(PARAMS.n)]


def test_a_failed_server_leaves_dispatch_and_its_validation_rows_go_to_the_healthy_ones():
    servers = _Servers(dead={1})
    ctrl = _controller(servers)
    assert _validate(ctrl) == _expected()  # the same responses: seeded per row, not per server
    assert ctrl.client.health == ["healthy", "down", "healthy"] and "http://b" in ctrl.client.server_errors[1]
    assert ctrl.steps.fill.server_failures == 1
    first, second = servers.calls
    retried = [(seed, n) for e, seed, n, _ in first if e == 1]
    assert len(retried) == 2 * PARAMS.n  # problems 1 and 4
    assert sorted((seed, n) for _, seed, n, _ in second) == sorted(retried)
    assert {e for e, *_ in second} == {0, 2}
    # the next validation deals over the healthy servers only, in one round
    servers.calls.clear()
    assert _validate(ctrl) == _expected()
    assert len(servers.calls) == 1 and {e for e, *_ in servers.calls[0]} == {0, 2}


def test_no_healthy_server_fails_naming_every_server():
    ctrl = _controller(_Servers(dead={0, 1, 2}))
    with pytest.raises(RuntimeError, match="every rollout server failed") as err:
        _validate(ctrl)
    assert all(u in str(err.value) for u in URLS)
    assert ctrl.client.health == ["down"] * 3


def test_validation_needs_the_controller_paused():
    with pytest.raises(RuntimeError, match="paused"):
        _controller(_Servers()).generate_validation(PROMPTS, PARAMS)


def test_a_generation_batch_retries_a_failed_servers_rows_and_continues_aborted_ones():
    records = [SimpleNamespace(prompt_ids=[10 + g], index=g, data_source="d", ground_truth="1", extra_info={})
               for g in range(4)]
    positions = [8, 9, 10, 11]  # the batch's groups' seeds and numbers
    ref_ctrl = _controller(_Servers(), URLS[:2])
    ref, *_ = ref_ctrl._generate_batch(records, positions, 4)
    servers = _Servers(dead={1})
    groups, resubmitted, reprefilled, retried = _controller(servers, URLS[:2])._generate_batch(records, positions, 4)
    assert retried == 2 * 2 and resubmitted == reprefilled == 0  # groups 1 and 3 (server 1), 2 rows each
    assert [[s.response_ids for s in g.samples] for g in groups] == [[s.response_ids for s in g.samples] for g in ref]
    assert [[e for e, *_ in c] for c in servers.calls] == [[0, 0, 1, 1, 0, 0, 1, 1], [0, 0, 0, 0]]
    # aborted after one token: continued as prompt + that token, its own seed, the remaining budget
    servers = _Servers(abort_once=True)
    groups, resubmitted, reprefilled, retried = _controller(servers, URLS[:2])._generate_batch(records, positions, 4)
    assert (resubmitted, reprefilled, retried) == (8, 8, 0)
    first, second = servers.calls
    assert [(seed, n - 1, length + 1) for _, seed, n, length in first] == [(seed, n, length)
                                                                         for _, seed, n, length in second]
    for g in groups:
        for j, s in enumerate(g.samples):
            seed = sample_seed(5, g.group_id, j)
            assert s.response_ids == _tokens(seed, 1) + _tokens(seed, 2) and s.finish_reason == "stop"


def _async_rollout(ctrl, broadcast):
    """A BackgroundDriver on rank 0 around ``ctrl`` (no trainer): PROMPTS as the validation problems,
    each graded right when its text's first token id is even (the rollout's reward pool)."""
    from dapo_megatron.rollout.background import BackgroundDriver
    from dapo_megatron.rollout.validation import Validation

    rollout = SimpleNamespace(cfg=SimpleNamespace(rollout=SimpleNamespace(val_n=PARAMS.n)),
                              decode=lambda ids: " ".join(map(str, ids)),
                              reward_pool=SimpleNamespace(grade=lambda reqs: [{"acc": int(r[1].split()[0]) % 2 == 0}
                                                                              for r in reqs]))
    rollout.validation = Validation(rollout)
    rollout.validation.problems = lambda: [SimpleNamespace(prompt_ids=p, data_source="d", ground_truth="",
                                                           extra_info={}) for p in PROMPTS]
    rollout.validation.params = lambda step: PARAMS
    ar = BackgroundDriver.__new__(BackgroundDriver)
    ar.controller, ar.parallel, ar.rollout = ctrl, SimpleNamespace(broadcast_object=broadcast), rollout
    return ar


def test_async_validate_broadcasts_rank_0s_metrics_or_its_error_and_resumes_the_controller():
    from dapo_megatron.metrics import compute_val_metrics

    sent = []

    def broadcast(obj, group, src):
        assert (group, src) == ("wait", 0)  # the gloo generation-wait group: rank 0 may validate for hours
        sent.append(obj)
        return obj

    ctrl = _controller(_Servers(dead={1}))
    metrics = _async_rollout(ctrl, broadcast).validate(2)
    accs = [[1.0 if t[0] % 2 == 0 else 0.0 for t in problem] for problem in _expected()]
    assert metrics == compute_val_metrics(["d"] * len(PROMPTS), accs, k=PARAMS.n) and sent == [(metrics, None)]  # the metrics, no error
    assert ctrl._paused == 0 and ctrl.client.health[1] == "down"
    sent.clear()
    ctrl = _controller(_Servers(dead={0, 1, 2}))
    with pytest.raises(RuntimeError, match="every rollout server failed"):
        _async_rollout(ctrl, broadcast).validate(2)
    assert sent[0][0] is None and "every rollout server failed" in sent[0][1] and ctrl._paused == 0


def test_async_validate_hands_any_error_of_rank_0_to_every_rank():
    """A grader's ValueError (a data_source with no grader, say) is broadcast as the error too:
    no rank waits in the broadcast for metrics that never come."""
    sent = []

    def broadcast(obj, group, src):
        sent.append(obj)
        return obj

    ctrl = _controller(_Servers())
    ar = _async_rollout(ctrl, broadcast)
    ar.rollout.reward_pool = SimpleNamespace(grade=lambda reqs: (_ for _ in ()).throw(ValueError("no grader for 'd'")))
    with pytest.raises(RuntimeError, match=r"^ValueError: no grader for 'd'$"):
        ar.validate(2)
    assert sent == [(None, "ValueError: no grader for 'd'")] and ctrl._paused == 0
    # another rank (no controller) raises the same from the broadcast
    other = _async_rollout(None, lambda obj, group, src: sent[0])
    with pytest.raises(RuntimeError, match=r"^ValueError: no grader for 'd'$"):
        other.validate(2)


def test_validation_finishes_its_rows_on_a_controller_that_stopped_itself():
    """The thread stops itself at the cap (on_cap=error) while the trainer is still one step behind;
    a validation then still retries a failed server's rows instead of ending half done."""
    ctrl = _controller(_Servers(dead={1}))
    ctrl._stop = True
    assert _validate(ctrl) == _expected()


def test_a_failed_controller_is_not_checkpointed_and_every_rank_raises():
    """Its last request's prompts were drawn and never offered: a state saved then would skip them
    on resume. The save fails on every rank (a broadcast), before anything is written."""
    from dapo_megatron.rollout.background import BackgroundDriver

    ctrl = _controller(_Servers())
    ctrl._error = RuntimeError("every rollout server failed (rollout.server_urls): ...")
    ctrl.pause()
    with pytest.raises(RuntimeError, match=r"^the rollout controller failed \(every rollout server failed .*"
                                           r"its state is not saved"):
        ctrl.state_dict()
    ctrl.resume()
    sent = []
    ar = BackgroundDriver.__new__(BackgroundDriver)
    ar.controller, ar.streams = ctrl, []
    ar.parallel = SimpleNamespace(broadcast_object=lambda obj, group, src: sent.append(obj) or obj)
    with pytest.raises(RuntimeError, match=r"^the rollout controller failed \(every rollout server failed"):
        ar.state_dict()
    # only the outcome is broadcast (rank 0 alone writes the state), never the state itself
    assert len(sent) == 1 and sent[0][0] is None and sent[0][1].startswith("the rollout controller failed") \
        and ctrl._paused == 0
    other = BackgroundDriver.__new__(BackgroundDriver)
    other.controller, other.streams = None, []
    other.parallel = SimpleNamespace(broadcast_object=lambda obj, group, src: sent[0])
    with pytest.raises(RuntimeError, match=r"^the rollout controller failed \(every rollout server failed"):
        other.state_dict()


def test_the_async_parser_reads_a_row_aborted_after_its_stop_token_or_at_its_budget_as_finished():
    """``parse_versioned_row`` (the controller's) and ``parse_row_output`` (the streamed rows') are one rule
    (``sglang_io.row_outcome``): SGLang decodes an aborted row once more and sets the abort before
    its EOS / length checks, so an ``"abort"`` ending on a stop token is ``"stop"``, one at its budget
    ``"length"``; only the others are partial rows to continue (issue 36 item 8)."""
    from dapo_megatron.rollout.engines.engine import RowRequest
    from dapo_megatron.rollout.engines.sglang_io import parse_row_output, parse_versioned_row as _parse_row

    def out(ids, kind="abort"):
        return {"output_ids": ids, "meta_info": {"finish_reason": {"type": kind}, "weight_version": "3",
                                                 "output_token_logprobs": [[-0.5 - t, t, None] for t in ids]}}

    cases = [([5, 7, 2], 10, "stop"),  # the EOS (2) sampled in the abort's last step
             ([5, 7, 9], 10, "abort"),  # a partial row
             ([5, 7, 9], 3, "length"),  # the budget's last token sampled in that step
             ([], 10, "abort")]  # aborted in the waiting queue
    for ids, budget, kind in cases:
        assert _parse_row(out(ids), 0, 7, budget=budget, stop_ids=frozenset({2})) == (
            ids, [-0.5 - t for t in ids], kind, 3), (ids, budget)
        row = RowRequest("k", (1,), SamplingParams(max_new_tokens=budget + 2), 0, prefix_ids=(4, 4))
        assert parse_row_output(out(ids), row, 1, eos_token_ids=frozenset({2})).finish_reason == kind
    stop_row = {"max_new_tokens": 10, "stop_token_ids": [9]}  # the row's own stop tokens count too
    assert _parse_row(out([5, 9]), 0, 7, budget=stop_row["max_new_tokens"],
                      stop_ids=frozenset(stop_row["stop_token_ids"]))[2] == "stop"
    assert _parse_row(out([5, 7, 2], "stop"), 0, 7, budget=10)[2:] == ("stop", 3)
    assert _parse_row({**out([5]), "meta_info": {**out([5])["meta_info"], "weight_version": "default"}}, 0, 7,
                      budget=10)[3] == 7, "a server that reports no integer version: the fallback"
