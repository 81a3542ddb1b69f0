"""Rollout: the engines (:mod:`.engines`; how new weights reach them is
:mod:`dapo_megatron.bridge`'s), dynamic sampling (:mod:`.sampling`), the step's records across ranks
(:mod:`.plan`; which ranks train them is :mod:`dapo_megatron.actor.step_plan`'s) and the one object the trainer talks to,
:class:`~dapo_megatron.rollout.rollout.Rollout` (:mod:`.rollout`); :mod:`.types` (Sample, Group)
and :mod:`.config` (RolloutConfig) are shared by all. Rooms and the Rollout's surface:
docs/design.md §2.3. The package imports nothing itself, so loading a config (which reads
:mod:`.config`) does not load the engines.
"""
