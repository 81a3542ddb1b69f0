"""The step's records across ranks (docs/design.md §2.3): replicated integer records of every
group and the grades (:mod:`.step_data`), and the one move of each response's tokens from the rank
that generated it to the ranks that train it; which ranks those are is the actor's plan
(:mod:`dapo_megatron.actor.step_plan`).
"""
