"""async_training on two real dapo-rollout-servers, with real faults: a server SIGKILLed with a
``/generate`` in flight, a server that hangs (SIGSTOP) past the request timeout and comes back
(SIGCONT), and a server SIGKILLed inside a weight sync (the run stops naming it, and resumes
from its last checkpoint on the server left).

η = 0 (``buffer.max_staleness=0``): the asynchronous run makes synchronous server mode's
requests, and every response is seeded by its prompt's global position and its index, so a
row retried on the other server draws the tokens it would have drawn where it was first sent
(both servers hold the same weights). Each faulty run must therefore train exactly the
prompts and tokens of the fault-free run REF, step by step: none lost, none trained twice.
Logprobs may differ in the last bits (another batch around the row), so they are compared to
1e-5.

The tiny model (test_async_rollout's) stops at about one token in three and
``buffer.filter_metric=reward`` keeps some groups and drops others.
"""

import os
import signal
import threading
import time

import pytest
import torch

from dapo_megatron.platform import spawn
from integration.test_async_rollout import CONFIG
from rollout_server import RolloutServer, forget_weight_update_groups, log_calls

STEPS = 3
TIMEOUT_S = 10  # rollout.server_silence_timeout_s and rollout.server_timeout_s of the runs but HANG...
# ...whose run waits out both bounds three times (the silent /generate, the /health after it, the
# /health before the next sync): shorter there (a healthy server answers /health in milliseconds)
HANG_TIMEOUT_S, HANG_HEALTH_TIMEOUT_S = 4, 5
FAULT_CONFIG = ["buffer.max_staleness=0", "async_training.enable=true", "trainer.save_freq=1"]


def _timeouts(fault) -> list[str]:
    silence, health = (HANG_TIMEOUT_S, HANG_HEALTH_TIMEOUT_S) if fault == "hang" else (TIMEOUT_S, TIMEOUT_S)
    return [f"rollout.server_silence_timeout_s={silence}", f"rollout.server_timeout_s={health}"]


def _record(trainer, groups) -> dict:
    """A trained step as the test compares it: per group its prompt seed (its global position
    in the run: one prompt drawn once) and per response the tokens, versions and logprobs."""
    return {"seeds": [g.prompt_seed for g in groups],
            "tokens": [[(s.response_ids, s.versions, s.finish_reason) for s in g.samples] for g in groups],
            "token_versions": [[s.token_versions() for s in g.samples] for g in groups],
            "logprobs": [[s.rollout_logprobs for s in g.samples] for g in groups]}


def _arm(hf_dir, urls, run_dir, out_path, fault, pids, logs=()):
    """Train to step STEPS (resuming from run_dir's checkpoint if there is one), saving after
    every step; ``fault``: None, "kill" (SIGKILL server 1 with its /generate of step 2 in flight),
    "hang" (SIGSTOP server 1 for step 1's /generate, SIGCONT after step 1) or "die_in_sync"
    (SIGKILL server 1 inside the weight sync of version 2). Writes the steps, the controller's
    view of its servers, the error that stopped the run, and the calls each server of ``logs``
    (log paths) answered so far."""
    from dapo_megatron.config import DAPOConfig, load_config
    from dapo_megatron.platform import init_distributed
    from dapo_megatron.bridge import servers
    from dapo_megatron.trainer import DAPOTrainer

    cfg = load_config(DAPOConfig, None, CONFIG + FAULT_CONFIG + _timeouts(fault) + [
        f"model.hf_path={hf_dir}", f"trainer.default_local_dir={run_dir}",
        f"rollout.server_urls=[{','.join(urls)}]"])
    trainer = DAPOTrainer(cfg, init_distributed(cfg.parallel, seed=cfg.trainer.seed))
    ctrl, out = trainer.rollout.controller, {"start": trainer.step, "steps": {}, "error": None, "fault_at": None}
    real_generate, real_collect = ctrl._generate, trainer.rollout.collect
    collected = {}

    def collect(step):
        batch = real_collect(step)
        collected["groups"] = batch.groups
        return batch

    def generate(rows, version):
        if out["fault_at"] is None and any(e == 1 for e, _, _ in rows):
            if fault == "kill" and trainer.step == 1:
                os.kill(pids[1], signal.SIGSTOP)  # the request reaches its socket and waits there
                threading.Timer(1.0, os.kill, (pids[1], signal.SIGKILL)).start()
                out["fault_at"] = time.monotonic()
            elif fault == "hang" and trainer.step == 0:
                os.kill(pids[1], signal.SIGSTOP)
                out["fault_at"] = time.monotonic()
        t0 = time.monotonic()
        res = real_generate(rows, version)
        failed = [r for r in res if not isinstance(r, tuple)]
        if failed:
            out.setdefault("failures", []).append((failed[0].server, failed[0].message, time.monotonic() - t0))
        return res

    real_pause, pauses = servers.pause_servers, [0]

    def pause_servers(urls_, timeout_s):
        real_pause(urls_, timeout_s)
        pauses[0] += 1
        if fault == "die_in_sync" and trainer.step == 2 and out["fault_at"] is None:
            os.kill(pids[1], signal.SIGKILL)  # paused, about to receive the weights of version 2
            out["fault_at"] = time.monotonic()

    ctrl._generate, trainer.rollout.collect, servers.pause_servers = generate, collect, pause_servers
    try:
        while trainer.step < STEPS:
            policy_version = trainer.step
            metrics = trainer.train_step()
            out["steps"][trainer.step] = {"policy_version": policy_version, "metrics": metrics,
                                          **_record(trainer, collected["groups"])}
            trainer.save()
            if fault == "hang" and trainer.step == 1:
                os.kill(pids[1], signal.SIGCONT)
    except RuntimeError as err:
        out["error"] = str(err)
    finally:
        servers.pause_servers = real_pause  # the next arm of this process gets the real one
        out["health"], out["server_errors"] = list(ctrl.client.health), list(ctrl.client.server_errors)
        trainer.rollout.close()
        out["calls"] = [log_calls(open(path).read()) for path in logs]
        torch.save(out, out_path)


