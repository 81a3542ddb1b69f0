"""DAPOTrainer (world of one, tiny random Llama with SmolLM2's tokenizer): how many model
forwards a step runs, the streamed rollout with partial rollouts and skipping, and what every
step hands on to the actor, each checked against a value computed here.

The oracle of "no recompute forward ran" is independent of the trainer's own metric: a spy on
``MegatronActor.compute_logprobs`` (the recompute pass) counts its calls, and a spy on
``MegatronActor.train_mini_batch`` adds up the model calls each update reports.

The same spy on ``train_mini_batch`` records what the trainer hands the actor (advantages,
weight versions, loss masks, old and rollout logprobs, the ``policy_version``), and a wrapper
around ``train_step`` records which samples each step started with as carried work (surplus
groups, partial rollouts: the same Python objects, so "carried" is known without reading any
version the trainer wrote). The tests recompute each quantity from what the step was given:

- advantages: :func:`compute_group_advantages` of grader score + the soft overlong penalty of
  Eq. 13 written out here, per group (the ``carried`` run stops responses at varied lengths,
  so the penalty changes advantages: the raw score alone would not give them);
- versions: every fresh token by the weights of the step (the trainer's step count), carried
  tokens by the versions they had when carried, ``policy_version`` = the step count; the
  behaviour-policy correction (``actor/rollout_corr_frac``) touches tokens exactly in the steps
  with carried work;
- masks: ``loss_mask_zero`` exactly on truncated responses under ``buffer.overlong_filter``,
  and the actor's loss-token count from them;
- old logprobs: a direct recompute at the first update's weights, and the engine's logprobs of
  fresh samples (same weights); the rollout logprobs one per token, for trained and carried
  samples;
- skip decisions: a prompt is a GRESO candidate exactly when its last graded group had zero
  variance;
- metrics (issue 25): the ``carried`` run's step 2 trains the two groups carried from step 1
  and generates nothing: every value it logs (metrics.jsonl, MLflow, the progress bar) is
  finite and no generation metric is logged.
"""

import json
import math
import os

import pytest
import torch

from dapo_megatron.platform import spawn

BASE = [
    "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1",
    "buffer.n=2", "buffer.gen_batch_size=2", "buffer.max_num_gen_batches=2", "buffer.on_cap=train_on_kept",
    "buffer.filter_groups=false",  # a random model solves nothing: keep every group
    "actor.ppo_max_token_len_per_gpu=512", "actor.optim.lr=1e-3", "actor.optim.lr_warmup_steps=0",
    "rollout.response_length=6", "buffer.overlong.max_response_length=6", "buffer.overlong.overlong_buffer_len=2",
    "data.arithmetic.num_train_problems=8", "data.arithmetic.num_val_problems=2", "model.params_dtype=float32",
    "model.transformer_impl=local", "reward.num_workers=1", "tracking.use_mlflow=false",
]
L_MAX, L_CACHE = 6, 2
VARIANTS = {
    # two mini-batches: pi_old must be recomputed before the first update changes the weights
    "recompute": ["trainer.total_training_steps=2", "buffer.train_batch_size=2", "actor.ppo_mini_batch_size=1"],
    # verl's bypass mode: the engine's logprobs are pi_old
    "bypass": ["trainer.total_training_steps=2", "buffer.train_batch_size=2", "actor.ppo_mini_batch_size=1",
               "actor.old_logprob_source=rollout"],
    # one mini-batch, one epoch: pi_old = sg(pi_theta) of the training forward, no recompute
    "one_update": ["trainer.total_training_steps=2", "buffer.train_batch_size=2", "actor.ppo_mini_batch_size=2"],
    # streamed, partial rollouts carried, skipping on
    "streaming": ["trainer.total_training_steps=6", "buffer.train_batch_size=2", "actor.ppo_mini_batch_size=1",
                  "rollout.streaming=true", "rollout.partial_rollout=true", "rollout.stream_poll_tokens=2",
                  "buffer.prompt_skip.enable=true", "buffer.prompt_skip.skip_probability=0.9"],
    # whole generation batches of 4 groups for N = 2: step 1 carries 2 groups, step 2 trains those
    # alone (one version stale, generating nothing), step 3 generates again. Responses of varied
    # lengths (the model stops on many token ids, see _stopping_model), truncated ones masked; MLflow on
    "carried": ["trainer.total_training_steps=3", "buffer.train_batch_size=2", "buffer.gen_batch_size=4",
                "actor.ppo_mini_batch_size=1", "buffer.max_staleness=1", "buffer.overlong_filter=true",
                "tracking.use_mlflow=true"],
}


