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
    from dapo_megatron.checkpointing import CheckpointError

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"run directory .*run holds no complete checkpoint"):
        ev.resolve_model(str(tmp_path / "run"), None, str(tmp_path))
    step = tmp_path / "run" / "checkpoints" / "step_3"
    step.mkdir(parents=True)
    (step / "checkpoint_info.json").write_text("{}")
    # a run directory stands for its latest checkpoint (here the only step directory)
    for model in (tmp_path / "run", step):
        with pytest.raises(ValueError, match="step_3' is a trainer checkpoint without dapo_megatron.json"):
            ev.resolve_model(str(model), None, str(tmp_path))
    (step / "dapo_megatron.json").write_text("{}")
    with pytest.raises(ValueError, match="--gguf-file 'm.gguf' given with the Megatron checkpoint"):
        ev.resolve_model(str(step), "m.gguf", str(tmp_path))
    with pytest.raises(CheckpointError, match=r"step_3/trainer_state.pt is missing"):  # checked before converting
        ev.resolve_model(str(step), None, str(tmp_path))
    gguf_dir = tmp_path / "g"
    gguf_dir.mkdir()
    (gguf_dir / "m.gguf").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="--gguf-file m.gguf"):
        ev.resolve_model(str(gguf_dir), None, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="other.gguf"):
        ev.resolve_model(str(gguf_dir), "other.gguf", str(tmp_path))
    assert ev.resolve_model(str(gguf_dir), "m.gguf", str(tmp_path)) == (str(gguf_dir), "m.gguf")


def _eval_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, EVAL, *args], capture_output=True, text=True, env=env, timeout=300)


def test_input_errors_are_one_line_with_exit_status_2(tmp_path):
    """A bad flag value, an unparsable flag and a missing model: one line each, exit status 2,
    no traceback, nothing on stdout."""
    cases = [(["--model", str(tmp_path), "--data", "x.jsonl", "--n", "2", "--k", "3"],
              "eval: error: --k=3 must be in [1, --n=2]: pass@k needs at least k samples per prompt\n"),
             (["--model", str(tmp_path), "--data", "x.jsonl", "--n", "two"],
              "eval: error: argument --n: invalid int value: 'two' (see --help)\n"),
             (["--model", str(tmp_path / "nope"), "--data", "x.jsonl"],
              f"eval: error: --model '{tmp_path / 'nope'}' is not a directory (HF / GGUF dir or Megatron "
              "checkpoint)\n")]
    for args, line in cases:
        proc = _eval_cli(*args)
        assert (proc.returncode, proc.stderr, proc.stdout) == (2, line, ""), proc.stderr[-3000:]


def test_closing_table_lists_every_source_and_all():
    cfg = ev.EvalConfig(model="m", data=["d"], n=4, k=[1, 4])
    metrics = {"val/avg@1": 0.5, "val/pass@1": 0.5, "val/avg@4": 0.5, "val/pass@4": 0.75, "val/num_prompts": 3.0,
               "val/arithmetic/avg@1": 0.25, "val/arithmetic/pass@1": 0.25, "val/arithmetic/avg@4": 0.25,
               "val/arithmetic/pass@4": 0.625, "val/arithmetic/num_prompts": 2.0,
               "val/openai/gsm8k/avg@1": 1.0, "val/openai/gsm8k/pass@1": 1.0, "val/openai/gsm8k/avg@4": 1.0,
               "val/openai/gsm8k/pass@4": 1.0, "val/openai/gsm8k/num_prompts": 1.0,
               "eval/num_samples": 12.0, "eval/response_length_mean": 7.25, "eval/clip_ratio": 0.25,
               "eval/generate_s": 3.14}
    records = [{"data_source": "openai/gsm8k"}, {"data_source": "arithmetic"}, {"data_source": "arithmetic"}]
    assert ev.format_table(metrics, records, cfg).splitlines() == [
        "data source   prompts   avg@4  pass@1  pass@4",
        "arithmetic          2  0.2500  0.2500  0.6250",
        "openai/gsm8k        1  1.0000  1.0000  1.0000",
        "all                 3  0.5000  0.5000  0.7500",
        "12 samples (n=4), mean response 7.2 tokens, 25.0% cut at --max-new-tokens, generation 3.1 s",
    ]


# ---------------------------------------------------------------- end to end (slow)
def _brute_pass_at_k(accs: list[int], k: int) -> float:
    subsets = list(itertools.combinations(range(len(accs)), k))
    return sum(any(accs[i] for i in s) for s in subsets) / len(subsets)


def _start_eval(args: list[str], log_dir) -> tuple[subprocess.Popen, list[str], str]:
    """``tools/eval.py args`` started, its stdout and stderr into files of ``log_dir`` (for
    :func:`_finish_eval`: an eval can run while the test does something else)."""
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    base = os.path.join(str(log_dir), os.path.basename(args[args.index("--output") + 1]))
    with open(base + ".stdout", "w") as out, open(base + ".stderr", "w") as err:
        return subprocess.Popen([sys.executable, EVAL, *args], stdout=out, stderr=err, text=True, env=env), args, base


