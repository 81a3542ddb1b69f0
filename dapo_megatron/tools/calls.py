"""Tool calls in generated text: where a call ends, the program it carries, and the text of its
result that is appended to the response.

Two formats (``multi_turn.format``):

* ``code_block``: a fenced block, ```` ```python ```` (``multi_turn.code_block_language``) on its
  own, the program, then a closing ```` ``` ````. The engine stops at ```` ```\\n ```` (the opening
  fence ```` ```python\\n ```` does not contain it). The result is appended as an
  ```` ```output ```` block, the convention of ToRA, ReTool and SimpleTIR prompts.
* ``hermes``: the Hermes / Qwen2.5 / Qwen3 chat-template tool call,
  ``<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>`` (``arguments`` may
  also be a JSON string, as OpenAI-style templates write it). The engine stops at
  ``</tool_call>``. The result is appended as the chat template renders a ``tool`` message after
  an assistant turn: the assistant turn's ``<|im_end|>``, then a ``user`` turn holding
  ``<tool_response>...</tool_response>``, then the next assistant header (ChatML, as Qwen2.5's
  and SmolLM2's templates; ``multi_turn.tool_response_template`` changes it).

The contract with the rollout loop: stop strings are only a shortcut, so the loop calls
:func:`find_tool_call` on every turn's decoded text however the turn ended (a Hermes call is
usually followed by the end-of-turn token). It keeps every sampled token id as sampled, whatever
follows the call's end in the text included; it tokenises the string :func:`format_tool_response`
returns once, appends those ids with response-mask 0, and never re-tokenises the conversation.
A turn with no complete call (the stop string matched an opening fence without a language, or a
call with no closing tag) is not a call. One call per turn, the first (verl's
``max_parallel_calls=1``).

The config keys follow verl's ``actor_rollout_ref.rollout.multi_turn`` names where verl has the
key (``enable``, ``format``, ``max_assistant_turns``, ``max_tool_response_length``,
``tool_response_truncate_side`` with verl's meaning of each side).

Design: docs/design.md §4.1 (tool calls in a sandbox).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from dapo_megatron.tools.sandbox import SandboxPool, SandboxResult

__all__ = ["ToolCallConfig", "ToolCall", "stop_strings", "find_tool_call", "truncate_tool_response",
           "tool_result_text", "format_tool_response", "run_tool_call", "FORMATS", "DEFAULT_TEMPLATES"]

FORMATS = ("code_block", "hermes")
DEFAULT_TEMPLATES = {
    "code_block": "```output\n{output}\n```\n",
    "hermes": "<|im_end|>\n<|im_start|>user\n<tool_response>\n{output}\n</tool_response><|im_end|>\n"
              "<|im_start|>assistant\n",
}
"""``multi_turn.tool_response_template`` when unset, per format; ``{output}`` is the tool's text."""

_TRUNCATED = "...(truncated)"  # verl's marker, so a model trained there reads ours the same


@dataclass
class ToolCallConfig:
    """The tool keys of a multi-turn rollout: tool calls inside one response (verl's ``multi_turn.*``
    names where verl has them). The run config's ``rollout.multi_turn`` block
    (:class:`dapo_megatron.rollout.config.MultiTurnConfig`) is this class plus the trajectory hook's
    ``trajectory``; :class:`dapo_megatron.tools.trajectory.ToolTrajectory` reads it."""

    enable: bool = False
    """let responses call the Python tool (verl: ``multi_turn.enable``)."""
    format: str = "code_block"
    """``code_block`` (a fenced Python block) or ``hermes`` (``<tool_call>`` JSON; verl: ``multi_turn.format``,
    whose ``hermes`` parser reads the same tags)."""
    code_block_language: str = "python"
    """the fence's info string that marks a call in the ``code_block`` format (```` ```python ````)."""
    tool_name: str = "python"
    """the function name a ``hermes`` call must give; its ``arguments`` carry the program under ``code``."""
    max_assistant_turns: int = 4
    """model turns per response, >= 1 (verl: ``multi_turn.max_assistant_turns``): at most this minus one
    tool calls."""
    max_tool_response_length: int = 256
    """characters of tool output kept in the appended text, >= 1 (verl's key and default)."""
    tool_response_truncate_side: str = "middle"
    """which part of a longer output survives (verl's meanings): ``left`` keeps the beginning, ``right``
    the end, ``middle`` both ends; the cut is marked ``...(truncated)``."""
    tool_response_template: str | None = None
    """the appended text around the output, with one ``{output}`` (default: :data:`DEFAULT_TEMPLATES`
    for the format)."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad key (``multi_turn.<key>``) and the fix."""
        if self.format not in FORMATS:
            raise ValueError(f"multi_turn.format={self.format!r} must be one of {FORMATS}")
        if not re.fullmatch(r"[\w.+-]+", self.code_block_language or ""):
            raise ValueError(f"multi_turn.code_block_language={self.code_block_language!r} must be a fence info "
                             "string such as 'python' (letters, digits, '.', '+', '-')")
        if not self.tool_name:
            raise ValueError("multi_turn.tool_name must be a non-empty function name")
        for key in ("max_assistant_turns", "max_tool_response_length"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"multi_turn.{key}={value!r} must be an int >= 1")
        if self.tool_response_truncate_side not in ("left", "right", "middle"):
            raise ValueError(f"multi_turn.tool_response_truncate_side={self.tool_response_truncate_side!r} must be "
                             "'left', 'right' or 'middle'")
        if self.tool_response_template is not None and self.tool_response_template.count("{output}") != 1:
            raise ValueError(f"multi_turn.tool_response_template={self.tool_response_template!r} must hold "
                             "'{output}' exactly once")

    @property
    def template(self) -> str:
        """The response template in force (the configured one or the format's default)."""
        return self.tool_response_template or DEFAULT_TEMPLATES[self.format]


