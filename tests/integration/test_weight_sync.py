"""Weight sync from the Megatron actor (TP=2) into HFEngine, checked by logprobs.

1. After an optimizer step on a TP=2 actor, ``iter_hf_weights`` → ``HFEngine.update_weights``
   makes the engine's logprobs of fixed responses equal the actor's (fp32, ≤ 1e-4), with
   sync buckets smaller than one tensor and larger than the whole model. The engine starts
   from different random weights, so a tensor the sync missed would show.
2. SmolLM2-135M-Instruct generates with HFEngine from chat-templated prompts, and the
   logprobs it returns equal the TP=2 Megatron actor's on the generated tokens (rank 0's
   engine generates; both TP ranks score its samples). The actor imports the GGUF through the
   bridge; the engine reads the session's de-quantised HF copy (``smollm2_hf_dir``: transformers'
   GGUF import, saved once; ~35 s less than de-quantising the GGUF and its tokenizer again).

Every case runs in ONE 2-rank world (a world costs more than a case).
"""

from __future__ import annotations

import pytest
import torch

from dapo_megatron.platform import spawn
from dapo_megatron.rollout.types import Sample


def _samples(vocab: int, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, r) in enumerate(((5, 7), (9, 3), (4, 11), (12, 6))):
        out.append(Sample(prompt_ids=torch.randint(1, vocab, (p,), generator=g).tolist(),
                          response_ids=torch.randint(1, vocab, (r,), generator=g).tolist(),
                          rollout_logprobs=[0.0] * r, finish_reason="length", group_id=i // 2,
                          advantage=1.0 if i % 2 else -1.0))
    return out


def _engine_logprobs(engine, samples: list[Sample], temperature: float) -> list[torch.Tensor]:
    """Teacher-forced logprobs of each response under the engine's HF model (one sequence
    at a time, no padding, no cache): an oracle independent of the actor's packing."""
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logits = engine.model(input_ids=ids).logits[0].float() / temperature
            P = len(s.prompt_ids)
            lp = torch.log_softmax(logits[P - 1:-1], dim=-1)
            out.append(lp.gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1))
    return out


def _sync_case(family: str) -> dict | None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from conftest import random_hf_model, tiny_hf_config
    from dapo_megatron.actor import ActorConfig, MegatronActor
    from dapo_megatron.bridge import iter_hf_weights, load_hf_weights
    from dapo_megatron.models import ModelConfig, build_gpt_model
    from dapo_megatron.platform import ParallelConfig, init_distributed
    from dapo_megatron.rollout.engines.hf_engine import HFEngine

    par = init_distributed(ParallelConfig(2, 1), seed=0)
    hf_config = tiny_hf_config(family)
    source = random_hf_model(hf_config, seed=1)
    model = build_gpt_model(hf_config, ModelConfig(transformer_impl="local"), parallel=par)
    load_hf_weights(model, source.state_dict(), parallel=par)
    cfg = ActorConfig(ppo_mini_batch_size=1, ppo_max_token_len_per_gpu=64)
    cfg.optim.lr, cfg.optim.weight_decay = 1e-2, 0.0
    actor = MegatronActor(model, cfg, total_steps=4, vocab_size=hf_config.vocab_size, parallel=par)
    samples = _samples(hf_config.vocab_size)
    temperature = 0.8
    for s, lp in zip(samples, actor.compute_logprobs([samples], temperature)):
        s.old_logprobs = lp.tolist()
    metrics = actor.train_mini_batch([samples[:2], samples[2:]], temperature).metrics
    assert metrics["skipped"] == 0.0 and metrics["grad_norm"] > 0
    actor_lp = actor.compute_logprobs([samples], temperature)

    torch.manual_seed(100 + dist.get_rank())  # engine weights differ from the actor's before the sync
    engine = HFEngine(AutoModelForCausalLM.from_config(hf_config).float(), eos_token_ids=[hf_config.vocab_size - 1])
    results = {}
    for label, bucket_bytes in (("bucket_smaller_than_a_tensor", 1024), ("bucket_larger_than_model", 2**30)):
        for p in engine.model.parameters():  # scramble, so each sync must rewrite every tensor
            p.data.normal_()
        engine.update_weights(iter_hf_weights(actor.model_chunks, parallel=par, bucket_bytes=bucket_bytes), version=1)
        eng_lp = _engine_logprobs(engine, samples, temperature)
        results[label] = max(float((a - b).abs().max()) for a, b in zip(actor_lp, eng_lp))
    before = _engine_logprobs(HFEngine(source, eos_token_ids=[0]), samples, temperature)
    results["moved_by_update"] = max(float((a - b).abs().max()) for a, b in zip(actor_lp, before))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    return gathered if dist.get_rank() == 0 else None


