"""The tool trajectory (dapo_megatron/tools/trajectory.py) on the rollout's hook, and the HF engine's
stop strings it relies on.

Token in, token out: the sampled ids of a turn are written NOT as the tokenizer would write their
text (one id per character), so a trajectory that decoded and re-encoded the response would change
them; the tool's ids must be exactly one tokenisation of the expected result text, written here
from the program's arithmetic, not from the code under test. The program runs in the real
bubblewrap sandbox (~50 ms a call). SmolLM2's tokenizer comes from the suite's cache (~0.7 s).
The loss, gradient, token count and overlong length of mask-0 tokens are tests/unit/actor/
test_response_mask.py's.
"""

from __future__ import annotations

import pytest
import torch

from dapo_megatron.rollout.config import MultiTurnConfig
from dapo_megatron.rollout.engines.engine import RowRequest, SamplingParams
from dapo_megatron.rollout.engines.hf_engine import HFEngine
from dapo_megatron.rollout.trajectory import PENDING, Trajectory, settle_row
from dapo_megatron.rollout.types import Sample
from dapo_megatron.tools.sandbox import SandboxConfig
from dapo_megatron.tools.trajectory import ToolTrajectory, tool_metrics
from unit.rollout.test_hf_engine import tiny_llama

TOOL = "dapo_megatron.tools.trajectory:ToolTrajectory"


# -- the HF engine's stop strings (tiny random Llama, ~1 s) ----------------------------------------

def _letters(ids):  # a decoder of one character per id: a stop string's tokens are known exactly
    return "".join(chr(ord("a") + int(t) % 26) for t in ids)


def test_the_hf_engine_ends_a_row_at_the_first_token_that_completes_a_stop_string():
    engine = HFEngine(tiny_llama(seed=3), eos_token_ids=[3])
    engine.set_stop_decoder(_letters)
    free = SamplingParams(n=1, max_new_tokens=40, seed=5)
    engine.submit([RowRequest("free", (1, 2, 7), free, 0)])
    (row,) = engine.poll()
    text = _letters(row.response_ids)
    # a two-letter stop string whose first occurrence ends well inside the free row
    k = next(k for k in range(4, len(text)) if text[k - 1:k + 1] not in text[:k])
    stop = text[k - 1:k + 1]
    engine.submit([RowRequest("stopped", (1, 2, 7), SamplingParams(n=1, max_new_tokens=40, seed=5, stop=(stop,)), 0)])
    (cut,) = engine.poll()
    assert cut.finish_reason == "stop"
    assert cut.response_ids == row.response_ids[:k + 1]  # the same draws, ended at the completing token, kept
    assert cut.logprobs == row.logprobs[:k + 1]
    with pytest.raises(ValueError, match="set_stop_decoder"):
        HFEngine(tiny_llama(seed=3), eos_token_ids=[3]).submit(
            [RowRequest("x", (1, 2), SamplingParams(stop=("ab",)), 0)])


def test_sglang_requests_carry_the_stop_strings_and_single_turn_ones_do_not():
    from dapo_megatron.rollout.engines.sglang_io import build_sampling_params

    assert build_sampling_params(SamplingParams(stop=("```\n",)), 7)["stop"] == ["```\n"]
    assert "stop" not in build_sampling_params(SamplingParams(), 7)  # single-turn requests as before
    with pytest.raises(ValueError, match="SamplingParams.stop"):
        SamplingParams(stop=("",))


# -- the tool trajectory (SmolLM2's tokenizer, the real sandbox) ------------------------------------

@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    from transformers import AutoTokenizer

    from conftest import smollm2_tokenizer_dir
    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir(smollm2_gguf))


@pytest.fixture(scope="module")
def trajectory(tokenizer):
    t = ToolTrajectory(MultiTurnConfig(enable=True, trajectory=TOOL, max_assistant_turns=3,
                                       max_tool_response_length=64), tokenizer)
    t.bind_sandbox(SandboxConfig(wall_timeout_s=10.0, max_concurrent=1))
    yield t
    t.close()


def _char_ids(tokenizer, text):
    """``text`` as one id per character: valid ids for it, but not the tokenizer's own encoding."""
    ids = [i for ch in text for i in tokenizer.encode(ch, add_special_tokens=False)]
    assert ids != tokenizer.encode(text, add_special_tokens=False)  # re-encoding would change them
    assert tokenizer.decode(ids) == text
    return ids