def _worker(arms):
    """:func:`_arm` for each ``args`` of ``arms``, one after the other in this world of one (a
    process costs more than an arm; each arm's trainer is closed before the next starts)."""
    seed = torch.initial_seed()
    for args in arms:
        torch.manual_seed(seed)  # each arm from torch's initial default generator, as in a fresh process
        _arm(*args)
        forget_weight_update_groups()  # the next arm forms groups of the same names


@pytest.fixture(scope="module")
def runs(tiny_async_hf_dir, tmp_path_factory, request):
    """A: the session's shared server on the tiny model (conftest; it is never faulted here);
    B and C: this module's own, the ones killed and stopped."""
    root = tmp_path_factory.mktemp("async_faults")
    hf_dir = tiny_async_hf_dir
    victims = {name: RolloutServer(hf_dir, root / f"{name}.log", wait=False) for name in ("B", "C")}
    servers = {"A": None, **victims}
    out = {"servers": servers}
    try:
        servers["A"] = request.getfixturevalue("tiny_async_server")  # starts while B and C load
        for s in victims.values():
            s.wait_ready()
        a, b, c = servers["A"], servers["B"], servers["C"]
        arms = {"REF": ([a, b], None), "KILL": ([a, b], "kill"), "HANG": ([a, c], "hang"),
                "DIE": ([a, c], "die_in_sync")}
        todo = [(hf_dir, [s.url for s in pair], str(root / name), str(root / f"{name}.pt"), fault,
                 [s.process.pid for s in pair], [c.log_path] if name == "HANG" else ())
                for name, (pair, fault) in arms.items()]
        # the run DIE stopped at the sync of version 2: resume it from its step-1 checkpoint on A alone
        todo.append((hf_dir, [a.url], str(root / "DIE"), str(root / "DIE_resumed.pt"), None, [a.process.pid]))
        spawn(_worker, 1, todo)
        for name in [*arms, "DIE_resumed"]:
            out[name] = torch.load(root / f"{name}.pt", weights_only=False)
        out["C_calls"] = out["HANG"]["calls"][0]  # C's calls up to the end of HANG (DIE uses C next)
        out["C_returncode"], out["B_returncode"] = c.process.poll(), b.process.poll()
    finally:
        for s in victims.values():
            s.stop()
    return out


def _same_training(ref_steps: dict, steps: dict) -> None:
    """The same prompts (seeds), tokens, versions and finish reasons at every step; logprobs to 1e-5."""
    assert sorted(steps) == sorted(ref_steps), (sorted(steps), sorted(ref_steps))
    for k in ref_steps:
        x, y = ref_steps[k], steps[k]
        assert x["seeds"] == y["seeds"], (k, x["seeds"], y["seeds"])
        assert x["tokens"] == y["tokens"], f"step {k}: tokens differ"
        for lx, ly in zip(x["logprobs"], y["logprobs"]):
            for a, b in zip(lx, ly):
                assert a == pytest.approx(b, abs=1e-5), k


def _all_seeds(*runs_steps) -> list[int]:
    return [seed for steps in runs_steps for k in sorted(steps) for seed in steps[k]["seeds"]]