FAMILIES = ("llama_tied", "qwen2_bias")
SMOLLM2_TEST = "test_smollm2_hf_engine_generation_logprobs_match_tp2_actor"


def _world(families, smollm2, out_path: str) -> None:
    """Every case of this file in ONE TP=2 world of 2 ranks (a world costs more than a case): the
    sync of each tiny family, then (``smollm2``: ``(gguf dir, gguf file, HF copy dir)`` or None) the
    SmolLM2 generation."""
    out = {family: _sync_case(family) for family in families}
    if smollm2 is not None:
        out["smollm2"] = _smollm2_case(*smollm2)
    if out[families[0]] is not None:  # rank 0
        torch.save(out, out_path)


@pytest.fixture(scope="module")
def world(request, tmp_path_factory):
    """Rank 0's results of :func:`_world`; the SmolLM2 case only when its (slow) test is selected."""
    wanted = any(item.originalname == SMOLLM2_TEST for item in request.session.items)
    smollm2 = (*request.getfixturevalue("smollm2_gguf"), request.getfixturevalue("smollm2_hf_dir")) if wanted else None
    path = str(tmp_path_factory.mktemp("weight_sync") / "out.pt")
    spawn(_world, 2, FAMILIES, smollm2, path)
    return torch.load(path)


@pytest.mark.dist
@pytest.mark.parametrize("family", FAMILIES)
def test_sync_after_optimizer_step_matches_actor_logprobs(family, world):
    for rank_result in world[family]:
        assert rank_result["bucket_smaller_than_a_tensor"] <= 1e-4, rank_result
        assert rank_result["bucket_larger_than_model"] <= 1e-4, rank_result
        assert rank_result["moved_by_update"] > 1e-3, rank_result  # the step changed the weights


def _smollm2_case(gguf_dir: str, gguf_file: str, hf_dir: str) -> dict | None:
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from dapo_megatron.actor import ActorConfig, MegatronActor
    from dapo_megatron.bridge import load_hf_weights, open_hf_source
    from dapo_megatron.models import ModelConfig, build_gpt_model, load_hf_config
    from dapo_megatron.platform import ParallelConfig, init_distributed
    from dapo_megatron.rollout.engines.engine import SamplingParams, completions_to_group
    from dapo_megatron.rollout.engines.hf_engine import HFEngine

    par = init_distributed(ParallelConfig(2, 1), seed=0)
    hf_config = load_hf_config(gguf_dir, gguf_file)
    model = build_gpt_model(hf_config, ModelConfig(hf_path=gguf_dir, gguf_file=gguf_file, transformer_impl="local"),
                            parallel=par)
    load_hf_weights(model, open_hf_source(gguf_dir, gguf_file), parallel=par)
    actor = MegatronActor(model, ActorConfig(ppo_max_token_len_per_gpu=1024), total_steps=1,
                          vocab_size=hf_config.vocab_size, parallel=par)
    temperature = 0.9
    samples = None
    if dist.get_rank() == 0:  # one engine generates (transformers' GGUF import, independent of the bridge)...
        tok = AutoTokenizer.from_pretrained(hf_dir)
        engine = HFEngine(hf_dir)
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=True)
                   for q in ("Compute 7 + 5. Reply with just the number.", "What is the capital of France?")]
        prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
        out = engine.generate(prompts, SamplingParams(n=2, temperature=temperature, max_new_tokens=12, seed=3))
        samples = [s for i, c in enumerate(out) for s in completions_to_group(i, prompts[i], c).samples]
    box = [samples]
    dist.broadcast_object_list(box, src=0)  # ...and both TP ranks score its samples
    samples = box[0]
    actor_lp = actor.compute_logprobs([samples], temperature)
    diff = max(max(abs(a - b) for a, b in zip(s.rollout_logprobs, lp.tolist())) for s, lp in zip(samples, actor_lp))
    if dist.get_rank() == 0:
        texts = [tok.decode(s.response_ids) for s in samples]
        return {"diff": diff, "lengths": [len(s.response_ids) for s in samples], "texts": texts}
    return None


@pytest.mark.slow
@pytest.mark.dist
def test_smollm2_hf_engine_generation_logprobs_match_tp2_actor(smollm2_gguf, world):
    out = world["smollm2"]
    assert all(n >= 1 for n in out["lengths"]), out
    assert out["diff"] <= 1e-4, out
