"""The streamed rollout's multi-turn trajectory in a world of two processes (issue 38 item 5).

Each rank drives one HF engine (tiny random Llama, CPU) and holds the tokens of the groups its
engine samples; the trajectory (:class:`~unit.rollout.test_trajectory.TwoTurns`: after a row that
stops, three context ids once) runs on the rank holding a finished row's tokens, and the other rank
takes its decision from one all-gather of ``(prompt_seed, j, context appended, finish)``
(``EngineClient.share_turns``). The oracle is the same streamed step in one process with one engine
(the streamed rollout's decisions do not depend on the layout with the HF engine, whose rows are
seeded per response): the same kept groups in the same order, every sample's length, context count
and finish reason on both ranks, and its token ids and mask on its holder. ~10 s (two processes).
"""

from __future__ import annotations

import json
import os

import pytest

from dapo_megatron.platform import spawn


class _GatherMod3:
    """``Mod3Grader`` as the distributed reward pool answers: each response graded once, on the rank
    holding it, the results all-gathered."""

    def grade(self, requests):
        import torch.distributed as dist

        from unit.rollout.test_streaming import Mod3Grader

        mine = Mod3Grader().grade([(d, t or "", g, e) for d, t, g, e in requests])
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, [r if t is not None else None for r, (_, t, _, _) in zip(mine, requests)])
        return [next(p[i] for p in parts if p[i] is not None) for i in range(len(requests))]


def _record(groups, metrics):
    return {"groups": [[g.prompt_seed, [{"length": s.response_length, "context": s.num_context_tokens,
                                         "finish": s.finish_reason, "versions": [list(v) for v in s.versions],
                                         "ids": s.response_ids, "mask": s.response_mask} for s in g.samples]]
                       for g in groups],
            "gen_tokens": metrics["rollout/gen_tokens"], "rounds": metrics["rollout/rounds"]}


def _collect(engine, trajectory, grader, client):
    from dapo_megatron.rollout.sampling.feeder import PromptQueue
    from unit.rollout.test_streaming import BATCH, RECORDS, Stream
    from unit.rollout.test_trajectory import _collector

    collector, _ = _collector(trajectory)
    collector.selector.reward_pool = grader
    return collector.collect(client, PromptQueue(Stream(), BATCH, RECORDS.__getitem__), policy_version=0)


def _worker(out_dir: str) -> None:
    import torch.distributed as dist

    from dapo_megatron.platform import ParallelConfig, init_distributed
    from dapo_megatron.rollout.engines.hf_engine import HFEngine
    from dapo_megatron.rollout.sampling.streaming import EngineClient
    from unit.rollout.test_hf_engine import tiny_llama
    from unit.rollout.test_trajectory import PARAMS, TwoTurns

    parallel = init_distributed(ParallelConfig(1, 1), seed=0)
    rank = dist.get_rank()
    engine = HFEngine(tiny_llama(seed=2), eos_token_ids=[3])
    trajectory = TwoTurns()
    client = EngineClient(engine, PARAMS, num_engines=2, engine_index=rank, parallel=parallel)
    out, metrics = _collect(engine, trajectory, _GatherMod3(), client)
    rec = _record(out, metrics)
    rec["settled_here"] = len(trajectory.calls)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_two_ranks_take_the_holders_turn_decisions_and_equal_one_process(tmp_path):
    from dapo_megatron.rollout.engines.hf_engine import HFEngine
    from dapo_megatron.rollout.sampling.streaming import EngineClient
    from unit.rollout.test_hf_engine import tiny_llama
    from unit.rollout.test_streaming import Mod3Grader
    from unit.rollout.test_trajectory import PARAMS, TwoTurns

    spawn(_worker, 2, str(tmp_path))
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    engine = HFEngine(tiny_llama(seed=2), eos_token_ids=[3])
    ref_trajectory = TwoTurns()
    ref = _record(*_collect(engine, ref_trajectory, Mod3Grader(), EngineClient(engine, PARAMS)))

    multi = 0
    for rec in ranks:
        assert [g[0] for g in rec["groups"]] == [g[0] for g in ref["groups"]]  # the same kept groups, in order
        assert (rec["gen_tokens"], rec["rounds"]) == (ref["gen_tokens"], ref["rounds"])
        for (_, samples), (_, want) in zip(rec["groups"], ref["groups"]):
            for s, w in zip(samples, want, strict=True):
                assert (s["length"], s["context"], s["finish"], s["versions"]) == (
                    w["length"], w["context"], w["finish"], w["versions"])
                multi += s["context"] > 0
    # each sample's tokens and mask on exactly one rank, its holder's equal to one process's
    for gi, (_, want) in enumerate(ref["groups"]):
        for j, w in enumerate(want):
            held = [rec["groups"][gi][1][j] for rec in ranks if rec["groups"][gi][1][j]["ids"] is not None]
            assert len(held) == 1
            assert (held[0]["ids"], held[0]["mask"]) == (w["ids"], w["mask"])
    assert multi >= 2 * 2  # second turns happened, seen on both ranks
    # the trajectory ran once per finished row, on the rank holding it: as often as in one process
    assert sum(rec["settled_here"] for rec in ranks) == len(ref_trajectory.calls)
