"""Behaviour-policy correction through the real MegatronActor (world of one, tiny GPT).

The effective per-token weight of a sample is read off the gradient of the mini-batch
loss with respect to its per-token logprobs: at the first update on a batch
``d L / d log pi_theta(y_t) = -A_t w_t r_t / N``, so ``w_t r_t = -N * grad_t / A_t``.
The oracle is computed independently in the test: the current policy's logprobs from
each sequence alone through the bare GPTModel (``test_actor._direct_logprobs``), the
behaviour policy's logprobs as written into ``Sample.rollout_logprobs``, and
``min(exp(lp_now - lp_behaviour), C)`` for every token the behaviour policy sampled at an
older weights version than the actor's.
"""

import math

import pytest
import torch

from dapo_megatron.platform import spawn
from unit.actor.test_actor import TEMPERATURE, VOCAB, VOCAB_PADDED, _direct_logprobs, _mini_batch_samples
from unit.actor.test_packing import tiny_gpt_config, tiny_gpt_model

C = 1.5  # rollout_is_threshold
POLICY_VERSION = 3
CLIP_LOW, CLIP_HIGH = 0.2, 0.28


def _versions(samples):
    """Sample 0-4 carried from version 2 (stale), 5-7 fresh (version 3), 8-9 partial rollouts:
    their first 3 tokens by version 2, continued by version 3."""
    for i, s in enumerate(samples):
        if i < 5:
            s.versions = [(0, 2)]
        elif i < 8:
            s.versions = [(0, 3)]
        else:
            s.versions = [(0, 2), (3, 3)] if len(s.response_ids) > 3 else [(0, 2)]


def _effective_weights_worker(out_path):
    from dapo_megatron.actor.actor import ActorConfig, MegatronActor, OptimConfig
    from dapo_megatron.actor.micro_batch import MicroBatch
    from dapo_megatron.actor.plan import FROM_TRAINING, OldLogprobPlan, resolve_old_logprob_plan
    from dapo_megatron.platform import init_distributed

    par = init_distributed(seed=0)
    torch.manual_seed(0)
    model = tiny_gpt_model(tiny_gpt_config(num_layers=2), vocab_size=VOCAB_PADDED)
    res = {}
    for variant in ("recompute", "skip_recompute", "bypass"):
        cfg = ActorConfig(ppo_max_token_len_per_gpu=64, rollout_is_threshold=C, clip_ratio_low=CLIP_LOW,
                          clip_ratio_high=CLIP_HIGH, old_logprob_source="rollout" if variant == "bypass" else "recompute",
                          optim=OptimConfig(lr=1e-3))
        actor = MegatronActor(model if not res else _fresh_copy(model, res), cfg, total_steps=10, parallel=par,
                              vocab_size=VOCAB)
        samples = _mini_batch_samples(seed=11)
        _versions(samples)
        direct, _ = _direct_logprobs(actor.model_chunks[0].module, samples)
        g = torch.Generator().manual_seed(3)
        for s, lp in zip(samples, direct):  # the behaviour policy: some weights versions behind
            s.rollout_logprobs = (lp.double() + 0.6 * torch.randn(len(lp), generator=g, dtype=torch.float64)).tolist()
        if variant == "recompute":
            for s, lp in zip(samples, actor.compute_logprobs([samples[:5], samples[5:]], TEMPERATURE)):
                s.old_logprobs = lp.tolist()
        elif variant == "bypass":  # the trainer's bypass mode: the engine's logprobs are pi_old
            for s in samples:
                s.old_logprobs = list(s.rollout_logprobs)
        grads = {}
        real = MicroBatch.logprobs_and_entropy

        def spy(mb, output_tensor, **kw):  # the per-token logprobs the loss is taken of, and their gradient
            lp, ent = real(mb, output_tensor, **kw)
            if lp.requires_grad:
                def keep(grad, mb=mb):
                    for s, gr in zip(mb.samples, mb.batch.unpack(grad)):
                        grads[id(s)] = gr.double().clone()
                lp.register_hook(keep)
            return lp, ent

        MicroBatch.logprobs_and_entropy = spy
        try:
            metrics = actor.forward_backward([samples[:5], samples[5:]], TEMPERATURE, policy_version=POLICY_VERSION,
                                             old=resolve_old_logprob_plan(
                                                 cfg, num_updates=1 if variant == "skip_recompute" else None)).metrics
        finally:
            MicroBatch.logprobs_and_entropy = real
        res[variant] = {
            "grads": [grads[id(s)].tolist() for s in samples],
            "direct": [lp.tolist() for lp in direct],
            "rollout": [list(s.rollout_logprobs) for s in samples],
            "adv": [s.advantage for s in samples],
            "stale": [[v < POLICY_VERSION for v in s.token_versions()] for s in samples],
            "in_loss": [not s.loss_mask_zero for s in samples],
            "metrics": metrics,
            "calls": actor.num_model_calls,
        }
        res.setdefault("state", {n: p.detach().clone() for n, p in actor.model_chunks[0].module.named_parameters()})
    # pi_old from the training forward cannot serve rollout_rs (its denominator is needed before the forward)
    actor.cfg.old_logprob_source, actor.cfg.rollout_rs, actor.cfg.rollout_rs_threshold = "recompute", "token", 2.0
    try:
        actor.forward_backward([samples], TEMPERATURE, old=OldLogprobPlan(FROM_TRAINING, corrects=True))
        res["rs_from_training"] = "accepted"
    except ValueError as e:
        res["rs_from_training"] = str(e)
    torch.save(res, out_path)


