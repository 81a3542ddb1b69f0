"""Validation under async_training on real dapo-rollout-servers: rank 0's controller generates the
problems over HTTP on its healthy servers (RolloutController.generate_validation) with the
seeds and sampling parameters of synchronous server-mode validation, so its metrics are
synchronous server mode's exactly, with two healthy servers and with one SIGKILLed before
validation (its rows retried on the other, the server marked down).

Three runs of one step, validating at step 0 (after the first sync) and at step 1, world of one
on CPU, test_async_rollout's tiny model and config with η = 0 (so the async run trains the
synchronous run's samples and the weights at step 1 are the same): S (synchronous server
mode on server A), AV (async on A and B), AH (async on A and B, B SIGSTOPped for the validation
of step 0: its request times out; no training) and AK (async on A and B, A SIGKILLed before the
validation of step 1), each fault with the controller paused so no rollout request meets it first;
and AV2, async on A and B with two trainer ranks (DP 2), validating at step 0: rank 0 generates
and grades, rank 1 gets the same metrics by broadcast. A process costs more than an arm: AV2 runs
first in its world of two, then S, AV, AH and AK one after the other in ONE world of one (a new
trainer per arm, each closed before the next; AK last: it kills A).
Server 0 is the one killed: before, async validation went through synchronous validation,
whose world of one drives server 0 only, so that is the fault that failed it.

The tiny random model never answers an arithmetic problem right, so every ``acc`` would be 0 and
equal metrics would prove nothing: during validation the worker replaces each grade's ``acc``
with a parity of a hash of the graded text (deterministic, changed by any token), and records
the texts, so equal metrics and equal texts mean equal responses.
"""

import hashlib
import os
import signal

import pytest
import torch

from dapo_megatron.platform import spawn
from integration.test_async_rollout import CONFIG
from rollout_server import RolloutServer, forget_weight_update_groups

VAL_CONFIG = ["trainer.total_training_steps=1", "buffer.max_staleness=0", "data.arithmetic.num_val_problems=4",
              "rollout.val_max_prompts=3", "rollout.val_n=4", "rollout.val_temperature=1.0",
              "rollout.server_silence_timeout_s=20", "rollout.server_timeout_s=20"]
ASYNC = ["async_training.enable=true"]
HANG_TIMEOUT_S = 4  # rollout.server_silence_timeout_s of the run whose server hangs...
HANG_HEALTH_TIMEOUT_S = 5  # ...and its server_timeout_s (the /health after the silence waits it out too)


def _acc(text: str) -> bool:
    return hashlib.blake2b(text.encode(), digest_size=1).digest()[0] % 2 == 0


