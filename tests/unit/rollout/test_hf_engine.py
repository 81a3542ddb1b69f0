"""HFEngine: sampling distribution, logprobs, stop handling, reproducibility, weight sync.

The oracle for logprobs is an independent teacher-forced forward of the same HF model on
prompt + response, one sequence at a time without padding or KV cache.
"""

import math
import os

import pytest
import torch

from dapo_megatron.rollout.engines.engine import SamplingParams, completions_to_group
from dapo_megatron.bridge.receiver import WeightSyncTracker, ParamSpec
from dapo_megatron.rollout.engines.hf_engine import HFEngine
from dapo_megatron.rollout.engines.hf_batch import process_logits, sample_rows

EOS = 3


def tiny_llama(seed=0, vocab=64, tie=True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=tie, eos_token_id=EOS, bos_token_id=1, pad_token_id=0)
    model = LlamaForCausalLM(cfg).float().eval()
    # sharpen the random model a bit so that sampling is not uniform noise
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8.0)
    return model


def teacher_forced_logprobs(model, prompt, response, temperature):
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    P = len(prompt)
    lp = torch.log_softmax(logits[P - 1:P - 1 + len(response)] / temperature, dim=-1)
    return lp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


PROMPTS = [[1, 5, 9, 17, 22, 40, 8], [1, 30], [1, 12, 13, 14, 50]]  # unequal lengths → left padding


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def test_logprobs_equal_teacher_forced_forward(model, monkeypatch):
    from transformers.cache_utils import Cache

    kept_rows = []  # record the batch compactions (finished rows dropped) that the check covers
    original = Cache.batch_select_indices
    monkeypatch.setattr(Cache, "batch_select_indices",
                        lambda self, idx: (kept_rows.append(len(idx)), original(self, idx))[1])
    eng = HFEngine(model)
    params = SamplingParams(n=3, temperature=0.7, max_new_tokens=12, stop_token_ids=(4, 5, 6, 7, 8, 9), seed=11)
    out = eng.generate(PROMPTS, params)
    assert len(out) == len(PROMPTS) and all(len(g) == 3 for g in out)
    reasons = set()
    for prompt, group in zip(PROMPTS, out):
        for c in group:
            assert len(c.response_ids) == len(c.logprobs) >= 1
            ref = teacher_forced_logprobs(model, prompt, c.response_ids, 0.7)
            torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-4, rtol=0)
            reasons.add(c.finish_reason)
    assert reasons == {"stop", "length"}, "the scripted stop ids should give both finish reasons"
    # the first call expands the 3 prefilled prompts to 9 rows; a later one drops finished rows
    assert kept_rows and min(kept_rows) < 9, "finished rows were dropped from the batch during this check"


def test_stop_token_kept_and_ends_response(model):
    eng = HFEngine(model)
    stops = {EOS, 4, 5, 6, 7, 8, 9}
    out = eng.generate(PROMPTS, SamplingParams(n=4, temperature=1.0, max_new_tokens=10,
                                              stop_token_ids=(4, 5, 6, 7, 8, 9), seed=3))
    for group in out:
        for c in group:
            early = [t for t in c.response_ids[:-1] if t in stops]
            assert early == [], "no stop token may appear before the last position"
            if c.finish_reason == "stop":
                assert c.response_ids[-1] in stops and len(c.response_ids) <= 10
            else:
                assert c.response_ids[-1] not in stops and len(c.response_ids) == 10


def test_seed_reproducible_and_seed_matters(model):
    eng = HFEngine(model)
    p = dict(n=2, temperature=1.0, max_new_tokens=8)
    a = eng.generate(PROMPTS, SamplingParams(seed=5, **p))
    b = eng.generate(PROMPTS, SamplingParams(seed=5, **p))
    c = eng.generate(PROMPTS, SamplingParams(seed=6, **p))
    assert a == b
    assert [x.response_ids for g in a for x in g] != [x.response_ids for g in c for x in g]