def _worker(hf_dirs, out_dir):
    for variant in VARIANTS:  # one process for all runs: imports dominate the cost
        _run(hf_dirs["stopping" if variant == "carried" else "plain"], os.path.join(out_dir, variant), variant)


def _sample_record(s) -> dict:
    return {"key": id(s), "group": s.group_id, "prompt_index": s.prompt_index, "score": s.score,
            "length": s.response_length, "finish": s.finish_reason, "advantage": s.advantage,
            "mask": s.loss_mask_zero, "token_versions": s.token_versions(),
            "rollout_lp": None if s.rollout_logprobs is None else list(s.rollout_logprobs),
            "old_lp": None if s.old_logprobs is None else list(s.old_logprobs)}


def _run(hf_dir, out_dir, variant):
    import dapo_megatron.trainer as trainer_mod
    from dapo_megatron.actor.actor import MegatronActor
    from dapo_megatron.config import DAPOConfig, load_config
    from dapo_megatron.platform import init_distributed

    os.makedirs(out_dir)
    calls = {"recompute": 0, "train_model_calls": 0}
    updates, steps, skips = [], [], []  # what the actor got; each step's start and metrics; skip decisions
    real_compute, real_train = MegatronActor.compute_logprobs, MegatronActor.train_mini_batch
    box = {}  # the trainer, once built

    def compute_spy(self, *a, **kw):
        if not kw.get("own_routing"):  # own_routing: the weight-sync probe (rollout.weight_probe), not a recompute
            calls["recompute"] += 1
        return real_compute(self, *a, **kw)

    def train_spy(self, micro_batches, temperature=1.0, global_num_tokens=None, **kw):
        step = box["trainer"].step
        first = not any(u["step"] == step for u in updates)
        samples = [s for mb in micro_batches for s in mb]
        ref = None
        from_training = kw["old"].from_training  # the step's OldLogprobPlan: pi_old from the training forward
        if first and not from_training:  # pi_old at the weights of the step's first update
            before = self.num_model_calls
            ref = [lp.tolist() for lp in real_compute(self, [samples], temperature=temperature)]
            self.num_model_calls = before  # the check's forward is not the trainer's
        rec = {"step": step, "policy_version": kw.get("policy_version"), "old_from_current": from_training,
               "samples": [_sample_record(s) for s in samples], "ref_old_lp": ref}
        out = real_train(self, micro_batches, temperature, global_num_tokens, **kw)
        metrics = out.metrics
        calls["train_model_calls"] += metrics["num_model_calls"]
        rec["metrics"] = {k: float(v) for k, v in metrics.items()}
        updates.append(rec)
        return out

    MegatronActor.compute_logprobs, MegatronActor.train_mini_batch = compute_spy, train_spy
    try:
        cfg = load_config(DAPOConfig, None, BASE + VARIANTS[variant] + [
            f"model.hf_path={hf_dir}", f"trainer.default_local_dir={out_dir}/run"])
        parallel = init_distributed(cfg.parallel, seed=cfg.trainer.seed)
        trainer = box["trainer"] = trainer_mod.DAPOTrainer(cfg, parallel)
        keep_alive = []  # carried samples stay referenced: their id() is never reused by a fresh one

        def carried_now():
            r = trainer.rollout
            groups = r.buffer.surplus + (r.collector.partial if r.collector else [])
            keep_alive.extend(s for g in groups for s in g.samples)
            return {id(s): _sample_record(s) for g in groups for s in g.samples}

        real_step = trainer.train_step

        def train_step():
            start = {"step": trainer.step, "carried": carried_now(), "calls": dict(calls)}
            m = real_step()
            m["spy/recompute_calls"] = calls["recompute"] - start["calls"]["recompute"]
            m["spy/train_model_calls"] = calls["train_model_calls"] - start["calls"]["train_model_calls"]
            start["metrics"] = dict(m)
            start["carried_after"] = carried_now()
            steps.append(start)
            return m

        trainer.train_step = train_step
        if trainer.rollout.collector is not None:  # the skip oracle: zero variance of each prompt's last graded group
            r = trainer.rollout
            last_zero, real_grade, real_skip = {}, r.buffer.grade, r.collector.skipper.skip

            def grade(groups):
                real_grade(groups)
                for g in groups:
                    last_zero[g.samples[0].prompt_index] = len({s.acc for s in g.samples}) == 1

            def skip(index):
                candidate = trainer.rollout.collector.skipper.is_candidate(index)
                skipped = real_skip(index)
                skips.append((index, candidate, skipped, last_zero.get(index)))
                return skipped

            trainer.rollout.buffer.grade, trainer.rollout.collector.skipper.skip = grade, skip
        bar, postfixes = trainer.progress, []
        real_update = bar.update

        def bar_update(step, metrics=None):
            real_update(step, metrics)
            postfixes.append(str(bar._bar.postfix) if bar._bar is not None else None)

        bar.update = bar_update
        trainer.fit()  # logs to metrics.jsonl (and MLflow), then closes the reward pool and the tracker
        state = {"skipper": trainer.rollout.collector.skipper.state_dict() if trainer.rollout.collector else None}
    finally:
        MegatronActor.compute_logprobs, MegatronActor.train_mini_batch = real_compute, real_train
    torch.save({"rows": [s["metrics"] for s in steps], "steps": steps, "updates": updates, "skips": skips,
                "postfixes": postfixes, "state": state, "run_dir": f"{out_dir}/run"}, os.path.join(out_dir, "res.pt"))