def _arm(hf_dir, urls, run_dir, extra, out_path, fault=None, pid=None):
    """Validate at step 0, train one step, validate at step 1. ``fault`` (with the controller
    paused, so no rollout request meets it first): "kill" SIGKILLs server ``pid`` before the
    validation of step 1; "hang" SIGSTOPs it for the validation of step 0 (then SIGCONT, and no
    training); "once": the validation of step 0 only. Every rank writes ``out_path.<rank>``: per
    validation its metrics, graded texts and the servers its requests went to (per call, per
    row: server, failed), and rank 0 the controller's view of its servers."""
    from dapo_megatron.config import DAPOConfig, load_config
    from dapo_megatron.platform import init_distributed
    from dapo_megatron.trainer import DAPOTrainer

    cfg = load_config(DAPOConfig, None, CONFIG + VAL_CONFIG + extra + [
        f"model.hf_path={hf_dir}", f"trainer.default_local_dir={run_dir}", f"rollout.server_urls=[{','.join(urls)}]"])
    trainer = DAPOTrainer(cfg, init_distributed(cfg.parallel, seed=cfg.trainer.seed))
    rollout, ctrl = trainer.rollout, getattr(trainer.rollout, "controller", None)
    out, current = {"val": {}}, {}
    real_grade = rollout.reward_pool.grade

    def grade(requests):
        results = real_grade(requests)
        if "texts" not in current:
            return results
        current["texts"] += [r[1] for r in requests]
        return [dict(res, acc=_acc(r[1])) for res, r in zip(results, requests)]

    rollout.reward_pool.grade = grade
    if ctrl is not None:
        real_generate = ctrl._generate

        def generate(rows, version):
            results = real_generate(rows, version)
            if "texts" in current:
                current["calls"].append([(e, not isinstance(r, tuple)) for (e, _, _), r in zip(rows, results)])
            return results

        ctrl._generate = generate

    def validate(sig=None):  # the controller paused: no rollout grade is taken for validation's
        if ctrl is not None:
            ctrl.pause()
        try:
            if sig is not None:
                os.kill(pid, sig)
            current.update(texts=[], calls=[])
            metrics = trainer.validate()
            out["val"][trainer.step] = {"metrics": metrics, "texts": current.pop("texts"),
                                        "calls": current.pop("calls")}
        finally:
            if ctrl is not None:
                ctrl.resume()

    out["error"] = None
    try:
        validate(signal.SIGSTOP if fault == "hang" else None)
        if fault == "hang":
            os.kill(pid, signal.SIGCONT)
        elif fault != "once":
            trainer.train_step()
            validate(signal.SIGKILL if fault == "kill" else None)
    except RuntimeError as err:  # a failed validation: the tests show it
        out["error"] = str(err)
    finally:
        if ctrl is not None:
            out["health"], out["server_errors"] = list(ctrl.client.health), list(ctrl.client.server_errors)
            out["server_failures"] = ctrl.steps.fill.server_failures
        trainer.rollout.close()
    torch.save(out, f"{out_path}.{trainer.rank}")


def _worker(arms):
    """:func:`_arm` for each ``args`` of ``arms``, one after the other in this world."""
    seed = torch.initial_seed()
    for args in arms:
        torch.manual_seed(seed)  # each arm from torch's initial default generator, as in a fresh process
        _arm(*args)
        forget_weight_update_groups()  # the next arm forms groups of the same names


@pytest.fixture(scope="module")
def runs(tiny_async_hf_dir, tmp_path_factory, request):
    """A: this module's own server (server 0, SIGKILLed by AK); B: the session's shared one on the
    tiny model (conftest), SIGSTOPped for AH's validation and continued."""
    root = tmp_path_factory.mktemp("async_validate")
    hf_dir = tiny_async_hf_dir
    own = RolloutServer(hf_dir, root / "A.log", wait=False)
    servers = {"A": own, "B": None}
    out = {"servers": servers}
    try:
        servers["B"] = request.getfixturevalue("tiny_async_server")  # starts while A loads
        own.wait_ready()
        a, b = servers["A"], servers["B"]
        arms = {"S": ([a], [], None, None), "AV": ([a, b], ASYNC, None, None),
                "AH": ([a, b], ASYNC + [f"rollout.server_silence_timeout_s={HANG_TIMEOUT_S}",
                                       f"rollout.server_timeout_s={HANG_HEALTH_TIMEOUT_S}"], "hang", b),
                "AV2": ([a, b], ASYNC, "once", None), "AK": ([a, b], ASYNC, "kill", a)}
        args = {name: (hf_dir, [s.url for s in pair], str(root / name), extra, str(root / f"{name}.pt"), fault,
                       victim.process.pid if victim is not None else None)
                for name, (pair, extra, fault, victim) in arms.items()}
        spawn(_worker, 2, [args["AV2"]])
        spawn(_worker, 1, [args[name] for name in ("S", "AV", "AH", "AK")])  # AK last: it kills A
        for name in arms:
            out[name] = torch.load(root / f"{name}.pt.0", weights_only=False)
        out["AV2_rank1"] = torch.load(root / "AV2.pt.1", weights_only=False)
        out["A_returncode"] = a.process.poll()
    finally:
        if servers["B"] is not None and servers["B"].process.poll() is None:
            os.kill(servers["B"].process.pid, signal.SIGCONT)  # a failed AH may have left it stopped
        own.stop()
    return out


