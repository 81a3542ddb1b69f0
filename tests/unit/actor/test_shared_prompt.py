"""Shared-prompt forward (Prefix Grouper) in MegatronActor: exactly the copied computation.

The same samples (GRPO groups: one prompt, several responses; an empty response, an
overlong-filtered one, a lone sample) go through the actor twice, with
``plan.shared_prompt`` off (every response with its own copy of the prompt) and on (the
prompt encoded once per micro-batch): logprobs, entropy, loss, metrics and every
parameter's gradient agree to fp32 round-off, for both layouts, with the LM head on all
rows or on the label rows only, at TP=1, TP=2 and PP=2. Also: FP8 padding (forced on through the plan) changes no loss, metric or token
count; the plan's choices and errors.
"""

import pytest
import torch

from dapo_megatron.platform import spawn
from unit.actor.test_actor import VOCAB, _full_grads, _rel, model_parallel_actor, reference_model
from unit.actor.test_packing import _sample, tiny_gpt_config, tiny_gpt_model

TEMPERATURE = 0.8
KEYS = ("loss", "pg_loss", "pg_clipfrac_lower", "pg_clipfrac_upper", "ppo_kl", "entropy", "num_tokens")


def _groups(seed=3):
    """3 groups of 4 responses (one empty, one overlong-filtered) and one lone sample; old logprobs
    and advantages are filled by the worker."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for p, P in enumerate((9, 5, 12)):
        prompt = torch.randint(0, VOCAB, (P,), generator=g).tolist()
        for k in range(4):
            R = 0 if (p, k) == (1, 2) else int(torch.randint(1, 11, (1,), generator=g))
            s = _sample(prompt, torch.randint(0, VOCAB, (R,), generator=g).tolist(), group_id=p)
            s.rollout_logprobs = (-torch.rand(R, generator=g)).tolist()
            s.loss_mask_zero = (p, k) == (2, 1)
            s.advantage = float(torch.randn((), generator=g))
            out.append(s)
    out.append(_sample(torch.randint(0, VOCAB, (7,), generator=g).tolist(), [3, 4, 5], group_id=3))
    out[-1].advantage = 0.5
    return out


def _actor_cfg(**kw):
    from dapo_megatron.actor.actor import ActorConfig, OptimConfig

    o = OptimConfig(lr=1e-3, weight_decay=0.01, clip_grad=1.0)
    # every token TIS-corrected (rollout_is_scope="all", cap 2): the weights go through the shared form too
    return ActorConfig(ppo_max_token_len_per_gpu=512, entropy_coeff=0.01, rollout_is_scope="all", optim=o, **kw)


def _run(actor, samples, micro_batches):
    """logprobs / entropies (no grad), then one forward_backward: metrics and full gradients."""
    mbs = [[samples[i] for i in mb] for mb in micro_batches]
    lps, ents = actor.compute_logprobs(mbs, TEMPERATURE, return_entropy=True)
    fb = actor.forward_backward(mbs, TEMPERATURE).metrics
    return dict(lps=lps, ents=ents, fb=fb, grads=_full_grads(actor))


def _compare_paths(actor, samples, cut):
    """Every plan variant the rank can run, copied vs shared (and the copied form of the default)."""
    base = actor.plan
    # the same variants on every rank (a PP stage without the LM head runs them all alike)
    variants = {"default": {}, "thd": dict(layout="thd", build_attention_mask=True, length_buckets=False),
                "bshd-all-rows": dict(logits_at_labels_only=False)}
    out = {}
    for name, change in variants.items():
        for mode in ("off", "on"):
            actor.plan = base.replace(shared_prompt=mode, **change)
            out[(name, mode)] = _run(actor, samples, cut)
    actor.plan = base
    return out


def _old_logprobs(samples, seed=1):
    g = torch.Generator().manual_seed(seed)
    for s in samples:  # off-policy enough that the clip and TIS are exercised
        s.old_logprobs = (-torch.rand(len(s.response_ids), generator=g) * 3).tolist()


CUT = [list(range(0, 7)), list(range(7, 13))]  # group 1 is split over two micro-batches


def _reference_worker(out_path):
    from dapo_megatron.actor.actor import MegatronActor
    from dapo_megatron.actor.micro_batch import make_micro_batches

    model, full_sd, par = reference_model()
    actor = MegatronActor(model, _actor_cfg(shared_prompt="on"), total_steps=10, parallel=par, vocab_size=VOCAB)
    samples = _groups()
    _old_logprobs(samples)
    res = {"full_sd": full_sd, "samples": samples, "plan": actor.plan}
    res["paths"] = _compare_paths(actor, samples, CUT)
    actor.cfg.loss_agg_mode = "seq-mean-token-mean"
    for mode in ("off", "on"):
        actor.plan = actor.plan.replace(shared_prompt=mode)
        res[("seq", mode)] = _run(actor, samples, CUT)
    actor.cfg.loss_agg_mode = "token-mean"
    # FP8 padding forced on through the plan (TE is absent on CPU): 16 and 32 tokens
    for align in (1, 16, 32):
        for mode in ("off", "on"):
            for layout in ("bshd", "thd"):
                change = {} if layout == "bshd" else dict(layout="thd", build_attention_mask=True,
                                                          length_buckets=False)
                actor.plan = res["plan"].replace(shared_prompt=mode, fp8_align=align, **change)
                mbs, _ = make_micro_batches([[samples[i] for i in mb] for mb in CUT], actor.plan,
                                            device="cpu")
                res[("fp8", align, mode, layout)] = dict(
                    run=_run(actor, samples, CUT), shapes=[tuple(m.batch.input_ids.shape) for m in mbs])
    # auto: shared where it saves tokens, the copied form where no two samples share a prompt
    actor.plan = res["plan"].replace(shared_prompt="auto")
    res["auto_groups"] = actor.forward_backward([samples[:12]], TEMPERATURE).metrics
    res["auto_lone"] = actor.forward_backward([[samples[0], samples[4], samples[8], samples[12]]], TEMPERATURE).metrics
    res["plan_resolution"] = _plan_resolution()  # in this world too: a spawned world of its own cost ~9 s
    torch.save(res, out_path)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("shared") / "ref.pt")
    spawn(_reference_worker, 1, path)
    return torch.load(path, weights_only=False)


def _assert_same_computation(got, want, tol=1e-5):
    """logprobs, entropies (per token), metrics and each parameter's gradient within ``tol`` relative."""
    assert len(got["lps"]) == len(want["lps"])
    for x, y in zip(got["lps"] + got["ents"], want["lps"] + want["ents"]):
        assert x.shape == y.shape
        if y.numel():
            assert float((x - y).abs().max()) <= tol * max(float(y.abs().max()), 1.0)
    for k in KEYS:
        assert abs(got["fb"][k] - want["fb"][k]) <= tol * max(abs(want["fb"][k]), 1e-3), k
    assert got["fb"]["num_tokens"] == want["fb"]["num_tokens"] and got["fb"]["tokens_copied"] == (
        want["fb"]["tokens_copied"])
    for name, g in want["grads"].items():
        den = float(g.norm())
        assert den > 0, name  # every parameter gets a gradient
        assert float((got["grads"][name] - g).norm()) <= tol * den, name


