"""Dynamic sampling (docs/design.md, "The rollout rooms"): which generated groups a step keeps.

The step feeder and its admission policies (:mod:`.feeder`), the keep rule and its carried
surplus (:mod:`.buffer`), streamed rounds with partial rollouts (:mod:`.streaming`) and prompt
skipping (:mod:`.prompt_skip`). Engines are reached
only through the engine API; nothing here moves tokens between ranks.
"""
