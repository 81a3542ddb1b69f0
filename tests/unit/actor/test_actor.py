"""MegatronActor: split invariance of the token-mean gradient (micro-batches, DP), TP/PP parity,
compute_logprobs vs a direct forward, NaN-step skipping and the LR warm-up.

One reference run (world of one) writes the weights, samples and reference numbers;
2-process gloo runs (DP=2, TP=2, PP=2) load the same weights and compare.
"""

import math

import pytest
import torch

from dapo_megatron.platform import ParallelConfig, spawn
from unit.actor.test_packing import random_samples, tiny_gpt_config, tiny_gpt_model
from unit.actor.test_response_mask import check_two_turn_training, train_two_turn, two_turn_hf_samples

VOCAB_PADDED = 64
VOCAB = 61  # the last 3 columns are Megatron vocab padding, masked out of the softmax
TEMPERATURE = 0.8
NUM_LAYERS = 4


def _actor_cfg(**kw):
    from dapo_megatron.actor.actor import ActorConfig, OptimConfig

    o = OptimConfig(lr=1e-3, lr_warmup_steps=2, lr_warmup_init=5e-4, weight_decay=0.01, clip_grad=1.0)
    return ActorConfig(ppo_max_token_len_per_gpu=64, optim=o, **kw)


def _local_shards(model, full_sd, cfg, par):
    """name -> the slice of the TP=1/PP=1 tensor ``full_sd[...]`` that this rank's parameter
    ``name`` holds (Megatron layouts).

    QKV rows are grouped per query group, so TP takes contiguous row blocks; the
    gated fc1 is [gate; up] and each TP rank holds [gate_r; up_r]; PP stages number
    their layers locally from 0; the last stage's output layer is the tied embedding.
    """
    tp, r = par.tp_size, par.tp_rank
    offset = par.pp_rank * (cfg.num_layers // par.pp_size)
    out = {}
    for name, p in model.named_parameters():
        src = name
        if name.startswith("decoder.layers."):
            parts = name.split(".")
            parts[2] = str(int(parts[2]) + offset)
            src = ".".join(parts)
        if src not in full_sd and name == "output_layer.weight":  # tied embeddings on the last PP stage
            src = "embedding.word_embeddings.weight"
        full = full_sd[src]
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            if name.endswith("linear_fc1.weight"):
                gate, up = full.chunk(2, dim=0)
                full = torch.cat([gate.chunk(tp, 0)[r], up.chunk(tp, 0)[r]], 0)
            else:
                full = full.chunk(tp, p.partition_dim)[r]
        assert full.shape == p.shape, (name, full.shape, p.shape)
        out[name] = full
    return out


def _load_full_weights(model, full_sd, cfg, par):
    """Copy TP=1/PP=1 weights into this rank's TP shard / PP stage (see :func:`_local_shards`)."""
    shards = _local_shards(model, full_sd, cfg, par)
    for name, p in model.named_parameters():
        p.data.copy_(shards[name])


def _weight_errors(model, full_sd, cfg, par):
    """name -> max |w - w_ref| of this rank's parameters against their slice of ``full_sd``."""
    shards = _local_shards(model, full_sd, cfg, par)
    return {name: float((p.detach() - shards[name]).abs().max()) for name, p in model.named_parameters()}


def _full_grads(actor):
    """name -> DP-reduced gradient; all-gathers the distributed optimizer's reduce-scatter shards."""
    import torch.distributed as dist

    group = actor.parallel.dp_group
    dp = dist.get_world_size(group)
    ddp = actor.model_chunks[0]
    if dp > 1:
        for buf in ddp.buffers:
            for bucket in buf.buckets:
                g = bucket.grad_data
                shards = list(g.view(dp, -1).clone().unbind(0))
                dist.all_gather(shards, shards[dist.get_rank(group)].clone(), group=group)
                g.copy_(torch.cat(shards))
    return {n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()}


def _direct_logprobs(model, samples):
    """Each sequence alone through the bare GPTModel, torch.log_softmax on the real vocabulary:
    per sample, the logprobs of its response tokens and the entropy (nats) of the full
    temperature-scaled distribution at each of those positions."""
    lps, ents = [], []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logits = model(ids, torch.arange(ids.shape[1])[None], None)[0, :, :VOCAB] / TEMPERATURE
            P = len(s.prompt_ids)
            logp = torch.log_softmax(logits.double(), -1)[P - 1:P - 1 + len(s.response_ids)]
            lps.append(logp.gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0].float())
            ents.append(-(logp.exp() * logp).sum(-1).float())
    return lps, ents