def test_response_depends_on_its_prompt_seed_not_on_the_batch(model):
    """Per-response seeding: a prompt's responses are the same alone, in another batch, at
    another position, or generated on another rank (what makes rollouts layout-independent)."""
    eng = HFEngine(model)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=5)
    alone = eng.generate([PROMPTS[1]], params, prompt_seeds=[42])[0]
    mixed = eng.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1]], params, prompt_seeds=[7, 8, 42])
    assert [c.response_ids for c in mixed[2]] == [c.response_ids for c in alone]
    for a, b in zip(mixed[2], alone):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    # the n responses of a prompt and different prompt seeds draw from different streams
    other = eng.generate([PROMPTS[1]], params, prompt_seeds=[43])[0]
    assert [c.response_ids for c in other] != [c.response_ids for c in alone]
    assert alone[0].response_ids != alone[1].response_ids
    with pytest.raises(ValueError, match="prompt_seeds has 1 entries for 2 prompts"):
        eng.generate(PROMPTS[:2], params, prompt_seeds=[1])


def test_sample_rows_distribution_and_row_independence():
    """Frequencies of 20,000 seeded draws match the probabilities (chi-square, 5 free categories;
    fixed seeds, so deterministic); zero-probability tokens are never drawn; a row's token
    depends only on its own generator and probabilities."""
    probs = torch.tensor([0.5, 0.0, 0.25, 0.125, 0.0, 0.0625, 0.0625])
    n = 20_000
    gens = [torch.Generator().manual_seed(1000 + i) for i in range(n)]
    tok = sample_rows(probs.expand(n, -1) * 3.0, gens)  # unnormalised rows are fine
    counts = torch.bincount(tok, minlength=probs.numel()).double()
    assert counts[1] == 0 and counts[4] == 0
    keep = probs > 0
    expected = probs[keep].double() * n
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # chi-square, 4 degrees of freedom: P(X > 20.5) < 0.0005

    # row independence: the same generator state gives the same token alone or in a batch
    rows = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3, -1)
    batch = sample_rows(rows, [torch.Generator().manual_seed(s) for s in (7, 8, 9)])
    alone = sample_rows(rows[1:2], [torch.Generator().manual_seed(8)])
    assert int(batch[1]) == int(alone[0])
    # a one-hot row always returns its token, also at the last vocabulary index
    one_hot = torch.zeros(2, 50)
    one_hot[0, 49], one_hot[1, 0] = 1.0, 1.0
    assert sample_rows(one_hot, [torch.Generator().manual_seed(s) for s in (1, 2)]).tolist() == [49, 0]
    with pytest.raises(ValueError, match="2 generators for 3 rows"):
        sample_rows(rows, [torch.Generator(), torch.Generator()])


def test_top_k_1_is_greedy_with_zero_logprob(model):
    eng = HFEngine(model)
    out = eng.generate(PROMPTS[:2], SamplingParams(n=2, top_k=1, max_new_tokens=6, seed=0))
    for prompt, group in zip(PROMPTS, out):
        for c in group:
            assert c.logprobs == [0.0] * len(c.logprobs)
            seq = list(prompt)
            for t in c.response_ids:  # independent greedy decode without cache
                with torch.no_grad():
                    nxt = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
                assert t == nxt
                seq.append(t)


def reference_filter(row, temperature, top_p, top_k):
    """Per-row python reference of temperature → top-k → top-p (HF/vLLM semantics)."""
    z = [x / temperature for x in row]
    keep = set(range(len(z)))
    if top_k > 0:
        kth = sorted(z, reverse=True)[top_k - 1]
        keep = {i for i in keep if z[i] >= kth}
    if top_p < 1:
        m = max(z[i] for i in keep)
        w = {i: math.exp(z[i] - m) for i in keep}
        total = sum(w.values())
        order = sorted(keep, key=lambda i: -z[i])
        kept, mass = set(), 0.0
        for i in order:
            if mass >= top_p:
                break
            kept.add(i)
            mass += w[i] / total
        keep = kept
    return keep


@pytest.mark.parametrize("top_p,top_k", [(1.0, 3), (0.5, -1), (0.9, 5), (0.3, 2), (1.0, -1)])
def test_process_logits_matches_reference(top_p, top_k):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 20, generator=g) * 3
    z = process_logits(logits, 0.8, top_p, top_k)
    for r in range(6):
        kept = set(torch.isfinite(z[r]).nonzero().squeeze(-1).tolist())
        assert kept == reference_filter(logits[r].tolist(), 0.8, top_p, top_k)
        torch.testing.assert_close(z[r][list(kept)], logits[r][list(kept)] / 0.8)


