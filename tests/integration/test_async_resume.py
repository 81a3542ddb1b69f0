"""async_training killed mid-step and resumed from its checkpoint: no prompt lost, none trained
twice, and what a resume with a lower η finds too stale is evicted and counted.

One real dapo-rollout-server, the tiny model of test_async_rollout. η = 1 with the weights
synced every 2 steps (``async_training.trigger_parameter_sync_step=2``, syncs of versions 0,
2): the controller fills the steps of policy versions 2 and 3 with the weights of version 2
and then waits (policy version 4 is not admitted before the sync of version 4), so what each
step trains does not depend on timing, and the checkpoint after step 2 (a sync was due: the
resumed servers hold what the uninterrupted ones did) holds two ready steps: policy version
2's, fresh, and 3's, its tokens one version behind.

FULL runs 4 steps; KILLED the same, saving every step, until ``os._exit`` inside step 3's
update (no cleanup, as under SIGKILL: the step taken from the ready queue is gone with the
process); RESUMED continues KILLED from its step-2 checkpoint; EVICT resumes a copy of that
checkpoint with η = 0 (and a sync every step). The same four runs again with streamed admission
and GRESO skipping (``STREAMED``): its queue, keep rate and skipper history come back too.
(Step 2's checkpoint already carries all of it: a sync was due, two steps are ready, the open
step is filling, and the skipper has seen prompts; killing later, in step 5 of 6 as before,
checked nothing more and cost 4 more steps per arm.) Each KILLED dies in its own process; FULL,
RESUMED and EVICT of both admissions run one after the other in one process (a process costs
more than a run), each from the state of a fresh process: torch's default generator reset to
its initial seed.
"""

import os
import shutil

import pytest
import torch

from dapo_megatron.platform import spawn
from integration.test_async_faults import _record
from integration.test_async_rollout import CONFIG
from rollout_server import forget_weight_update_groups