def _mini_batch_samples(seed=5):
    samples = random_samples(10, VOCAB, seed=seed, max_prompt=8, max_resp=12, min_resp=1)
    samples[3].response_ids = []  # an empty response contributes nothing
    samples[3].rollout_logprobs = []
    samples[6].loss_mask_zero = True  # overlong filtering: 0 loss tokens
    g = torch.Generator().manual_seed(seed)
    for s in samples:
        s.advantage = float(torch.randn((), generator=g))
    return samples


def reference_model():
    """The TP=1 tiny model (world of one, seeded), a copy of its weights for the parallel runs, and
    the world's ParallelDims."""
    from dapo_megatron.platform import init_distributed

    torch.use_deterministic_algorithms(True)
    par = init_distributed(seed=0)
    torch.manual_seed(0)
    model = tiny_gpt_model(tiny_gpt_config(num_layers=NUM_LAYERS), vocab_size=VOCAB_PADDED)
    return model, {n: p.detach().clone() for n, p in model.named_parameters()}, par


def _reference_worker(out_path, two_turn_samples):
    from dapo_megatron.actor.actor import MegatronActor

    model, full_sd, par = reference_model()
    samples = _mini_batch_samples()
    direct, direct_ents = _direct_logprobs(model, samples)
    actor = MegatronActor(model, _actor_cfg(), total_steps=10, parallel=par, vocab_size=VOCAB)

    lps, ents = actor.compute_logprobs([samples[:4], samples[4:]], TEMPERATURE, return_entropy=True)
    g = torch.Generator().manual_seed(1)
    for s, lp in zip(samples, lps):  # old policy = current policy + noise, so ratios leave the clip range
        s.old_logprobs = (lp + 0.3 * torch.randn(lp.shape, generator=g)).tolist()

    one = actor.forward_backward([samples], TEMPERATURE).metrics
    grads_one = _full_grads(actor)
    three = actor.forward_backward([samples[:1], samples[1:7], samples[7:]], TEMPERATURE).metrics
    grads_three = _full_grads(actor)
    actor.cfg.loss_agg_mode = "seq-mean-token-mean"  # GRPO ablation: read at every call
    seq_one = actor.forward_backward([samples], TEMPERATURE).metrics
    seq_grads_one = _full_grads(actor)
    seq_three = actor.forward_backward([samples[:1], samples[1:7], samples[7:]], TEMPERATURE).metrics
    seq_grads_three = _full_grads(actor)
    actor.cfg.loss_agg_mode = "token-mean"
    actor.cfg.entropy_coeff = 0.01  # entropy bonus: differentiable entropy through the same scaling
    ent_one = actor.forward_backward([samples], TEMPERATURE).metrics
    ent_grads_one = _full_grads(actor)
    ent_three = actor.forward_backward([samples[:5], samples[5:]], TEMPERATURE).metrics
    ent_grads_three = _full_grads(actor)
    actor.cfg.entropy_coeff = 0.0
    default_plan = actor.plan
    layout_default, labels_only_default = default_plan.layout, default_plan.logits_at_labels_only
    # one packed row + block-diagonal mask, LM head on every position: the pre-optimisation path
    actor.plan = default_plan.replace(layout="thd", build_attention_mask=True, logits_at_labels_only=False,
                                      length_buckets=False)
    thd_lps = actor.compute_logprobs([samples[:4], samples[4:]], TEMPERATURE)
    thd_one = actor.forward_backward([samples], TEMPERATURE).metrics
    thd_grads_one = _full_grads(actor)
    # length buckets at zero overhead: every distinct length its own model call
    actor.plan = default_plan.replace(length_bucket_overhead_tokens=0)
    bucket_lps = actor.compute_logprobs([samples[:4], samples[4:]], TEMPERATURE)
    bucket_one = actor.forward_backward([samples], TEMPERATURE).metrics
    bucket_grads_one = _full_grads(actor)
    actor.plan = default_plan
    step = actor.train_mini_batch([samples], TEMPERATURE, global_num_tokens=int(one["num_tokens"])).metrics
    # the TP=1 optimizer step that the parallel layouts must reproduce
    stepped_sd = {n: p.detach().clone() for n, p in model.named_parameters()}
    stepped_lps = actor.compute_logprobs([samples[:4], samples[4:]], TEMPERATURE)
    two_turn = train_two_turn(actor, model, two_turn_samples, TEMPERATURE, _direct_logprobs)
    torch.save(dict(full_sd=full_sd, samples=samples, direct=direct, direct_ents=direct_ents, lps=lps, ents=ents,
                    one=one, three=three,
                    stepped_sd=stepped_sd, stepped_lps=stepped_lps,
                    grads_one=grads_one, grads_three=grads_three, step=step,
                    seq_one=seq_one, seq_three=seq_three, seq_grads_one=seq_grads_one,
                    seq_grads_three=seq_grads_three, ent_one=ent_one, ent_three=ent_three,
                    ent_grads_one=ent_grads_one, ent_grads_three=ent_grads_three, layout_default=layout_default,
                    labels_only_default=labels_only_default, bucket_lps=bucket_lps, bucket_one=bucket_one,
                    bucket_grads_one=bucket_grads_one,
                    thd_lps=thd_lps, thd_one=thd_one, thd_grads_one=thd_grads_one, two_turn=two_turn), out_path)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("actor") / "ref.pt")
    spawn(_reference_worker, 1, path, two_turn_hf_samples(VOCAB, TEMPERATURE))
    return torch.load(path, weights_only=False)


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


