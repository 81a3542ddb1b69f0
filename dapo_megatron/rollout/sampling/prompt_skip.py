"""Pre-rollout prompt skipping after GRESO (Zheng et al. 2025, "Act Only When It Pays:
Efficient Reinforcement Learning for LLM Reasoning via Selective Rollouts", arXiv 2506.02177).

Zero-variance prompts, which dynamic sampling drops after generating them, stay zero-variance
across epochs (GRESO Sec. 3), so they can be skipped *before* rollout. The rule is the paper's
probabilistic filter in its plain form: a prompt whose groups had zero variance in each of its last
``k`` visits is skipped with probability ``p``, explored again otherwise (so one that becomes
informative is found again and its streak reset). The paper's adaptation of ``p`` towards a target
zero-variance rate is not implemented.

Every draw is a pure function of ``(seed, prompt index, encounter count)`` (blake2b), so
the decisions are the same on every rank and after a resume; the per-prompt streaks and
encounter counts are the whole state (:meth:`PromptSkipper.state_dict`, in the checkpoint).

Design: docs/design.md §3.7 (skipping).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass
class PromptSkipConfig:
    """GRESO-style skipping of prompts that were uninformative in their recent visits."""

    enable: bool = False
    """skip candidates before rollout (``rollout/skipped_prompts`` counts them per step)."""
    zero_variance_visits: int = 1
    """``k``: a prompt is a candidate after this many consecutive visits whose group had zero
    variance (every response equally right or wrong, on ``buffer.filter_metric``)."""
    skip_probability: float = 0.5
    """``p``: a candidate is skipped with this probability and explored otherwise (in [0, 1))."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad field."""
        if isinstance(self.zero_variance_visits, bool) or not isinstance(self.zero_variance_visits, int) \
                or self.zero_variance_visits < 1:
            raise ValueError(f"zero_variance_visits={self.zero_variance_visits!r} must be an int >= 1")
        if not 0.0 <= self.skip_probability < 1.0:
            raise ValueError(f"skip_probability={self.skip_probability} must be in [0, 1) (1 would never explore a "
                             "skipped prompt again)")


def _uniform(seed: int, prompt_index: int, encounter: int) -> float:
    """A uniform in [0, 1) from the three numbers (53 bits of blake2b)."""
    digest = hashlib.blake2b(f"skip:{seed}:{prompt_index}:{encounter}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


class PromptSkipper:
    """The skip decisions and per-prompt history (module docstring).

    Args:
        config: :class:`PromptSkipConfig`, validated.
        seed: base seed of the draws (``trainer.seed``).
    """

    def __init__(self, config: PromptSkipConfig, seed: int = 0):
        self.config = config
        self.seed = int(seed)
        self._streak: dict[int, int] = {}  # prompt index -> consecutive zero-variance visits (capped at k)
        self._encounters: dict[int, int] = {}  # prompt index -> times it came up (visited or skipped)

    def skip(self, prompt_index: int) -> bool:
        """Whether to skip the prompt this time it comes up; counts the encounter."""
        enc = self._encounters.get(prompt_index, 0)
        self._encounters[prompt_index] = enc + 1
        if not self.config.enable or self._streak.get(prompt_index, 0) < self.config.zero_variance_visits:
            return False
        return _uniform(self.seed, prompt_index, enc) < self.config.skip_probability

    def record(self, prompt_index: int, zero_variance: bool) -> None:
        """The outcome of a visit: extends or resets the prompt's zero-variance streak."""
        if zero_variance:
            self._streak[prompt_index] = min(self._streak.get(prompt_index, 0) + 1, self.config.zero_variance_visits)
        else:
            self._streak.pop(prompt_index, None)

    def is_candidate(self, prompt_index: int) -> bool:
        """Whether the prompt's last ``k`` visits were all zero-variance."""
        return self._streak.get(prompt_index, 0) >= self.config.zero_variance_visits

    def state_dict(self) -> dict:
        """Plain python: ``{"streak": [[index, n], ...], "encounters": [[index, n], ...]}``."""
        return {"streak": sorted([i, n] for i, n in self._streak.items()),
                "encounters": sorted([i, n] for i, n in self._encounters.items())}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s history.

        Raises:
            ValueError: not a state written by :meth:`state_dict`.
        """
        if not isinstance(state, dict) or not {"streak", "encounters"} <= set(state):
            raise ValueError("PromptSkipper.load_state_dict: expected {'streak', 'encounters'} from state_dict()")
        self._streak = {int(i): int(n) for i, n in state["streak"]}
        self._encounters = {int(i): int(n) for i, n in state["encounters"]}
