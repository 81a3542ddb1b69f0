"""ParallelDims: the rollout groups of many layouts, the validation that names the key, the
object init_distributed returns on a 2-process world at TP=2 / PP=2 / DP=2 with rollout TP 1 and 2,
and its collectives (``platform/collectives.py``) run for real on that world (the same processes)."""

from __future__ import annotations

import dataclasses
import itertools
import os

import pytest
import torch

from dapo_megatron.platform import ParallelConfig, ParallelDims, rollout_groups, single_process, spawn


@pytest.mark.parametrize("world,local,rtp", [
    (w, loc, r) for w, loc, r in itertools.product((1, 2, 4, 8, 16, 24), (1, 2, 4, 8), (1, 2, 4, 8))
    if w % loc == 0 and loc % r == 0
])
def test_rollout_groups_are_consecutive_blocks_on_one_node(world, local, rtp):
    groups = rollout_groups(world, local, rtp)
    assert len(groups) == world // rtp
    seen = []
    for e, ranks in enumerate(groups):
        assert ranks == tuple(range(e * rtp, (e + 1) * rtp))  # consecutive, leader first
        assert len({r // local for r in ranks}) == 1  # one node
        seen.extend(ranks)
    assert seen == list(range(world))  # every rank in exactly one group


def test_rollout_groups_reject_layouts_naming_the_key():
    with pytest.raises(ValueError, match=r"^rollout\.tensor_model_parallel_size=3 does not divide the world size 8"):
        rollout_groups(8, 8, 3)
    # 4 divides the world of 12 but a group of ranks 4..7 would span the nodes {0..5} and {6..11}
    with pytest.raises(ValueError, match=r"^rollout\.tensor_model_parallel_size=4 must divide the ranks per node "
                                         r"\(LOCAL_WORLD_SIZE=6\)"):
        rollout_groups(12, 6, 4)
    with pytest.raises(ValueError, match=r"^rollout\.tensor_model_parallel_size=16 must divide the ranks per node"):
        rollout_groups(16, 8, 16)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match=r"^rollout\.tensor_model_parallel_size=.* must be an int >= 1"):
            rollout_groups(8, 8, bad)


def _dims(**overrides) -> ParallelDims:
    fields = dict(world_size=4, rank=1, local_rank=1, local_world_size=4, tp_size=2, tp_rank=1, tp_group=None,
                  pp_size=1, pp_rank=0, pp_group=None, pp_ranks=(1,), dp_size=2, dp_rank=0, dp_group=None,
                  dp_rank_of=(0, 0, 1, 1),
                  mp_size=2, mp_rank=1, mp_group=None, rollout_tp_size=2, rollout_group_ranks=(0, 1),
                  rollout_index=0, num_engines=2)
    return ParallelDims(**{**fields, **overrides})


def test_parallel_dims_is_frozen_and_checks_its_sizes():
    d = _dims()
    assert (d.rollout_leader, d.rollout_rank, d.is_rollout_leader) == (0, 1, False)
    assert d.is_pp_first and d.is_pp_last and d.pp_last_rank == 1
    assert d.ranks_of_dp_rank(0) == (0, 1) and d.ranks_of_dp_rank(1) == (2, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.dp_rank = 1
    with pytest.raises(ValueError, match=r"tp_size=2 × pp_size=1 × dp_size=1 != world_size=4"):
        _dims(dp_size=1)
    with pytest.raises(ValueError, match=r"^mp_size=4 != tp_size × pp_size = 2"):
        _dims(mp_size=4)
    with pytest.raises(ValueError, match=r"^dp_rank=2 is not in \[0, 2\)"):
        _dims(dp_rank=2)
    with pytest.raises(ValueError, match=r"^dp_rank_of=\(0, 1, 1, 1\) must give each"):
        _dims(dp_rank_of=(0, 1, 1, 1))
    with pytest.raises(ValueError, match=r"^pp_ranks=\(0,\) must list"):
        _dims(pp_ranks=(0,))
    with pytest.raises(ValueError, match=r"^rollout_group_ranks=\(2, 3\) must be"):
        _dims(rollout_group_ranks=(2, 3))



def test_experts_span_dp_when_the_expert_groups_leave_the_dp_shard():
    # world 4 = TP 2 × DP 2, rank 1 in DP shard 0 = ranks (0, 1)
    assert not _dims().experts_span_dp  # dense: EP of one, experts split as TP
    assert not _dims(ep_size=2, ep_rank=1, ep_ranks=(0, 1), etp_size=1, etp_rank=0).experts_span_dp  # EP = the TP pair
    assert _dims(ep_size=2, ep_rank=0, ep_ranks=(1, 3), etp_size=2, etp_rank=1).experts_span_dp  # EP across DP
    assert _dims(etp_size=4, etp_rank=1).experts_span_dp  # expert-TP wider than TP: over both DP shards

LAYOUTS = [(2, 1, 1), (2, 1, 2), (1, 2, 1), (1, 2, 2), (1, 1, 1), (1, 1, 2)]  # (TP, PP, rollout TP)


def _layout_worker(out_path: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from dapo_megatron.platform import init_distributed

    rank = int(os.environ["RANK"])
    res = {}
    for tp, pp, rtp in LAYOUTS:
        d = init_distributed(ParallelConfig(tp, pp), seed=0, rollout_tp=rtp)
        entry = {k: getattr(d, k) for k in (
            "world_size", "rank", "local_rank", "local_world_size", "tp_size", "tp_rank", "pp_size", "pp_rank",
            "pp_ranks", "dp_size", "dp_rank", "dp_rank_of", "mp_size", "mp_rank", "rollout_tp_size",
            "rollout_group_ranks", "rollout_index", "num_engines")}
        # the groups are megatron-core's own, not copies
        entry["same_groups"] = (d.tp_group is parallel_state.get_tensor_model_parallel_group()
                                and d.pp_group is parallel_state.get_pipeline_model_parallel_group()
                                and d.dp_group is parallel_state.get_data_parallel_group()
                                and d.mp_group is parallel_state.get_model_parallel_group())
        if d.rollout_group is None:
            entry["rollout_sum"] = None
        else:  # a working gloo group over exactly the rollout ranks
            x = torch.tensor([float(rank + 1)])
            dist.all_reduce(x, group=d.rollout_group)
            entry["rollout_sum"] = float(x)
            entry["rollout_backend"] = str(dist.get_backend(d.rollout_group))
        res[(tp, pp, rtp)] = entry
    again = init_distributed(ParallelConfig(1, 1), seed=0, rollout_tp=2)  # repeated call: the same gloo group
    res["reused_group"] = again.rollout_group is init_distributed(ParallelConfig(1, 1), rollout_tp=2).rollout_group
    try:
        init_distributed(ParallelConfig(1, 1), rollout_tp=4)
        res["error"] = None
    except ValueError as e:
        res["error"] = str(e)
    res["collectives"] = _collectives(init_distributed(ParallelConfig(1, 1), seed=0, rollout_tp=2), rank)
    torch.save(res, out_path.format(rank=rank))


def _collectives(d: ParallelDims, rank: int) -> dict:
    """Every collective of ParallelDims and of platform/collectives.py on the DP=2 world (rollout
    group of both ranks, TP group of one): what each returns on this rank."""
    from dapo_megatron.platform import collectives, dims_or_single

    max_op = collectives.ReduceOp.MAX
    out = {
        "broadcast_object": d.broadcast_object({"from": rank}, "world", src=1),
        "broadcast_object_first": d.broadcast_object(10 * rank + 7, "rollout"),  # src: the group's first rank
        "all_gather_objects": d.all_gather_objects(("r", rank), "dp"),
        "gather_objects_dst1": d.gather_objects(rank + 100, "world", dst=1),
        "gather_objects_first": d.gather_objects([rank], "rollout"),
        "all_reduce_sum": d.all_reduce(torch.tensor([rank + 1.0, 2.0 * rank]), "dp").tolist(),
        "all_reduce_max": d.all_reduce(torch.tensor([3.0 - rank, float(rank)]), "world", op=max_op).tolist(),
        "all_reduce_tp1": d.all_reduce(torch.tensor([rank + 0.5]), "tp").tolist(),  # a group of one: as given
        "all_gather": [t.tolist() for t in d.all_gather(torch.tensor([rank, rank * rank + 3]), "world")],
        "raw_all_gather_objects": collectives.all_gather_objects(rank * 2, group=d.world_group),
        "raw_gather_objects": collectives.gather_objects(rank, group=d.rollout_group, dst=0),
        "raw_broadcast_object": collectives.broadcast_object(f"r{rank}", group=d.dp_group, src=1),
    }
    t = torch.tensor([float(rank), -1.0])
    d.broadcast(t, "world", src=1)
    out["broadcast"] = t.tolist()
    flat = torch.empty(4, dtype=torch.int64)
    collectives.all_gather_into_tensor(flat, torch.tensor([rank, 5 + rank]), group=d.dp_group, async_op=True).wait()
    out["all_gather_into_tensor"] = flat.tolist()
    d.barrier("world")
    collectives.barrier(group=d.rollout_group)
    for name, call in (("none_group", lambda: collectives.all_reduce(torch.zeros(1), group=None)),
                       ("bad_name", lambda: d.barrier("xp")),
                       ("no_parallel", lambda: dims_or_single(None, "probe"))):
        try:
            call()
            out[name] = None
        except (TypeError, ValueError) as e:
            out[name] = (type(e).__name__, str(e))
    return out


def test_collectives_of_a_world_of_one_return_without_torch_distributed():
    """single_process(): every collective returns its input (gather: the one-element list) and
    nothing touches torch.distributed (not initialised here)."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    d = single_process()
    t = torch.tensor([1.5])
    assert d.broadcast_object("x") == "x" and d.all_gather_objects(3, "dp") == [3]
    assert d.gather_objects({"a": 1}, "world", dst=0) == [{"a": 1}]
    assert d.all_reduce(t, "world") is t and t.tolist() == [1.5]
    assert d.all_gather(t, "pp") == [t]
    d.barrier("rollout")
    d.broadcast(t, "tp", src=0)
    with pytest.raises(ValueError, match="group='xp' is none of"):
        d.broadcast_object(1, "xp")


@pytest.mark.dist
def test_init_distributed_returns_each_layout(tmp_path):
    path = str(tmp_path / "rank{rank}.pt")
    spawn(_layout_worker, 2, path)
    for rank in (0, 1):
        got = torch.load(path.format(rank=rank), weights_only=False)["collectives"]
        want = {
            "broadcast_object": {"from": 1},
            "broadcast_object_first": 7,
            "all_gather_objects": [("r", 0), ("r", 1)],
            "gather_objects_dst1": [100, 101] if rank == 1 else None,  # None off dst
            "gather_objects_first": [[0], [1]] if rank == 0 else None,
            "all_reduce_sum": [1.0 + 2.0, 0.0 + 2.0],
            "all_reduce_max": [3.0, 1.0],
            "all_reduce_tp1": [rank + 0.5],
            "all_gather": [[0, 3], [1, 4]],
            "raw_all_gather_objects": [0, 2],
            "raw_gather_objects": [0, 1] if rank == 0 else None,
            "raw_broadcast_object": "r1",
            "broadcast": [1.0, -1.0],
            "all_gather_into_tensor": [0, 5, 1, 6],
            "none_group": ("TypeError", "all_reduce: group=None would be the default world group; pass the group "
                                        "explicitly (ParallelDims.world_group for the world)"),
            "no_parallel": ("ValueError", "probe: pass parallel= (the run's ParallelDims from init_distributed) in "
                                          "a world of 2 ranks"),
        }
        assert {k: got[k] for k in want} == want, rank
        assert got["bad_name"][0] == "ValueError" and "group='xp' is none of" in got["bad_name"][1]
    for rank in (0, 1):
        res = torch.load(path.format(rank=rank), weights_only=False)
        for tp, pp, rtp in LAYOUTS:
            got = res[(tp, pp, rtp)]
            dp = 2 // (tp * pp)
            # megatron-core's default order: TP fastest, then DP, PP slowest
            want = dict(world_size=2, rank=rank, local_rank=rank, local_world_size=2, tp_size=tp,
                        tp_rank=rank % tp, pp_size=pp, pp_rank=rank // (tp * dp),
                        pp_ranks=(0, 1) if pp == 2 else (rank,), dp_size=dp, dp_rank=(rank // tp) % dp,
                        dp_rank_of=(0, 1) if dp == 2 else (0, 0),
                        mp_size=tp * pp, mp_rank=rank if tp * pp == 2 else 0, rollout_tp_size=rtp,
                        rollout_group_ranks=(0, 1) if rtp == 2 else (rank,), rollout_index=rank // rtp,
                        num_engines=2 // rtp)
            assert {k: got[k] for k in want} == want, (tp, pp, rtp)
            assert got["same_groups"]
            assert got["rollout_sum"] == (3.0 if rtp == 2 else None)
            if rtp == 2:
                assert got["rollout_backend"] == "gloo"
        assert res["reused_group"]
        assert res["error"].startswith("rollout.tensor_model_parallel_size=4 does not divide the world size 2")
