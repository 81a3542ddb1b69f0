"""MegatronActor on the real SmolLM2-135M-Instruct (de-quantised GGUF, fp32, TP=1):
packed compute_logprobs equals transformers' per-sequence logprobs, and one DAPO step
with positive advantages raises the logprobs of the sampled tokens."""

from __future__ import annotations

import pytest
import torch

from dapo_megatron.platform import spawn
from dapo_megatron.rollout.types import Sample

TEMPERATURE = 0.7


def _worker(hf_dir: str, samples: list, out_path: str) -> None:
    from dapo_megatron.actor import ActorConfig, MegatronActor, OptimConfig
    from dapo_megatron.bridge import SafetensorsSource, load_hf_weights
    from dapo_megatron.models import build_gpt_model, load_hf_config
    from dapo_megatron.platform import init_distributed

    par = init_distributed(seed=0)
    cfg = load_hf_config(hf_dir)
    model = build_gpt_model(cfg, parallel=par)
    load_hf_weights(model, SafetensorsSource(hf_dir), strict=True, parallel=par)
    actor = MegatronActor(
        model, ActorConfig(optim=OptimConfig(lr=1e-5, weight_decay=0.0, clip_grad=1.0)), total_steps=4,
        parallel=par, vocab_size=cfg.vocab_size,
    )
    before = actor.compute_logprobs([samples[:2], samples[2:]], TEMPERATURE)
    for s, lp in zip(samples, before):
        s.old_logprobs = lp.tolist()
        s.advantage = 1.0
    step = actor.train_mini_batch([samples[:3], samples[3:]], TEMPERATURE).metrics
    after = actor.compute_logprobs([samples], TEMPERATURE)
    torch.save({"before": before, "after": after, "step": step, "padded_vocab": model.vocab_size}, out_path)


@pytest.mark.slow
def test_smollm2_actor_logprobs_and_one_step(smollm2_hf_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_hf_dir)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()
    questions = ["Compute 7 + 12. Reply with just the number.", "Compute 3 + 15. Reply with just the number.",
                 "What is 2 + 2?", "Name a prime number."]
    samples, ref = [], []
    g = torch.Generator().manual_seed(0)
    for q in questions:
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        prompt = list(tok(text, add_special_tokens=False)["input_ids"])
        with torch.no_grad():
            torch.manual_seed(int(torch.randint(0, 10**6, (1,), generator=g)))
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=True, temperature=TEMPERATURE,
                              top_k=0, top_p=1.0)
            resp = out[0, len(prompt):].tolist()
            logits = hf(out).logits[0, len(prompt) - 1:-1].float() / TEMPERATURE
            ref.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(resp)[:, None])[:, 0])
        samples.append(Sample(prompt_ids=prompt, response_ids=resp, rollout_logprobs=ref[-1].tolist(),
                              finish_reason="length"))
    del hf
    path = str(tmp_path / "out.pt")
    spawn(_worker, 1, smollm2_hf_dir, samples, path)
    out = torch.load(path, weights_only=False)
    assert out["padded_vocab"] >= 49152
    for got, want in zip(out["before"], ref):
        assert got.shape == want.shape and (got - want).abs().max().item() <= 1e-4
    step = out["step"]
    n_tok = sum(len(s.response_ids) for s in samples)
    assert step["num_tokens"] == n_tok and step["skipped"] == 0.0
    assert abs(step["ppo_kl"]) < 1e-6 and step["pg_clipfrac_lower"] == step["pg_clipfrac_upper"] == 0.0
    assert abs(step["loss"] + 1.0) < 1e-5  # ratio 1, advantage 1: token-mean of -A*r = -1
    gain = sum(float((a - b).sum()) for a, b in zip(out["after"], out["before"])) / n_tok
    assert gain > 0  # policy gradient with A > 0 raises the sampled tokens' logprobs