def test_a_tool_turn_keeps_the_sampled_ids_and_appends_one_tokenisation_of_the_output(tokenizer, trajectory):
    assert trajectory.stop == ("```\n",)
    turn1 = _char_ids(tokenizer, "Let me compute.\n```python\nprint(123 * 456)\n```\n")
    s = Sample(prompt_ids=[1, 2, 3], response_ids=list(turn1), rollout_logprobs=[-0.5] * len(turn1),
               finish_reason=PENDING, versions=[(0, 7)])
    assert settle_row(s, "stop", trajectory, version=7, max_new_tokens=400)
    stdout = f"{123 * 456}\n"  # what print wrote, in the code_block format's template
    tool = tokenizer.encode(f"```output\n{stdout}\n```\n", add_special_tokens=False)
    assert s.response_ids == turn1 + tool and s.finish_reason == PENDING
    assert s.response_mask == [1] * len(turn1) + [0] * len(tool)
    assert s.rollout_logprobs == [-0.5] * len(turn1) + [0.0] * len(tool)
    # the next turn: model tokens after the context, no call: the sample is finished
    turn2 = _char_ids(tokenizer, "The answer is 56088.")
    s.append_tokens(8, turn2, [-0.25] * len(turn2))
    assert not settle_row(s, "stop", trajectory, version=8, max_new_tokens=400)
    assert s.response_ids == turn1 + tool + turn2  # exactly the sampled ids and the tool's ids
    assert s.response_mask == [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2)
    assert s.num_model_tokens == len(turn1) + len(turn2) and s.versions == [(0, 7), (len(turn1) + len(tool), 8)]
    assert "```output\n56088\n" in tokenizer.decode(s.response_ids, skip_special_tokens=True)  # the grader's text
    s.acc = True
    counts = trajectory.take_counts()
    assert counts == {"responses": 1, "calls": 1, "errors": 0, "timeouts": 0, "with_call": 1, "acc_with_call": 1,
                      "without_call": 0, "acc_without_call": 0}
    assert tool_metrics(counts) == {"tool/calls_per_response": 1.0, "tool/call_rate": 1.0,
                                    "tool/errors_per_call": 0.0, "tool/timeouts_per_call": 0.0,
                                    "tool/acc_with_call": 1.0}
    assert trajectory.take_counts()["responses"] == 0  # counted once


def test_errors_turn_limits_and_turns_without_a_call(tokenizer, trajectory):
    failing = _char_ids(tokenizer, "```python\nprint(1 / 0)\n```\n")
    s = Sample(prompt_ids=[1], response_ids=list(failing), rollout_logprobs=[0.0] * len(failing),
               finish_reason=PENDING, versions=[(0, 0)])
    assert settle_row(s, "stop", trajectory, version=0, max_new_tokens=400)
    assert "DivisionError: division by zero" in tokenizer.decode(s.response_ids[len(failing):])
    for turn in range(2):  # turns 2 and 3 call again: the second is run, the third is past max_assistant_turns
        s.append_tokens(0, list(failing), [0.0] * len(failing))
        assert settle_row(s, "stop", trajectory, version=0, max_new_tokens=400) == (turn == 0)
    # a turn cut by the length limit, and one without a call, are finished as they are
    for text, reason in (("```python\nprint(2)\n```\n", "length"), ("The answer is 42.", "stop")):
        ids = _char_ids(tokenizer, text)
        t = Sample(prompt_ids=[1], response_ids=ids, rollout_logprobs=[0.0] * len(ids), finish_reason=PENDING)
        assert not settle_row(t, reason, trajectory, version=0, max_new_tokens=400)
        assert t.response_ids == ids and t.response_mask is None
    counts = trajectory.take_counts()
    assert (counts["responses"], counts["calls"], counts["errors"], counts["with_call"]) == (3, 2, 2, 1)


def test_an_aborted_rows_tokens_end_the_turn_when_they_complete_the_calls_stop_string(tokenizer, trajectory):
    """``ends_turn`` (SGLang's abort decodes one more token, applied before its stop checks): the
    turn's tokens, the held ones then the row's, completing the stop string; a turn before the
    context does not count."""
    def _chars(tok, text):  # one id per character
        return [i for ch in text for i in tok.encode(ch, add_special_tokens=False)]

    head = _chars(tokenizer, "Let me compute.\n```python\nprint(2 + 2)\n``")
    s = Sample(prompt_ids=[1, 2], response_ids=list(head), rollout_logprobs=[-0.5] * len(head),
               finish_reason=PENDING, versions=[(0, 1)])
    assert trajectory.ends_turn(s, _chars(tokenizer, "`\n"))  # completed across the held part and the row's
    assert not trajectory.ends_turn(s, _chars(tokenizer, "`"))  # one newline short
    assert not trajectory.ends_turn(s, [])
    # after a context (a tool's output ends with the same fence), a new turn starts: nothing of it ends it
    done = _chars(tokenizer, "```python\nprint(1)\n```\n")
    t = Sample(prompt_ids=[1, 2], response_ids=list(done), rollout_logprobs=[-0.5] * len(done),
               finish_reason=PENDING, versions=[(0, 1)])
    t.append_tokens(1, _chars(tokenizer, "```output\n1\n```\n"), None, context=True)
    assert not trajectory.ends_turn(t, _chars(tokenizer, "So"))
    assert not Trajectory().ends_turn(s, _chars(tokenizer, "`\n"))  # single-turn: no stop strings