def test_reference_uses_both_servers_and_dynamic_sampling(runs):
    ref = runs["REF"]
    assert ref["error"] is None and sorted(ref["steps"]) == [1, 2, 3]
    assert sum(st["metrics"]["rollout/num_gen_batches"] for st in ref["steps"].values()) > STEPS
    assert all(st["metrics"]["rollout/healthy_servers"] == 2 and st["metrics"]["rollout/retried_rows"] == 0
               for st in ref["steps"].values())
    for name in ("A", "B"):  # both served rows (A: every run's; B: REF's and KILL's step 1 only)
        assert "POST /generate" in runs["servers"][name].calls(), name


def test_a_server_killed_with_its_request_in_flight_leaves_its_rows_to_the_other(runs):
    kill, url_b = runs["KILL"], runs["servers"]["B"].url
    assert kill["error"] is None, kill["error"]
    assert runs["B_returncode"] == -signal.SIGKILL
    server, message, waited = kill["failures"][0]
    assert server == 1 and url_b in message and waited >= 0.9, kill["failures"]  # in flight until the kill
    assert kill["health"] == ["healthy", "down"] and url_b in kill["server_errors"][1]
    m = {k: st["metrics"] for k, st in kill["steps"].items()}
    assert m[1]["rollout/healthy_servers"] == 2 and m[1]["rollout/server_failures"] == 0
    assert m[2]["rollout/server_failures"] == 1 and m[2]["rollout/retried_rows"] > 0
    assert m[2]["rollout/healthy_servers"] == m[3]["rollout/healthy_servers"] == 1
    _same_training(runs["REF"]["steps"], kill["steps"])


def test_a_hung_server_times_out_and_is_synced_before_it_gets_work_again(runs):
    hang, url_c = runs["HANG"], runs["servers"]["C"].url
    assert hang["error"] is None, hang["error"]
    server, message, waited = hang["failures"][0]
    assert server == 1 and f"rollout.server_silence_timeout_s={HANG_TIMEOUT_S:g})" in message and url_c in message
    assert f"{url_c}/generate: no bytes for" in message and "/health" in message
    assert waited >= HANG_TIMEOUT_S - 0.5
    m = {k: st["metrics"] for k, st in hang["steps"].items()}
    assert m[1]["rollout/retried_rows"] > 0 and m[1]["rollout/server_failures"] == 1
    assert m[2]["rollout/healthy_servers"] == 1  # excluded from the sync of version 1 (/health timed out)
    assert m[3]["rollout/healthy_servers"] == 2 and hang["health"] == ["healthy", "healthy"]
    # C's calls after it came back: a new weight-update group and the weights of version 2 first, then work
    # (uvicorn logs a call when it answers: the /generate that hung is not logged, its client had gone)
    calls = runs["C_calls"]
    joins = [i for i, c in enumerate(calls) if c == "POST /init_weights_update_group"]
    assert len(joins) == 2, calls  # at the start, and again for the sync of version 2
    after = calls[joins[1]:]
    assert "POST /update_weights_from_distributed" in after and "POST /generate" in after
    assert after.index("POST /update_weights_from_distributed") < after.index("POST /generate"), after
    _same_training(runs["REF"]["steps"], hang["steps"])


def test_a_server_killed_in_a_weight_sync_stops_the_run_naming_it_and_resume_loses_no_prompt(runs):
    die, resumed, url_c = runs["DIE"], runs["DIE_resumed"], runs["servers"]["C"].url
    assert runs["C_returncode"] == -signal.SIGKILL
    print("DIE stopped with:", die["error"])
    assert die["error"] is not None and url_c in die["error"], die["error"]
    assert sorted(die["steps"]) == [1]  # step 2 failed in its sync (of version 2): no checkpoint 2
    assert resumed["error"] is None and resumed["start"] == 1 and sorted(resumed["steps"]) == [2, 3]
    # count the prompts: the trained ones are REF's, each exactly once
    done = {1: die["steps"][1], **resumed["steps"]}
    ref_seeds = _all_seeds(runs["REF"]["steps"])
    assert _all_seeds(done) == ref_seeds and len(set(ref_seeds)) == len(ref_seeds)
    _same_training(runs["REF"]["steps"], done)


@pytest.mark.parametrize("arm", ["REF", "KILL", "HANG", "DIE_resumed"])
def test_every_token_is_within_the_staleness_bound_and_spans_ascend(runs, arm):
    for k, st in runs[arm]["steps"].items():
        p = st["policy_version"]
        assert st["metrics"]["train/staleness_max"] <= 0, (arm, k)
        for group_tokens, group_versions in zip(st["tokens"], st["token_versions"]):
            for (ids, versions, _), per_token in zip(group_tokens, group_versions):
                starts = [a for a, _ in versions]
                assert starts[0] == 0 and starts == sorted(set(starts)), versions
                assert len(per_token) == len(ids) and all(v == p for v in per_token), (arm, k, versions)