# Weights after one optimizer step against the TP=1 reference. Adam's first update is about
# lr * sign(grad) = 5e-4 on every element (the largest move of every tensor of the reference
# is 5.00e-4 to 5.01e-4); fp32 round-off in the gradients moves it by <= 1.6e-6 here (TP=2, elements
# whose gradient is near Adam's eps), <= 1.6e-7 elsewhere. A wrong or missing gradient
# reduction moves elements by ~lr.
STEPPED_WEIGHT_ATOL = 1e-5


def test_reference_step_moves_every_weight(reference):
    """The post-step comparisons below are meaningful: each tensor moved by far more than their bound."""
    moved = {n: float((reference["stepped_sd"][n] - w).abs().max()) for n, w in reference["full_sd"].items()}
    assert min(moved.values()) > 40 * STEPPED_WEIGHT_ATOL, moved
    change = max(float((a - b).abs().max()) for a, b in zip(reference["stepped_lps"], reference["lps"]) if a.numel())
    assert change > 0.1  # and the logprobs changed by far more than their 1e-5 bound


def test_compute_logprobs_equals_direct_forward(reference):
    assert len(reference["lps"]) == 10 and reference["lps"][3].numel() == 0
    for got, ref in zip(reference["lps"], reference["direct"]):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    # entropy of the temperature-scaled distribution over the real vocabulary (padding columns
    # excluded), against -sum p log p of the direct forward
    assert [e.shape for e in reference["ents"]] == [e.shape for e in reference["direct_ents"]]
    for got, ref in zip(reference["ents"], reference["direct_ents"]):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_micro_batch_split_gives_identical_gradient(reference):
    one, three = reference["one"], reference["three"]
    samples = reference["samples"]
    n_tok = sum(len(s.response_ids) for s in samples if not s.loss_mask_zero)
    assert one["num_tokens"] == three["num_tokens"] == n_tok
    assert three["num_micro_batches"] == 3
    assert _rel(three["loss"], one["loss"]) < 1e-6
    assert 0 < one["pg_clipfrac_lower"] + one["pg_clipfrac_upper"] < 1  # the clip is exercised
    for k in ("pg_clipfrac_lower", "pg_clipfrac_upper", "ppo_kl", "entropy"):
        assert abs(three[k] - one[k]) < 1e-6, k
    num = sum(float((reference["grads_three"][n] - g).norm() ** 2) for n, g in reference["grads_one"].items())
    den = sum(float(g.norm() ** 2) for g in reference["grads_one"].values())
    assert den > 0 and math.sqrt(num / den) < 1e-6


