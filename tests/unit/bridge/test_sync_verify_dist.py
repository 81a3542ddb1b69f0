"""Weight-sync verification (issue 39) on 2 gloo processes: faults planted in the sync are caught in
the same sync, with one error naming the tensor, the engine and the version, and the engine does not
serve the version; the same fault without verification (the sync as it was before) goes through.

- EP = 2 (Qwen3-MoE): one bit flipped in one expert's bucket on the rank that receives it over the
  EP broadcast;
- PP = 2 (Llama): the second sync's pipeline broadcast replaced by the first sync's bytes on the
  receiving stage (a stale PP-stage cache);
- TP = 1: an HF engine whose load map sends one tensor into another of the same shape (a wrong name
  map);
- TP = 1: the functional probe (``Rollout.probe``: a fixed sequence's logprobs, engine against actor)
  passes a clean sync and catches a sender-side layout bug (gate and up halves swapped before the
  sender checksums them), which every checksum passes;
- the clean sync passes at period 1 and 8; the sender's checksums equal an independent NumPy sum of
  the exported bytes; period k checks every tensor once in k consecutive versions.

One spawned world runs every case; the workers report, the tests assert.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from conftest import hf_checkpoint_state, random_hf_model, tiny_hf_config, tiny_moe_config
from dapo_megatron.platform import spawn


def _numpy_checksum(t: torch.Tensor) -> int:
    """The checksum's definition, computed apart: the bytes as little-endian int64 words, summed
    with wrap-around, plus the leftover bytes."""
    raw = t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    whole = len(raw) // 8 * 8
    total = int(np.frombuffer(raw[:whole], dtype="<i8").astype(np.uint64).sum(dtype=np.uint64))
    total += sum(raw[whole:])
    total %= 2**64
    return total - 2**64 if total >= 2**63 else total


def _sync(engine, model, par, version, digest, bucket=4096):
    """One sync; returns the error message (None when it went through)."""
    from dapo_megatron.bridge import iter_hf_weights

    try:
        engine.update_weights(iter_hf_weights(model, parallel=par, bucket_bytes=bucket, digest=digest),
                              version=version, digest=digest)
        return None
    except RuntimeError as err:
        return f"{type(err).__name__}: {err}"


def _sync_stream(engine, stream, version, digest):
    try:
        engine.update_weights(stream, version=version, digest=digest)
        return None
    except RuntimeError as err:
        return f"{type(err).__name__}: {err}"


def _generate_refused(engine) -> bool:
    from dapo_megatron.bridge.receiver import InvalidWeightsError
    from dapo_megatron.rollout.engines.engine import SamplingParams

    try:
        engine.generate([[1, 2, 3]], SamplingParams(n=1, max_new_tokens=1, temperature=1.0))
        return False
    except InvalidWeightsError:
        return True


def _flip_one_bit_on_ep_receive(par, rank: int, state: dict):
    """Plant: the first EP broadcast this rank receives gets one bit of its first word flipped
    (the lowest mantissa bit of the bucket's first expert tensor's first element)."""
    real = par.broadcast

    def broadcast(tensor, group, src):
        real(tensor, group, src)
        if group == "ep" and src != rank and not state.get("flipped"):
            tensor.view(torch.int32)[0] ^= 1
            state["flipped"] = True

    object.__setattr__(par, "broadcast", broadcast)


def _flip_one_bit_on_direct_receive(rank: int, state: dict):
    """Plant, on the fast path's expert buckets (one broadcast per parameter into the bucket): the first
    parameter this rank receives gets one bit of its first word flipped once its broadcast finished.
    Returns the function that removes the plant."""
    from dapo_megatron.platform import collectives

    real = collectives.broadcast

    class Flipping:
        def __init__(self, work, tensor):
            self.work, self.tensor = work, tensor

        def wait(self):
            self.work.wait()
            self.tensor.view(torch.int32)[0] ^= 1

    def broadcast(tensor, *, src, group, async_op=False):
        work = real(tensor, src=src, group=group, async_op=async_op)
        if not async_op or src == rank or tensor.dtype == torch.int64 or state.get("flipped"):
            return work  # sent, not received; the trailer (int64 words); or planted already
        state["flipped"] = True
        return Flipping(work, tensor)

    collectives.broadcast = broadcast
    return lambda: setattr(collectives, "broadcast", real)


def _stale_pp_cache(par, rank: int, cache: dict):
    """Plant: the receiving stage keeps what it received in the first sync (per call index) and
    hands it out again in the next one instead of what arrived."""
    real = par.broadcast
    calls = {"n": 0}

    def broadcast(tensor, group, src):
        real(tensor, group, src)
        if group != "pp" or src == rank:
            return
        k = calls["n"]
        calls["n"] += 1
        if cache.get("record", True):
            cache[k] = tensor.clone()
        elif k in cache and cache[k].shape == tensor.shape:
            tensor.copy_(cache[k])

    object.__setattr__(par, "broadcast", broadcast)
    return calls


def _worker(out_dir: str, cases: dict) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from dapo_megatron.bridge import iter_hf_weights, load_hf_weights
    from dapo_megatron.bridge.weights import expert_turn
    from dapo_megatron.models import build_gpt_model
    from dapo_megatron.platform import ParallelConfig, init_distributed
    from dapo_megatron.bridge.receiver import checkpoint_parameters
    from dapo_megatron.rollout.engines.hf_engine import HFEngine
    from dapo_megatron.bridge.verify import SyncDigest

    rank = int(os.environ["RANK"])
    res: dict = {}

    def engine_for(cfg, seed):
        torch.manual_seed(seed)
        engine = HFEngine(AutoModelForCausalLM.from_config(cfg).float(), eos_token_ids=[0])
        engine.engine_label = f"HFEngine on rank {rank}"
        return engine

    # ---- EP = 2: one flipped bit in one expert shard, received over the EP broadcast
    cfg, state = cases["moe"]
    par = init_distributed(ParallelConfig(1, 1, 2), seed=3)
    model = build_gpt_model(cfg, parallel=par).eval()
    load_hf_weights(model, state, parallel=par)
    for verify in (False, True):
        engine = engine_for(cfg, 60 + rank)
        planted: dict = {}
        _flip_one_bit_on_ep_receive(par, rank, planted)
        digest = SyncDigest(1, 1) if verify else None
        error = _sync(engine, model, par, 1, digest)
        object.__delattr__(par, "broadcast")
        held = dict(checkpoint_parameters(engine.model))
        differing = sorted(n for n in state if not torch.equal(held[n], state[n]))
        res[("ep2_bitflip", verify)] = {"error": error, "flipped": planted.get("flipped", False),
                                        "differing": differing, "valid": engine.weights_valid,
                                        "refused": _generate_refused(engine), "version": engine.weight_version}
    # ---- EP = 2, the trainer's fast path: kept buffers (the bucket plan cached from the first sync) and
    # views of the parameters where no transport or re-layout is needed; verified, held bitwise
    from dapo_megatron.bridge import ExportBuffers

    engine, buffers = engine_for(cfg, 62 + rank), ExportBuffers()
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    engine_storages = {p.untyped_storage().data_ptr() for p in engine.model.parameters()}
    for version in (2, 3):
        digest, aliased, in_place = SyncDigest(version, 1), set(), set()

        def stream():
            for name, t in iter_hf_weights(model, parallel=par, bucket_bytes=4096, digest=digest, buffers=buffers,
                                           param_views=engine.copies_on_load):
                if t.untyped_storage().data_ptr() in storages:
                    aliased.add(name)
                if t.untyped_storage().data_ptr() in engine_storages:
                    in_place.add(name)
                yield name, t
                del t

        error = _sync_stream(engine, stream(), version, digest)
        held = dict(checkpoint_parameters(engine.model))
        res[("ep2_views", version)] = {"error": error, "aliased": aliased, "version": engine.weight_version,
                                       "in_place": in_place,
                                       "differing": sorted(n for n in state if not torch.equal(held[n], state[n]))}
    res["experts_mine"] = sorted(n for n in state if ".experts." in n
                                 and expert_turn(n, cfg.num_experts, par.ep_size) == par.ep_rank)
    res["experts_all"] = sorted(n for n in state if ".experts." in n)
    # ---- EP = 2, the fast path's expert buckets (each parameter broadcast straight into the receiver's
    # bucket, the trailer apart): one bit flipped in the first parameter this rank receives
    for verify in (False, True):
        engine = engine_for(cfg, 64 + rank)
        planted = {}
        restore = _flip_one_bit_on_direct_receive(rank, planted)
        digest = SyncDigest(1, 1) if verify else None
        try:
            error = _sync_stream(engine, iter_hf_weights(model, parallel=par, bucket_bytes=4096, digest=digest,
                                                         buffers=ExportBuffers(), param_views=True), 1, digest)
        finally:
            restore()
        held = dict(checkpoint_parameters(engine.model))
        res[("ep2_direct_bitflip", verify)] = {
            "error": error, "flipped": planted.get("flipped", False), "valid": engine.weights_valid,
            "differing": sorted(n for n in state if not torch.equal(held[n], state[n])),
            "refused": _generate_refused(engine), "version": engine.weight_version}
    dist.barrier()

    # ---- PP = 2: the second sync's pipeline broadcast replaced by the first sync's bytes
    cfg, state = cases["dense"]
    par = init_distributed(ParallelConfig(1, 2), seed=3)
    for verify in (False, True):
        model = build_gpt_model(cfg, parallel=par).eval()
        load_hf_weights(model, state, parallel=par)
        engine = engine_for(cfg, 70 + rank)
        cache: dict = {}
        calls = _stale_pp_cache(par, rank, cache)
        first = _sync(engine, model, par, 1, SyncDigest(1, 1) if verify else None)
        with torch.no_grad():  # the actor trains: every weight moves
            for p in model.parameters():
                p.add_(0.01)
        cache["record"], calls["n"] = False, 0
        second = _sync(engine, model, par, 2, SyncDigest(2, 1) if verify else None)
        object.__delattr__(par, "broadcast")
        fresh = {n: t.clone() for n, t in iter_hf_weights(model, parallel=par)}
        held = dict(checkpoint_parameters(engine.model))
        stale = sorted(n for n in fresh if not torch.equal(held[n], fresh[n]))
        res[("pp2_stale", verify)] = {"first": first, "error": second, "stale": stale, "valid": engine.weights_valid,
                                      "refused": _generate_refused(engine), "version": engine.weight_version}
    dist.barrier()

    # ---- TP = 1 (DP = 2): a load map that sends gate_proj of layer 0 into up_proj and back
    class SwappedMapEngine(HFEngine):
        """The product's load, entered through a map that sends gate_proj of layer 0 into up_proj
        and back (a wrong name map for one tensor between the sender's names and the parameters)."""

        def _load_stream(self, named_tensors):
            a, b = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"
            swap = {a: b, b: a}
            return super()._load_stream((swap.get(n, n), t) for n, t in named_tensors)

    par = init_distributed(ParallelConfig(1, 1), seed=3)
    model = build_gpt_model(cfg, parallel=par).eval()
    load_hf_weights(model, state, parallel=par)
    for verify in (False, True):
        torch.manual_seed(80)
        engine = SwappedMapEngine(AutoModelForCausalLM.from_config(cfg).float(), eos_token_ids=[0])
        engine.engine_label = f"HFEngine on rank {rank}"
        error = _sync(engine, model, par, 5, SyncDigest(5, 1) if verify else None)
        held = dict(checkpoint_parameters(engine.model))
        differing = sorted(n for n in state if not torch.equal(held[n], state[n]))
        res[("name_map", verify)] = {"error": error, "differing": differing, "valid": engine.weights_valid,
                                     "refused": _generate_refused(engine)}

    # ---- the functional probe: a sender-side layout bug (layer 0's gate and up halves swapped while
    # re-laid out, before the sender checksums) passes every checksum; the probe catches it
    from types import SimpleNamespace

    import dapo_megatron.bridge.weights as bridge_weights
    from dapo_megatron.actor import ActorConfig, MegatronActor
    from dapo_megatron.rollout.config import RolloutConfig
    from dapo_megatron.rollout.rollout import Rollout

    actor = MegatronActor(model, ActorConfig(ppo_mini_batch_size=1, ppo_max_token_len_per_gpu=64), total_steps=4,
                          vocab_size=cfg.vocab_size, parallel=par)
    real_relayout = bridge_weights.megatron_to_hf_into

    def swapped_gate_up(layout, name, shards, outs):
        if name == "decoder.layers.0.mlp.linear_fc1.weight":
            outs = outs[::-1]
        return real_relayout(layout, name, shards, outs)

    for planted in (False, True):
        engine = engine_for(cfg, 100)
        if planted:
            bridge_weights.megatron_to_hf_into = swapped_gate_up
        digest = SyncDigest(6, 1)
        error = _sync(engine, model, par, 6, digest)
        bridge_weights.megatron_to_hf_into = real_relayout
        rollout = SimpleNamespace(cfg=SimpleNamespace(rollout=RolloutConfig()), engine=engine)
        res[("probe", planted)] = {"checksum_error": error, "probe": Rollout.probe(rollout, actor, 6, digest),
                                   "probe_seconds": digest.seconds}

    # ---- clean syncs: period 1 and 8 pass; the sender's sums are the exported bytes' sums
    engine = engine_for(cfg, 90)
    coverage: dict = {}
    for version in range(1, 9):
        digest = SyncDigest(version, 8)
        coverage[version] = (_sync(engine, model, par, version, digest), sorted(digest.sums), len(digest.sent))
    digest = SyncDigest(9, 1)
    res["clean_period1"] = _sync(engine, model, par, 9, digest)
    exported = {n: t.clone() for n, t in iter_hf_weights(model, parallel=par, bucket_bytes=4096)}
    res["sums"] = {n: (digest.sums[n], _numpy_checksum(t)) for n, t in exported.items()}
    res["coverage"] = coverage
    res["dtype"] = digest.dtype
    dist.barrier()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def verify_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sync_verify")
    cases = {"moe": (tiny_moe_config("qwen3_moe"), None), "dense": (tiny_hf_config("llama_untied"), None)}
    for i, (key, (cfg, _)) in enumerate(list(cases.items())):
        cases[key] = (cfg, hf_checkpoint_state(random_hf_model(cfg, seed=i), out / key))
    spawn(_worker, 2, str(out), cases)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _one_error(msg: str, *, tensor: str, version: int, rank: int) -> None:
    assert msg.startswith("WeightSyncVerifyError: "), msg
    assert f"version {version}" in msg and repr(tensor) in msg and f"HFEngine on rank {rank}" in msg, msg


@pytest.mark.dist
def test_a_flipped_bit_in_one_expert_shard_at_ep2_is_caught_in_the_same_sync(verify_results):
    for rank, res in enumerate(verify_results):
        _expert_flip_caught(res, "ep2_bitflip", rank)


def _expert_flip_caught(res: dict, case: str, rank: int) -> str:
    """The case's unverified sync served one wrong expert tensor; its verified sync raised one error
    naming that tensor, this engine and the version, and was not served. Returns the tensor's name."""
    before, after = res[(case, False)], res[(case, True)]
    assert before["flipped"] and after["flipped"]
    # unverified (the sync as it was): accepted, serving one wrong expert tensor
    assert before["error"] is None and before["valid"] and before["version"] == 1
    assert len(before["differing"]) == 1 and ".mlp.experts." in before["differing"][0]
    # verified: one error naming that tensor, this engine and the version; not served
    _one_error(after["error"], tensor=after["differing"][0], version=1, rank=rank)
    assert not after["valid"] and after["refused"] and after["version"] == 0
    return before["differing"][0]


@pytest.mark.dist
def test_the_fast_path_at_ep2_views_parameters_and_syncs_bitwise(verify_results):
    for res in verify_results:
        for version in (2, 3):  # the second sync reuses the bucket plan kept in ExportBuffers
            r = res[("ep2_views", version)]
            assert r["error"] is None and r["version"] == version and r["differing"] == []
            # what needs no transport was handed out as the parameter itself; experts travel over EP, each
            # owner's straight from its parameters (handed out as they are), the others' into the bucket
            assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= r["aliased"]
            assert res["experts_mine"] and {n for n in r["aliased"] if ".experts." in n} == set(res["experts_mine"])
            # the other rank's experts were received straight into the engine's fused expert parameters
            # (bridge.weights.load_targets, entered by the HF engine's load), nothing else
            theirs = {n for n in res["experts_all"] if n not in res["experts_mine"]}
            assert theirs and r["in_place"] == theirs


@pytest.mark.dist
def test_a_flipped_bit_in_an_expert_sent_straight_from_its_parameter_is_caught_in_the_same_sync(verify_results):
    for rank, res in enumerate(verify_results):
        # the wrong tensor is one of the other rank's experts, sent straight from its parameter
        assert _expert_flip_caught(res, "ep2_direct_bitflip", rank) not in res["experts_mine"]


@pytest.mark.dist
def test_a_stale_pipeline_stage_cache_at_pp2_is_caught_in_the_same_sync(verify_results):
    for rank, res in enumerate(verify_results):
        before, after = res[("pp2_stale", False)], res[("pp2_stale", True)]
        assert before["first"] is None and after["first"] is None
        # unverified: version 2 accepted while the other stage's tensors are version 1's
        assert before["error"] is None and before["valid"] and before["version"] == 2 and before["stale"]
        msg = after["error"]
        assert msg.startswith("WeightSyncVerifyError: weight sync to version 2: the bucket starting at"), msg
        assert "trailer of version 1" in msg and f"HFEngine on rank {rank}" in msg, msg
        assert not after["valid"] and after["refused"] and after["version"] == 1


@pytest.mark.dist
def test_a_wrong_name_map_for_one_tensor_is_caught_in_the_same_sync(verify_results):
    for rank, res in enumerate(verify_results):
        before, after = res[("name_map", False)], res[("name_map", True)]
        swapped = ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]
        assert before["error"] is None and before["valid"] and before["differing"] == swapped
        _one_error(after["error"], tensor=swapped[0], version=5, rank=rank)
        assert not after["valid"] and after["refused"]