def _stopping_model(hf_dir: str) -> str:
    """The tiny model ends a response at any of 16,384 token ids (HF's list-valued
    ``eos_token_id``), about one token in three: responses of varied lengths, some truncated."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_dir)
    config.eos_token_id = [config.eos_token_id] + list(range(1000, 1000 + 16383))
    config.save_pretrained(hf_dir)
    return hf_dir


@pytest.fixture(scope="module")
def runs(smollm2_gguf, tmp_path_factory):
    from conftest import tiny_llama_with_smollm2_tokenizer_dir

    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1)
    hf_dirs = {"plain": tiny_llama_with_smollm2_tokenizer_dir(smollm2_gguf, tmp_path_factory.mktemp("tiny_hf"),
                                                              **sizes),
               "stopping": _stopping_model(tiny_llama_with_smollm2_tokenizer_dir(
                   smollm2_gguf, tmp_path_factory.mktemp("tiny_hf_stopping"), **sizes))}
    out = tmp_path_factory.mktemp("trainer_streaming")
    spawn(_worker, 1, hf_dirs, str(out))
    return {v: torch.load(out / v / "res.pt", weights_only=False) for v in VARIANTS}


def test_model_calls_per_step_with_and_without_the_recompute(runs):
    for variant, recomputes in (("recompute", True), ("bypass", False), ("one_update", False)):
        for m in runs[variant]["rows"]:
            assert m["spy/recompute_calls"] == (1 if recomputes else 0), (variant, m["spy/recompute_calls"])
            assert m["actor/recomputed_old_logprobs"] == float(recomputes)
            if recomputes:  # the recompute's micro-batch forwards come on top of the updates'
                assert m["actor/num_model_calls"] > m["spy/train_model_calls"] > 0
            else:
                assert m["actor/num_model_calls"] == m["spy/train_model_calls"] > 0, variant
    # the mismatch gap is measured all the same (from the first update's forward when nothing was
    # recomputed); the engine holds the actor's weights: round-off only
    for variant in ("recompute", "bypass", "one_update"):
        for m in runs[variant]["rows"]:
            assert m["rollout/logprob_diff_fresh_max"] < 1e-4, (variant, m["rollout/logprob_diff_fresh_max"])


def test_streamed_steps_train_exactly_n_groups_and_record_skip_history(runs):
    """(Partial rollouts through the trainer need groups that finish at different times: the
    main job's kill-and-resume test covers them with the real SmolLM2.)"""
    rows = runs["streaming"]["rows"]
    assert all(m["rollout/kept_groups"] == 2 for m in rows)
    for m in rows:
        assert m["rollout/rounds"] == 3  # 6-token responses, 2 tokens per round
        assert m["train/staleness_max"] == 0 and m["rollout/logprob_diff_fresh_max"] < 1e-4
        assert m["actor/num_model_calls"] > m["spy/train_model_calls"]  # two mini-batches: recomputed
    assert runs["streaming"]["state"]["skipper"]["streak"]  # all-wrong groups of a random model: zero variance
    assert sum(m["rollout/skipped_prompts"] for m in rows) > 0  # 8 prompts, 2 a step: steps 5-6 revisit them


def _penalty(length: int) -> float:
    """DAPO Eq. 13 (penalty factor 1) with L_max = 6, L_cache = 2."""
    if length <= L_MAX - L_CACHE:
        return 0.0
    return (L_MAX - L_CACHE - length) / L_CACHE if length <= L_MAX else -1.0


def _by_step(run) -> dict[int, list[dict]]:
    """The samples the actor trained on, per step (trainer step count at the step's start)."""
    out: dict[int, list[dict]] = {}
    for u in run["updates"]:
        out.setdefault(u["step"], []).extend(u["samples"])
    return out


def test_the_actor_trains_on_group_advantages_of_the_shaped_reward(runs):
    from dapo_megatron.algorithms import compute_group_advantages

    penalty_mattered = False
    for variant, run in runs.items():
        for step, samples in _by_step(run).items():
            assert sorted({s["group"] for s in samples}) == list(range(2)) and len(samples) == 4, (variant, step)
            groups = torch.tensor([s["group"] for s in samples])
            score = torch.tensor([s["score"] for s in samples], dtype=torch.float64)
            shaped = score + torch.tensor([_penalty(s["length"]) for s in samples], dtype=torch.float64)
            want = compute_group_advantages(shaped, groups, norm_by_std=True, eps=1e-6)
            got = torch.tensor([s["advantage"] for s in samples], dtype=torch.float64)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12, msg=f"{variant} step {step}")
            raw = compute_group_advantages(score, groups, norm_by_std=True, eps=1e-6)
            penalty_mattered |= not torch.allclose(raw, want, rtol=0, atol=1e-6)
    assert penalty_mattered, "no group's advantages depend on the overlong penalty: the check would see nothing"


