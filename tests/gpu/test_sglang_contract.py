"""Contract test of SGLangEngine against the real ``sglang.Engine`` (CUDA machine only).

A tiny random Llama checkpoint is written to a temp dir (no download); the test checks
generate (shapes, finish reasons, logprobs against a teacher-forced HF forward),
update_weights (values read back with ``get_weights_by_name``; the unknown-name and
never-updated errors) and release/resume of memory.
"""

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("sglang") is None,
                       reason="needs a CUDA GPU and the sglang package (pip install -e .[gpu])"),
]


def tiny_checkpoint(path, seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=2, bos_token_id=1, torch_dtype="bfloat16")
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from dapo_megatron.rollout.sglang_engine import SGLangEngine

    path = tmp_path_factory.mktemp("tiny_llama")
    model = tiny_checkpoint(path, seed=0)
    eng = SGLangEngine(str(path), dtype="bfloat16", mem_fraction_static=0.2, update_bucket_mb=1,
                       engine_kwargs={"skip_tokenizer_init": True, "random_seed": 0})
    yield eng, model
    eng.shutdown()


def test_generate_contract(engine):
    from dapo_megatron.rollout.engine import SamplingParams

    eng, model = engine
    prompts = [[1, 17, 40, 99], [1, 5]]
    out = eng.generate(prompts, SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=1))
    assert len(out) == 2 and all(len(g) == 3 for g in out)
    model = model.float().eval()
    for p, group in zip(prompts, out):
        for c in group:
            assert c.finish_reason in ("stop", "length") and 1 <= len(c.response_ids) == len(c.logprobs) <= 8
            ids = torch.tensor([p + c.response_ids])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(p) - 1:-1].float()
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.response_ids)[:, None]).squeeze(-1)
            # bf16 engine vs fp32 oracle: loose bound
            assert (torch.tensor(c.logprobs) - ref).abs().max() < 0.15


def test_update_weights_and_release_resume(engine, tmp_path):
    eng, _ = engine
    new = tiny_checkpoint(tmp_path / "new", seed=3)
    named = [(k, v.to(torch.bfloat16).cuda()) for k, v in new.state_dict().items() if k != "lm_head.weight"]
    eng.update_weights(named, version=1)
    assert eng.weight_version == 1
    got = eng.engine.get_weights_by_name("model.layers.0.mlp.up_proj.weight", truncate_size=4)
    want = new.state_dict()["model.layers.0.mlp.up_proj.weight"][0, :4].float()
    assert torch.allclose(torch.tensor(got, dtype=torch.float32).flatten()[:4], want, atol=1e-2)
    with pytest.raises(KeyError, match="model.layers.0.mlp.fused.weight"):
        eng.update_weights([("model.layers.0.mlp.fused.weight", torch.zeros(2))], version=2)
    eng.abort_weight_update()
    with pytest.raises(RuntimeError, match="never updated"):
        eng.update_weights(named[:3], version=2)
    eng.abort_weight_update()

    free_before = torch.cuda.mem_get_info()[0]
    eng.sleep()
    assert torch.cuda.mem_get_info()[0] > free_before, "release_memory_occupation freed nothing"
    # the trainer syncs while the engine sleeps: weights come back first, the KV cache at wake_up
    eng.update_weights(named, version=2)
    eng.wake_up()
    assert eng.weight_version == 2
    got = eng.engine.get_weights_by_name("model.layers.0.mlp.up_proj.weight", truncate_size=4)
    assert torch.allclose(torch.tensor(got, dtype=torch.float32).flatten()[:4], want, atol=1e-2)
    from dapo_megatron.rollout.engine import SamplingParams

    out = eng.generate([[1, 2, 3]], SamplingParams(n=2, max_new_tokens=4, seed=0))
    assert len(out[0]) == 2
