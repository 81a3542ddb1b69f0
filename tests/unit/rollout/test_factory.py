"""rollout.engines.factory: the trainer and tools/eval.py build their tokenizer and engine one way.

The model directory used here names three different EOS ids (tokenizer, config.json,
generation_config.json), so a caller that skipped one source would stop on fewer tokens.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch

from conftest import REPO, tiny_llama_with_smollm2_tokenizer_dir
from unit.rollout.test_sglang_engine import fake_sglang  # noqa: F401  (fixture)

CONFIG_EOS, GENERATION_EOS = 5, [5, 7]


def _eval_tool():
    spec = importlib.util.spec_from_file_location("dapo_eval_tool_factory", os.path.join(REPO, "tools", "eval.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def model_dir(smollm2_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("three_eos")
    tiny_llama_with_smollm2_tokenizer_dir(smollm2_gguf, out, hidden_size=16, intermediate_size=32,
                                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    with open(out / "config.json") as f:
        cfg = json.load(f)
    cfg["eos_token_id"] = CONFIG_EOS
    with open(out / "config.json", "w") as f:
        json.dump(cfg, f)
    with open(out / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": GENERATION_EOS}, f)
    return str(out)


def _both_specs(model_dir, *, engine="hf", trainer_overrides=(), **eval_flags):
    from dapo_megatron.config import DAPOConfig, load_config
    from dapo_megatron.models import load_hf_config
    from dapo_megatron.rollout.engines.factory import load_tokenizer, training_engine_spec

    cfg = load_config(DAPOConfig, None, [f"model.hf_path={model_dir}", f"rollout.name={engine}",
                                         *trainer_overrides])
    tok = load_tokenizer(model_dir)
    trainer = training_engine_spec(cfg, tok, load_hf_config(model_dir))
    ev = _eval_tool()
    evaluated = ev.engine_spec(ev.EvalConfig(model=model_dir, data=["unused.jsonl"], engine=engine, **eval_flags),
                               model_dir, None, tok)
    return tok, trainer, evaluated


def test_stop_tokens_are_the_union_of_tokenizer_config_and_generation_config(model_dir):
    from dapo_megatron.rollout.engines.factory import stop_token_ids

    tok, trainer, evaluated = _both_specs(model_dir)
    want = tuple(sorted({tok.eos_token_id, CONFIG_EOS, *GENERATION_EOS}))
    assert tok.eos_token_id not in (CONFIG_EOS, *GENERATION_EOS)  # three distinct sources
    assert trainer.eos_token_ids == evaluated.eos_token_ids == want
    # a GGUF directory has no generation_config.json: tokenizer and config only
    from types import SimpleNamespace

    assert stop_token_ids(SimpleNamespace(eos_token_id=2), SimpleNamespace(eos_token_id=[2, 9]), "/nonexistent") \
        == (2, 9)
    with pytest.raises(ValueError, match="no EOS token id"):
        stop_token_ids(SimpleNamespace(eos_token_id=None), SimpleNamespace(eos_token_id=None), None)


def test_trainer_and_eval_hf_engines_stop_and_pad_alike(model_dir):
    from dapo_megatron.models import load_hf_config
    from dapo_megatron.rollout.engines.factory import build_engine

    tok, trainer, evaluated = _both_specs(model_dir)
    assert (trainer.dtype, evaluated.dtype) == (torch.float32, torch.float32)  # CPU defaults of both
    assert not trainer.pretrained and evaluated.pretrained  # the trainer's weights come from the actor's sync
    engines = [build_engine(trainer, load_hf_config(model_dir)), build_engine(evaluated)]
    want = frozenset({tok.eos_token_id, CONFIG_EOS, *GENERATION_EOS})
    assert [e.eos_token_ids for e in engines] == [want, want]
    assert engines[0].pad_token_id == engines[1].pad_token_id == min(want)
    # the eval engine holds the checkpoint's weights; the trainer's its own random ones
    saved = {n: p for n, p in engines[1].model.named_parameters()}
    from safetensors.torch import load_file

    on_disk = load_file(os.path.join(model_dir, "model.safetensors"))
    assert torch.equal(saved["model.embed_tokens.weight"], on_disk["model.embed_tokens.weight"])


def test_trainer_and_eval_sglang_engines_get_the_same_kwargs_but_the_memory_settings(fake_sglang, model_dir,  # noqa: F811
                                                                                     monkeypatch):
    from dapo_megatron.rollout.engines.factory import build_engine

    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    _, trainer, evaluated = _both_specs(model_dir, engine="sglang", trainer_overrides=["model.params_dtype=bf16"],
                                        dtype="bfloat16", gpu_memory_utilization=0.8)
    got_trainer = build_engine(trainer).engine.kwargs
    got_eval = build_engine(evaluated).engine.kwargs
    assert got_trainer == {"model_path": model_dir, "dtype": "bfloat16", "tp_size": 1, "mem_fraction_static": 0.5,
                           "enable_memory_saver": True, "base_gpu_id": 3, "enable_deterministic_inference": False,
                           "disable_prefill_cuda_graph": True}
    # eval owns its GPU: no memory saver (so SGLang's default prefill graph), its own memory fraction;
    # everything else as the trainer's
    expected = {**got_trainer, "mem_fraction_static": 0.8, "enable_memory_saver": False}
    del expected["disable_prefill_cuda_graph"]
    assert got_eval == expected
