"""``Sample.response_mask`` (multi-turn context tokens) through the actor's loss path: the packed loss
mask, DAPO's token-mean loss and its gradient, the entropy metric, the behaviour-policy correction,
the step plan's global token count, the soft overlong penalty and the mismatch metrics.

The oracle is a hand-written token mean over the mask-1 tokens from ``torch.log_softmax`` of the same
logits; every test also shows that counting the context tokens would give another number, so a
defect that lets them into the loss fails it. No model: the loss function gets a logits tensor."""

from __future__ import annotations

import pytest
import torch

from dapo_megatron.actor.config import ActorConfig
from dapo_megatron.actor.loss import dapo_loss_func
from dapo_megatron.actor.micro_batch import MicroBatch, Targets
from dapo_megatron.actor.plan import ActorPlan, OldLogprobPlan
from dapo_megatron.actor.step_plan import plan_step
from dapo_megatron.algorithms.overlong import OverlongConfig, overlong_penalty
from dapo_megatron.rollout.engines.routes import routes_start_of
from dapo_megatron.rollout.sampling.buffer import GroupSelector, logprob_mismatch_metrics
from dapo_megatron.rollout.sampling.config import BufferConfig
from dapo_megatron.rollout.types import Group, Sample

V = 16
TEMPERATURE = 0.7


def _two_turn(prompt, turn1, context, turn2, lp1, lp2, version2=0) -> Sample:
    """A sample built as the loops build one: turn 1, the context (mask 0), turn 2."""
    s = Sample(list(prompt), [], [], "")
    s.append_tokens(0, turn1, lp1)
    s.append_tokens(0, context, None, context=True)
    s.append_tokens(version2, turn2, lp2)
    s.finish_reason = "stop"
    return s


def _samples() -> list[Sample]:
    g = torch.Generator().manual_seed(3)
    a = _two_turn([5, 6, 7], [8, 9], [10, 11, 12], [13], [-0.1, -0.2], [-0.3])
    b = Sample([1, 2], [3, 4, 5], [-0.5, -0.6, -0.7], "stop")  # single-turn: no mask
    c = _two_turn([9], [2], [14, 15], [4, 6], [-0.8], [-0.9, -1.0])
    for s, adv in zip((a, b, c), (1.0, -0.5, 0.7)):
        s.advantage = adv
        s.old_logprobs = (-1.0 - torch.rand(s.response_length, generator=g)).tolist()
    return [a, b, c]


def test_append_tokens_keeps_one_entry_per_token_and_masks_the_context():
    a = _samples()[0]
    assert a.response_ids == [8, 9, 10, 11, 12, 13]
    assert a.response_mask == [1, 1, 0, 0, 0, 1]
    assert a.rollout_logprobs == [-0.1, -0.2, 0.0, 0.0, 0.0, -0.3]  # placeholders at the context, never read
    assert (a.num_context_tokens, a.num_model_tokens, a.response_length) == (3, 3, 6)
    # a single-turn sample is untouched: no mask, every token the model's
    b = Sample([1], [], [], "")
    b.append_tokens(2, [4, 5], [-1.0, -2.0])
    assert b.response_mask is None and b.num_context_tokens == 0 and b.loss_token_mask() == [1, 1]
    # versions: the context takes the span of the turn it answers; a later turn by newer weights opens one
    c = _two_turn([1], [2, 3], [4, 5], [6], [-1.0, -1.0], [-1.0], version2=4)
    assert c.versions == [(0, 0), (4, 4)] and c.token_versions() == [0, 0, 0, 0, 4]
    # a rank without the tokens keeps the counts (replicated records)
    d = Sample([1], None, None, "", num_response_tokens=2)
    d.append_tokens(0, None, None, num_tokens=3, context=True)
    assert (d.response_length, d.num_context_tokens, d.num_model_tokens, d.response_mask) == (5, 3, 2, None)
    # routes: a context append keeps the sample's (positions 0-1); the next row asks for its routes from
    # where they end (routes_start_of: 2), so positions 2 (the turn's last token) and 3 (the context)
    # come from its prefill; a row from position 0 replaces them all
    e = Sample([1, 2], [3], [-1.0], "stop", routes=torch.zeros(2, 1, 1, dtype=torch.uint8))
    e.append_tokens(0, [4], None, context=True)
    assert torch.equal(e.routes, torch.zeros(2, 1, 1, dtype=torch.uint8))
    assert routes_start_of(len(e.prompt_ids) + len(e.response_ids), e.routes) == 2
    e.append_tokens(1, [5], [-1.0], routes=torch.ones(2, 1, 1, dtype=torch.uint8))
    assert e.routes[:, 0, 0].tolist() == [0, 0, 1, 1]
    e.append_tokens(1, [6], [-1.0], routes=torch.full((5, 1, 1), 2, dtype=torch.uint8))
    assert e.routes[:, 0, 0].tolist() == [2] * 5
    with pytest.raises(ValueError, match="context tokens have no rollout logprobs"):
        e.append_tokens(0, [6], [-1.0], context=True)


