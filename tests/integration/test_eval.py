"""tools/eval.py: prompt grouping, model resolution errors, and end-to-end runs whose
printed avg@k / pass@k are recomputed here from the per-sample records of --output
(re-graded with ``compute_score``, pass@k by enumerating every k-subset of the samples)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

EVAL = os.path.join(REPO, "tools", "eval.py")
TO_MEGATRON = os.path.join(REPO, "tools", "convert_hf_to_megatron.py")


def _load_eval_module():
    spec = importlib.util.spec_from_file_location("dapo_eval_tool", EVAL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["dapo_eval_tool"] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


ev = _load_eval_module()


def _record(i, content, gt="1", source="arithmetic"):
    from dapo_megatron.data.dataset import PromptRecord

    return PromptRecord(index=i, data_source=source, prompt_ids=[1, *map(ord, content), 2],
                        messages=[{"role": "user", "content": content}], ground_truth=gt, extra_info={"i": i})


# ---------------------------------------------------------------- grouping (fast)
def test_group_prompts_dedup_merges_identical_rows_in_first_row_order():
    recs = [_record(0, "a"), _record(1, "b"), _record(2, "a"), _record(3, "a", gt="2"),
            _record(4, "b"), _record(5, "a", source="math_dapo")]
    plain = ev.group_prompts(recs, dedup=False)
    assert [p.rows for p in plain] == [[0], [1], [2], [3], [4], [5]]
    assert [p.index for p in plain] == list(range(6))
    merged = ev.group_prompts(recs, dedup=True)
    # same messages but another ground truth or data source is another prompt
    assert [p.rows for p in merged] == [[0, 2], [1, 4], [3], [5]]
    assert [p.index for p in merged] == [0, 1, 2, 3]
    assert merged[0].record is recs[0]
    assert [p.rows for p in ev.group_prompts(recs, dedup=True, max_prompts=2)] == [[0, 2], [1, 4]]
    with pytest.raises(ValueError, match="max_prompts"):
        ev.group_prompts(recs, dedup=True, max_prompts=-1)


# ---------------------------------------------------------------- arguments and models (fast)
def test_parse_args_rejects_bad_flags_by_name(tmp_path):
    base = ["--model", str(tmp_path), "--data", "x.jsonl", "--n", "2"]
    with pytest.raises(ValueError, match=r"--k=3 must be in \[1, --n=2\]"):
        ev.parse_args(base + ["--k", "1", "3"])
    with pytest.raises(ValueError, match="--top-p"):
        ev.parse_args(base + ["--top-p", "0"])
    with pytest.raises(ValueError, match="--gguf-file"):
        ev.parse_args(base + ["--engine", "sglang", "--gguf-file", "m.gguf"])
    cfg = ev.parse_args(base + ["--k", "2", "1", "2", "--dedup"])
    assert cfg.ks == [1, 2] and cfg.dedup and cfg.n == 2
    assert ev.parse_args(base).ks == [2]  # default k = n


def test_resolve_model_names_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        ev.resolve_model(str(tmp_path / "missing"), None, str(tmp_path))
    step = tmp_path / "run" / "checkpoints" / "step_3"
    step.mkdir(parents=True)
    (step / "checkpoint_info.json").write_text("{}")
    with pytest.raises(ValueError, match=r"run directory: pass one of its checkpoints, .*step_<k>"):
        ev.resolve_model(str(tmp_path / "run"), None, str(tmp_path))
    with pytest.raises(ValueError, match="trainer checkpoint without dapo_megatron.json"):
        ev.resolve_model(str(step), None, str(tmp_path))
    (step / "dapo_megatron.json").write_text("{}")
    with pytest.raises(ValueError, match="--gguf-file 'm.gguf' given with the Megatron checkpoint"):
        ev.resolve_model(str(step), "m.gguf", str(tmp_path))
    gguf_dir = tmp_path / "g"
    gguf_dir.mkdir()
    (gguf_dir / "m.gguf").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="--gguf-file m.gguf"):
        ev.resolve_model(str(gguf_dir), None, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="other.gguf"):
        ev.resolve_model(str(gguf_dir), "other.gguf", str(tmp_path))
    assert ev.resolve_model(str(gguf_dir), "m.gguf", str(tmp_path)) == (str(gguf_dir), "m.gguf")


# ---------------------------------------------------------------- end to end (slow)
def _brute_pass_at_k(accs: list[int], k: int) -> float:
    subsets = list(itertools.combinations(range(len(accs)), k))
    return sum(any(accs[i] for i in s) for s in subsets) / len(subsets)


def _run_eval(args: list[str]) -> tuple[dict, list[dict]]:
    out_path = args[args.index("--output") + 1]
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, EVAL, *args], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout  # stdout is exactly the metrics line
    with open(out_path) as f:
        return json.loads(lines[0]), [json.loads(line) for line in f]


def _check_metrics_against_records(metrics: dict, records: list[dict], n: int, ks: list[int]) -> None:
    from dapo_megatron.rewards import compute_score

    for r in records:
        assert len(r["responses"]) == len(r["accs"]) == n
        regraded = [1 if compute_score(r["data_source"], t, r["ground_truth"])["acc"] else 0 for t in r["responses"]]
        assert regraded == r["accs"], (r["responses"], r["ground_truth"])
    per_prompt = [sum(r["accs"]) / n for r in records]
    for k in ks:
        assert metrics[f"val/avg@{k}"] == pytest.approx(sum(per_prompt) / len(per_prompt), abs=1e-12)
        brute = [_brute_pass_at_k(r["accs"], k) for r in records]
        assert metrics[f"val/pass@{k}"] == pytest.approx(sum(brute) / len(brute), abs=1e-12)
    assert metrics["val/num_prompts"] == len(records)
    assert metrics["eval/num_samples"] == n * len(records)


@pytest.fixture(scope="module")
def arithmetic_file(tmp_path_factory):
    """4 distinct small-operand problems, the first two repeated (7 rows), DAPO schema."""
    from dapo_megatron.data.arithmetic import write_arithmetic_dataset
    from dapo_megatron.data.dataset import write_dapo_rows

    d = tmp_path_factory.mktemp("eval_data")
    write_arithmetic_dataset(str(d / "base.jsonl"), 4, seed=5, min_operand=1, max_operand=4, split="val")
    rows = [json.loads(line) for line in open(d / "base.jsonl")]
    assert len({r["prompt"][0]["content"] for r in rows}) == 4, "the generator repeated a problem; change seed"
    return write_dapo_rows(rows + rows[:2] + rows[:1], str(d / "arith.jsonl"))


@pytest.mark.slow
def test_eval_smollm2_gguf_metrics_match_records(smollm2_gguf, arithmetic_file, tmp_path):
    path, fname = smollm2_gguf
    out = str(tmp_path / "results.jsonl")
    metrics, records = _run_eval(["--model", path, "--gguf-file", fname, "--data", arithmetic_file, "--dedup",
                                  "--n", "2", "--k", "1", "2", "--max-new-tokens", "8", "--temperature", "1.0",
                                  "--top-p", "0.7", "--num-workers", "1", "--output", out])
    # --dedup: 7 rows are 4 prompts; rows 4, 5 are copies of 0, 1 and row 6 of 0
    assert [r["rows"] for r in records] == [[0, 4, 6], [1, 5], [2], [3]]
    assert metrics["eval/num_rows"] == 7
    _check_metrics_against_records(metrics, records, n=2, ks=[1, 2])
    for r in records:
        assert all(1 <= n <= 8 for n in r["response_lengths"])
        for length, reason in zip(r["response_lengths"], r["finish_reasons"]):
            assert reason == "stop" or (reason == "length" and length == 8)
    clipped = sum(f == "length" for r in records for f in r["finish_reasons"])
    assert metrics["eval/clip_ratio"] == pytest.approx(clipped / 8)


@pytest.mark.slow
def test_eval_megatron_checkpoint_equals_its_hf_source(tiny_llama_with_smollm2_tokenizer, arithmetic_file, tmp_path):
    """A Megatron checkpoint is converted back to HF and samples exactly as the HF model it
    was made from (fp32 weights round-trip bitwise; same seeds). Tiny random Llama with
    SmolLM2's tokenizer (vocab 49,152) keeps it fast."""
    hf_dir = tiny_llama_with_smollm2_tokenizer
    ckpt = tmp_path / "tiny_megatron"
    proc = subprocess.run([sys.executable, TO_MEGATRON, "--hf", hf_dir, "--out", str(ckpt)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    common = ["--data", arithmetic_file, "--n", "2", "--max-new-tokens", "6", "--max-prompts", "3",
              "--num-workers", "1", "--seed", "11"]
    m_hf, r_hf = _run_eval(["--model", hf_dir, *common, "--output", str(tmp_path / "hf.jsonl")])
    m_mg, r_mg = _run_eval(["--model", str(ckpt), *common, "--output", str(tmp_path / "mg.jsonl")])
    assert [r["rows"] for r in r_mg] == [[0], [1], [2]]  # no --dedup: one prompt per row
    assert [r["responses"] for r in r_mg] == [r["responses"] for r in r_hf]
    assert [r["response_lengths"] for r in r_mg] == [r["response_lengths"] for r in r_hf]
    _check_metrics_against_records(m_mg, r_mg, n=2, ks=[2])
    assert {k: v for k, v in m_mg.items() if k != "eval/generate_s"} == \
        {k: v for k, v in m_hf.items() if k != "eval/generate_s"}


_WRITE_TRAINER_CKPT = '''
import sys, torch
from safetensors.torch import save_file
from transformers import AutoTokenizer
from dapo_megatron.actor import ActorConfig, MegatronActor
from dapo_megatron.bridge import export_hf_state_dict, load_hf_weights, open_hf_source
from dapo_megatron.bridge.dist_ckpt import write_model_meta
from dapo_megatron.checkpointing import save_checkpoint
from dapo_megatron.config import DAPOConfig, load_config
from dapo_megatron.models import build_gpt_model, load_hf_config
from dapo_megatron.platform import destroy_distributed, init_distributed

def main(hf_dir, run_dir, expected_path):
    cfg = load_config(DAPOConfig, None, [f"model.hf_path={hf_dir}", "model.transformer_impl=local",
                                         f"trainer.default_local_dir={run_dir}"])
    par = init_distributed(cfg.parallel, seed=1)
    hf_config = load_hf_config(hf_dir)
    model = build_gpt_model(hf_config, cfg.model, parallel=par)
    load_hf_weights(model, open_hf_source(hf_dir), strict=True, parallel=par)
    torch.manual_seed(3)
    with torch.no_grad():  # "trained" weights: not the ones of hf_dir
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    actor = MegatronActor(model, ActorConfig(), 10, vocab_size=hf_config.vocab_size, parallel=par)
    ddp, opt = actor.model_chunks[0], actor.optimizer  # one optimizer step: Adam state to save
    ids = torch.randint(0, hf_config.vocab_size, (2, 8))
    opt.zero_grad()
    ddp.zero_grad_buffer()
    ddp(ids, torch.arange(8).expand(2, 8), None, labels=ids).float().mean().backward()
    ddp.finish_grad_sync()
    assert opt.step()[0]
    actor.scheduler.step(1)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    # as DAPOTrainer.save: the model meta (HF config, tokenizer, dapo_megatron.json) is
    # written inside the checkpoint's atomic commit
    save_checkpoint(run_dir, 1, actor.model_chunks, actor.optimizer, actor.scheduler, {"step": 1},
                    write_extra=lambda d: write_model_meta(d, actor.model_chunks, hf_config, tokenizer),
                    parallel=par)
    exported = export_hf_state_dict(actor.model_chunks, parallel=par)
    save_file({k: v.contiguous() for k, v in exported.items()}, expected_path)
    destroy_distributed()

if __name__ == "__main__":
    main(*sys.argv[1:])
'''


@pytest.fixture(scope="module")
def tiny_llama_with_smollm2_tokenizer(smollm2_gguf, tmp_path_factory):
    """A random 2-layer Llama HF directory with SmolLM2's tokenizer (vocab 49,152)."""
    from conftest import tiny_llama_with_smollm2_tokenizer_dir

    return tiny_llama_with_smollm2_tokenizer_dir(smollm2_gguf, tmp_path_factory.mktemp("tiny_hf"))


@pytest.mark.slow
def test_eval_trainer_checkpoint_reads_the_trained_weights(tiny_llama_with_smollm2_tokenizer, arithmetic_file,
                                                          tmp_path):
    """A trainer checkpoint (model + distributed optimizer + scheduler + the model meta, saved
    as ``DAPOTrainer.save`` does) is evaluated on the weights it holds, bitwise: the HF
    export of the conversion equals the saving model's own export, not the base model's."""
    import torch
    from safetensors.torch import load_file

    hf_dir = tiny_llama_with_smollm2_tokenizer
    script = tmp_path / "write_ckpt.py"
    script.write_text(_WRITE_TRAINER_CKPT)
    run_dir, expected = tmp_path / "run", tmp_path / "expected.safetensors"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, str(script), hf_dir, str(run_dir), str(expected)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = run_dir / "checkpoints" / "step_1"
    assert (step / "dapo_megatron.json").is_file() and (step / "config.json").is_file()
    conv = tmp_path / "converted"
    metrics, records = _run_eval(["--model", str(step), "--data", arithmetic_file, "--n", "2", "--max-new-tokens",
                                  "4", "--max-prompts", "2", "--num-workers", "1", "--keep-converted", str(conv),
                                  "--output", str(tmp_path / "r.jsonl")])
    _check_metrics_against_records(metrics, records, n=2, ks=[2])
    got, want = load_file(str(conv / "hf" / "model.safetensors")), load_file(str(expected))
    base = load_file(os.path.join(hf_dir, "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(got[name], base[name])  # the trained weights, not the run's base model
