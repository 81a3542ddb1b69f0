"""async_training on a real dapo-rollout-server: η = 0 is synchronous server mode bit for bit, and
at η = 1 every trained token is within the bound.

World of one on CPU (gloo), a tiny random Llama with SmolLM2's tokenizer served by one
``dapo-rollout-server`` process; the trainer in ``rollout.mode=server``. The model stops at any
of 16,384 token ids (about one token in three, as in test_trainer_streaming_resume), so
responses end at varied lengths and ``buffer.filter_metric=reward`` (soft overlong shaping)
keeps some groups and drops others: dynamic sampling asks for more than one generation batch.

S (synchronous server mode), A0 (async, η = 0) and A1 (async, η = 1) each run 3 steps against
the same server (each run's first sync overwrites every weight the last one left there).
"""


import pytest
import torch

from dapo_megatron.platform import spawn
from rollout_server import RolloutServer, tiny_async_model

STEPS = 3
CONFIG = [
    f"trainer.total_training_steps={STEPS}", "trainer.test_freq=-1", "trainer.val_before_train=false",
    "trainer.save_freq=-1",
    "buffer.train_batch_size=2", "buffer.n=2", "buffer.gen_batch_size=4", "buffer.max_num_gen_batches=4",
    "buffer.on_cap=train_on_kept", "buffer.filter_metric=reward",
    "actor.ppo_mini_batch_size=1", "actor.ppo_max_token_len_per_gpu=512", "actor.optim.lr=1e-3",
    "actor.optim.lr_warmup_steps=0",
    "rollout.response_length=8", "buffer.overlong.max_response_length=8", "buffer.overlong.overlong_buffer_len=4",
    "rollout.name=sglang", "rollout.mode=server", "rollout.server_timeout_s=60",
    "data.arithmetic.num_train_problems=16", "data.arithmetic.num_val_problems=2", "model.params_dtype=float32",
    "model.transformer_impl=local", "reward.num_workers=1", "tracking.use_mlflow=false",
]
NUM_STOP_IDS = 16384

def _sync_lands_in_flight(rollout):
    """Each weight sync after the first waits until the controller has a /generate in flight, so
    the sync's /pause_generation (abort) interrupts it: the interruption, not its timing, is tested."""
    import threading

    ctrl, started = rollout.controller, threading.Event()
    real_generate, real_sync = ctrl._generate, rollout.sync_weights

    def generate(rows, version):
        started.set()
        return real_generate(rows, version)

    def sync_weights(actor, version):
        if rollout.background.started:
            assert started.wait(60), "no generation in flight"
        started.clear()
        return real_sync(actor, version)

    ctrl._generate, rollout.sync_weights = generate, sync_weights


def _run_worker(hf_dir, url, run_dir, extra, out_path, interrupt=False):
    """3 steps; per step the trained samples (every field) and the metrics; the final weights."""
    from dapo_megatron.config import DAPOConfig, load_config
    from dapo_megatron.platform import init_distributed
    from dapo_megatron.trainer import DAPOTrainer

    cfg = load_config(DAPOConfig, None, CONFIG + [f"model.hf_path={hf_dir}", f"trainer.default_local_dir={run_dir}",
                                                  f"rollout.server_urls=[{url}]", *extra])
    trainer = DAPOTrainer(cfg, init_distributed(cfg.parallel, seed=cfg.trainer.seed))
    if interrupt:
        _sync_lands_in_flight(trainer.rollout)
    steps = []
    try:
        for _ in range(STEPS):
            policy_version = trainer.step
            metrics = trainer.train_step()
            samples = [(s.prompt_ids, s.response_ids, s.rollout_logprobs, s.finish_reason, s.versions, s.reward,
                        s.acc, s.advantage, s.group_id, s.prompt_index, s.token_versions())
                       for s in trainer._last_samples]
            steps.append({"policy_version": policy_version, "metrics": metrics, "samples": samples})
    finally:
        trainer.rollout.close()
    weights = {k: v.detach().clone() for k, v in trainer.actor.model_chunks[0].state_dict().items()
               if isinstance(v, torch.Tensor)}
    torch.save({"steps": steps, "weights": weights}, out_path)


@pytest.fixture(scope="module")
def runs(smollm2_gguf, tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    hf_dir = tiny_async_model(smollm2_gguf, root / "tiny_hf", NUM_STOP_IDS)
    server = RolloutServer(hf_dir, root / "server.log")
    out = {}
    try:
        arms = {"S": ["buffer.max_staleness=0"],
                "A0": ["buffer.max_staleness=0", "async_training.enable=true"],
                "A1": ["buffer.max_staleness=1", "async_training.enable=true"]}
        for name, extra in arms.items():
            path = str(root / f"{name}.pt")
            spawn(_run_worker, 1, hf_dir, server.url, str(root / name), extra, path)
            out[name] = torch.load(path, weights_only=False)
    finally:
        server.stop()
    return out


def test_async_at_eta_0_is_synchronous_server_mode_bit_for_bit(runs):
    s, a0 = runs["S"], runs["A0"]
    # the scenario is the one meant: dynamic sampling dropped groups and drew a second batch
    assert sum(st["metrics"]["rollout/num_gen_batches"] for st in s["steps"]) > STEPS
    assert all(st["metrics"]["rollout/kept_groups"] >= 1 for st in s["steps"]), [
        (st["metrics"]["rollout/kept_groups"], st["metrics"]["rollout/num_gen_batches"]) for st in s["steps"]]
    for k, (x, y) in enumerate(zip(s["steps"], a0["steps"])):
        assert x["samples"] == y["samples"], f"step {k + 1}: the trained samples differ"
        for key in ("actor/pg_loss", "actor/grad_norm", "rollout/gen_tokens", "rollout/num_gen_batches",
                    "rollout/dropped_stale", "rollout/surplus_in", "rollout/gen_reward_mean"):
            assert x["metrics"][key] == y["metrics"][key], (k + 1, key, x["metrics"][key], y["metrics"][key])
        assert "time/wait_rollout_s" in y["metrics"] and "trainer/idle_ratio" in y["metrics"]
    assert s["weights"].keys() == a0["weights"].keys()
    for name, w in s["weights"].items():
        assert torch.equal(w, a0["weights"][name]), name


def test_the_a1_run_overlaps_and_reports_verl_metrics(runs):
    rows = [st["metrics"] for st in runs["A1"]["steps"]]
    print("A1", [(m["train/staleness_max"], m["async/partial_ratio"], m["rollout/resubmitted_rows"],
                  m["time/wait_rollout_s"], m.get("rollouter/idle_ratio")) for m in rows])
    for m in rows:
        assert 0 <= m["async/partial_ratio"] <= 1 and m["async/max_partial_span"] <= 1
        assert m["time/wait_rollout_s"] >= 0 and "time/sync_pause_s" in m


@pytest.mark.parametrize("arm,eta", [("A0", 0), ("A1", 1)])
def test_every_trained_token_is_within_the_staleness_bound(runs, arm, eta):
    for st in runs[arm]["steps"]:
        p, m = st["policy_version"], st["metrics"]
        assert m["train/staleness_max"] <= eta, (arm, p, m["train/staleness_max"])
        for x in st["samples"]:
            versions, per_token = x[4], x[10]
            starts = [a for a, _ in versions]
            assert starts[0] == 0 and starts == sorted(set(starts)), versions  # spans ascend
            assert all(p - eta <= v <= p for v in per_token), (arm, p, versions)
