"""Every tensor handed to a collective lives on the device its group's backend serves.

On a GPU machine every process group is NCCL, which moves CUDA tensors of this rank's
device only (a CPU tensor fails with "No backend type associated with device type cpu"
on the first mini-batch). The CPU suite runs on gloo, which takes anything, so the
defect is invisible there unless the NCCL layout is declared: here every group answers
``"nccl"`` to ``dapo_megatron.platform.distributed.group_backend``, this rank computes on
``cuda:0`` (``device()``), megatron-core allocates on ``torch.cuda.current_device() = 0``,
and :class:`collective_spy.PlacementTracker` records where each tensor would live on the
GPU machine while the CPU compatibility layer still allocates it on the CPU. A real
actor step (the trainer's step data path: records gathered, grades all-reduced, tokens
routed to their DP rank, ``compute_logprobs``, the mismatch metrics pooled over DP,
``train_mini_batch`` with the distributed optimizer) and the trainer's weight sync
(``iter_hf_weights`` into an ``HFEngine``) and checkpoint save then run on two gloo
processes with :class:`collective_spy.CollectiveSpy` recording (op, backend, placement of
each tensor); every placement must equal ``collective_device(group)``.

The same spy runs on real NCCL in ``tests/gpu/h200_check.py``.
"""

import os

import pytest
import torch

from dapo_megatron.platform import ParallelConfig, spawn

TEMPERATURE = 0.9


def _prompt_groups(vocab, n_prompts=4, n=2, seed=0):
    """``n_prompts`` groups of ``n`` random responses, the same on every rank, and their prompts'
    dataset records."""
    from unit.actor.test_packing import random_samples

    from dapo_megatron.data.dataset import PromptRecord
    from dapo_megatron.rollout.types import Group

    samples = random_samples(n_prompts * n, vocab, seed=seed, max_prompt=6, max_resp=6, min_resp=1)
    groups = []
    for k in range(n_prompts):
        members = samples[k * n:(k + 1) * n]
        for s in members:
            s.prompt_ids, s.prompt_index = list(members[0].prompt_ids), k
        groups.append(Group(k, members))
    records = [PromptRecord(index=k, data_source="toy", prompt_ids=g.samples[0].prompt_ids, messages=[],
                            ground_truth="", extra_info={}) for k, g in enumerate(groups)]
    return groups, records


class _ParityGrader:
    """A RewardPoolLike for the spy (the exchange of grades is under test, not the grading)."""

    def grade(self, requests):
        return [{"score": 1.0 if len(r[1]) % 2 else -1.0, "acc": len(r[1]) % 2 == 1} for r in requests]


def _worker(out_dir, layouts):
    for tp, pp in layouts:  # one pair of processes for all layouts: the imports dominate the cost
        _run_layout(out_dir, tp, pp)