def test_bshd_default_on_cpu_equals_packed_thd(reference):
    """CPU default (padded BSHD rows, LM head at response label positions only) equals the packed
    THD row with a block-diagonal mask and full logits: logprobs, loss and gradients."""
    assert reference["layout_default"] == "bshd" and reference["labels_only_default"]
    for got, ref in zip(reference["thd_lps"], reference["lps"]):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    one, thd = reference["one"], reference["thd_one"]
    assert thd["num_tokens"] == one["num_tokens"] and _rel(thd["loss"], one["loss"]) < 1e-5
    num = sum(float((reference["thd_grads_one"][n] - g).norm() ** 2) for n, g in reference["grads_one"].items())
    den = sum(float(g.norm() ** 2) for g in reference["grads_one"].values())
    assert den > 0 and math.sqrt(num / den) < 1e-5


def test_length_buckets_keep_order_loss_and_gradient(reference):
    """BSHD micro-batches cut into per-length row groups: logprobs come back in the caller's order,
    loss and gradients equal the single-call micro-batch."""
    one, bucket = reference["one"], reference["bucket_one"]
    lens = {s.total_length for s in reference["samples"]}
    assert bucket["num_micro_batches"] == 1 and bucket["num_model_calls"] == len(lens) > 1
    assert one["num_model_calls"] < bucket["num_model_calls"]
    for got, ref in zip(reference["bucket_lps"], reference["direct"]):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert _rel(bucket["loss"], one["loss"]) < 1e-6
    num = sum(float((reference["bucket_grads_one"][n] - g).norm() ** 2) for n, g in reference["grads_one"].items())
    den = sum(float(g.norm() ** 2) for g in reference["grads_one"].values())
    assert den > 0 and math.sqrt(num / den) < 1e-6


def test_loss_value_is_token_mean_of_dapo_objective(reference):
    """Independent recomputation of the mini-batch loss from the direct-forward logprobs."""
    num, n, seq_means = 0.0, 0, []
    for s, lp in zip(reference["samples"], reference["direct"]):
        if s.loss_mask_zero or not s.response_ids:
            continue
        ratio = torch.exp(lp.double() - torch.tensor(s.old_logprobs, dtype=torch.float64))
        a = s.advantage
        per_tok = torch.maximum(-a * ratio, -a * ratio.clamp(1 - 0.2, 1 + 0.28))
        num += float(per_tok.sum())
        n += len(s.response_ids)
        seq_means.append(float(per_tok.mean()))
    assert abs(reference["one"]["loss"] - num / n) < 1e-5
    assert abs(reference["seq_one"]["loss"] - sum(seq_means) / len(seq_means)) < 1e-5


def test_a_two_turn_sample_from_the_hf_engine_trains_on_its_model_tokens_only(reference):
    """test_response_mask.py's check: a sample with tool-like context (response_mask 0) from the HF
    engine through the trajectory hook, trained by the actor with the context out of the loss."""
    check_two_turn_training(reference["two_turn"], 0.2, 0.28)