def test_the_reference_validation_is_not_trivial(runs):
    assert [runs[arm]["error"] for arm in ("S", "AV", "AH", "AV2", "AV2_rank1", "AK")] == [None] * 6
    for step, v in runs["S"]["val"].items():
        m = v["metrics"]
        assert m["val/num_prompts"] == 3 and len(v["texts"]) == 3 * 4, (step, m)
        assert 0 < m["val/avg@4"] < 1, (step, m)  # some responses graded right, some wrong
    assert runs["S"]["val"][0]["texts"] != runs["S"]["val"][1]["texts"]  # new seeds (and weights) at step 1


@pytest.mark.parametrize("step", [0, 1])
def test_async_validation_on_two_healthy_servers_is_synchronous_server_modes(runs, step):
    s, av = runs["S"]["val"][step], runs["AV"]["val"][step]
    assert av["metrics"] == s["metrics"], (step, av["metrics"], s["metrics"])
    assert av["texts"] == s["texts"]
    (call,) = av["calls"]  # one round, both servers: problems 0 and 2 on A, problem 1 on B
    assert [e for e, _ in call] == [0] * 4 + [1] * 4 + [0] * 4 and not any(f for _, f in call)
    assert runs["AV"]["health"] == ["healthy", "healthy"] and runs["AV"]["server_failures"] == 0


def test_server_0_killed_before_validation_is_marked_down_and_its_rows_retried_on_the_other(runs):
    ak, url_a = runs["AK"], runs["servers"]["A"].url
    assert ak["error"] is None, ak["error"]
    assert runs["A_returncode"] == -signal.SIGKILL
    assert ak["val"][0]["metrics"] == runs["S"]["val"][0]["metrics"]  # both healthy at step 0
    v, s = ak["val"][1], runs["S"]["val"][1]
    first, second = v["calls"]
    assert first == [(0, True)] * 4 + [(1, False)] * 4 + [(0, True)] * 4  # problems 0 and 2 failed on A...
    assert second == [(1, False)] * 8  # ...and were sent again to B
    assert v["metrics"] == s["metrics"] and v["texts"] == s["texts"]
    assert ak["health"] == ["down", "healthy"] and url_a in ak["server_errors"][0]
    assert ak["server_failures"] == 1


def test_a_server_that_hangs_past_the_timeout_is_marked_down_and_its_rows_retried(runs):
    ah, url_b = runs["AH"], runs["servers"]["B"].url
    v = ah["val"][0]
    first, second = v["calls"]
    assert first == [(0, False)] * 4 + [(1, True)] * 4 + [(0, False)] * 4  # problem 1 timed out on B...
    assert second == [(0, False)] * 4  # ...and went to A
    assert v["metrics"] == runs["S"]["val"][0]["metrics"] and v["texts"] == runs["S"]["val"][0]["texts"]
    assert ah["health"] == ["healthy", "down"] and ah["server_failures"] == 1
    error = ah["server_errors"][1]  # silent (SIGSTOP) past the bound; its /health does not answer either
    assert f"{url_b}/generate: no bytes for" in error and f"rollout.server_silence_timeout_s={HANG_TIMEOUT_S:g})" in error
    assert f"{url_b}/health did not answer" in error


def test_every_rank_returns_rank_0s_validation_metrics(runs):
    r0, r1, ref = runs["AV2"]["val"][0], runs["AV2_rank1"]["val"][0], runs["S"]["val"][0]
    assert r0["metrics"] == ref["metrics"] and r0["texts"] == ref["texts"]
    assert r1["metrics"] == r0["metrics"] and r1["texts"] == [] and "health" not in runs["AV2_rank1"]
