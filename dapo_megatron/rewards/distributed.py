"""Grading across ranks: each response graded on the rank that holds its tokens, in that rank's
reward pool; ``(score, acc)`` all-reduced, 3 float64 per response; the extracted answer (``pred``,
for logs) stays on the holder. Design: docs/design.md §1 step 2.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from dapo_megatron.platform.distributed import collective_device
from dapo_megatron.platform.parallel_dims import ParallelDims, dims_or_single


class DistributedGrader:
    """Grades each response on the rank that holds it; the grades of all are replicated.

    Wraps a :class:`~dapo_megatron.rewards.RewardPool` with the same ``grade`` API, so the
    replicated rollout buffer sees one grader. A collective over the world: every rank
    passes the same requests, with ``solution_str`` None where it does not hold the
    response (exactly one rank holds each).
    """

    def __init__(self, pool, parallel: Optional[ParallelDims] = None):
        self.pool = pool
        self.parallel = dims_or_single(parallel, "DistributedGrader")

    def grade(self, requests: Sequence[tuple]) -> list[dict]:
        """``{"score", "acc"}`` for every request, plus ``"pred"`` for the ones graded here.

        Raises:
            RuntimeError: a response held by no rank or by several (its index named).
        """
        mine = [i for i, r in enumerate(requests) if r[1] is not None]
        results = self.pool.grade([requests[i] for i in mine]) if mine else []
        table = torch.zeros(len(requests), 3, dtype=torch.float64)  # score, acc, graded here
        for i, res in zip(mine, results):
            table[i] = torch.tensor([float(res["score"]), 1.0 if res["acc"] else 0.0, 1.0], dtype=torch.float64)
        if self.parallel.world_size > 1:  # each row is non-zero on one rank only: the sum is that rank's row, exactly
            self.parallel.wait_for_generation()  # a rank with little to grade waits on gloo, not in the all-reduce
            dev = collective_device(self.parallel.world_group)
            table = self.parallel.all_reduce(table.to(dev), "world").cpu()
        graded = table[:, 2]
        if len(requests) and not bool((graded == 1).all()):
            bad = int((graded != 1).nonzero()[0])
            raise RuntimeError(f"response {bad} of the batch was graded by {int(graded[bad])} ranks; exactly the "
                               "rank that generated it must hold its text")
        out = [{"score": score, "acc": acc == 1.0} for score, acc, _ in table.tolist()]
        for i, res in zip(mine, results):
            out[i]["pred"] = res.get("pred")
        return out