def test_versions_policy_version_and_the_correction_follow_the_carried_work(runs):
    """Fresh tokens were sampled by the weights of the step (the engine holds version ``step``
    while step ``step + 1`` rolls out), carried tokens by the versions they had when carried;
    the actor is told ``policy_version = step``; the behaviour-policy correction touches tokens
    in exactly the steps that train carried (stale) tokens, and is the identity elsewhere."""
    saw_stale = saw_fresh = False
    for variant, run in runs.items():
        trained = _by_step(run)
        for start in run["steps"]:
            t, carried, m = start["step"], start["carried"], start["metrics"]
            assert all(u["policy_version"] == t for u in run["updates"] if u["step"] == t), variant
            stale = False
            for s in trained.get(t, []):
                before = carried[s["key"]]["token_versions"] if s["key"] in carried else []
                want = before + [t] * (s["length"] - len(before))  # new tokens: the step's weights
                assert s["token_versions"] == want, (variant, t, s["token_versions"], want)
                stale |= any(v < t for v in want) and not s["mask"]
            assert (m["train/staleness_max"] > 0) == any(
                any(v < t for v in s["token_versions"]) for s in trained.get(t, [])), (variant, t)
            if stale:
                saw_stale = True
                assert m["actor/rollout_corr_frac"] > 0, (variant, t)
            else:
                saw_fresh = True
                assert m["actor/rollout_corr_frac"] == 0, (variant, t, m["actor/rollout_corr_frac"])
                assert m["actor/rollout_is_mean"] == pytest.approx(1.0, abs=1e-12), (variant, t)
    assert saw_stale and saw_fresh
    carried = runs["carried"]["steps"]
    assert [len(s["carried"]) for s in carried] == [0, 4, 0], "step 2 trains the 2 groups carried from step 1"


def test_masks_and_old_logprobs_handed_to_the_actor(runs):
    for variant, run in runs.items():
        masked_any = False
        for u in run["updates"]:
            samples = u["samples"]
            # buffer.overlong_filter (carried run only): truncated responses out of the loss
            for s in samples:
                assert s["mask"] == (variant == "carried" and s["finish"] == "length"), (variant, s)
                assert len(s["rollout_lp"]) == s["length"], (variant, "one rollout logprob per response token")
            masked_any |= any(s["mask"] for s in samples)
            assert u["metrics"]["num_tokens"] == sum(s["length"] for s in samples if not s["mask"]), variant
            fresh = [s for s in samples if all(v == u["step"] for v in s["token_versions"])]
            if variant == "bypass":  # the engine's logprobs are pi_old
                assert all(s["old_lp"] == s["rollout_lp"] for s in samples)
            elif variant == "one_update":  # pi_old from the training forward itself
                assert u["old_from_current"] and all(s["old_lp"] is None for s in samples)
            else:
                assert not u["old_from_current"]
                for s in samples:
                    assert len(s["old_lp"]) == s["length"], variant
                for s in fresh:  # the engine sampled them with the weights pi_old is taken at
                    assert max(abs(a - b) for a, b in zip(s["old_lp"], s["rollout_lp"], strict=True)) < 1e-4, variant
                if u["ref_old_lp"] is not None:  # first update of the step: a direct recompute
                    for s, ref in zip(samples, u["ref_old_lp"], strict=True):
                        assert max(abs(a - b) for a, b in zip(s["old_lp"], ref, strict=True)) < 1e-5, variant
        if variant == "carried":
            assert masked_any, "no truncated response: the mask check would see nothing"
        # carried work (surplus, partial rollouts) keeps one rollout logprob per token as well
        for start in run["steps"]:
            for s in start["carried_after"].values():
                assert s["rollout_lp"] is not None and len(s["rollout_lp"]) == s["length"], variant