def _run_layout(out_dir, tp, pp):
    import dapo_megatron.platform.distributed as pdist
    from collective_spy import CollectiveSpy, PlacementTracker, place_module, placement_of
    from conftest import tiny_hf_config
    from dapo_megatron.actor.actor import ActorConfig, MegatronActor, OptimConfig
    from dapo_megatron.actor.dp_split import split_for_dp
    from dapo_megatron.actor.step_plan import route_step
    from dapo_megatron.bridge import iter_hf_weights
    from dapo_megatron.checkpointing import save_checkpoint
    from dapo_megatron.models import ModelConfig, build_gpt_model
    from dapo_megatron.platform import init_distributed
    from dapo_megatron.rewards.distributed import DistributedGrader
    from dapo_megatron.rollout.sampling.buffer import RolloutBuffer, logprob_mismatch_metrics
    from dapo_megatron.rollout.sampling.config import BufferConfig
    from dapo_megatron.rollout.engines.hf_engine import HFEngine
    from dapo_megatron.rollout.plan.step_data import gather_groups
    from transformers import AutoModelForCausalLM

    real_backend, real_device, real_current = pdist.group_backend, pdist.device, torch.cuda.current_device
    par = init_distributed(ParallelConfig(tp, pp), seed=0)
    rank = torch.distributed.get_rank()
    gpu = torch.device("cuda", 0)
    # the NCCL layout a GPU node has (see the module docstring)
    pdist.group_backend = lambda group=None: "nccl"
    pdist.device = lambda: gpu
    torch.cuda.current_device = lambda: 0

    hf_config = tiny_hf_config("llama_untied", num_hidden_layers=2)
    spy = CollectiveSpy(device_of=placement_of, expected_device=pdist.collective_device,
                        backend_of=pdist.group_backend)
    with PlacementTracker(), spy:
        torch.manual_seed(0)
        model = build_gpt_model(hf_config, ModelConfig(transformer_impl="local", params_dtype="float32"),
                                parallel=par)
        place_module(model, gpu)  # a GPU run initialises parameters on the device (no use_cpu_initialization)
        cfg = ActorConfig(ppo_max_token_len_per_gpu=48, optim=OptimConfig(lr=1e-3))
        actor = MegatronActor(model, cfg, total_steps=4, parallel=par, vocab_size=hf_config.vocab_size)

        # the trainer's steps 1-6 (SyncFeeder.generate_groups, the buffer's grading, route_step and
        # the old logprobs, train_step): DP rank d holds prompts d::DP, its model-parallel
        # rank m generates positions m::MP of them
        all_groups, records = _prompt_groups(hf_config.vocab_size)
        prompts = [k for k in range(len(all_groups)) if k % par.dp_size == par.dp_rank]
        local = [(par.dp_rank, pos, all_groups[k]) for pos, k in enumerate(prompts)
                 if pos % par.mp_size == par.mp_rank]
        groups = gather_groups(local, n=2, max_local=-(-len(prompts) // par.mp_size), record_of=records.__getitem__,
                               parallel=par)
        RolloutBuffer(BufferConfig(train_batch_size=4, n=2, gen_batch_size=4), DistributedGrader(_ParityGrader(), par),
                      lambda ids: " ".join(map(str, ids))).grade(groups)
        samples = [s for g in groups for s in g.samples]
        g = torch.Generator().manual_seed(1)
        for s in samples:  # replicated, as the advantages are
            s.advantage = float(torch.randn((), generator=g))
        plan, mine = route_step(groups, samples, par, 4, cfg.ppo_max_token_len_per_gpu)
        micro = split_for_dp([samples[i] for i in mine], 1, cfg.ppo_max_token_len_per_gpu)[0]
        lps = actor.compute_logprobs([[samples[mine[j]] for j in mb] for mb in micro], TEMPERATURE)
        for j, lp in zip([j for mb in micro for j in mb], lps):
            samples[mine[j]].old_logprobs = lp.tolist()
        logprob_mismatch_metrics([samples[i] for i in mine], group=par.dp_group)
        (mini,) = plan.mini_batches
        out = actor.train_mini_batch([[samples[i] for i in mb] for mb in mini.micro_batches[par.dp_rank]],
                                     TEMPERATURE, global_num_tokens=mini.global_num_tokens).metrics
        assert out["skipped"] == 0.0 and out["num_tokens"] == mini.global_num_tokens, out

        # step 7 (weight sync into this rank's engine) and the checkpoint
        engine = HFEngine(AutoModelForCausalLM.from_config(hf_config), dtype=torch.float32, device="cpu")
        engine.update_weights(iter_hf_weights(actor.model_chunks, parallel=par, bucket_bytes=2**16), version=1)
        save_checkpoint(os.path.join(out_dir, f"run_tp{tp}pp{pp}"), 1, actor.model_chunks, actor.optimizer,
                        actor.scheduler, {"step": 1}, parallel=par)
        real = list(spy.calls)

        # the defect this test exists for, as actor.count_loss_tokens once had it: a host tensor
        # all-reduced over the DP group. The spy must flag it.
        spy.calls.clear()
        torch.distributed.all_reduce(torch.zeros(2, dtype=torch.float64), group=par.dp_group)
        planted = list(spy.calls)
    pdist.group_backend, pdist.device, torch.cuda.current_device = real_backend, real_device, real_current
    torch.save({"real": [(c.op, c.backend, [str(d) for d in c.devices], str(c.expected), c.where, c.ok, c.unknown)
                         for c in real],
                "planted": [(c.op, c.ok, [str(d) for d in c.devices]) for c in planted],
                "report": spy.report(real)},
               os.path.join(out_dir, f"tp{tp}pp{pp}_rank{rank}.pt"))


LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # DP=2, TP=2, PP=2 on two processes


@pytest.fixture(scope="module")
def spied(tmp_path_factory):
    out = tmp_path_factory.mktemp("collectives")
    spawn(_worker, 2, str(out), LAYOUTS)
    return out


@pytest.mark.dist
@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=["dp2", "tp2", "pp2"])
def test_every_collective_tensor_is_on_its_groups_device(spied, tp, pp):
    for rank in range(2):
        res = torch.load(spied / f"tp{tp}pp{pp}_rank{rank}.pt")
        calls = res["real"]
        tensor_calls = [c for c in calls if c[0] not in ("all_gather_object", "broadcast_object_list",
                                                         "gather_object", "barrier")]
        bad = [c for c in tensor_calls if not c[5]]
        assert not bad, f"rank {rank}: tensors off their group's device:\n" + res["report"]
        assert all(c[1] == "nccl" and c[3] == "cuda:0" for c in tensor_calls)
        # tensors of unknown placement come only from megatron-core's backward (gradients made by
        # the autograd engine, outside the tracker), never from this package's own collectives
        unknown = {c[4].rsplit(":", 1)[0] for c in tensor_calls if c[6]}
        assert unknown <= {"megatron/core/tensor_parallel/layers.py"}, unknown
        # the check is not vacuous: the collectives of the actor, megatron-core's DDP /
        # optimizer and the bridge were all seen, each with its tensors
        sites = {c[4].rsplit(":", 1)[0] for c in tensor_calls}
        assert all(c[2] for c in tensor_calls), "a tensor collective without a recorded tensor"
        if tp == 1:  # the actor's counts and metrics over DP (and PP); at TP=2 both are groups of one, skipped
            assert any(c[0] == "all_reduce" and c[4].startswith("dapo_megatron/actor/actor.py") for c in tensor_calls)
        assert "megatron/core/optimizer/clip_grads.py" in sites or "megatron/core/optimizer/optimizer.py" in sites
        if tp * pp == 1:  # DP=2: gradient reduce-scatter and parameter all-gather of the distributed optimizer
            assert {"reduce_scatter_tensor", "all_gather_into_tensor"} <= {c[0] for c in tensor_calls}, sites
        if tp == 2:  # TP shards gathered by the bridge, TP softmax statistics in the logprobs
            assert {"dapo_megatron/bridge/weights.py", "dapo_megatron/actor/logprobs.py"} <= sites, sites
        if pp == 2:  # PP broadcasts of HF tensors and logprobs, activations between stages
            assert "dapo_megatron/bridge/weights.py" in sites, sites
            assert any(c[0] == "broadcast" and c[4].startswith("dapo_megatron/actor/actor.py") for c in tensor_calls)
            assert any(c[0] == "batch_isend_irecv" for c in tensor_calls), sites
        # the step data path over the world: records gathered and tokens routed (step_data), grades
        # all-reduced (rewards/distributed)
        data_path = {c[0] for c in tensor_calls if c[4].startswith("dapo_megatron/rollout/plan/step_data.py")}
        assert {"all_gather", "all_to_all_single"} <= data_path, data_path
        assert any(c[0] == "all_reduce" and c[4].startswith("dapo_megatron/rewards/distributed.py")
                   for c in tensor_calls), sites
        if tp * pp == 1:  # DP=2: the rollout-vs-actor mismatch pooled over DP (a DP group of one skips it)
            assert any(c[0] == "all_reduce" and c[4].startswith("dapo_megatron/rollout/sampling/buffer.py")
                       for c in tensor_calls)
        # and it fails where it should: the planted host tensor is flagged
        assert res["planted"] == [("all_reduce", False, ["cpu"])]