def test_seq_mean_token_mean_split_invariance(reference):
    one, three = reference["seq_one"], reference["seq_three"]
    assert _rel(three["loss"], one["loss"]) < 1e-6 and one["loss"] != reference["one"]["loss"]
    num = sum(float((reference["seq_grads_three"][n] - g).norm() ** 2)
              for n, g in reference["seq_grads_one"].items())
    den = sum(float(g.norm() ** 2) for g in reference["seq_grads_one"].values())
    assert den > 0 and math.sqrt(num / den) < 1e-6


def test_entropy_bonus_loss_and_split_invariance(reference):
    one, three, plain = reference["ent_one"], reference["ent_three"], reference["one"]
    assert abs(one["loss"] - (plain["pg_loss"] - 0.01 * plain["entropy"])) < 1e-6
    assert abs(three["loss"] - one["loss"]) < 1e-6  # absolute: the loss is a small difference of two terms
    diff = sum(float((reference["ent_grads_one"][n] - g).norm() ** 2) for n, g in reference["grads_one"].items())
    assert diff > 0  # the bonus changes the gradient
    num = sum(float((reference["ent_grads_three"][n] - g).norm() ** 2)
              for n, g in reference["ent_grads_one"].items())
    den = sum(float(g.norm() ** 2) for g in reference["ent_grads_one"].values())
    assert math.sqrt(num / den) < 1e-6


def _dp2_worker(ref_path, out_path):
    import torch.distributed as dist

    from dapo_megatron.actor.actor import MegatronActor
    from dapo_megatron.platform import init_distributed

    torch.use_deterministic_algorithms(True)
    par = init_distributed(ParallelConfig(1, 1), seed=0)
    ref = torch.load(ref_path, weights_only=False)
    cfg = tiny_gpt_config(num_layers=NUM_LAYERS)
    model = tiny_gpt_model(cfg, vocab_size=VOCAB_PADDED)
    _load_full_weights(model, ref["full_sd"], cfg, par)
    actor = MegatronActor(model, _actor_cfg(), total_steps=10, parallel=par, vocab_size=VOCAB)
    order = sorted(ref["samples"], key=lambda s: -s.total_length)
    # rank 0: the 2 longest sequences (22 loss tokens) in one micro-batch; rank 1: the 8 shorter
    # ones (43 loss tokens, incl. an empty and a filtered response) in two
    mine = [order[:2]] if dist.get_rank() == 0 else [order[2:5], order[5:]]
    fb = actor.forward_backward(mine, TEMPERATURE).metrics
    grads = _full_grads(actor)
    step = actor.train_mini_batch(mine, TEMPERATURE, global_num_tokens=int(ref["one"]["num_tokens"])).metrics
    weight_errors = _weight_errors(model, ref["stepped_sd"], cfg, par)
    try:
        actor.train_mini_batch(mine, TEMPERATURE, global_num_tokens=int(ref["one"]["num_tokens"]) - 1)
        wrong_count = "accepted"
    except ValueError as e:
        wrong_count = str(e)
    local_tokens = sum(len(s.response_ids) for mb in mine for s in mb if not s.loss_mask_zero)
    if dist.get_rank() == 0:
        torch.save(dict(fb=fb, grads=grads, step=step, wrong_count=wrong_count, local_tokens=local_tokens,
                        weight_errors=weight_errors), out_path)


@pytest.mark.dist
def test_dp2_with_uneven_ranks_equals_dp1(reference, tmp_path):
    ref_path = str(tmp_path / "ref.pt")
    torch.save(reference, ref_path)
    out_path = str(tmp_path / "dp2.pt")
    spawn(_dp2_worker, 2, ref_path, out_path)
    out = torch.load(out_path, weights_only=False)
    one = reference["one"]
    assert out["fb"]["num_tokens"] == one["num_tokens"] and out["local_tokens"] <= one["num_tokens"] / 2 - 10
    assert _rel(out["fb"]["loss"], one["loss"]) < 1e-6
    num = sum(float((out["grads"][n] - g).norm() ** 2) for n, g in reference["grads_one"].items())
    den = sum(float(g.norm() ** 2) for g in reference["grads_one"].values())
    assert math.sqrt(num / den) < 1e-6
    assert _rel(out["step"]["grad_norm"], reference["step"]["grad_norm"]) < 1e-6
    worst = max(out["weight_errors"], key=out["weight_errors"].get)  # after the (distributed) optimizer step
    assert out["weight_errors"][worst] < STEPPED_WEIGHT_ATOL, (worst, out["weight_errors"][worst])
    assert "global_num_tokens" in out["wrong_count"]