def test_shared_prompt_equals_copied_form_tp1(reference):
    paths = reference["paths"]
    assert reference["plan"].shared_prompt == "on" and reference["plan"].layout == "bshd"
    for name in ("default", "thd", "bshd-all-rows"):
        on, off = paths[(name, "on")], paths[(name, "off")]
        _assert_same_computation(on, off)
        # fewer tokens computed, each prompt once per micro-batch: group 0 (P=9) saves 3 copies;
        # group 1 (P=5) has samples 4-6 in the first micro-batch (2 copies saved, one of them the
        # empty response's) and sample 7 alone in the second; group 2 (P=12) saves 3 copies
        real_on = on["fb"]["tokens_computed"] - on["fb"]["tokens_padding"]
        real_off = off["fb"]["tokens_computed"] - off["fb"]["tokens_padding"]
        assert real_off == off["fb"]["tokens_copied"] == on["fb"]["tokens_copied"]
        assert real_off - real_on == 3 * 9 + 2 * 5 + 3 * 12
    _assert_same_computation(reference[("seq", "on")], reference[("seq", "off")])
    # the copied form of every path is the same computation too (layout floor)
    _assert_same_computation(paths[("thd", "off")], paths[("default", "off")])


def test_fp8_padding_changes_no_loss_metric_or_token_count(reference):
    base = {mode: {lay: reference[("fp8", 1, mode, lay)]["run"] for lay in ("bshd", "thd")} for mode in ("off", "on")}
    for align in (16, 32):
        for mode in ("off", "on"):
            for layout in ("bshd", "thd"):
                got = reference[("fp8", align, mode, layout)]
                assert all((B * T) % align == 0 for B, T in got["shapes"]), got["shapes"]
                want = base[mode][layout]
                # the padding adds computed tokens and nothing else
                assert got["run"]["fb"]["tokens_padding"] > want["fb"]["tokens_padding"]
                assert got["run"]["fb"]["tokens_computed"] - got["run"]["fb"]["tokens_padding"] == (
                    want["fb"]["tokens_computed"] - want["fb"]["tokens_padding"])
                _assert_same_computation(got["run"], want, tol=1e-6)


