"""Tool-call text: stop strings, parsing a turn into the program, and the appended result text
(dapo_megatron/tools/calls.py). Pure string functions, plus one round trip through the real
sandbox (~50 ms)."""

from __future__ import annotations

import asyncio
import json

import pytest

from dapo_megatron.tools.calls import (DEFAULT_TEMPLATES, ToolCallConfig, ToolCall, find_tool_call,
                                       format_tool_response, run_tool_call, stop_strings, tool_result_text,
                                       truncate_tool_response)
from dapo_megatron.tools.sandbox import SandboxConfig, SandboxPool, SandboxResult

BLOCK = ToolCallConfig()
HERMES = ToolCallConfig(format="hermes")


# -- code_block ---------------------------------------------------------------------------------

def test_a_fenced_python_block_is_a_call_ending_at_its_closing_fence():
    text = "Compute it.\n```python\nx = 12345 * 6789\nprint(x)\n```\n"
    call = find_tool_call(text, BLOCK)
    assert call == ToolCall(code="x = 12345 * 6789\nprint(x)\n", end=len(text) - 1)
    assert text[:call.end].endswith("```") and text[call.end:] == "\n"


def test_the_stop_string_fires_at_the_closing_fence_and_not_the_opening_one():
    (stop,) = stop_strings(BLOCK)
    opening, closing = "Let me check.\n```python\n", "print(1)\n```\n"
    assert stop not in opening  # generation is not cut at the opening fence
    text = opening + closing
    assert text.index(stop) + len(stop) == len(text)  # ...but right after the closing one
    assert find_tool_call(text[:text.index(stop) + len(stop)], BLOCK).code == "print(1)\n"


def test_no_complete_block_is_no_call():
    for text in ("```python\nprint(1)\n",  # cut by the length limit
                 "```\nprint(1)\n```\n",  # no language: not a tool call
                 "```js\nconsole.log(1)\n```\n",
                 "The answer is 42."):
        assert find_tool_call(text, BLOCK) is None, text


def test_the_first_of_two_blocks_is_the_call_and_the_language_is_configurable():
    text = "```py\na = 1\n```\nthen\n```py\nb = 2\n```\n"
    call = find_tool_call(text, ToolCallConfig(code_block_language="py"))
    assert call.code == "a = 1\n" and call.end == text.index("```\nthen") + 3
    inline = "```python  \nprint(2)```"  # closing fence on the code's line, then the end of the text
    assert find_tool_call(inline, BLOCK) == ToolCall("print(2)", len(inline))


# -- hermes -------------------------------------------------------------------------------------

def _hermes(payload) -> str:
    return f"I'll use the tool.\n<tool_call>\n{json.dumps(payload)}\n</tool_call>"


def test_a_hermes_call_carries_the_code_in_its_arguments():
    code = 'print("a\\tb", {1: 2})\n'
    text = _hermes({"name": "python", "arguments": {"code": code}})
    assert stop_strings(HERMES) == ("</tool_call>",)
    assert find_tool_call(text + "<|im_end|>", HERMES) == ToolCall(code=code, end=len(text))
    as_string = _hermes({"name": "python", "arguments": json.dumps({"code": code})})  # OpenAI-style
    assert find_tool_call(as_string, HERMES).code == code


@pytest.mark.parametrize("body, error", [
    ('{"name": "python", "arguments": {"code": "print(1)"}', "not valid JSON"),
    ('["python"]', "must be a JSON object"),
    ('{"name": "search", "arguments": {"query": "x"}}', "unknown tool 'search': the only tool is 'python'"),
    ('{"name": "python", "arguments": {"program": "print(1)"}}', 'python takes {"code": "<program>"}'),
    ('{"name": "python", "arguments": "{not json"}', "arguments are not valid JSON"),
])
def test_a_malformed_hermes_call_is_a_call_with_an_error(body, error):
    text = f"<tool_call>{body}</tool_call>"
    call = find_tool_call(text, HERMES)
    assert call.code is None and error in call.error and call.end == len(text)
    appended, result = asyncio.run(run_tool_call(call, pool=None, config=HERMES))  # never reaches a sandbox
    assert result is None and appended == DEFAULT_TEMPLATES["hermes"].replace("{output}", f"Error: {call.error}")


def test_an_unclosed_hermes_call_is_no_call():
    assert find_tool_call('<tool_call>{"name": "python", "arguments": {"code": "1"}}', HERMES) is None


# -- the appended text --------------------------------------------------------------------------

@pytest.mark.parametrize("side, expected", [("left", "abcd...(truncated)"), ("right", "(truncated)...ghij"),
                                            ("middle", "ab...(truncated)...ij")])
def test_truncation_follows_verls_sides(side, expected):
    config = ToolCallConfig(max_tool_response_length=4, tool_response_truncate_side=side)
    assert truncate_tool_response("abcdefghij", config) == expected
    assert truncate_tool_response("abcd", config) == "abcd"


def test_the_response_text_wraps_the_truncated_output_in_the_template():
    assert format_tool_response("42\n", BLOCK) == "```output\n42\n\n```\n"
    assert format_tool_response("7", HERMES) == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n7\n"
                                                 "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    custom = ToolCallConfig(tool_response_template="<out>{output}</out> {not a field}",
                             max_tool_response_length=3, tool_response_truncate_side="left")
    assert format_tool_response("{x}yz", custom) == "<out>{x}...(truncated)</out> {not a field}"


def _result(kind, output="", detail="d"):
    return SandboxResult(output=output, kind=kind, wall_s=0.1, exit_code=None, detail=detail, call_id="c")


def test_the_result_text_says_why_a_program_was_stopped():
    assert tool_result_text(_result("ok", "5\n")) == "5\n"
    assert tool_result_text(_result("nonzero_exit", "Traceback ...\nValueError\n")) == "Traceback ...\nValueError\n"
    assert tool_result_text(_result("timeout", "partial\n", "wall time over 2 s")) == (
        "partial\n\nTimeoutError: the program was stopped (wall time over 2 s)")
    assert tool_result_text(_result("output_truncated", "xxx", "output over 3 bytes")) == (
        "xxx\n(output stopped: output over 3 bytes)")
    assert tool_result_text(_result("sandbox_error", "bwrap: secret host path", "bwrap exited 1")) == (
        "the tool could not run the program (bwrap exited 1)")


@pytest.mark.parametrize("key, value", [("format", "json"), ("code_block_language", "py thon"), ("tool_name", ""),
                                        ("max_assistant_turns", 0), ("max_tool_response_length", True),
                                        ("tool_response_truncate_side", "both"),
                                        ("tool_response_template", "no placeholder")])
def test_a_bad_key_is_named(key, value):
    with pytest.raises(ValueError, match=rf"multi_turn\.{key}"):
        ToolCallConfig(**{key: value}).validate()


def test_a_turn_round_trips_through_the_sandbox():
    turn = "Multiply.\n```python\nprint(98765 * 43210)\n```\n"
    call = find_tool_call(turn, BLOCK)
    with SandboxPool(SandboxConfig(wall_timeout_s=5, max_concurrent=1)) as pool:
        appended, result = asyncio.run(run_tool_call(call, pool, BLOCK))
    assert result.kind == "ok"
    assert appended == f"```output\n{98765 * 43210}\n\n```\n"