def test_top_p_logprobs_are_renormalised(model):
    eng = HFEngine(model)
    out = eng.generate(PROMPTS[:1], SamplingParams(n=2, temperature=1.0, top_p=0.5, max_new_tokens=5, seed=1))
    for c in out[0]:
        full = teacher_forced_logprobs(model, PROMPTS[0], c.response_ids, 1.0)
        got = torch.tensor(c.logprobs)
        assert (got >= full - 1e-5).all(), "truncated distribution gives logprobs >= the full one's"
        # renormalisation constant: log of the kept mass, recomputed independently
        seq = list(PROMPTS[0])
        for t, lp in zip(c.response_ids, c.logprobs):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([seq])).logits[0, -1]
            kept = reference_filter(logits.tolist(), 1.0, 0.5, -1)
            p = torch.softmax(logits, -1)
            assert t in kept
            assert abs(lp - math.log(p[t] / p[list(kept)].sum())) < 1e-4
            seq.append(t)


def test_sampling_params_validation():
    for bad, field in [(dict(n=0), "n"), (dict(temperature=0.0), "temperature"), (dict(top_p=0.0), "top_p"),
                       (dict(top_p=1.5), "top_p"), (dict(top_k=0), "top_k"), (dict(max_new_tokens=0), "max_new_tokens"),
                       (dict(stop_token_ids=(-1,)), "stop_token_ids"), (dict(seed=1.5), "seed")]:
        with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
            SamplingParams(**bad)


def test_bad_prompts_rejected(model):
    eng = HFEngine(model)
    with pytest.raises(ValueError, match=r"prompt_ids\[1\]"):
        eng.generate([[1, 2], []], SamplingParams())
    with pytest.raises(ValueError, match=r"prompt_ids\[0\] holds invalid"):
        eng.generate([[1, 999]], SamplingParams())


def test_update_weights_then_generation_follows_new_model(model):
    eng = HFEngine(tiny_llama(seed=0))
    target = tiny_llama(seed=7)
    # the bridge may send only the embedding for tied weights: drop lm_head.weight
    named = [(k, v.clone()) for k, v in target.state_dict().items() if k != "lm_head.weight"]
    eng.update_weights(iter(named), version=3)
    assert eng.weight_version == 3
    assert eng.model.lm_head.weight.data_ptr() == eng.model.model.embed_tokens.weight.data_ptr()
    out = eng.generate(PROMPTS[:2], SamplingParams(n=2, max_new_tokens=6, seed=2))
    for prompt, group in zip(PROMPTS, out):
        for c in group:
            ref = teacher_forced_logprobs(target, prompt, c.response_ids, 1.0)
            torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-4, rtol=0)


def test_sync_drops_each_tensor_before_asking_for_the_next():
    # what lets the bridge reuse a bucket's memory (its storage must be unreferenced)
    from conftest import ReleaseRecorder

    eng = HFEngine(tiny_llama(seed=0))
    target = tiny_llama(seed=7)
    stream = ReleaseRecorder((k, v) for k, v in target.state_dict().items() if k != "lm_head.weight")
    eng.update_weights(stream, version=1)
    assert len(stream.held) == len(stream.named) - 1 and not any(stream.held)
    for name, want in stream.named:  # and every tensor was loaded
        assert torch.equal(dict(eng.model.named_parameters())[name], want), name


def test_update_weights_errors_name_the_tensor():
    eng = HFEngine(tiny_llama())
    sd = tiny_llama(seed=1).state_dict()
    with pytest.raises(KeyError, match="model.layers.0.mlp.gate_up.weight"):
        eng.update_weights([("model.layers.0.mlp.gate_up.weight", torch.zeros(3))], version=1)
    eng.abort_weight_update()  # discard the failed sync
    with pytest.raises(ValueError, match="model.embed_tokens.weight"):
        eng.update_weights([("model.embed_tokens.weight", torch.zeros(65, 32))], version=1)
    eng.abort_weight_update()
    partial = [(k, v) for k, v in sd.items() if not k.startswith("model.layers.1.")]
    with pytest.raises(RuntimeError, match=r"never updated: model\.layers\.1\..*"):
        eng.update_weights(partial, version=1)
    assert eng.weight_version == 0