def model_parallel_actor(ref_path, tp, pp, actor_cfg):
    """(actor, reference dict) on this rank of a TP x PP world, with the reference's TP=1 weights."""
    from dapo_megatron.actor.actor import MegatronActor
    from dapo_megatron.platform import init_distributed

    torch.use_deterministic_algorithms(True)
    par = init_distributed(ParallelConfig(tp, pp), seed=0)
    ref = torch.load(ref_path, weights_only=False)
    cfg = tiny_gpt_config(tp=tp, pp=pp, num_layers=NUM_LAYERS)
    model = tiny_gpt_model(cfg, vocab_size=VOCAB_PADDED, parallel=par)
    _load_full_weights(model, ref["full_sd"], cfg, par)
    return MegatronActor(model, actor_cfg, total_steps=10, parallel=par, vocab_size=VOCAB), ref


def _model_parallel_worker(ref_path, out_path, tp, pp):
    import torch.distributed as dist

    actor, ref = model_parallel_actor(ref_path, tp, pp, _actor_cfg())
    samples = ref["samples"]
    lps = actor.compute_logprobs([samples[:5], samples[5:]], TEMPERATURE)
    step = actor.train_mini_batch([samples[:4], samples[4:]], TEMPERATURE).metrics
    weight_errors = _weight_errors(actor.model_chunks[0].module, ref["stepped_sd"], actor.config, actor.parallel)
    stepped_lps = actor.compute_logprobs([samples[:5], samples[5:]], TEMPERATURE)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"lps": lps, "step": step, "weight_errors": weight_errors,
                                      "stepped_lps": stepped_lps})
    if dist.get_rank() == 0:
        torch.save(gathered, out_path)


