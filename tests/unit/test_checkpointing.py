"""Trainer checkpointing: exact resume, crash atomicity, per-rank RNG, the buffer surplus and reader position kept.

The 2-process tests build a tiny GPTModel (dropout on, so RNG matters) with Megatron DDP,
the distributed optimizer sharded over DP=2 and a warm-up LR scheduler, and compare a
resumed run against an uninterrupted one step for step.
"""

import os
import random

import numpy as np
import pytest
import torch

from dapo_megatron import checkpointing as ckpt
from dapo_megatron.platform import ParallelConfig, spawn

VOCAB, SEQ, BATCH = 64, 8, 2


# ----------------------------------------------------------------- helpers run in each rank


def _build(tp: int):
    """Tiny GPT + DDP + distributed optimizer + scheduler on the current world, and its layout."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer import TransformerConfig

    from dapo_megatron.platform import init_distributed

    par = init_distributed(ParallelConfig(tp, 1), seed=11)
    cfg = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, tensor_model_parallel_size=tp, use_cpu_initialization=True,
        hidden_dropout=0.2, attention_dropout=0.2,
    )
    model = GPTModel(
        cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=VOCAB,
        max_sequence_length=SEQ, position_embedding_type="rope",
    )
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, min_lr=1e-3, use_distributed_optimizer=True, clip_grad=1.0), [ddp]
    )
    sched = OptimizerParamScheduler(
        opt, init_lr=2e-3, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=3, lr_decay_steps=10,
        lr_decay_style="cosine", start_wd=0.0, end_wd=0.0, wd_incr_steps=10, wd_incr_style="constant",
    )
    return ddp, opt, sched, par


def _seed_this_rank(par):
    """Trainer-style seeding per DP rank (TP ranks must share data and dropout masks).

    Megatron keeps the default streams equal across TP ranks and makes only the
    tracker's model-parallel stream TP-rank specific, so with DP=2 the default streams
    differ per rank and with TP=2 the tracker stream does.
    """
    r = par.dp_rank
    random.seed(100 + r)
    np.random.seed(200 + r)
    torch.manual_seed(300 + r)


def _train_step(ddp, opt, sched):
    """One step on data drawn from this rank's RNG (python, numpy and torch all used)."""
    offset = random.randrange(VOCAB)
    scale = float(np.random.uniform(0.5, 1.5))
    ids = (torch.randint(0, VOCAB, (BATCH, SEQ)) + offset) % VOCAB
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    opt.zero_grad()
    ddp.zero_grad_buffer()
    loss = ddp(ids, pos, None, labels=ids).float().mean() * scale  # dropout draws RNG too
    loss.backward()
    ddp.finish_grad_sync()
    ok, grad_norm, _ = opt.step()
    assert ok
    sched.step(1)
    return loss.item(), float(grad_norm), opt.param_groups[0]["lr"]


def _params(ddp):
    return {n: p.detach().clone() for n, p in ddp.module.named_parameters()}


