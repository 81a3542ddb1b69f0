"""Every tensor handed to a collective lives on the device its group's backend serves.

On a GPU machine every process group is NCCL, which moves CUDA tensors of this rank's
device only (a CPU tensor fails with "No backend type associated with device type cpu"
on the first mini-batch). The CPU suite runs on gloo, which takes anything, so the
defect is invisible there unless the NCCL layout is declared: here every group answers
``"nccl"`` to ``dapo_megatron.platform.distributed.group_backend``, this rank computes on
``cuda:0`` (``device()``), megatron-core allocates on ``torch.cuda.current_device() = 0``,
and :class:`collective_spy.PlacementTracker` records where each tensor would live on the
GPU machine while the CPU compatibility layer still allocates it on the CPU. A real
actor step (``compute_logprobs``, the trainer's DP all-gather of old logprobs,
``train_mini_batch`` with the distributed optimizer) and the trainer's weight sync
(``iter_hf_weights`` into an ``HFEngine``) and checkpoint save then run on two gloo
processes with :class:`collective_spy.CollectiveSpy` recording (op, backend, placement of
each tensor); every placement must equal ``collective_device(group)``.

The same spy runs on real NCCL in ``tests/gpu/h200_check.py``.
"""

import os
import sys

import pytest
import torch

from dapo_megatron.platform import ParallelConfig, spawn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TEMPERATURE = 0.9


def _samples(vocab, n=8, seed=0):
    from test_packing import random_samples

    samples = random_samples(n, vocab, seed=seed, max_prompt=6, max_resp=6, min_resp=1)
    g = torch.Generator().manual_seed(seed)
    for s in samples:
        s.advantage = float(torch.randn((), generator=g))
    return samples


def _worker(out_dir, layouts):
    for tp, pp in layouts:  # one pair of processes for all layouts: the imports dominate the cost
        _run_layout(out_dir, tp, pp)


def _run_layout(out_dir, tp, pp):
    import dapo_megatron.platform.distributed as pdist
    import megatron.core.parallel_state as ps
    from collective_spy import CollectiveSpy, PlacementTracker, place_module, placement_of
    from conftest import tiny_hf_config
    from dapo_megatron.actor.actor import ActorConfig, MegatronActor, OptimConfig
    from dapo_megatron.bridge import iter_hf_weights
    from dapo_megatron.checkpointing import save_checkpoint
    from dapo_megatron.models import ModelConfig, build_gpt_model
    from dapo_megatron.platform import init_distributed
    from dapo_megatron.rollout.dp_split import split_for_dp
    from dapo_megatron.rollout.hf_engine import HFEngine
    from dapo_megatron.trainer import _all_gather_objects
    from transformers import AutoModelForCausalLM

    real_backend, real_device, real_current = pdist.group_backend, pdist.device, torch.cuda.current_device
    init_distributed(ParallelConfig(tp, pp), seed=0)
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
        model = build_gpt_model(hf_config, ModelConfig(transformer_impl="local", params_dtype="float32"))
        place_module(model, gpu)  # a GPU run initialises parameters on the device (no use_cpu_initialization)
        cfg = ActorConfig(ppo_max_token_len_per_gpu=48, optim=OptimConfig(lr=1e-3))
        actor = MegatronActor(model, cfg, total_steps=4, vocab_size=hf_config.vocab_size)

        # the trainer's step 5-6 on this rank's DP shard (trainer._old_logprobs / train_step)
        samples = _samples(hf_config.vocab_size)
        dp_size, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        shard = split_for_dp(samples, dp_size, cfg.ppo_max_token_len_per_gpu)[dp_rank]
        lps = actor.compute_logprobs([[samples[i] for i in mb] for mb in shard], TEMPERATURE)
        mine = [i for mb in shard for i in mb]
        for part in _all_gather_objects([(i, lp.tolist()) for i, lp in zip(mine, lps)],
                                        group=ps.get_data_parallel_group()):
            for i, lp in part:
                samples[i].old_logprobs = lp
        n_tok = sum(len(s.response_ids) for s in samples)
        out = actor.train_mini_batch([[samples[i] for i in mb] for mb in shard], TEMPERATURE,
                                     global_num_tokens=n_tok)
        assert out["skipped"] == 0.0 and out["num_tokens"] == n_tok, out

        # step 7 (weight sync into this rank's engine) and the checkpoint
        engine = HFEngine(AutoModelForCausalLM.from_config(hf_config), dtype=torch.float32, device="cpu")
        engine.update_weights(iter_hf_weights(actor.model_chunks, bucket_bytes=2**16), version=1)
        save_checkpoint(os.path.join(out_dir, f"run_tp{tp}pp{pp}"), 1, actor.model_chunks, actor.optimizer, actor.scheduler,
                        {"step": 1})
        real = list(spy.calls)

        # the defect this test exists for, as actor.count_loss_tokens once had it: a host tensor
        # all-reduced over the DP group. The spy must flag it.
        spy.calls.clear()
        torch.distributed.all_reduce(torch.zeros(2, dtype=torch.float64), group=ps.get_data_parallel_group())
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
        if tp * pp == 1:  # DP=2: the trainer's gather of old logprobs over DP (a world of one skips it)
            assert any(c[0] == "all_gather_object" and c[4].startswith("dapo_megatron/trainer.py") for c in calls)
        # and it fails where it should: the planted host tensor is flagged
        assert res["planted"] == [("all_reduce", False, ["cpu"])]
