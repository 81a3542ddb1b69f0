"""Batch mode with GRESO prompt skipping (``buffer.prompt_skip`` without ``rollout.streaming``) in a
world of two processes (DP = 2).

Each rank drives one HF engine (tiny random Llama, CPU; each generation batch is dealt over the two)
and reads the whole of every generation batch from the replicated prompt queue
(:func:`~dapo_megatron.rollout.build.prompt_stream` with skipping), so the one skipper decides the
same on both. The grader (``Mod3Grader``'s rule: a response is right iff its last token id is a
multiple of 3) records, per generation batch, each group it graded on its rank; the oracle is
GRESO's rule from its definition (:func:`unit.rollout.test_feeder.greso_skips`) replayed over the
stream in order with those recorded outcomes: which prompts each batch admits, how many it skips,
and the skipper's history at the end. ~10 s (two processes).
"""

from __future__ import annotations

import json
import os

import pytest

from dapo_megatron.platform import spawn

NUM_PROMPTS, GEN, N, STEPS, SEED = 12, 4, 2, 4, 11


def _records():
    from dapo_megatron.data.dataset import PromptRecord

    return [PromptRecord(index=i, data_source="mod3", prompt_ids=[1, 5 + i % 7, 9 + i, 2 + i % 5][: 2 + i % 3],
                         messages=[], ground_truth=str(i), extra_info={}) for i in range(NUM_PROMPTS)]


def _cfg():
    from dapo_megatron.config import DAPOConfig

    cfg = DAPOConfig()  # no model: the buffer, rollout and trainer sections are read
    b = cfg.buffer
    b.train_batch_size, b.n, b.gen_batch_size, b.max_num_gen_batches, b.on_cap = 2, N, GEN, 3, "train_on_kept"
    b.prompt_skip.enable, b.prompt_skip.zero_variance_visits, b.prompt_skip.skip_probability = True, 1, 0.5
    b.overlong.enable = False
    cfg.rollout.response_length = b.overlong.max_response_length = 8
    cfg.trainer.seed = SEED
    return cfg


class _RecordingMod3:
    """The grader of ``unit.rollout.test_streaming.Mod3Grader``; records each call's groups as
    ``[prompt index, [acc, ...]]`` (the ground truth is the prompt's index; a group's ``n`` rows
    are graded together, on the rank that generated them)."""

    def __init__(self):
        self.calls = []

    def grade(self, requests):
        from unit.rollout.test_streaming import Mod3Grader

        out = Mod3Grader().grade(requests)
        accs = [(int(gt), r["acc"]) for (_, _, gt, _), r in zip(requests, out)]
        self.calls.append([[accs[k][0], [a for _, a in accs[k:k + N]]] for k in range(0, len(accs), N)])
        return out


def _worker(out_dir: str) -> None:
    import torch.distributed as dist

    from dapo_megatron.platform import ParallelConfig, init_distributed
    from dapo_megatron.rollout.build import compose_rollout, prompt_stream
    from dapo_megatron.rollout.engines.hf_engine import HFEngine
    from dapo_megatron.rewards.distributed import DistributedGrader
    from dapo_megatron.rollout.sampling.buffer import RolloutBuffer
    from dapo_megatron.rollout.sampling.feeder import PromptQueue
    from unit.rollout.test_hf_engine import tiny_llama
    from unit.rollout.test_streaming import decode

    parallel = init_distributed(ParallelConfig(1, 1), seed=0)
    cfg, records, grader = _cfg(), _records(), _RecordingMod3()
    stream = prompt_stream(cfg, parallel, records)
    rollout = compose_rollout(cfg, parallel, engine=HFEngine(tiny_llama(seed=2), eos_token_ids=[3]), num_engines=2,
                              engine_index=dist.get_rank(), train_data=records, val_data=None, stream=stream,
                              reward_pool=None, decode=decode,
                              buffer=RolloutBuffer(cfg.buffer, DistributedGrader(grader, parallel), decode),
                              collector=None, prompt_queue=PromptQueue(stream.next_batch, GEN, records.__getitem__))
    steps = []
    for step in range(STEPS):
        batch = rollout.collect(step)
        steps.append({"kept": [g.samples[0].prompt_index for g in batch.groups],
                      # a step the surplus fills generates nothing: its generation metrics are absent
                      "metrics": {k: batch.metrics.get(k, 0.0) for k in ("rollout/num_gen_batches",
                                                                         "rollout/prompts_submitted",
                                                                         "rollout/skipped_prompts")}})
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"steps": steps, "graded": grader.calls, "skipper": rollout.steps.skipper.state_dict(),
                   "queue": rollout.prompt_queue.state_dict(), "stream_batch": stream.batch_size}, f)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_two_ranks_admit_and_skip_the_prompts_gresos_rule_says(tmp_path):
    from dapo_megatron.data.stream import PromptStream
    from unit.rollout.test_feeder import greso_skips

    spawn(_worker, 2, str(tmp_path))
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    for key in ("steps", "skipper", "queue"):  # every rank took the same decisions
        assert ranks[0][key] == ranks[1][key], key
    assert ranks[0]["stream_batch"] == GEN  # the whole batch on each DP rank: the replicated stream
    # the outcomes of each generation batch: both ranks graded their engine's groups of every batch
    assert len(ranks[0]["graded"]) == len(ranks[1]["graded"])
    batches = [dict(g for rank in ranks for g in rank["graded"][c]) for c in range(len(ranks[0]["graded"]))]
    assert all(len(b) == GEN for b in batches)  # GEN distinct prompts each (no prompt twice in one batch)
    # the oracle: the stream in order, each prompt skipped or admitted by GRESO's rule on its history
    d = _cfg().data
    order = PromptStream(_records(), GEN, 0, 1, seed=d.seed, shuffle=d.shuffle)
    pending, fetched, streak, seen, skipped = [], 0, {}, {}, []
    for outcomes in batches:
        admitted, skips = [], 0
        while len(admitted) < GEN:
            if not pending:  # the next batch of the stream; position fetched * GEN + j seeds prompt j
                pending = [(rec.index, fetched * GEN + j) for j, rec in enumerate(order.next_batch())]
                fetched += 1
            i = pending.pop(0)[0]
            if greso_skips(SEED, 0.5, 1, i, seen.get(i, 0), streak.get(i, 0)):
                skips += 1
            else:
                admitted.append(i)
            seen[i] = seen.get(i, 0) + 1
        assert sorted(admitted) == sorted(outcomes)  # the prompts this batch generated
        for i, accs in outcomes.items():
            zero_variance = len(set(accs)) == 1
            streak[i] = min(streak.get(i, 0) + 1, 1) if zero_variance else 0
        skipped.append(skips)
    assert sum(skipped) > 0  # the run did skip
    done = 0
    for step in ranks[0]["steps"]:
        m, k = step["metrics"], int(step["metrics"]["rollout/num_gen_batches"])
        assert m["rollout/skipped_prompts"] == sum(skipped[done:done + k])
        assert m["rollout/prompts_submitted"] == GEN * k
        kept_from = {i for b in batches[done:done + k] for i, accs in b.items() if len(set(accs)) > 1}
        assert set(step["kept"]) <= kept_from | {i for b in batches[:done] for i in b}  # mixed groups (or surplus)
        done += k
    assert done == len(batches)
    assert ranks[0]["queue"] == {"fetched": fetched, "leftover": [list(x) for x in pending]}
    assert ranks[0]["skipper"] == {"streak": sorted([i, n] for i, n in streak.items() if n),
                                   "encounters": sorted([i, n] for i, n in seen.items())}