def test_auto_shares_only_where_it_saves_tokens(reference):
    groups, lone = reference["auto_groups"], reference["auto_lone"]
    assert groups["tokens_computed"] - groups["tokens_padding"] == groups["tokens_copied"] - (3 * 9 + 3 * 5 + 3 * 12)
    assert lone["tokens_computed"] - lone["tokens_padding"] == lone["tokens_copied"]  # 4 distinct prompts


def _model_parallel_worker(ref_path, out_path, tp, pp):
    import torch.distributed as dist

    actor, ref = model_parallel_actor(ref_path, tp, pp, _actor_cfg(shared_prompt="on"))
    res = {"plan": actor.plan, "paths": _compare_paths(actor, ref["samples"], CUT),
           "last_stage": dist.get_rank() == dist.get_world_size() - 1}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, res)
    if dist.get_rank() == 0:
        torch.save(gathered, out_path)


@pytest.mark.dist
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_shared_prompt_equals_copied_form_tp2_pp2(reference, tmp_path, tp, pp):
    """TP=2 (vocab-parallel logprobs, LM head on the label rows or, as under sequence parallelism,
    on every row with the shared rows gathered from its output) and PP=2 (1F1B, RoPE hooked on
    both stages). Sequence parallelism itself cannot run on CPU: megatron-core's torch norm
    asserts ``not sequence_parallel`` without Apex."""
    ref_path = str(tmp_path / "ref.pt")
    torch.save({k: reference[k] for k in ("full_sd", "samples")}, ref_path)
    out_path = str(tmp_path / "mp.pt")
    spawn(_model_parallel_worker, 2, ref_path, out_path, tp, pp)
    ranks = torch.load(out_path, weights_only=False)
    for r in ranks:
        assert r["plan"].shared_prompt == "on" and r["plan"].seq_multiple == 1
        assert r["plan"].logits_at_labels_only == (pp == 1 or r["last_stage"])
        for name in {n for n, _ in r["paths"]}:
            _assert_same_computation(r["paths"][(name, "on")], r["paths"][(name, "off")])
        # and the same numbers as the TP=1 copied form
        for x, y in zip(r["paths"][("default", "on")]["lps"], reference["paths"][("default", "off")]["lps"]):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=0)
        for k in ("loss", "entropy"):
            assert _rel(r["paths"][("default", "on")]["fb"][k], reference["paths"][("default", "off")]["fb"][k]) < 1e-5


class TEDotProductAttention(torch.nn.Module):
    """Stands for TE's core attention: the plan looks for a module of this class name."""