def _finish_eval(started: tuple[subprocess.Popen, list[str], str]) -> tuple[dict, list[dict]]:
    proc, args, base = started
    try:
        proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc = subprocess.CompletedProcess(proc.args, proc.returncode, open(base + ".stdout").read(),
                                       open(base + ".stderr").read())
    return _eval_result(proc, args)


def _run_eval(args: list[str]) -> tuple[dict, list[dict]]:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    return _eval_result(subprocess.run([sys.executable, EVAL, *args], capture_output=True, text=True, env=env,
                                       timeout=600), args)


def _eval_result(proc: subprocess.CompletedProcess, args: list[str]) -> tuple[dict, list[dict]]:
    """The metrics line and the ``--output`` records of a finished eval, checked: exit 0, stdout is
    exactly the metrics line, the closing table's "all" row holds the metrics."""
    out_path = args[args.index("--output") + 1]
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout  # stdout is exactly the metrics line
    metrics = json.loads(lines[0])
    # the closing table on stderr: its "all" row holds the printed metrics (4 decimals)
    (row,) = [line.split() for line in proc.stderr.splitlines() if line.startswith("all ")]
    ks = sorted(int(k.split("@")[1]) for k in metrics if k.startswith("val/pass@"))
    n = int(args[args.index("--n") + 1])
    assert row == ["all", str(int(metrics["val/num_prompts"])), f"{metrics[f'val/avg@{n}']:.4f}",
                   *(f"{metrics[f'val/pass@{k}']:.4f}" for k in ks)], proc.stderr[-2000:]
    with open(out_path) as f:
        return metrics, [json.loads(line) for line in f]


def _check_metrics_against_records(metrics: dict, records: list[dict], n: int, ks: list[int]) -> None:
    from dapo_megatron.rewards import RewardPool

    # re-graded in a pool of this test's own, closed here: compute_score's shared pool would keep
    # its grader process alive until the interpreter exits, past the suite's end-of-session check
    with RewardPool(num_workers=1, timeout_s=5.0) as pool:
        for r in records:
            assert len(r["responses"]) == len(r["accs"]) == n
            graded = pool.grade([(r["data_source"], t, r["ground_truth"], None) for t in r["responses"]])
            regraded = [1 if g["acc"] else 0 for g in graded]
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
    common = ["--data", arithmetic_file, "--n", "2", "--max-new-tokens", "6", "--max-prompts", "3",
              "--num-workers", "1", "--seed", "11"]
    # the HF model's eval does not need the conversion: it runs alongside it (one process each, one per core)
    hf_eval = _start_eval(["--model", hf_dir, *common, "--output", str(tmp_path / "hf.jsonl")], tmp_path)
    try:
        proc = subprocess.run([sys.executable, TO_MEGATRON, "--hf", hf_dir, "--out", str(ckpt)],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    except BaseException:
        hf_eval[0].kill()  # its grader worker follows its parent (rewards/worker.py --parent-pid)
        hf_eval[0].wait()
        raise
    m_hf, r_hf = _finish_eval(hf_eval)
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
    # the run directory stands for its latest checkpoint, step_1
    metrics, records = _run_eval(["--model", str(run_dir), "--data", arithmetic_file, "--n", "2", "--max-new-tokens",
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
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(conv / "hf" / "model.safetensors").st_mode & 0o777 == 0o666 & ~umask  # not safetensors' 0600

    # a shard cut short: eval and the converter name the file in one line, exit status 2, before
    # any model is built (the index .metadata and the file sizes, not torch.load's traceback)
    shard = max((p for p in step.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    line = f"{shard} is truncated: {size // 2} bytes, the checkpoint index .metadata needs {size}\n"
    # both tools side by side (one process each, one per core): they read the checkpoint, write nothing
    started = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for cmd in (
        [sys.executable, EVAL, "--model", str(run_dir), "--data", arithmetic_file, "--n", "1"],
        [sys.executable, os.path.join(REPO, "tools", "convert_megatron_to_hf.py"), "--ckpt", str(run_dir), "--out",
         str(tmp_path / "x")])]
    try:
        outputs = [p.communicate(timeout=600) for p in started]
        done = [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(started, outputs)]
    finally:
        for p in started:  # a timed-out tool leaves none running
            if p.poll() is None:
                p.kill()
            p.communicate()
    proc = done[0]
    assert proc.returncode == 2 and proc.stderr.endswith(f"eval: error: {line}"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    proc = done[1]
    assert (proc.returncode, proc.stderr) == (2, f"convert_megatron_to_hf: error: {line}"), proc.stderr[-3000:]
    assert f"converting its latest checkpoint, {step}" in proc.stdout and not (tmp_path / "x").exists()
