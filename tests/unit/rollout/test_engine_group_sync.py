"""Weight sync from a Megatron actor into a colocated SGLang engine spanning a rollout group.

A TP=2 actor and a TP=1 / PP=2 actor (2 gloo ranks) each sync into rollout groups of 1 rank
(two engines of TP 1) and of 2 ranks (one engine of TP 2 led by rank 0). The package code
runs unchanged up to ``sglang.Engine``: the flat buckets, SGLang's serializer format
(``ForkingPickler``; CPU tensors travel through shared memory where a GPU uses CUDA IPC), the
gather of the group's payloads over gloo, the checks and the acknowledgement. At the engine
boundary the spy of tests/test_sglang_engine.py decodes each TP worker's payload as SGLang's
worker does (SGLang's own ``FlattenedTensorBucket`` and unpickler allow-list where SGLang is
installed, tests/sglang_reference.py), and every worker's tensors must equal the HF export of
the actor bit for bit.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from dapo_megatron.platform import spawn

BUCKET = 20_000  # bytes: several buckets, and the 64,000-byte embedding larger than one


def _hf_source(family):
    """``(hf_config, state)`` of ``family``'s random model (seed 1): an MoE model's under its checkpoint
    names. Built before ``torch.distributed`` starts (``hf_checkpoint_state`` refuses afterwards)."""
    import tempfile

    from conftest import TINY_MOE_FAMILIES, hf_checkpoint_state, random_hf_model, tiny_hf_config, tiny_moe_config

    if family in TINY_MOE_FAMILIES:  # checkpoint names: each expert's tensors on their own
        hf_config = tiny_moe_config(family)
        with tempfile.TemporaryDirectory(prefix="moe_ckpt_") as ckpt:  # a worker process: no tmp_path here
            return hf_config, hf_checkpoint_state(random_hf_model(hf_config, seed=1), ckpt)
    hf_config = tiny_hf_config(family)
    return hf_config, random_hf_model(hf_config, seed=1).state_dict()


def _setup(tp, pp, rollout_tp, source, ep=1):
    import sys
    import types

    import torch.distributed as dist

    import sglang_reference
    from dapo_megatron.bridge import export_hf_state_dict, load_hf_weights
    from dapo_megatron.models import ModelConfig, build_gpt_model
    from dapo_megatron.platform import ParallelConfig, init_distributed
    from dapo_megatron.rollout.engines.engine_group import RolloutGroup
    from unit.rollout.test_sglang_engine import _SpyEngine

    hf_config, state = source
    # a new layout in the same world: init_distributed rebuilds megatron-core's groups (distributed.py)
    parallel = init_distributed(ParallelConfig(tp, pp, ep), seed=0)
    rank = dist.get_rank()
    model = build_gpt_model(hf_config, ModelConfig(transformer_impl="local"), parallel=parallel)
    load_hf_weights(model, state, parallel=parallel)
    export = export_hf_state_dict(model, parallel=parallel)
    if rollout_tp == 1:
        group = RolloutGroup.single(rank)
    else:
        group = RolloutGroup((0, 1), rank, dist.new_group([0, 1], backend="gloo"))
    # the sglang.Engine boundary: the spy, with SGLang's real tensor_bucket below it when installed
    _SpyEngine.tensor_bucket = sglang_reference.install_tensor_bucket()
    fake = sys.modules.get("sglang") if _SpyEngine.tensor_bucket is not None else None
    fake = fake or types.ModuleType("sglang")
    fake.Engine, fake.__version__ = _SpyEngine, "0.5.23"
    sys.modules["sglang"] = fake
    sglang_reference.install_server_args()
    return model, hf_config, export, group, parallel


def _engine(group, hf_config, model_dir, bucket_bytes):
    from dapo_megatron.bridge.receiver import hf_param_specs
    from dapo_megatron.rollout.engines.engine_group import EngineGroupMember
    from dapo_megatron.rollout.engines.sglang_engine import SGLangEngine

    if group.is_leader:
        eng = SGLangEngine(model_dir, dtype="float32", tp_size=group.size, group=group, base_gpu_id=0)
    else:
        eng = EngineGroupMember(group, hf_param_specs(hf_config), device="cpu")
    eng.update_bucket_bytes = bucket_bytes
    return eng


def _sync_case(tp, pp, rollout_tp, source, model_dir, out_dir, ep=1):
    import torch.distributed as dist

    from dapo_megatron.bridge import iter_hf_weights

    model, hf_config, export, group, parallel = _setup(tp, pp, rollout_tp, source, ep)
    eng = _engine(group, hf_config, model_dir, BUCKET)
    eng.update_weights(iter_hf_weights(model, parallel=parallel, bucket_bytes=BUCKET), version=1)
    result = {"rank": dist.get_rank(), "leader": group.is_leader, "version": eng.weight_version,
              "valid": eng.weights_valid}
    if group.is_leader:
        spy = eng.engine
        result["calls"] = [c[0] for c in spy.calls]
        result["flush_flags"] = [c[2] for c in spy.calls if c[0] == "update_weights_from_tensor"]
        result["workers"] = []
        for worker in range(group.size):  # what each SGLang TP worker loaded, over all update calls
            loaded = [(n, t) for call in spy.loaded for n, t in call[worker]]
            names = [n for n, _ in loaded]
            mismatched = [n for n, t in loaded
                          if t.dtype != export[n].dtype or t.shape != export[n].shape
                          or not torch.equal(t.contiguous().view(-1).view(torch.uint8),
                                             export[n].contiguous().view(-1).view(torch.uint8))]
            result["workers"].append({"names": names, "mismatched": mismatched})
        result["export_names"] = list(export)
        result["updates"] = len(spy.loaded)
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)


SYNC_CASES = {f"actor_{'tp2' if tp == 2 else 'pp2'}-rollout_tp{rollout_tp}": (tp, pp, rollout_tp)
              for rollout_tp in (1, 2) for tp, pp in ((2, 1), (1, 2))}
MOE_CASES = {f"moe_ep2-rollout_tp{rollout_tp}": rollout_tp for rollout_tp in (1, 2)}


def _world(model_dirs, out_root):
    """Every case of this file in ONE 2-rank world (a world costs more than its cases): the dense
    syncs (TP=2 and PP=2 actors into rollout groups of 1 and 2), the EP=2 MoE syncs and the
    bucket mismatch, one after the other, re-laying out megatron-core's groups between them
    (init_distributed). Each case writes ``out_root/<case>/rank<r>.json``. A case that raises stops
    the world (spawn ends the other rank, which may wait in a collective) naming the case: every
    test of the file then errors with that traceback."""
    dense, moe = _hf_source("qwen2_bias"), _hf_source("qwen3_moe")  # before the world starts
    cases = [(name, _sync_case, (*layout, dense, model_dirs["dense"])) for name, layout in SYNC_CASES.items()]
    cases += [(name, _sync_case, (1, 1, rollout_tp, moe, model_dirs["moe"]), 2) for name, rollout_tp in MOE_CASES.items()]
    cases.append(("mismatch", _mismatch_case, (dense, model_dirs["dense"])))
    for name, fn, args, *ep in cases:
        out = os.path.join(out_root, name)
        os.makedirs(out, exist_ok=True)
        try:
            fn(*args, out, *ep)
        except Exception as err:
            raise RuntimeError(f"case {name} failed") from err


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The results of :func:`_world`: ``case -> [rank 0's, rank 1's]``."""
    from conftest import tiny_hf_config, tiny_moe_config

    root = tmp_path_factory.mktemp("engine_group_sync")
    tiny_hf_config("qwen2_bias").save_pretrained(root / "model")
    tiny_moe_config("qwen3_moe").save_pretrained(root / "moe")
    spawn(_world, 2, {"dense": str(root / "model"), "moe": str(root / "moe")}, str(root / "out"))
    return {case: [json.load(open(root / "out" / case / f"rank{r}.json")) for r in range(2)]
            for case in os.listdir(root / "out")}


