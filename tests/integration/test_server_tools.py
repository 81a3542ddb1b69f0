"""Stop strings and tool turns on ``dapo-rollout-server`` (rollout.mode=server, synchronous).

One real server (tests/rollout_server.py) on a tiny random Llama with SmolLM2's tokenizer (the
server needs the tokenizer to match stop strings), ~4 s to start. Checked against values computed
here independently:

* a stop string ends the row at the token whose decoded text first holds it (found here on the
  full text of the free row, not the engine's window), the ids keep that token (``no_stop_trim``),
  ``finish_reason`` is SGLang's ``{"type": "stop", "matched": <the string>}`` and ``text`` stops
  before the string; a server without a tokenizer refuses ``stop`` naming the flag;
* a tool turn in server mode: a sample whose first turn is a call (planted ids, one per character:
  not the tokenizer's encoding) goes through the rollout's batch loop (``run_turns``) on
  :class:`~dapo_megatron.rollout.engines.server_sync.ServerRollout`; the program runs in the real
  sandbox, its output is appended as one tokenisation of the expected text, and the row continues
  on the server from prompt + turn + output: its ids equal ONE plain ``/generate`` of that whole
  input with the row's seed, its logprobs the local model's ``log_softmax`` at those ids, the
  versions are per token (the turn's, then the sync that landed before the continuation).
"""

from __future__ import annotations

import random

import pytest
import torch

from dapo_megatron.rollout.config import MultiTurnConfig
from dapo_megatron.rollout.engines.engine import SamplingParams, sample_seed
from dapo_megatron.platform.http import http_post
from dapo_megatron.rollout.engines.sglang_io import build_sampling_params
from dapo_megatron.rollout.trajectory import PENDING, run_turns
from dapo_megatron.rollout.types import Sample
from dapo_megatron.rollout_server.protocol import BadRequest, parse_sampling_params
from dapo_megatron.tools.sandbox import SandboxConfig
from dapo_megatron.tools.trajectory import ToolTrajectory
from rollout_server import RolloutServer, tiny_async_model

PROMPT = [28, 1131, 314, 260, 2205]


@pytest.fixture(scope="module")
def model_dir(smollm2_gguf, tmp_path_factory):
    return tiny_async_model(smollm2_gguf, tmp_path_factory.mktemp("tools_model"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = RolloutServer(model_dir, tmp_path_factory.mktemp("tools_server") / "server.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def local_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _logprobs(model, prompt, response):
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(response)])).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return lp[torch.arange(len(response)), torch.tensor(response)].tolist()


def test_a_stop_string_ends_the_row_at_the_token_completing_it_as_sglang_reports_it(server, tokenizer):
    sp = {"max_new_tokens": 48, "temperature": 1.0, "sampling_seed": 11, "ignore_eos": True}
    free = http_post(server.url, "/generate", {"input_ids": PROMPT, "sampling_params": sp}, 60)["output_ids"]

    def text(ids):
        return tokenizer.decode(ids, skip_special_tokens=False)

    # a stop string made of the 2 last characters of token k's text, first complete at token k
    k, stop = next((k, text(free[:k + 1])[-2:]) for k in range(3, len(free))
                   if len(text(free[:k + 1]).strip()) >= 2 and text(free[:k + 1])[-2:] not in text(free[:k]))
    for no_trim in (True, False):
        out = http_post(server.url, "/generate", {"input_ids": PROMPT, "sampling_params": {
            **sp, "stop": [stop, "never-seen-stop"], "no_stop_trim": no_trim}}, 60)
        assert out["output_ids"] == free[:k + 1]  # the same draws, ended at the completing token, kept
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        full = tokenizer.decode(free[:k + 1], skip_special_tokens=True)
        assert out["text"] == (full if no_trim else full[:full.find(stop)])
    # a plain string is one stop string (SGLang's normalize)
    one = http_post(server.url, "/generate", {"input_ids": PROMPT, "sampling_params": {**sp, "stop": stop}}, 60)
    assert one["output_ids"] == free[:k + 1]
    with pytest.raises(BadRequest, match="--skip-tokenizer-init"):
        parse_sampling_params({"stop": ["```\n"]}, "sampling_params", 100, random.Random(0), decodes_text=False)
    with pytest.raises(BadRequest, match=r"sampling_params.stop must be a string or a list of non-empty strings"):
        parse_sampling_params({"stop": ["a", ""]}, "sampling_params", 100, random.Random(0), decodes_text=True)
    assert parse_sampling_params({"stop": []}, "sp", 100, random.Random(0))[0].stop == ()


def _char_ids(tokenizer, text):
    ids = [i for ch in text for i in tokenizer.encode(ch, add_special_tokens=False)]
    assert ids != tokenizer.encode(text, add_special_tokens=False) and tokenizer.decode(ids) == text
    return ids


def test_a_tool_turn_continues_on_the_server_after_the_appended_output(server, tokenizer, local_model):
    from dapo_megatron.rollout.engines.server_sync import ServerRollout

    trajectory = ToolTrajectory(MultiTurnConfig(enable=True, trajectory="dapo_megatron.tools.trajectory:ToolTrajectory",
                                                max_assistant_turns=2, max_tool_response_length=64), tokenizer)
    trajectory.bind_sandbox(SandboxConfig(wall_timeout_s=10.0, max_concurrent=1))
    engine = ServerRollout([server.url], None, stage=0, num_stages=1, is_sender=False, device="cpu", timeout_s=30,
                           silence_timeout_s=30, bucket_bytes=1 << 20, eos_token_ids=[tokenizer.eos_token_id])
    try:
        turn1 = _char_ids(tokenizer, "```python\nprint(12 * 34)\n```\n")
        s = Sample(prompt_ids=list(PROMPT), response_ids=list(turn1), rollout_logprobs=[-0.5] * len(turn1),
                   finish_reason="stop", versions=[(0, 4)])
        engine.weight_version = 5  # a sync landed between the first turn and the tool's answer
        params = SamplingParams(n=1, temperature=1.0, max_new_tokens=60, seed=3, stop=trajectory.stop)
        run_turns(engine, [(s, 9, 0)], params, trajectory)
        tool = tokenizer.encode(f"```output\n{12 * 34}\n\n```\n", add_special_tokens=False)
        assert s.response_ids[:len(turn1) + len(tool)] == turn1 + tool
        turn2 = s.response_ids[len(turn1) + len(tool):]
        assert turn2 and s.finish_reason in ("stop", "length")
        # the continuation is the server's row for the whole input, prompt + turn + tool output
        whole = list(PROMPT) + turn1 + tool
        ref = http_post(server.url, "/generate", {"input_ids": whole, "return_logprob": True, "sampling_params":
                        build_sampling_params(SamplingParams(n=1, temperature=1.0, max_new_tokens=60 - len(turn1)
                                                             - len(tool), stop=trajectory.stop),
                                              sample_seed(3, 9, 0))}, 60)
        assert turn2 == ref["output_ids"]
        got = s.rollout_logprobs[len(turn1) + len(tool):]
        assert got == pytest.approx(_logprobs(local_model, whole, turn2), abs=1e-4)
        assert s.response_mask == [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2)
        assert s.versions == [(0, 4), (len(turn1), 5)]
        assert trajectory.take_counts()["calls"] == 1
    finally:
        engine.client.close()
        trajectory.close()