@pytest.mark.dist
def test_the_probe_catches_a_sender_side_layout_bug_that_every_checksum_passes(verify_results):
    for rank, res in enumerate(verify_results):
        clean, planted = res[("probe", False)], res[("probe", True)]
        assert clean["checksum_error"] is None and clean["probe"] is None
        assert planted["checksum_error"] is None  # the sender checksums what it wrongly laid out
        msg = planted["probe"]
        assert msg is not None and msg.startswith("weight sync to version 6: the probe sequence's logprobs under "
                                                  f"HFEngine on rank {rank} differ from the actor's by"), msg
        assert "rollout.weight_probe_tolerance=0.001" in msg


@pytest.mark.dist
def test_clean_syncs_pass_and_the_sender_checksums_are_the_exported_bytes(verify_results):
    for res in verify_results:
        assert res["clean_period1"] is None and res["dtype"] == "float32"
        assert res["sums"] and all(ours == ref for ours, ref in res["sums"].values()), res["sums"]
        names = sorted(res["sums"])
        seen = set()
        for version, (error, checked, sent) in res["coverage"].items():
            assert error is None and sent == len(names)
            assert len(checked) in (len(names) // 8, len(names) // 8 + 1)
            seen |= set(checked)
        assert seen == set(names)  # every tensor once in 8 consecutive syncs at period 8