@pytest.mark.dist
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_tp2_and_pp2_match_tp1(reference, tmp_path, tp, pp):
    """TP=2 and PP=2 (1F1B, tied embeddings): same loss, grad norm and logprobs, and after the
    optimizer step the same weights (each rank's shard / stage, both tied embedding copies at
    PP=2) and logprobs as TP=1."""
    ref_path = str(tmp_path / "ref.pt")
    torch.save(reference, ref_path)
    out_path = str(tmp_path / "mp.pt")
    spawn(_model_parallel_worker, 2, ref_path, out_path, tp, pp)
    ranks = torch.load(out_path, weights_only=False)
    for r in ranks:  # every rank of the model-parallel group returns the same numbers
        for got, want in zip(r["lps"], reference["lps"]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert _rel(r["step"]["loss"], reference["step"]["loss"]) < 1e-5
        assert _rel(r["step"]["grad_norm"], reference["step"]["grad_norm"]) < 1e-5
        assert r["step"]["skipped"] == 0.0
        # after the optimizer step: every weight (tied embedding copies included) and the logprobs
        for got, want in zip(r["stepped_lps"], reference["stepped_lps"]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        worst = max(r["weight_errors"], key=r["weight_errors"].get)
        assert r["weight_errors"][worst] < STEPPED_WEIGHT_ATOL, (worst, r["weight_errors"][worst])
    if pp == 2:  # the last stage holds its own copy of the tied embedding: the output layer
        assert "output_layer.weight" in ranks[1]["weight_errors"]
        assert "embedding.word_embeddings.weight" in ranks[0]["weight_errors"]


def _nan_and_schedule_worker(out_path):
    from dapo_megatron.actor.actor import MegatronActor
    from dapo_megatron.platform import init_distributed

    par = init_distributed(seed=0)
    torch.manual_seed(0)
    model = tiny_gpt_model(tiny_gpt_config(num_layers=2), vocab_size=VOCAB_PADDED)
    # every token TIS-corrected (rollout_is_scope='all'): a NaN rollout logprob reaches the loss
    actor = MegatronActor(model, _actor_cfg(rollout_is_scope="all"), total_steps=10, parallel=par, vocab_size=VOCAB)
    samples = _mini_batch_samples(seed=7)
    for s, lp in zip(samples, actor.compute_logprobs([samples], TEMPERATURE)):
        s.old_logprobs = lp.tolist()

    def snapshot():
        return [p.detach().clone() for p in actor.model_chunks[0].module.parameters()]

    res = {"lrs": [], "changed": []}
    for i in range(5):
        before = snapshot()
        if i == 1:  # a NaN rollout logprob makes the TIS weight, the loss and the gradients NaN
            samples[0].rollout_logprobs[0] = float("nan")
        if i == 2:  # a NaN old logprob: NaN loss, but the clamped log-ratio passes no (NaN) gradient
            samples[0].rollout_logprobs[0] = 0.0
            samples[0].old_logprobs[0], good = float("nan"), samples[0].old_logprobs[0]
        m = actor.train_mini_batch([samples], TEMPERATURE).metrics
        if i == 2:
            samples[0].old_logprobs[0] = good
        res["lrs"].append((m["lr"], m["skipped"], m["grad_norm"]))
        res["changed"].append(any(not torch.equal(a, b) for a, b in zip(before, snapshot())))
        res.setdefault("finite", []).append(all(bool(torch.isfinite(p).all()) for p in snapshot()))
    res["num_steps"] = actor.scheduler.num_steps
    filtered = [s for s in samples]
    for s in filtered:
        s.loss_mask_zero = True
    before = snapshot()
    res["all_filtered"] = actor.train_mini_batch([filtered], TEMPERATURE).metrics
    res["all_filtered_changed"] = any(not torch.equal(a, b) for a, b in zip(before, snapshot()))
    torch.save(res, out_path)


def test_nan_step_is_skipped_and_warmup_schedule(tmp_path):
    path = str(tmp_path / "nan.pt")
    spawn(_nan_and_schedule_worker, 1, path)
    res = torch.load(path, weights_only=False)
    lrs = res["lrs"]
    # Megatron warm-up: lr_k = init + (lr - init) * k / warmup for the k-th successful step (k from 0)
    assert lrs[0][:2] == (5e-4, 0.0) and math.isfinite(lrs[0][2]) and lrs[0][2] > 0
    assert lrs[1][1] == 1.0 and math.isnan(lrs[1][2])  # NaN gradients: skipped by the optimizer, reported
    assert lrs[2][1] == 1.0 and math.isnan(lrs[2][2])  # NaN loss: skipped by the actor
    assert lrs[3][0] == pytest.approx(7.5e-4, rel=1e-12) and lrs[3][1] == 0.0  # scheduler did not advance
    assert lrs[4][0] == pytest.approx(1e-3, rel=1e-12)
    assert res["changed"] == [True, False, False, True, True]
    assert all(res["finite"]) and res["num_steps"] == 3
    assert res["all_filtered"]["skipped"] == 1.0 and res["all_filtered"]["num_tokens"] == 0
    assert not res["all_filtered_changed"]


def test_config_errors_name_the_field():
    from dapo_megatron.actor.actor import ActorConfig, OptimConfig

    with pytest.raises(ValueError, match="loss_agg_mode"):
        ActorConfig(loss_agg_mode="seq-mean-token-sum-norm").validate()
    with pytest.raises(ValueError, match="micro_batch_layout"):
        ActorConfig(micro_batch_layout="sbhd").validate()
    with pytest.raises(ValueError, match="lr_warmup_steps"):
        OptimConfig(lr_warmup_steps=20).check_total_steps(20)
    with pytest.raises(ValueError, match="lr_decay_style"):
        OptimConfig(lr_decay_style="wsd").validate()
