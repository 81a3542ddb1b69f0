"""The asynchronous rollout's per-step metrics (rollout/async_rollout.py ``partial_metrics``),
against values counted by hand from the version spans."""

import pytest

from dapo_megatron.rollout.steps_ahead import partial_metrics
from dapo_megatron.rollout.types import Sample


def _sample(n_tokens, versions):
    return Sample([1], list(range(n_tokens)), [0.0] * n_tokens, "stop", versions=versions)


def test_partial_metrics_count_spans_and_reprefill():
    trained = [_sample(4, [(0, 2), (3, 3)]),   # one sync inside: span 1
               _sample(5, [(0, 1), (2, 2), (4, 4)]),  # three spans, versions 1..4: span 3
               _sample(2, [(0, 4)]),            # one version
               _sample(3, [(0, 4)])]
    generated = trained + [_sample(6, [(0, 4)])]  # a dropped group's sample counts for the step's tokens
    m = partial_metrics(trained, resubmitted=3, reprefilled=5, generated=generated)
    assert m == {"async/partial_ratio": 2 / 4, "async/max_partial_span": 3.0, "rollout/resubmitted_rows": 3.0,
                 "rollout/reprefill_ratio": pytest.approx(5 / (4 + 5 + 2 + 3 + 6))}
    none = partial_metrics([], resubmitted=0, reprefilled=0, generated=[])
    assert none == {"async/partial_ratio": 0.0, "async/max_partial_span": 0.0, "rollout/resubmitted_rows": 0.0,
                    "rollout/reprefill_ratio": 0.0}