def _case(world, name):
    return world[name]


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["actor_tp2", "actor_pp2"])
@pytest.mark.parametrize("rollout_tp", [1, 2], ids=["rollout_tp1", "rollout_tp2"])
def test_every_tp_worker_loads_the_hf_export_bitwise(tp, pp, rollout_tp, world):
    results = _case(world, f"actor_{'tp2' if tp == 2 else 'pp2'}-rollout_tp{rollout_tp}")
    assert all(r["version"] == 1 and r["valid"] for r in results)
    leaders = [r for r in results if r["leader"]]
    assert len(leaders) == (2 if rollout_tp == 1 else 1)
    for r in leaders:
        assert len(r["workers"]) == rollout_tp, "one payload per SGLang TP worker"
        assert r["updates"] >= 4, "several buckets (the test's bucket is smaller than the model)"
        assert r["calls"] == ["update_weights_from_tensor"] * r["updates"] + ["flush_cache"], "one flush per sync"
        assert r["flush_flags"] == [False] * r["updates"]
        for w in r["workers"]:
            assert w["names"] == r["export_names"], "every tensor once, in the bridge's order"
            assert w["mismatched"] == []


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("rollout_tp", [1, 2], ids=["rollout_tp1", "rollout_tp2"])
def test_moe_actor_ep2_every_tp_worker_loads_every_expert_bitwise(rollout_tp, world):
    """A Qwen3-MoE actor with its experts over 2 EP ranks: each SGLang TP worker receives every
    expert of every layer under its checkpoint name, bit for bit, and the sync's completeness
    check (SGLang's parameter specs, one per expert tensor) passes."""
    results = _case(world, f"moe_ep2-rollout_tp{rollout_tp}")
    assert all(r["version"] == 1 and r["valid"] for r in results)
    leaders = [r for r in results if r["leader"]]
    assert len(leaders) == (2 if rollout_tp == 1 else 1)
    for r in leaders:
        experts = [n for n in r["export_names"] if ".mlp.experts." in n]
        assert len(experts) == 2 * 4 * 3  # layers × experts × (gate, up, down)
        assert len(r["workers"]) == rollout_tp
        for w in r["workers"]:
            assert w["names"] == r["export_names"], "every tensor once, in the bridge's order"
            assert w["mismatched"] == []