STEPS, KILL_IN_STEP = 4, 3
GEN_BATCH_SIZE = int(next(o for o in CONFIG if o.startswith("buffer.gen_batch_size=")).split("=")[1])
RESUME_CONFIG = [f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1", "async_training.enable=true"]
ETA1 = ["buffer.max_staleness=1", "async_training.trigger_parameter_sync_step=2"]
ETA0 = ["buffer.max_staleness=0", "async_training.trigger_parameter_sync_step=1"]
# streamed admission with GRESO skipping: 16 prompts in batches of 4 come back every 4 batches
STREAMED = ["rollout.streaming=true", "buffer.prompt_skip.enable=true", "buffer.prompt_skip.zero_variance_visits=1",
            "buffer.prompt_skip.skip_probability=0.5"]


def _worker(runs):
    """:func:`_run` for each ``args`` of ``runs``, one after the other in this process, each from
    torch's initial default generator (the state of a fresh process)."""
    seed = torch.initial_seed()
    for args in runs:
        torch.manual_seed(seed)
        _run(*args)
        forget_weight_update_groups()  # the next run forms groups of the same names


def _run(hf_dir, url, run_dir, extra, out_path, kill=False):
    """Train to step STEPS from run_dir's checkpoint (if any), saving after every step; ``kill``:
    before the step-2 save wait until the ready queue holds policy version 3's step, then
    ``os._exit(9)`` inside step 3's update."""
    import time

    from dapo_megatron.config import DAPOConfig, load_config
    from dapo_megatron.platform import init_distributed
    from dapo_megatron.trainer import DAPOTrainer

    cfg = load_config(DAPOConfig, None, CONFIG + RESUME_CONFIG + extra + [
        f"model.hf_path={hf_dir}", f"trainer.default_local_dir={run_dir}", f"rollout.server_urls=[{url}]"])
    trainer = DAPOTrainer(cfg, init_distributed(cfg.parallel, seed=cfg.trainer.seed))
    ctrl, out, collected = trainer.rollout.controller, {"start": trainer.step, "steps": {}}, {}
    real_collect, real_train = trainer.rollout.collect, trainer.actor.train_mini_batch

    def collect(step):
        batch = real_collect(step)
        collected["groups"] = batch.groups
        return batch

    def train_mini_batch(*args, **kwargs):
        if kill and trainer.step == KILL_IN_STEP - 1:
            os._exit(9)
        return real_train(*args, **kwargs)

    trainer.rollout.collect, trainer.actor.train_mini_batch = collect, train_mini_batch
    try:
        while trainer.step < STEPS:
            policy_version = trainer.step
            metrics = trainer.train_step()
            out["steps"][trainer.step] = {"policy_version": policy_version, "metrics": metrics,
                                          **_record(trainer, collected["groups"])}
            if trainer.step == KILL_IN_STEP and ctrl.steps.prompts is not None:
                # the controller now waits for the sync after step 4 (η = 1): its admission state is
                # settled, and a resumed run's must be the uninterrupted one's (restored, then the same)
                with ctrl._cv:
                    out["admission"] = {"skipper": ctrl.steps.skipper.state_dict(),
                                        "keep_rate": ctrl.steps.keep_rate.state_dict()}
            if kill and trainer.step == KILL_IN_STEP - 1:
                deadline = time.monotonic() + 120
                while not any(v == KILL_IN_STEP for v, _, _ in list(ctrl.steps.ready)):
                    assert time.monotonic() < deadline, f"the step of policy version {KILL_IN_STEP} never got ready"
                    time.sleep(0.05)
            trainer.save()
            torch.save(out, out_path)  # the steps so far: a killed run leaves them
    finally:
        trainer.rollout.close()


def _all_runs(hf_dir, url, roots: dict) -> dict:
    """Per admission (``roots``: name -> (run root, extra options on top of η = 1)): FULL, KILLED,
    RESUMED and EVICT, and the rollout state of KILLED's checkpoint. The KILLED runs first, each in
    its own process; then every other run in one process."""
    for root, extra in roots.values():
        with pytest.raises(Exception, match="exit code 9|exitcode 9|exited with exit code"):
            spawn(_worker, 1, [(hf_dir, url, str(root / "KILLED"), ETA1 + extra, str(root / "KILLED.pt"), True)])
        shutil.copytree(root / "KILLED", root / "EVICT")
    rest = []
    for root, extra in roots.values():
        rest += [(hf_dir, url, str(root / "FULL"), ETA1 + extra, str(root / "FULL.pt")),
                 (hf_dir, url, str(root / "KILLED"), ETA1 + extra, str(root / "RESUMED.pt")),
                 (hf_dir, url, str(root / "EVICT"), ETA0 + extra, str(root / "EVICT.pt"))]
    spawn(_worker, 1, rest)
    out = {}
    for arms, (root, _) in roots.items():
        ckpt = os.path.join(root, "KILLED", "checkpoints", f"step_{KILL_IN_STEP - 1}")
        out[arms] = {"ckpt_state": torch.load(os.path.join(ckpt, "trainer_state.pt"),
                                              weights_only=False)["components"]["rollout"]}  # Checkpointer's layout 2
        for name in ("FULL", "KILLED", "RESUMED", "EVICT"):
            out[arms][name] = torch.load(root / f"{name}.pt", weights_only=False)
    return out


@pytest.fixture(scope="module")
def server(tiny_async_hf_dir, tiny_async_server):
    """The session's tiny model and its shared server (conftest): every run's first sync rewrites
    the weights an earlier module left there."""
    return tiny_async_hf_dir, tiny_async_server


@pytest.fixture(scope="module")
def all_runs(server, tmp_path_factory):
    hf_dir, srv = server
    return _all_runs(hf_dir, srv.url, {"runs": (tmp_path_factory.mktemp("batch"), []),
                                       "streamed_runs": (tmp_path_factory.mktemp("streamed"), STREAMED)})


@pytest.fixture(scope="module")
def runs(all_runs):
    return all_runs["runs"]


@pytest.fixture(scope="module")
def streamed_runs(all_runs):
    return all_runs["streamed_runs"]


def _seeds(steps: dict) -> list[int]:
    return [seed for k in sorted(steps) for seed in steps[k]["seeds"]]


def test_the_checkpoint_holds_a_fresh_and_a_stale_ready_step(runs):
    state = runs["ckpt_state"]["async_rollout"]
    assert sorted(runs["KILLED"]["steps"]) == [1, 2]  # step 3 never finished
    assert [r["version"] for r in state["ready"]] == [2, 3] and state["fill"]["version"] == 4
    versions = {v for r in state["ready"] for g in r["groups"] for s in g["samples"] for _, v in s["versions"]}
    assert versions == {2}


@pytest.mark.parametrize("arms", ["runs", "streamed_runs"])
def test_the_resumed_run_trains_the_uninterrupted_runs_prompts_each_once(arms, request):
    runs = request.getfixturevalue(arms)
    full, killed, resumed = runs["FULL"]["steps"], runs["KILLED"]["steps"], runs["RESUMED"]["steps"]
    assert runs["RESUMED"]["start"] == KILL_IN_STEP - 1 and sorted(resumed) == [3, 4]
    done = {**{k: killed[k] for k in (1, 2)}, **resumed}
    assert sorted(full) == sorted(done) == [1, 2, 3, 4]
    # count them: the same prompts step by step, none twice
    assert _seeds(done) == _seeds(full) and len(set(_seeds(full))) == len(_seeds(full)) >= STEPS
    for k in full:
        assert done[k]["tokens"] == full[k]["tokens"], k
        assert done[k]["logprobs"] == full[k]["logprobs"], k
        for key in ("rollout/num_gen_batches", "rollout/dropped_stale", "rollout/surplus_in", "actor/pg_loss",
                    "train/staleness_max") + (("rollout/skipped_prompts", "rollout/prompts_submitted",
                                               "rollout/keep_rate") if arms == "streamed_runs" else ()):
            assert done[k]["metrics"][key] == full[k]["metrics"][key], (k, key)
    if arms == "streamed_runs":  # the skipper's history and the keep rate came back: after step 3 they are FULL's
        assert runs["RESUMED"]["admission"] == runs["FULL"]["admission"]
        assert runs["FULL"]["admission"]["skipper"]["encounters"]
    # the scenario: steps 3 and 4 train on the weights of version 2 (one version stale at step 4)
    assert [full[k]["metrics"]["train/staleness_max"] for k in sorted(full)] == [0, 1, 0, 1]


@pytest.mark.parametrize("arms", ["runs", "streamed_runs"])
def test_a_resume_with_a_lower_eta_evicts_and_counts_the_too_stale_groups(arms, request):
    runs = request.getfixturevalue(arms)
    state, evict, full = runs["ckpt_state"]["async_rollout"], runs["EVICT"]["steps"], runs["FULL"]["steps"]
    assert runs["EVICT"]["start"] == KILL_IN_STEP - 1 and sorted(evict) == [3, 4]
    # independently: every carried group (ready steps, the open step's kept and surplus) with a
    # token sampled before the policy version of the step it was kept for
    carried = ([(r["version"], g) for r in state["ready"] for g in r["groups"]]
               + [(state["fill"]["version"], g) for g in state["fill"]["kept"] + state["fill"]["surplus"]["surplus"]])
    stale = [g["prompt_seed"] for p, g in carried if min(v for s in g["samples"] for _, v in s["versions"]) < p]
    assert stale, "nothing in the checkpoint is stale at eta=0: the test would test nothing"
    # step 3 trains the fresh ready step as it was; step 4's is filled again without the evicted groups
    assert evict[3]["seeds"] == full[3]["seeds"] and evict[3]["tokens"] == full[3]["tokens"]
    m4 = evict[4]["metrics"]
    assert m4["rollout/evicted_on_resume"] == len(stale) and m4["rollout/dropped_stale"] == 0
    assert evict[3]["metrics"]["rollout/evicted_on_resume"] == 0
    assert all(evict[k]["metrics"]["train/staleness_max"] == 0 for k in evict)
    for k in evict:
        for per_sample in evict[k]["token_versions"]:
            assert all(v == evict[k]["policy_version"] for vs in per_sample for v in vs)
    # no prompt twice: what steps 5, 6 train is neither trained before the checkpoint nor evicted
    before = _seeds({k: runs["KILLED"]["steps"][k] for k in (1, 2)})
    after = _seeds(evict)
    assert len(set(after)) == len(after) and not set(after) & (set(before) | set(stale))


def test_the_streamed_checkpoint_holds_the_skippers_history_and_the_keep_rate(streamed_runs):
    """Streamed admission under async: the checkpoint carries the prompt queue, the keep rate and
    GRESO's per-prompt history (the resumed run above skips exactly as the uninterrupted one),
    and skipping happened in the run (the test would test nothing otherwise)."""
    adm = streamed_runs["ckpt_state"]["async_rollout"]["admission"]
    assert adm["prompts"]["fetched"] >= 1 and adm["keep_rate"]["graded"] > 0
    assert adm["skipper"]["encounters"] and adm["skipper"]["streak"]
    full = streamed_runs["FULL"]["steps"]
    assert sum(full[k]["metrics"]["rollout/skipped_prompts"] for k in full) >= 1
    # every encounter of the skipper is a prompt drawn from the queue, trained, dropped or skipped
    drawn = sum(n for _, n in adm["skipper"]["encounters"])
    assert drawn == adm["prompts"]["fetched"] * GEN_BATCH_SIZE - len(adm["prompts"]["leftover"])