def _hand_loss(samples, logits_rows, cfg, n_tokens, use_mask=True):
    """sum over loss tokens of DAPO's clipped per-token loss / n_tokens, and the entropy mean."""
    num, ent = 0.0, 0.0
    for s, rows in zip(samples, logits_rows):
        logp = torch.log_softmax(rows.double() / TEMPERATURE, -1)
        lp = logp.gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
        ratio = torch.exp(lp - torch.tensor(s.old_logprobs, dtype=torch.float64))
        a = s.advantage
        per = torch.maximum(-a * ratio, -a * ratio.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high))
        mask = torch.tensor(s.loss_token_mask() if use_mask else [1] * s.response_length, dtype=torch.float64)
        num += float((per * mask).sum())
        ent += float((-(logp.exp() * logp).sum(-1) * mask).sum())
    return num / n_tokens, ent / n_tokens


@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_loss_is_the_token_mean_over_model_tokens_and_context_logits_get_no_gradient(layout):
    samples = _samples()
    cfg = ActorConfig(ppo_max_token_len_per_gpu=64)
    plan = plan_step([Group(0, samples)], 1, 1, 64)
    n_tok = plan.mini_batches[0].global_num_tokens
    assert n_tok == 3 + 3 + 3 == sum(s.num_model_tokens for s in samples)  # the context is not counted
    b = MicroBatch(samples, ActorPlan(layout=layout), share_prompts=False, device="cpu").batch
    logits = torch.randn(*b.input_ids.shape, V, generator=torch.Generator().manual_seed(0), requires_grad=True)
    # each sample's label rows: position P - 1 + j of its sequence predicts response token j
    rows_of = [[(b.rows[i], b.offsets[i] + b.prompt_lens[i] - 1 + j) for j in range(s.response_length)]
               for i, s in enumerate(samples)]
    logits_rows = [torch.stack([logits[r, t] for r, t in rows]).detach() for rows in rows_of]
    g = torch.Generator().manual_seed(1)
    for s, rows in zip(samples, logits_rows):  # pi_old near pi_theta: every ratio inside the clip, every grad > 0
        lp = torch.log_softmax(rows / TEMPERATURE, -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
        s.old_logprobs = (lp + 0.1 * torch.rand(lp.shape, generator=g) - 0.05).tolist()
    mb = MicroBatch(samples, ActorPlan(layout=layout), share_prompts=False, device="cpu",
                    targets=Targets(cfg, None, OldLogprobPlan("recompute")))
    assert mb.num_loss_tokens == n_tok
    loss, num_tokens, reduced = dapo_loss_func(mb, logits, actor_cfg=cfg, temperature=TEMPERATURE, vocab_size=V,
                                               logits_at_labels_only=False, global_num_tokens=n_tok, global_num_seqs=3)
    want, want_ent = _hand_loss(samples, logits_rows, cfg, n_tok)
    assert int(num_tokens) == n_tok
    assert float(loss) == pytest.approx(want, abs=1e-6)
    assert float(reduced["entropy"]) == pytest.approx(want_ent, abs=1e-6)
    # the planted defect (context tokens in the loss) would give another value
    wrong, _ = _hand_loss(samples, logits_rows, cfg, sum(s.response_length for s in samples), use_mask=False)
    assert abs(wrong - want) > 1e-3
    loss.backward()
    for s, rows in zip(samples, rows_of):
        for m, (r, t) in zip(s.loss_token_mask(), rows):
            g = logits.grad[r, t]
            assert bool((g == 0).all()) if m == 0 else float(g.abs().max()) > 0


def test_the_behaviour_policy_correction_ignores_the_context_placeholders():
    """rollout_is_scope=all corrects every model token against its rollout logprob; the context's 0.0
    placeholders (log rho of ~ -1.5 nats) would be rejected by rollout_rs=token if they were read."""
    samples = _samples()
    cfg = ActorConfig(ppo_max_token_len_per_gpu=64, rollout_is="token", rollout_is_scope="all",
                      rollout_rs="token", rollout_rs_threshold=2.0)
    for s in samples:  # old = rollout at the model tokens: rho = 1, nothing rejected
        s.old_logprobs = [lp if m else -1.5 for lp, m in zip(s.rollout_logprobs, s.loss_token_mask())]
    mb = MicroBatch(samples, ActorPlan(layout="bshd"), share_prompts=False, device="cpu",
                    targets=Targets(cfg, 0, OldLogprobPlan("recompute", corrects=True)))
    assert mb.num_loss_tokens == mb.num_valid_tokens == 9
    assert float(mb.corr_metrics["rollout_rs_masked_frac"]) == 0.0
    assert torch.equal(mb.loss_mask.bool(), mb.batch.loss_mask)
    assert int(mb.batch.loss_mask.sum()) == 9 and int(mb.batch.response_mask.sum()) == 14


class _ConstantGrader:
    """Every response scores 1: the grades are not under test, the overlong length is."""

    def grade(self, requests):
        return [{"score": 1.0, "acc": True, "pred": None} for _ in requests]


def test_the_soft_overlong_penalty_counts_model_tokens_only():
    # L_max 8, buffer 4: a response of 6 model tokens is 2 into the buffer (-0.5); with its 3 context
    # tokens counted it would be 9 > 8 (-1.0)
    cfg = BufferConfig(train_batch_size=1, n=2, gen_batch_size=1,
                       overlong=OverlongConfig(enable=True, max_response_length=8, overlong_buffer_len=4))
    sel = GroupSelector(cfg, _ConstantGrader(), lambda ids: " ".join(map(str, ids)))
    multi = _two_turn([1], [2, 3, 4], [5, 6, 7], [8, 9, 10], [-1.0] * 3, [-1.0] * 3)
    single = Sample([1], [2, 3, 4, 5, 6, 7], [-1.0] * 6, "stop")
    sel.grade([Group(0, [multi, single])])
    assert multi.num_model_tokens == single.response_length == 6
    assert multi.overlong_penalty == single.overlong_penalty == pytest.approx(-0.5)
    assert overlong_penalty(cfg.overlong, torch.tensor([multi.response_length])).item() == pytest.approx(-1.0)


def test_the_mismatch_metrics_leave_the_context_out():
    a = _samples()[0]
    a.old_logprobs = [lp - 0.25 for lp in a.rollout_logprobs]  # 0.25 at every model token
    m = logprob_mismatch_metrics([a])
    assert m["rollout/logprob_diff_mean"] == pytest.approx(0.25) and m["rollout/logprob_diff_max"] == pytest.approx(0.25)
    a.old_logprobs = [lp - 0.25 if k else -9.0 for lp, k in zip(a.rollout_logprobs, a.loss_token_mask())]
    assert logprob_mismatch_metrics([a]) == m  # the context's values are never read



# ----------------------------------------------------------------- the actor on a real two-turn sample
# test_actor.py's reference world trains these samples (its one spawned process, no other): a
# two-turn sample from the HF engine through the trajectory hook, next to single-turn ones.

def two_turn_hf_samples(vocab: int, temperature: float) -> list[Sample]:
    """One group of 4 responses of a tiny random HF Llama (``vocab`` ids) through the batch loop's
    :func:`~dapo_megatron.rollout.trajectory.run_turns` with a two-turn trajectory: some with
    context tokens, some without (checked)."""
    from dapo_megatron.rollout.engines.engine import SamplingParams, completions_to_group
    from dapo_megatron.rollout.engines.hf_engine import HFEngine
    from dapo_megatron.rollout.trajectory import run_turns
    from unit.rollout.test_hf_engine import tiny_llama
    from unit.rollout.test_trajectory import TwoTurns

    engine = HFEngine(tiny_llama(seed=2, vocab=vocab), eos_token_ids=[3])
    # every fourth id stops a turn: the random model ends some first turns early
    params = SamplingParams(n=4, temperature=temperature, max_new_tokens=12,
                            stop_token_ids=tuple(range(4, vocab, 4)), seed=13)
    prompt = [1, 7, 9, 11]
    (group,) = [completions_to_group(0, prompt, c) for c in engine.generate([prompt], params, prompt_seeds=[0])]
    run_turns(engine, [(s, 0, j) for j, s in enumerate(group.samples)], params, TwoTurns())
    assert any(s.num_context_tokens for s in group.samples) and any(not s.num_context_tokens for s in group.samples)
    return group.samples


def train_two_turn(actor, model, samples, temperature: float, direct_logprobs) -> dict:
    """In the actor's world: old logprobs, advantages, one ``forward_backward`` with the plan's
    global token count; what :func:`check_two_turn_training` checks."""
    direct, _ = direct_logprobs(model, samples)
    lps = actor.compute_logprobs([samples], temperature)
    g = torch.Generator().manual_seed(1)
    for s, lp in zip(samples, lps):
        s.old_logprobs = (lp + 0.3 * torch.randn(lp.shape, generator=g)).tolist()
        s.advantage = float(torch.randn((), generator=g))
    n_tok = plan_step([Group(0, samples)], 1, 1, 256).mini_batches[0].global_num_tokens
    metrics = actor.forward_backward([samples], temperature, n_tok).metrics
    return dict(samples=samples, direct=direct, metrics=metrics, n_tok=n_tok)


def check_two_turn_training(res: dict, clip_low: float, clip_high: float) -> None:
    """The actor trained the two-turn samples on their model tokens: the global count excludes the
    context, and the loss is the hand-written token mean over mask-1 tokens of the direct forward's
    logprobs (with the context counted it would differ)."""
    samples, m = res["samples"], res["metrics"]
    assert m["num_tokens"] == res["n_tok"] == sum(s.num_model_tokens for s in samples) < sum(
        s.response_length for s in samples)
    num, num_all = 0.0, 0.0
    for s, lp in zip(samples, res["direct"]):
        ratio = torch.exp(lp.double() - torch.tensor(s.old_logprobs, dtype=torch.float64))
        per = torch.maximum(-s.advantage * ratio, -s.advantage * ratio.clamp(1 - clip_low, 1 + clip_high))
        num += float((per * torch.tensor(s.loss_token_mask(), dtype=torch.float64)).sum())
        num_all += float(per.sum())
        if s.num_context_tokens:  # the context sits in the forward as the tokens appended, unchanged
            k = s.response_mask.index(0)
            assert s.response_ids[k:k + 3] == [20, 21, 22] and s.response_mask[k:k + 3] == [0, 0, 0]
    assert m["loss"] == pytest.approx(num / res["n_tok"], abs=1e-5)
    assert abs(num_all / sum(s.response_length for s in samples) - m["loss"]) > 1e-3  # a planted defect fails