@dataclass(frozen=True)
class ToolCall:
    """The first complete tool call of a turn's text.

    Attributes:
        code: the program to run, or None when the call is malformed (see ``error``).
        end: offset in the text just past the call (after the closing fence or ``</tool_call>``).
        error: why a malformed call cannot run (bad JSON, another tool's name, no ``code``); the
            loop sends it back as the tool's output so the model sees its mistake.
    """

    code: str | None
    end: int
    error: str | None = None


def stop_strings(config: ToolCallConfig) -> tuple[str, ...]:
    """Stop strings for the engine: generation halts right after a call's end (SGLang and HF
    match them on the decoded text, whatever the token boundaries)."""
    return ("```\n",) if config.format == "code_block" else ("</tool_call>",)


def find_tool_call(text: str, config: ToolCallConfig) -> ToolCall | None:
    """The first complete call in ``text`` (one turn's decoded response), or None."""
    if config.format == "code_block":
        fence = re.compile(r"```" + re.escape(config.code_block_language) + r"[ \t]*\n(.*?)```", re.S)
        m = fence.search(text)
        return None if m is None else ToolCall(code=m.group(1), end=m.end())
    # verl's HermesToolParser (verl/experimental/agent_loop/tool_parser.py) matches the same
    # non-greedy <tool_call>(.*?)</tool_call> and drops a call whose JSON fails; we answer it instead
    m = re.search(r"<tool_call>(.*?)</tool_call>", text, re.S)
    if m is None:
        return None
    return _parse_hermes(m.group(1), m.end(), config)


def _parse_hermes(body: str, end: int, config: ToolCallConfig) -> ToolCall:
    try:
        call = json.loads(body)
    except ValueError as e:
        return ToolCall(None, end, f"the tool call is not valid JSON ({e})")
    if not isinstance(call, dict):
        return ToolCall(None, end, 'the tool call must be a JSON object {"name": ..., "arguments": {...}}')
    if call.get("name") != config.tool_name:
        return ToolCall(None, end, f"unknown tool {call.get('name')!r}: the only tool is {config.tool_name!r}")
    arguments = call.get("arguments")
    if isinstance(arguments, str):  # OpenAI-style: the arguments object serialised as a string
        try:
            arguments = json.loads(arguments)
        except ValueError as e:
            return ToolCall(None, end, f"the tool call's arguments are not valid JSON ({e})")
    if not isinstance(arguments, dict) or not isinstance(arguments.get("code"), str):
        return ToolCall(None, end, f'{config.tool_name} takes {{"code": "<program>"}} as its arguments')
    return ToolCall(arguments["code"], end)


def truncate_tool_response(text: str, config: ToolCallConfig) -> str:
    """``text`` cut to ``max_tool_response_length`` characters as verl cuts it (``left``: the first
    n + ``...(truncated)``; ``right``: ``(truncated)...`` + the last n; ``middle``: the first and last
    n // 2 around ``...(truncated)...``); unchanged when it fits."""
    # verl/experimental/agent_loop/tool_agent_loop.py cuts characters the same way (verl's middle
    # keeps text[-0:], all of it, when n == 1; here it keeps nothing of the end)
    n = config.max_tool_response_length
    if len(text) <= n:
        return text
    if config.tool_response_truncate_side == "left":
        return text[:n] + _TRUNCATED
    if config.tool_response_truncate_side == "right":
        return "(truncated)..." + text[-n:]
    half = n // 2
    return text[:half] + _TRUNCATED + "..." + text[len(text) - half:]


def tool_result_text(result: SandboxResult) -> str:
    """What the model reads of a call's result: the program's output (a traceback included), plus
    one line saying why it stopped when it did not end by itself."""
    if result.kind in ("ok", "nonzero_exit", "memory"):
        return result.output
    if result.kind == "timeout":
        return result.output + f"\nTimeoutError: the program was stopped ({result.detail})"
    if result.kind == "output_truncated":
        return result.output + f"\n(output stopped: {result.detail})"
    return f"the tool could not run the program ({result.detail})"  # sandbox_error: no host details


def format_tool_response(output: str, config: ToolCallConfig) -> str:
    """The text appended after a call: ``output`` truncated (:func:`truncate_tool_response`), then
    placed in the template. The caller tokenises it once (no special tokens added)."""
    return config.template.replace("{output}", truncate_tool_response(output, config))


async def run_tool_call(call: ToolCall, pool: SandboxPool, config: ToolCallConfig) -> tuple[str, SandboxResult | None]:
    """Run ``call`` in the sandbox and return (text to append, the sandbox's result); a malformed
    call does not run: its text is the error, and the result is None."""
    if call.code is None:
        return format_tool_response(f"Error: {call.error}", config), None
    result = await pool.arun(call.code)
    return format_tool_response(tool_result_text(result), config), result