def test_split_sync_over_calls_and_version_guard():
    eng = HFEngine(tiny_llama())
    items = list(tiny_llama(seed=2).state_dict().items())
    eng.update_weights(items[:5], version=1, finish=False)
    with pytest.raises(RuntimeError, match="version 1 is unfinished"):
        eng.update_weights(items[5:], version=2)
    eng.update_weights(items[5:], version=1, finish=False)
    assert eng.finish_weight_update() == 1 and eng.weight_version == 1


def test_tracker_alias_only_counts_for_target():
    tr = WeightSyncTracker({"emb": ParamSpec((4, 2), torch.float32), "w": ParamSpec((2,), torch.float32)},
                           aliases={"head": "emb"})
    tr.begin(0)
    tr.check_and_mark("head", torch.zeros(4, 2))  # sending only the alias updates the tied parameter
    with pytest.raises(RuntimeError, match=r"never updated: w$"):
        tr.finish()
    with pytest.raises(ValueError, match="not an engine parameter"):
        WeightSyncTracker({"a": ParamSpec((1,), torch.float32)}, aliases={"b": "c"})


def test_sleep_wake_up(model):
    eng = HFEngine(model)
    eng.sleep()
    with pytest.raises(RuntimeError, match="wake_up"):
        eng.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    eng.wake_up()
    assert len(eng.generate(PROMPTS, SamplingParams(max_new_tokens=2))) == 3


def test_completions_to_group(model):
    eng = HFEngine(model)
    out = eng.generate(PROMPTS[:1], SamplingParams(n=2, max_new_tokens=3))
    g = completions_to_group(7, PROMPTS[0], out[0], prompt_index=4, data_source="s", ground_truth="12")
    assert g.group_id == 7 and len(g.samples) == 2
    s = g.samples[1]
    assert (s.prompt_ids, s.response_ids, s.rollout_logprobs, s.group_id, s.prompt_index, s.ground_truth) == (
        PROMPTS[0], out[0][1].response_ids, out[0][1].logprobs, 7, 4, "12")


@pytest.mark.slow
def test_smollm2_chat_logprobs_match_teacher_forced(smollm2_hf_dir):
    from transformers import AutoTokenizer

    # the de-quantised HF directory: the same weights as the GGUF, loaded in 1 s instead of 37 s
    # (HFEngine's GGUF path, built by the engine factory as the trainer builds it: the GGUF eval of
    # tests/integration/test_eval.py)
    tok = AutoTokenizer.from_pretrained(smollm2_hf_dir)
    eng = HFEngine(smollm2_hf_dir, num_threads=1)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False)
               for q in ["Compute 7 + 5. Reply with just the number.", "What is 13 + 9?"]]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in prompts]
    assert len(prompts[0]) != len(prompts[1])
    out = eng.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=24, seed=0))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert eos in eng.eos_token_ids
    for prompt, group in zip(prompts, out):
        for c in group:
            ref = teacher_forced_logprobs(eng.model, prompt, c.response_ids, 1.0)
            torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-4, rtol=0)
            if c.finish_reason == "stop":
                assert c.response_ids[-1] in eng.eos_token_ids
    assert any(tok.decode(c.response_ids, skip_special_tokens=True).strip() for g in out for c in g)


# ---------------------------------------------------------------------------- asynchronous rows
def _rows(prompt_index, params, prompt_seed, n, prefixes=None, key=None):
    from dapo_megatron.rollout.engines.engine import RowRequest

    return [RowRequest((key if key is not None else prompt_index, j), PROMPTS[prompt_index], params, prompt_seed, j,
                       prefix_ids=tuple(prefixes[j]) if prefixes else ()) for j in range(n)]


def _close(a, b, tol=1e-5):
    return len(a) == len(b) and all(abs(x - y) < tol for x, y in zip(a, b))