def _plan_resolution() -> dict:
    """The plans resolved for a fresh tiny model (local spec, FP8 recipes, a TE attention module);
    run inside the reference worker's world (``torch.distributed`` initialised)."""
    from dapo_megatron.actor.plan import resolve_actor_plan

    res = {}
    model = tiny_gpt_model(tiny_gpt_config())
    res["local_auto"] = resolve_actor_plan(_actor_cfg(), model, tp_size=1)
    for recipe in ("delayed", "tensorwise", "blockwise", "mxfp8"):
        model.config.fp8, model.config.fp8_recipe = "e4m3", recipe
        res[recipe] = resolve_actor_plan(_actor_cfg(), model, tp_size=1).fp8_align
    model.config.fp8 = None
    model.decoder.add_module("te_probe", TEDotProductAttention())
    res["te_auto"] = resolve_actor_plan(_actor_cfg(), model, tp_size=1)
    try:
        resolve_actor_plan(_actor_cfg(shared_prompt="on"), model, tp_size=1)
    except ValueError as e:
        res["te_on"] = str(e)
    return res


def test_plan_resolution_fp8_alignment_and_shared_prompt_support(reference):
    res = reference["plan_resolution"]
    local = res["local_auto"]
    assert (local.layout, local.shared_prompt, local.fp8_align, local.length_buckets) == ("bshd", "auto", 1, True)
    # megatron-core 0.16.1 fp8_utils.get_fp8_align_size: 32 for mxfp8, 16 for every other recipe
    assert [res[r] for r in ("delayed", "tensorwise", "blockwise", "mxfp8")] == [16, 16, 16, 32]
    te = res["te_auto"]
    assert te.layout == "thd" and te.use_packed_seq_params and te.shared_prompt == "off"
    assert "PackedSeqParams" in te.shared_prompt_off_reason
    assert res["te_on"].startswith("actor.shared_prompt='on' cannot run on this path")
    with pytest.raises(ValueError, match="shared_prompt"):
        te.replace(shared_prompt="on")
    from dapo_megatron.actor.actor import ActorConfig

    with pytest.raises(ValueError, match="^shared_prompt='yes'"):  # the loader prefixes the section
        ActorConfig(shared_prompt="yes").validate()
    # YAML 1.1 reads on / off as booleans: a file or an override still means what it says
    from dapo_megatron.config import DAPOConfig, load_config

    for word in ("on", "off", "auto"):
        cfg = load_config(DAPOConfig, None, [f"actor.shared_prompt={word}", "model.hf_path=unused"])
        assert cfg.actor.shared_prompt == word


@pytest.mark.slow
@pytest.mark.dist
def test_main_job_first_step_same_with_and_without_shared_prompt(first_step):
    """The README main job (SmolLM2-135M, TP=2, BSHD on CPU, fp32, same seeds), first step with
    actor.shared_prompt off and at its default (auto, which shares here: asserted by the ratio):
    the same rollout, and the same loss, grad norm and entropy within 1e-5 relative, while the
    shared form computes fewer tokens. The shared run is the TP=2 run of
    tests/integration/test_trainer_parallel_parity.py (``first_step`` runs it once a session)."""
    off = first_step(2, 1, "actor.shared_prompt=off")
    on = first_step(2, 1)
    assert off["rollout/kept_groups"] >= 1 and off["actor/grad_norm"] > 0
    for key in ("rollout/gen_tokens", "rollout/gen_reward_mean", "rollout/kept_groups", "actor/num_tokens"):
        assert on[key] == off[key], key
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert _rel(on[key], off[key]) <= 1e-5, (key, on[key], off[key])
    assert on["actor/tokens_copied"] == off["actor/tokens_copied"]
    assert off["actor/shared_prompt_ratio"] == 1.0 and on["actor/shared_prompt_ratio"] < 0.7
    print({key: (off[key], on[key], _rel(on[key], off[key])) for key in ("actor/pg_loss", "actor/grad_norm",
          "actor/entropy", "actor/shared_prompt_ratio", "actor/padding_share", "time/update_s")})
