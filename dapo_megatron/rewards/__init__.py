"""Rule-based math rewards, verl-compatible, graded in killable worker processes.

- :func:`compute_score` ``(data_source, solution_str, ground_truth, extra_info=None) -> dict``
  grades one response (``score`` +1/-1, ``acc``, ``pred``).
- :class:`RewardPool` grades batches in parallel, in order, with a per-item timeout.
- :class:`~dapo_megatron.rewards.distributed.DistributedGrader` grades each response on the rank
  that holds it and replicates the grades (it imports torch: not loaded with the package).

Graders by ``data_source``: DAPO math / ``aime*`` (:mod:`.math_dapo`), boxed
MATH with math-verify (:mod:`.math_boxed`), ``math`` in either form, a box or an
``Answer:`` line (:mod:`.math_either`), GSM8K (:mod:`.gsm8k`) and the embedded
arithmetic task (:mod:`.arithmetic`).

Design: docs/design.md §4 (rewards in killable processes).
"""

from dapo_megatron.rewards.config import RewardConfig
from dapo_megatron.rewards.pool import TIMEOUT_RESULT, RewardPool, compute_score
from dapo_megatron.rewards.registry import DATA_SOURCES, resolve_grader

__all__ = ["DATA_SOURCES", "TIMEOUT_RESULT", "RewardConfig", "RewardPool", "compute_score", "resolve_grader"]