def _rng_probe():
    """Next draws of every RNG stream of this rank, leaving the streams untouched."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = ckpt.get_rng_state()
    probe = {"random": random.random(), "numpy": float(np.random.rand()), "torch": torch.rand(3)}
    with get_cuda_rng_tracker().fork():
        probe["tracker"] = torch.rand(3)
    ckpt.set_rng_state(state)
    return probe


def _out(out_dir, name):
    import torch.distributed as dist

    return os.path.join(out_dir, f"{name}_rank{dist.get_rank()}.pt")


def _run_full(out_dir, tp, steps):
    ddp, opt, sched, par = _build(tp)
    _seed_this_rank(par)
    hist = [_train_step(ddp, opt, sched) for _ in range(steps)]
    torch.save({"hist": hist, "params": _params(ddp)}, _out(out_dir, "full"))


def _run_first_half(out_dir, run_dir, tp, steps):
    ddp, opt, sched, par = _build(tp)
    _seed_this_rank(par)
    hist = [_train_step(ddp, opt, sched) for _ in range(steps)]
    import torch.distributed as dist

    positions = [None] * dist.get_world_size()
    dist.all_gather_object(positions, {"rank": dist.get_rank(), "reader_pos": 7 * steps})
    ckpt.save_checkpoint(run_dir, steps, [ddp], opt, sched, {"step": steps, "readers": positions}, parallel=par)
    torch.save({"hist": hist, "probe": _rng_probe()}, _out(out_dir, "first"))


def _run_second_half(out_dir, run_dir, tp, steps):
    ddp, opt, sched, par = _build(tp)
    _seed_this_rank(par)  # a fresh process seeds as usual; load must win over this
    state = ckpt.load_checkpoint(run_dir, [ddp], opt, sched, parallel=par)
    probe = _rng_probe()
    hist = [_train_step(ddp, opt, sched) for _ in range(steps)]
    torch.save({"state": state, "probe": probe, "hist": hist, "params": _params(ddp)}, _out(out_dir, "second"))


def _run_save_before_first_step(out_dir, run_dir, tp, steps):
    """Save before any optimizer step (a first step that kept no group), then train on."""
    ddp, opt, sched, par = _build(tp)
    _seed_this_rank(par)
    ckpt.save_checkpoint(run_dir, 0, [ddp], opt, sched, {"step": 0}, parallel=par)
    hist = [_train_step(ddp, opt, sched) for _ in range(steps)]
    torch.save({"hist": hist, "params": _params(ddp)}, _out(out_dir, "early"))


def _run_crash(out_dir, run_dir):
    ddp, opt, sched, par = _build(2)  # TP=2: replicated and TP-sharded weights, TP-specific RNG
    _seed_this_rank(par)
    _train_step(ddp, opt, sched)
    ckpt.save_checkpoint(run_dir, 1, [ddp], opt, sched, {"step": 1}, max_ckpt_to_keep=2, parallel=par)
    at_step1, probe_step1 = _params(ddp), _rng_probe()
    _train_step(ddp, opt, sched)

    real_save_rng = ckpt._save_rng_state

    def crash_after_model_written(tmp_dir):
        # the model/optimizer shards are already in tmp_dir; die before the rename
        assert os.path.isfile(os.path.join(tmp_dir, "metadata.json"))
        raise RuntimeError("simulated crash")

    ckpt._save_rng_state = crash_after_model_written
    try:
        ckpt.save_checkpoint(run_dir, 2, [ddp], opt, sched, {"step": 2}, max_ckpt_to_keep=2, parallel=par)
        crashed = False
    except RuntimeError as e:
        crashed = "simulated crash" in str(e)
    finally:
        ckpt._save_rng_state = real_save_rng
    root = ckpt.checkpoints_dir(run_dir)
    after_crash = {"latest": ckpt.read_latest_step(run_dir), "entries": sorted(os.listdir(root))}

    import torch.distributed as dist

    dist.barrier()
    state = ckpt.load_checkpoint(run_dir, [ddp], opt, sched, parallel=par)
    probe_loaded = _rng_probe()
    params_loaded = _params(ddp)
    same = all(torch.equal(params_loaded[n], at_step1[n]) for n in at_step1)
    # train on and save twice more: the stale tmp dir goes, pruning keeps the newest two
    _train_step(ddp, opt, sched)
    ckpt.save_checkpoint(run_dir, 2, [ddp], opt, sched, {"step": 2}, max_ckpt_to_keep=2, parallel=par)
    _train_step(ddp, opt, sched)
    ckpt.save_checkpoint(run_dir, 3, [ddp], opt, sched, {"step": 3}, max_ckpt_to_keep=2, parallel=par)
    final = {"latest": ckpt.read_latest_step(run_dir), "entries": sorted(os.listdir(root))}
    torch.save(
        {
            "crashed": crashed, "after_crash": after_crash, "state": state, "same": same,
            "final": final, "probes": (probe_step1, probe_loaded),
        },
        _out(out_dir, "crash"),
    )


# ----------------------------------------------------------------- 2-process tests


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_resume_matches_uninterrupted_run_and_restores_rng_per_rank(tmp_path):
    """DP=2: the distributed optimizer's state is sharded over the two ranks."""
    out, run_dir, tp = str(tmp_path), str(tmp_path / "run"), 1
    spawn(_run_full, 2, out, tp, 4)
    spawn(_run_first_half, 2, out, run_dir, tp, 2)
    spawn(_run_second_half, 2, out, run_dir, tp, 2)

    for r in range(2):
        full = torch.load(os.path.join(out, f"full_rank{r}.pt"), weights_only=False)
        first = torch.load(os.path.join(out, f"first_rank{r}.pt"), weights_only=False)
        second = torch.load(os.path.join(out, f"second_rank{r}.pt"), weights_only=False)
        # (a) identical loss, grad norm and lr step for step, bitwise-equal final weights
        assert first["hist"] + second["hist"] == full["hist"]
        assert full["params"].keys() == second["params"].keys()
        for name, p in full["params"].items():
            assert torch.equal(p, second["params"][name]), name
        assert second["state"] == {
            "step": 2,
            "readers": [{"rank": 0, "reader_pos": 14}, {"rank": 1, "reader_pos": 14}],
        }
        # (c) this rank's streams continue exactly where the saved run left them
        p1, p2 = first["probe"], second["probe"]
        assert p1["random"] == p2["random"] and p1["numpy"] == p2["numpy"]
        assert torch.equal(p1["torch"], p2["torch"]) and torch.equal(p1["tracker"], p2["tracker"])

    # (c) the DP ranks' streams differ, so a replicated (rank-0) RNG file would have failed above
    p0 = torch.load(os.path.join(out, "first_rank0.pt"), weights_only=False)["probe"]
    p1 = torch.load(os.path.join(out, "first_rank1.pt"), weights_only=False)["probe"]
    assert p0["random"] != p1["random"] and p0["numpy"] != p1["numpy"]
    assert not torch.equal(p0["torch"], p1["torch"])
    step_dir = ckpt.step_dir(run_dir, 2)
    assert sorted(os.listdir(os.path.join(step_dir, "rng"))) == ["rank_0.pt", "rank_1.pt"]
    assert open(os.path.join(run_dir, "checkpoints", "latest")).read().strip() == "2"


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_checkpoint_before_the_first_optimizer_step(tmp_path):
    """A checkpoint written before any optimizer step (megatron-core's CPU optimizer has no
    state yet) neither fails nor changes the run that goes on, and resumes exactly."""
    out, run_dir, tp = str(tmp_path), str(tmp_path / "run"), 1
    spawn(_run_full, 2, out, tp, 2)
    spawn(_run_save_before_first_step, 2, out, run_dir, tp, 2)
    spawn(_run_second_half, 2, out, run_dir, tp, 2)
    for r in range(2):
        full = torch.load(os.path.join(out, f"full_rank{r}.pt"), weights_only=False)
        for name in ("early", "second"):  # the saving run itself, then the run resumed from step 0
            run = torch.load(os.path.join(out, f"{name}_rank{r}.pt"), weights_only=False)
            assert run["hist"] == full["hist"], name
            for p, value in full["params"].items():
                assert torch.equal(value, run["params"][p]), (name, p)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_crash_mid_save_keeps_previous_checkpoint(tmp_path):
    """TP=2: a crash between writing the shards and the rename; then load and save on."""
    out, run_dir = str(tmp_path), str(tmp_path / "run")
    spawn(_run_crash, 2, out, run_dir)
    res = torch.load(os.path.join(out, "crash_rank0.pt"), weights_only=False)
    res1 = torch.load(os.path.join(out, "crash_rank1.pt"), weights_only=False)
    assert res["crashed"] and res1["crashed"]
    assert res["after_crash"]["latest"] == 1
    entries = res["after_crash"]["entries"]
    assert "step_1" in entries and "step_2" not in entries
    assert any(e.startswith("step_2.tmp-") for e in entries)  # the half-written save
    assert res["state"] == {"step": 1} and res1["state"] == {"step": 1}
    assert res["same"] and res1["same"]  # weights of step 1 restored bitwise on both TP ranks
    for r in (res, res1):  # RNG of each rank is back at the state of step 1
        saved, loaded = r["probes"]
        assert saved["random"] == loaded["random"] and saved["numpy"] == loaded["numpy"]
        assert torch.equal(saved["torch"], loaded["torch"])
        assert torch.equal(saved["tracker"], loaded["tracker"])
    # Megatron's model-parallel stream is TP-rank specific: per-rank files are needed
    assert not torch.equal(res["probes"][0]["tracker"], res1["probes"][0]["tracker"])
    # the next saves removed the stale tmp dir and pruned step_1 (max_ckpt_to_keep=2)
    assert res["final"] == {"latest": 3, "entries": ["latest", "step_2", "step_3"]}