def test_rows_admitted_while_others_run_equal_generate_alone(model):
    """Continuous batching: a prompt submitted while another prompt's rows are mid-response gives
    the responses generate() gives it alone (same seeds), and rows come back as they stop."""
    eng = HFEngine(model)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=(4, 5, 6), seed=5)
    eng.submit(_rows(0, params, 100, 3))
    first = eng.poll(max_tokens=4)
    assert eng.num_in_flight == 3 - len(first)
    eng.submit(_rows(2, params, 102, 3))
    rest = first + eng.poll()
    assert eng.num_in_flight == 0
    got = {r.key: r for r in rest}
    for i, seed in ((0, 100), (2, 102)):
        alone = eng.generate([PROMPTS[i]], SamplingParams(n=3, **{k: getattr(params, k) for k in (
            "temperature", "max_new_tokens", "stop_token_ids", "seed")}), prompt_seeds=[seed])[0]
        for j, c in enumerate(alone):
            r = got[(i, j)]
            assert r.response_ids == c.response_ids and r.finish_reason == c.finish_reason, (i, j)
            assert _close(r.logprobs, c.logprobs) and r.version == eng.weight_version
    # every row is returned by the poll in which it stopped: after its length in sampled tokens
    order = [len(r.response_ids) + (4 if r.key[0] == 2 else 0) for r in rest]
    assert all(len(r.response_ids) <= 4 for r in first)
    assert order == sorted(order)


def test_abort_then_continue_reproduces_the_uninterrupted_response(model):
    """A partial rollout: rows aborted after 5 tokens and resubmitted with their prefix continue
    on the same random stream: prefix + continuation = the uninterrupted response."""
    eng = HFEngine(model)
    params = SamplingParams(temperature=1.0, max_new_tokens=14, seed=9)
    whole = {r.key: r for r in (eng.submit(_rows(0, params, 7, 4)) or eng.poll())}
    eng.submit(_rows(0, params, 7, 4))
    eng.submit(_rows(1, params, 8, 2))  # another prompt in the batch, dropped by the abort too
    early = eng.poll(max_tokens=5)
    partial = {r.key: r for r in eng.abort()}
    assert eng.num_in_flight == 0 and len(early) + len(partial) == 6
    assert all(r.finish_reason == "abort" and len(r.response_ids) == 5 for r in partial.values())
    resumed = [k for k in partial if k[0] == 0]
    assert resumed, "some row of prompt 0 must still be running after 5 tokens"
    eng.submit([_rows(0, params, 7, 4, prefixes=[partial.get((0, j), whole[(0, j)]).response_ids
                                                 for j in range(4)])[j] for j in range(4) if (0, j) in partial])
    cont = {r.key: r for r in eng.poll()}
    for k in resumed:
        assert partial[k].response_ids + cont[k].response_ids == whole[k].response_ids, k
        assert _close(partial[k].logprobs + cont[k].logprobs, whole[k].logprobs)
        assert cont[k].finish_reason == whole[k].finish_reason


def test_prefix_that_already_ends_the_response(model):
    eng = HFEngine(model)
    params = SamplingParams(temperature=1.0, max_new_tokens=3, seed=1)
    eng.submit(_rows(1, params, 0, 2, prefixes=[[7, EOS], [7, 8, 9]]))
    out = {r.key: r for r in eng.poll()}
    assert out[(1, 0)].finish_reason == "stop" and out[(1, 1)].finish_reason == "length"
    assert out[(1, 0)].response_ids == [] and out[(1, 1)].response_ids == []


def test_no_weight_sync_or_sleep_with_rows_in_flight(model):
    eng = HFEngine(tiny_llama(seed=1))
    params = SamplingParams(temperature=1.0, max_new_tokens=30, seed=1)
    eng.submit(_rows(0, params, 0, 2))
    eng.poll(max_tokens=1)
    with pytest.raises(RuntimeError, match="rows in flight"):
        eng.update_weights(iter(model.state_dict().items()), version=1)
    with pytest.raises(RuntimeError, match="rows in flight"):
        eng.sleep()
    with pytest.raises(ValueError, match="already in flight"):
        eng.submit(_rows(0, params, 0, 1))
    eng.abort()
    eng.sleep()
