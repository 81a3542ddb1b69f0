"""Tools a model calls mid-response: the Python sandbox (:mod:`~dapo_megatron.tools.sandbox`)
and the tool-call text format (:mod:`~dapo_megatron.tools.calls`): where a call ends in the
generated text, the program it carries, and the text of its result appended to the response.

Design: docs/design.md §4.1 (tool calls in a sandbox).
"""