def _mismatch_case(source, model_dir, out_dir):
    """Rank 1 cuts its buckets at another size than the leader: both ranks must stop with the
    same error naming rank 1 (instead of SGLang loading tensors under the wrong names)."""
    import torch.distributed as dist

    from dapo_megatron.bridge import iter_hf_weights

    model, hf_config, _, group, parallel = _setup(2, 1, 2, source)
    eng = _engine(group, hf_config, model_dir, BUCKET if group.is_leader else BUCKET // 2)
    try:
        eng.update_weights(iter_hf_weights(model, parallel=parallel, bucket_bytes=BUCKET), version=1)
        error = None
    except RuntimeError as err:
        error = str(err)
    updates = len(eng.engine.loaded) if group.is_leader else None
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"error": error, "updates": updates, "valid": eng.weights_valid}, f)


def test_a_member_without_transport_drops_each_tensor_before_asking_for_the_next():
    # the HF engine's rollout-group members drain the bridge's stream: holding nothing lets
    # the bridge reuse its bucket memory
    from conftest import ReleaseRecorder, random_hf_model, tiny_hf_config
    from dapo_megatron.bridge.receiver import hf_param_specs
    from dapo_megatron.rollout.engines.engine_group import EngineGroupMember, RolloutGroup

    hf_config = tiny_hf_config("llama_untied")
    member = EngineGroupMember(RolloutGroup((0, 1), 1, group="unused: no transport"), hf_param_specs(hf_config),
                               transport=None)
    stream = ReleaseRecorder(random_hf_model(hf_config).state_dict().items())
    member.update_weights(stream, version=1)
    assert member.weight_version == 1
    assert len(stream.held) == len(stream.named) - 1 and not any(stream.held)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_ranks_that_pack_different_buckets_stop_together_before_the_engine_loads(world):
    r0, r1 = _case(world, "mismatch")
    assert r0["error"] == r1["error"] and "rank 1 packed a different bucket than the leader" in r0["error"]
    # the first bucket (the 64,000-byte embedding, larger than either bucket size) agrees; the engine is
    # never called with the first one that does not
    assert r0["updates"] == 1
    assert not r0["valid"]
