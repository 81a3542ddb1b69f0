"""Rollout engines: what generates responses, and how prompts reach it. Nothing here knows the
trainer's batch or the DAPO keep rule; how weights reach an engine is :mod:`dapo_megatron.bridge`'s.
``sglang`` itself is imported only when an SGLang engine is constructed. The modules, one idea
each: docs/design.md §2.3 (the rollout rooms).
"""
