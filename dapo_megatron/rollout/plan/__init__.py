"""The step's data plan (docs/design.md, "The rollout rooms"): where each kept response trains.

Replicated integer records of every group and the grades (:mod:`.step_data`), the split of a
step's samples over DP ranks by token count (:mod:`.dp_split`), and the one move of each
response's tokens from the rank that generated it to the ranks that train it.
"""