def test_skip_decisions_follow_the_last_graded_group_of_each_prompt(runs):
    skips = runs["streaming"]["skips"]
    assert skips and any(s for _, _, s, _ in skips)
    for index, candidate, skipped, zero in skips:
        # zero_variance_visits = 1: a candidate exactly when its last graded group had zero variance
        assert candidate == bool(zero), (index, candidate, zero)
        assert not skipped or zero, f"prompt {index} skipped though its last group had mixed accuracy"


def test_a_step_of_carried_groups_only_logs_finite_trained_metrics_and_no_generation_metric(runs):
    """Issue 25: metrics.jsonl, MLflow and the progress bar of the ``carried`` run, whose step 2
    trained the groups carried from step 1 and generated nothing."""
    from mlflow.tracking import MlflowClient

    from dapo_megatron.rollout.sampling.buffer import GENERATION_METRICS

    run = runs["carried"]
    rows = {}
    with open(os.path.join(run["run_dir"], "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            rows[row.pop("step")] = row
    assert sorted(rows) == [1, 2, 3] and rows[2]["rollout/num_gen_batches"] == 0 and rows[2]["rollout/surplus_in"] == 2
    trained = [k for k in rows[1] if k.startswith("train/")]
    assert {"train/score_mean", "train/acc_mean", "train/reward_mean", "train/overlong_penalty_mean",
            "train/response_length_mean", "train/staleness_max"} <= set(trained)
    for step, row in rows.items():
        assert all(math.isfinite(v) for v in row.values()), (step, {k: v for k, v in row.items()
                                                                   if not math.isfinite(v)})
        assert set(trained) <= set(row), step  # the trained batch's metrics, every step
    assert not set(GENERATION_METRICS) & set(rows[2]), sorted(set(GENERATION_METRICS) & set(rows[2]))
    assert {"rollout/gen_tokens", "rollout/gen_acc_mean", "perf/gen_tokens_per_s"} <= set(rows[1]) & set(rows[3])
    # the trained batch of step 2 is the groups carried from step 1, one version stale
    carried = list(runs["carried"]["steps"][1]["carried"].values())
    assert rows[2]["train/score_mean"] == pytest.approx(sum(s["score"] for s in carried) / 4)
    assert rows[2]["train/response_length_mean"] == pytest.approx(sum(s["length"] for s in carried) / 4)
    assert rows[2]["train/staleness_max"] == 1 and rows[2]["train/stale_samples"] == 4

    client = MlflowClient(tracking_uri=f"sqlite:///{run['run_dir']}/mlflow.db")
    (mlrun,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    names = sorted(mlrun.data.metrics)
    assert set(trained) <= set(names)
    for name in names:
        history = client.get_metric_history(mlrun.info.run_id, name)
        assert all(math.isfinite(m.value) for m in history), (name, [(m.step, m.value) for m in history])
        want = [1, 3] if name in GENERATION_METRICS else [1, 2, 3]
        if name in GENERATION_METRICS or name.startswith("train/"):
            assert sorted(m.step for m in history) == want, (name, [m.step for m in history])
    # the progress bar: the generated responses' accuracy where there were any, never a NaN
    postfixes = run["postfixes"]
    assert postfixes and all("nan" not in (p or "").lower() for p in postfixes), postfixes
    assert len(postfixes) == 3 and "gen_acc" in postfixes[0] and "gen_acc" in postfixes[2], postfixes
    assert "gen_acc" not in postfixes[1] and "reward" not in postfixes[1], postfixes