def _fresh_copy(model, res):
    """A new tiny model holding the first variant's initial weights (each variant gets its own actor)."""
    copy = tiny_gpt_model(tiny_gpt_config(num_layers=2), vocab_size=VOCAB_PADDED)
    with torch.no_grad():
        for n, p in copy.named_parameters():
            p.copy_(res["state"][n])
    return copy


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = tmp_path_factory.mktemp("off_policy") / "res.pt"
    spawn(_effective_weights_worker, 1, str(path))
    return torch.load(path)


def _effective(r):
    """-N * grad / A per token of every sample in the loss (N: the mini-batch's loss tokens)."""
    n = sum(len(g) for g, keep in zip(r["grads"], r["in_loss"]) if keep)
    return [[-n * g / a for g in gs] if keep else None for gs, a, keep in zip(r["grads"], r["adv"], r["in_loss"])]


@pytest.mark.parametrize("variant", ["recompute", "skip_recompute"])
def test_carried_sample_weight_is_the_clipped_ratio_to_its_behaviour_policy(runs, variant):
    r = runs[variant]
    truncated = corrected = fresh = 0
    for i, eff in enumerate(_effective(r)):
        if eff is None:
            assert all(g == 0.0 for g in r["grads"][i])  # overlong-filtered: no gradient at all
            continue
        for t, w in enumerate(eff):
            if r["stale"][i][t]:  # sampled by version 2: clipped pi_now / pi_behaviour, computed independently
                ratio = math.exp(r["direct"][i][t] - r["rollout"][i][t])
                want = min(ratio, C)
                truncated += ratio > C
                corrected += 1
            else:  # fresh: weight exactly 1 (r = 1 up to the recompute's round-off)
                want = 1.0
                fresh += 1
            assert w == pytest.approx(want, rel=2e-5, abs=1e-6), (variant, i, t, w, want)
    assert corrected > 10 and truncated > 2 and fresh > 5 and corrected - truncated > 2  # every branch is hit
    m = r["metrics"]
    assert m["rollout_corr_frac"] == pytest.approx(corrected / (corrected + fresh))
    assert m["rollout_is_clipfrac"] == pytest.approx(truncated / (corrected + fresh))


def test_skipping_the_recompute_saves_one_forward_per_micro_batch_and_changes_nothing(runs):
    a, b = runs["recompute"], runs["skip_recompute"]
    assert a["calls"] == 2 * b["calls"] and b["calls"] == b["metrics"]["num_model_calls"]
    for ga, gb in zip(a["grads"], b["grads"]):
        assert ga == pytest.approx(gb, rel=1e-5, abs=1e-9)
    assert a["metrics"]["loss"] == pytest.approx(b["metrics"]["loss"], rel=1e-6)


def test_bypass_mode_ratio_is_to_the_behaviour_policy_with_ppo_clipping(runs):
    """old_logprob_source=rollout: pi_old = mu, no weights; the ratio pi_now / mu is clipped by
    PPO (zero gradient outside the trust region on the side the advantage pushes)."""
    r = runs["bypass"]
    assert r["calls"] == r["metrics"]["num_model_calls"]  # no recompute forward ran
    clipped = 0
    for i, eff in enumerate(_effective(r)):
        if eff is None:
            continue
        a = r["adv"][i]
        for t, w in enumerate(eff):
            ratio = math.exp(r["direct"][i][t] - r["rollout"][i][t])
            out = (a > 0 and ratio > 1 + CLIP_HIGH) or (a < 0 and ratio < 1 - CLIP_LOW)
            clipped += out
            assert w == pytest.approx(0.0 if out else ratio, rel=2e-5, abs=1e-6), (i, t, w, ratio)
    assert clipped > 2
    assert r["metrics"]["rollout_corr_frac"] == 0.0 and r["metrics"]["rollout_is_mean"] == pytest.approx(1.0)


def test_pi_old_from_the_training_forward_refuses_rollout_rs(runs):
    assert "FROM_TRAINING with actor.rollout_rs set" in runs["rs_from_training"], runs["rs_from_training"]
