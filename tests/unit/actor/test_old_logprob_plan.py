"""The per-step old-logprob plan: every case of the rule of docs/design.md §3.7, written out by hand.

Rule: ``actor.old_logprob_source: rollout`` -> the engine's logprobs are pi_old (ROLLOUT), nothing
is corrected (pi_old is the behaviour policy). Otherwise one update in the step without
``rollout_rs`` -> pi_old = sg(pi_theta) of the training forward (FROM_TRAINING); else a recompute
(RECOMPUTE). The correction applies when ``rollout_is`` or ``rollout_rs`` is set and pi_old is not
the rollout's.
"""

import pytest

from dapo_megatron.actor import ActorConfig, OldLogprobPlan, resolve_old_logprob_plan
from dapo_megatron.actor.plan import FROM_TRAINING, RECOMPUTE, ROLLOUT

# (old_logprob_source, rollout_is, rollout_rs, num_updates) -> (source, corrects)
TABLE = [
    ("recompute", "token", None, 1, FROM_TRAINING, True),
    ("recompute", "sequence", None, 1, FROM_TRAINING, True),
    ("recompute", None, None, 1, FROM_TRAINING, False),
    ("recompute", "token", None, 2, RECOMPUTE, True),
    ("recompute", None, None, 4, RECOMPUTE, False),
    ("recompute", "token", None, None, RECOMPUTE, True),  # update count unknown: never from training
    ("recompute", None, None, None, RECOMPUTE, False),
    ("recompute", "token", "token", 1, RECOMPUTE, True),  # rejection needs pi_old before the forward
    ("recompute", None, "geometric", 1, RECOMPUTE, True),
    ("recompute", None, "token", 3, RECOMPUTE, True),
    ("rollout", "token", None, 1, ROLLOUT, False),
    ("rollout", "token", None, 2, ROLLOUT, False),
    ("rollout", None, None, None, ROLLOUT, False),
]


@pytest.mark.parametrize("source,rollout_is,rollout_rs,num_updates,want_source,want_corrects", TABLE)
def test_resolver_table(source, rollout_is, rollout_rs, num_updates, want_source, want_corrects):
    cfg = ActorConfig(old_logprob_source=source, rollout_is=rollout_is, rollout_rs=rollout_rs,
                      rollout_rs_threshold=2.0 if rollout_rs else None)
    cfg.validate()
    plan = resolve_old_logprob_plan(cfg, num_updates=num_updates)
    assert (plan.source, plan.corrects) == (want_source, want_corrects)
    assert plan.recompute == (want_source == RECOMPUTE)
    assert plan.from_training == (want_source == FROM_TRAINING)


def test_every_source_is_reached():
    assert {row[4] for row in TABLE} == {RECOMPUTE, FROM_TRAINING, ROLLOUT}


def test_plan_refuses_contradictions():
    with pytest.raises(ValueError, match="must be one of"):
        OldLogprobPlan("recomputed")
    with pytest.raises(ValueError, match="nothing to correct"):
        OldLogprobPlan(ROLLOUT, corrects=True)