# ----------------------------------------------------------------- commit protocol on disk


def _fake_complete(run_dir, step):
    d = ckpt.step_dir(run_dir, step)
    os.makedirs(d)
    open(os.path.join(d, ckpt.INFO_FILENAME), "w").write("{}")
    return d


def test_latest_is_only_advanced_after_the_rename(tmp_path):
    run_dir = str(tmp_path)
    assert ckpt.read_latest_step(run_dir) is None  # nothing to resume
    root = ckpt.checkpoints_dir(run_dir)
    _fake_complete(run_dir, 1)
    ckpt._update_latest(root, 1)
    # crash after the rename of step 2, before `latest` was rewritten
    tmp = os.path.join(root, "step_2.tmp-abc123")
    os.makedirs(tmp)
    ckpt._rename_into_place(tmp, ckpt.step_dir(run_dir, 2))
    assert ckpt.read_latest_step(run_dir) == 1
    assert ckpt.list_checkpoint_steps(run_dir) == [1, 2]
    ckpt._update_latest(root, 2)
    assert ckpt.read_latest_step(run_dir) == 2
    assert sorted(os.listdir(root)) == ["latest", "step_1", "step_2"]  # no temp files left


def test_resaving_an_existing_step_and_dangling_latest(tmp_path):
    run_dir = str(tmp_path)
    root = ckpt.checkpoints_dir(run_dir)
    _fake_complete(run_dir, 1)
    old = _fake_complete(run_dir, 3)
    open(os.path.join(old, "marker"), "w").write("old")
    ckpt._update_latest(root, 3)
    new_tmp = os.path.join(root, "step_3.tmp-def456")
    os.makedirs(new_tmp)
    open(os.path.join(new_tmp, "marker"), "w").write("new")
    ckpt._rename_into_place(new_tmp, ckpt.step_dir(run_dir, 3))
    assert open(os.path.join(ckpt.step_dir(run_dir, 3), "marker")).read() == "new"
    moved_aside = [e for e in os.listdir(root) if e.startswith("step_3.tmp-")]
    assert len(moved_aside) == 1  # the old copy, cleaned by the next save
    ckpt._clean_stale_tmp_dirs(root)
    assert sorted(os.listdir(root)) == ["latest", "step_1", "step_3"]
    # `latest` naming a vanished dir falls back to the newest complete one
    ckpt._update_latest(root, 7)
    assert ckpt.read_latest_step(run_dir) == 3
    open(os.path.join(root, "latest"), "w").write("seven")
    with pytest.raises(ValueError, match="must hold an integer step"):
        ckpt.read_latest_step(run_dir)


def test_load_rejects_incomplete_dir_and_bad_arguments(tmp_path):
    run_dir = str(tmp_path)
    os.makedirs(ckpt.step_dir(run_dir, 5))
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        ckpt.load_checkpoint(run_dir, [torch.nn.Linear(1, 1)], None, None, step=5)
    with pytest.raises(ValueError, match="step=-1"):
        ckpt.save_checkpoint(run_dir, -1, [torch.nn.Linear(1, 1)], None, None, {})
    with pytest.raises(ValueError, match="trainer_state must be a dict"):
        ckpt.save_checkpoint(run_dir, 1, [torch.nn.Linear(1, 1)], None, None, [1])
