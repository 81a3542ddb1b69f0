"""Evaluate a model's avg@k and pass@k on a DAPO-schema file (the DAPO paper's AIME 2024 avg@32).

Usage::

    # the paper's evaluation: AIME 2024, 32 samples per problem, temperature 1.0, top-p 0.7
    python tools/eval.py --model /models/Qwen2.5-32B --data /data/aime-2024.parquet --dedup \\
        --n 32 --temperature 1.0 --top-p 0.7 --max-new-tokens 20480 --engine sglang --tp 8 \\
        --output results.jsonl
    # SmolLM2 GGUF on CPU
    python tools/eval.py --model "$SMOLLM2_DIR" --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf \\
        --data prompts.jsonl --n 4 --max-new-tokens 32

``--model`` is one of

* an HF directory (config.json + safetensors + tokenizer), or a directory holding the GGUF
  file named by ``--gguf-file`` (de-quantised by transformers);
* a Megatron model checkpoint (``dapo_megatron.json`` + torch_dist shards): written by
  ``tools/convert_hf_to_megatron.py`` / ``bridge.save_model_checkpoint``, or a trainer
  checkpoint ``<run dir>/checkpoints/step_<k>`` (``DAPOTrainer.save`` writes the HF config,
  tokenizer and ``dapo_megatron.json`` next to the model, optimizer and RNG state; the
  loader reads the model and skips the ``optimizer.*`` entries). It is converted to a
  temporary HF directory by ``tools/convert_megatron_to_hf.py`` (one process, TP=PP=1),
  deleted at exit (``--keep-converted DIR`` keeps it). A checkpoint saved with the
  Transformer Engine spec converts anywhere: both specs write the same checkpoint keys
  (``bridge.dist_ckpt.write_model_meta``). A run directory stands for its latest checkpoint
  (``checkpoints/latest``, as a resume would load; the step is printed). The checkpoint is
  checked from its index and file sizes before the conversion
  (:func:`dapo_megatron.checkpointing.check_model_checkpoint`): a truncated shard is named.

Duplicate prompts: DAPO-schema evaluation files often repeat each problem (the AIME 2024
parquet holds its 30 problems 32 times each). Without ``--dedup`` every row is a prompt
of its own and gets ``--n`` samples (verl's way with ``--n 1``: 32 copies × 1 sample is
avg@32 per problem). With ``--dedup`` rows with the same data_source, chat-templated
prompt and ground truth form one prompt that gets ``--n`` samples
(:func:`dapo_megatron.data.dataset.unique_prompts`, as the trainer's ``validate()``
does; ``--n 32`` gives avg@32 and a pass@32 that the copies-with-n=1 way cannot).
``--max-prompts`` keeps the first M prompts after deduplication (file order of their
first row).

Metrics (:func:`dapo_megatron.metrics.compute_val_metrics`): avg@k = mean over prompts of
the mean 0/1 accuracy of their samples (all ``n`` samples are used); pass@k = mean over
prompts of the unbiased ``1 - C(n-c, k) / C(n, k)`` (Chen et al. 2021, Eq. 1), for each
``--k`` (default: ``n``). Accuracy is the ``acc`` of the project's rule-based graders
(:class:`dapo_megatron.rewards.RewardPool`, chosen by ``data_source``), graded on the
response decoded with ``skip_special_tokens=True``, as the trainer's ``validate()`` does.

Output: stdout gets exactly one line, the metrics dict as JSON; progress and, at the end, a
table of the scores per data source (:func:`format_table`) go to stderr. ``--output
FILE.jsonl`` writes one JSON object per prompt (see :func:`prompt_record`). Bad input (a flag,
a missing or damaged model / checkpoint file) is one line, ``eval: error: ...``, exit status 2.

Sampling is reproducible: response j of prompt i uses the sampler seed
``sample_seed(--seed, i, j)`` (:func:`dapo_megatron.rollout.engines.engine.sample_seed`), so the
samples do not depend on ``--batch-size``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONVERT_TO_HF = os.path.join(REPO, "tools", "convert_megatron_to_hf.py")
MEGATRON_META_FILE = "dapo_megatron.json"  # dapo_megatron.bridge.dist_ckpt.META_FILE
TRAINER_INFO_FILE = "checkpoint_info.json"  # dapo_megatron.checkpointing.INFO_FILENAME


@dataclass
class EvalConfig:
    """Settings of one evaluation (the command-line flags, same names with ``_``).

    Attributes:
        model: HF directory, GGUF directory (with ``gguf_file``) or Megatron model checkpoint
            (also a trainer's ``checkpoints/step_<k>``).
        data: DAPO-schema parquet/jsonl file(s).
        gguf_file: GGUF file name inside ``model``; None for safetensors / Megatron.
        n: samples per prompt (>= 1).
        k: the k values of avg@k / pass@k, each in [1, n]; empty means ``[n]``.
        temperature: sampling temperature (> 0; paper: 1.0).
        top_p: nucleus mass in (0, 1] (paper: 0.7).
        top_k: -1 (off) or k >= 1.
        max_new_tokens: generation budget per response (paper: 20480).
        max_prompt_length: prompts longer than this many chat-templated tokens are dropped
            (and counted in ``eval/num_overlong_prompts``).
        max_prompts: evaluate the first M prompts (after ``dedup``); 0 = all.
        dedup: one prompt per distinct (data_source, prompt ids, ground truth); see module doc.
        engine: "hf" (transformers, CPU or GPU) or "sglang" (GPU).
        tp: SGLang tensor-parallel size (engine "sglang").
        gpu_memory_utilization: SGLang ``mem_fraction_static``.
        dtype: "float32", "bfloat16" or "float16"; None: float32 on CPU, bfloat16 on CUDA.
        device: "cpu", "cuda", "cuda:1", ... (engine "hf"); None: this rank's device
            (``dapo_megatron.platform.device()``: cuda:LOCAL_RANK % GPUs, else cpu).
        batch_size: prompts per ``generate`` call (each with ``n`` samples); 0 = all at once.
        seed: base sampler seed.
        num_workers: grader processes.
        timeout_s: grading wall-clock limit per response (a timeout counts as wrong).
        output: per-prompt JSONL file, or None.
        keep_converted: directory to write (and keep) the HF conversion of a Megatron
            checkpoint in; None converts into a temporary directory deleted at exit.
    """

    model: str
    data: list[str]
    gguf_file: Optional[str] = None
    n: int = 32
    k: list[int] = field(default_factory=list)
    temperature: float = 1.0
    top_p: float = 0.7
    top_k: int = -1
    max_new_tokens: int = 20480
    max_prompt_length: int = 2048
    max_prompts: int = 0
    dedup: bool = False
    engine: str = "hf"
    tp: int = 1
    gpu_memory_utilization: float = 0.8
    dtype: Optional[str] = None
    device: Optional[str] = None
    batch_size: int = 0
    seed: int = 0
    num_workers: int = 2
    timeout_s: float = 5.0
    output: Optional[str] = None
    keep_converted: Optional[str] = None

    def validate(self) -> None:
        """Raises ValueError naming the flag and the accepted values."""
        if self.n < 1:
            raise ValueError(f"--n={self.n} must be >= 1 (samples per prompt)")
        for k in self.ks:
            if not 1 <= k <= self.n:
                raise ValueError(f"--k={k} must be in [1, --n={self.n}]: pass@k needs at least k samples per prompt")
        if not self.temperature > 0:
            raise ValueError(f"--temperature={self.temperature} must be > 0 (greedy: --top-k 1)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p={self.top_p} must be in (0, 1]")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"--top-k={self.top_k} must be -1 (off) or >= 1")
        for name in ("max_new_tokens", "max_prompt_length", "num_workers", "tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be >= 1")
        for name in ("max_prompts", "batch_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be >= 0 (0 = all)")
        if self.engine not in ("hf", "sglang"):
            raise ValueError(f"--engine={self.engine!r} must be 'hf' or 'sglang'")
        if self.engine == "sglang" and self.gguf_file:
            raise ValueError("--engine sglang does not load --gguf-file here; use --engine hf, or an HF "
                             "safetensors directory")
        if self.dtype is not None and self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype={self.dtype!r} must be float32, bfloat16 or float16")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout-s={self.timeout_s} must be > 0 seconds")
        if not self.data:
            raise ValueError("--data needs at least one DAPO-schema parquet/jsonl file")

    @property
    def ks(self) -> list[int]:
        """The k values of the metrics (``k`` or ``[n]``), sorted, unique."""
        return sorted(set(self.k)) if self.k else [self.n]


PROG = "eval"


def parse_args(argv: Optional[Sequence[str]] = None) -> EvalConfig:
    """Command line → validated :class:`EvalConfig` (``--help`` lists the flags).

    Raises:
        ValueError: a flag out of its range (:meth:`EvalConfig.validate`); ``SystemExit(2)``
            with one line for an unparsable flag.
    """
    from dapo_megatron.cli import ArgumentParser

    d = EvalConfig(model="", data=[])
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF dir, GGUF dir (with --gguf-file) or Megatron model checkpoint")
    p.add_argument("--data", required=True, nargs="+", help="DAPO-schema parquet/jsonl file(s)")
    p.add_argument("--gguf-file", default=None, help="GGUF file name inside --model")
    p.add_argument("--n", type=int, default=d.n, help="samples per prompt (default %(default)s)")
    p.add_argument("--k", type=int, nargs="*", default=[], help="k values of avg@k / pass@k (default: n)")
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--max-prompt-length", type=int, default=d.max_prompt_length)
    p.add_argument("--max-prompts", type=int, default=d.max_prompts, help="first M prompts (after --dedup); 0 = all")
    p.add_argument("--dedup", action="store_true", help="one prompt per distinct (source, prompt, ground truth)")
    p.add_argument("--engine", choices=["hf", "sglang"], default=d.engine)
    p.add_argument("--tp", type=int, default=d.tp, help="SGLang tensor-parallel size")
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--device", default=None, help="hf engine device (default: cuda if available, else cpu)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="prompts per generate call; 0 = all")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--num-workers", type=int, default=d.num_workers, help="grader processes")
    p.add_argument("--timeout-s", type=float, default=d.timeout_s, help="grading time limit per response")
    p.add_argument("--output", default=None, help="per-prompt JSONL (accs, preds, responses)")
    p.add_argument("--keep-converted", default=None, help="keep the HF conversion of a Megatron checkpoint here")
    args = p.parse_args(argv)
    cfg = EvalConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EvalConfig)})
    cfg.validate()
    return cfg


# --------------------------------------------------------------------------- model


def _log(msg: str) -> None:
    print(f"[eval] {msg}", file=sys.stderr, flush=True)


def resolve_model(model: str, gguf_file: Optional[str], workdir: str) -> tuple[str, Optional[str]]:
    """The HF directory (and GGUF file name) to load for ``--model``.

    Args:
        model: HF / GGUF directory, or a Megatron model checkpoint directory (a trainer's
            ``checkpoints/step_<k>`` is one).
        gguf_file: ``--gguf-file``.
        workdir: where a Megatron checkpoint is converted to (``<workdir>/hf``).

    Returns:
        ``(hf_dir, gguf_file)``; for a Megatron checkpoint the converted directory and None.

    Raises:
        FileNotFoundError: ``model`` (or its GGUF file / config.json) does not exist.
        InputError (a ValueError): a trainer checkpoint without ``dapo_megatron.json`` (saved
            by an older trainer), or a Megatron checkpoint given with --gguf-file.
        CheckpointError (a ValueError): a run directory without a checkpoint, a missing or
            truncated checkpoint file (named).
        RuntimeError: the conversion failed (its output is included).
    """
    if not os.path.isdir(model):  # before the imports below (torch): a mistyped path stops at once
        raise FileNotFoundError(f"--model {model!r} is not a directory (HF / GGUF dir or Megatron checkpoint)")
    from dapo_megatron.checkpointing import check_model_checkpoint, is_run_dir, latest_checkpoint_dir
    from dapo_megatron.cli import InputError

    if is_run_dir(model) and not os.path.isfile(os.path.join(model, "config.json")):
        model = latest_checkpoint_dir(model)
        _log(f"run directory: evaluating its latest checkpoint, {model}")
    if os.path.isfile(os.path.join(model, TRAINER_INFO_FILE)) and \
            not os.path.isfile(os.path.join(model, MEGATRON_META_FILE)):
        raise InputError(f"--model {model!r} is a trainer checkpoint without {MEGATRON_META_FILE} (saved before "
                         "DAPOTrainer.save wrote the HF config and tokenizer next to the model): it cannot be "
                         "converted; evaluate a checkpoint saved by the current trainer")
    if os.path.isfile(os.path.join(model, MEGATRON_META_FILE)):
        if gguf_file:
            raise InputError(f"--gguf-file {gguf_file!r} given with the Megatron checkpoint {model!r}; drop it")
        check_model_checkpoint(model)  # a truncated shard named now, not in the conversion's traceback
        out = os.path.join(workdir, "hf")
        _log(f"converting the Megatron checkpoint {model} to HF safetensors in {out}")
        _run_tool([sys.executable, CONVERT_TO_HF, "--ckpt", model, "--out", out],
                  f"tools/convert_megatron_to_hf.py --ckpt {model}")
        return out, None
    if gguf_file:
        if not os.path.isfile(os.path.join(model, gguf_file)):
            raise FileNotFoundError(f"--gguf-file {gguf_file!r} not found in --model {model!r}")
        return model, gguf_file
    if not os.path.isfile(os.path.join(model, "config.json")):
        ggufs = sorted(f for f in os.listdir(model) if f.endswith(".gguf"))
        hint = f"; pass --gguf-file {ggufs[0]}" if ggufs else ""
        raise FileNotFoundError(f"--model {model!r} has no config.json (not an HF directory){hint}")
    return model, None


def _run_tool(cmd: list[str], what: str) -> None:
    """Run the conversion in its own process (a world of one: it initialises torch.distributed
    and Megatron's parallel state, which this process must not keep)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode == 2 and proc.stderr.strip():  # the tool's one-line input error: pass it on
        from dapo_megatron.cli import InputError

        raise InputError(proc.stderr.strip().splitlines()[-1].split(": error: ", 1)[-1])
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def engine_spec(cfg: EvalConfig, hf_dir: str, gguf_file: Optional[str], tokenizer):
    """The :class:`~dapo_megatron.rollout.engines.factory.EngineSpec` of ``--engine`` on the model: its
    weights loaded, stopping on :func:`~dapo_megatron.rollout.engines.factory.stop_token_ids` (the
    trainer's engine stops on the same tokens), float32 on CPU / bfloat16 on CUDA unless
    ``--dtype``, SGLang without the memory saver (nothing else shares the GPU here)."""
    import torch
    from transformers import AutoConfig

    from dapo_megatron.rollout.engines.factory import EngineSpec, stop_token_ids

    hf_config = AutoConfig.from_pretrained(hf_dir, **({"gguf_file": gguf_file} if gguf_file else {}))
    dtype_name = cfg.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    return EngineSpec(name=cfg.engine, model_path=hf_dir, dtype=getattr(torch, dtype_name),
                      eos_token_ids=stop_token_ids(tokenizer, hf_config, hf_dir), gguf_file=gguf_file,
                      device=cfg.device, tp_size=cfg.tp, mem_fraction_static=cfg.gpu_memory_utilization,
                      enable_memory_saver=False)


# --------------------------------------------------------------------------- prompts


@dataclass
class EvalPrompt:
    """One prompt to sample ``n`` times.

    Attributes:
        index: position among the evaluated prompts (0-based; also its sampler prompt seed).
        rows: dataset indices (after prompt-length filtering) of the rows it stands for
            (several with ``dedup``).
        record: the first row's :class:`~dapo_megatron.data.dataset.PromptRecord`.
    """

    index: int
    rows: list[int]
    record: Any


def group_prompts(records: Sequence[Any], dedup: bool, max_prompts: int = 0) -> list[EvalPrompt]:
    """The prompts to evaluate, in file order of their first row.

    Args:
        records: ``PromptRecord`` s of the loaded dataset (position = dataset row).
        dedup: merge copies of a problem (equal data_source, prompt ids and ground truth;
            :func:`dapo_megatron.data.dataset.unique_prompts`) into one prompt.
        max_prompts: keep the first M prompts (after merging); 0 keeps all.

    Returns:
        list of :class:`EvalPrompt` with ``index`` 0..P-1.

    Raises:
        ValueError: ``max_prompts < 0``.
    """
    from dapo_megatron.data.dataset import unique_prompts

    if max_prompts < 0:
        raise ValueError(f"max_prompts={max_prompts} must be >= 0 (0 = all)")
    groups = unique_prompts(records) if dedup else [(rec, [i]) for i, rec in enumerate(records)]
    if max_prompts:
        groups = groups[:max_prompts]
    return [EvalPrompt(index=j, rows=rows, record=rec) for j, (rec, rows) in enumerate(groups)]


# --------------------------------------------------------------------------- evaluation


def prompt_record(prompt: EvalPrompt, completions, texts: list[str], grades: list[dict], ks: list[int]) -> dict:
    """One ``--output`` line: the prompt, its samples and their grades.

    Keys: ``index``, ``rows`` (dataset rows merged into it), ``data_source``,
    ``ground_truth``, ``messages``, ``num_correct``, ``avg`` (mean acc), ``pass@k`` for each
    k, and per sample (same order): ``accs`` (0/1), ``scores`` (+1/-1), ``preds`` (extracted
    answers), ``responses`` (decoded text), ``response_lengths`` (generated tokens),
    ``finish_reasons`` ("stop" / "length").
    """
    from dapo_megatron.metrics import pass_at_k

    accs = [1 if g["acc"] else 0 for g in grades]
    rec = prompt.record
    out = {
        "index": prompt.index,
        "rows": prompt.rows,
        "data_source": rec.data_source,
        "ground_truth": rec.ground_truth,
        "messages": rec.messages,
        "num_correct": sum(accs),
        "avg": sum(accs) / len(accs),
    }
    for k in ks:
        out[f"pass@{k}"] = pass_at_k(len(accs), sum(accs), k)
    out.update(
        accs=accs,
        scores=[float(g["score"]) for g in grades],
        preds=[g.get("pred") for g in grades],
        responses=texts,
        response_lengths=[len(c.response_ids) for c in completions],
        finish_reasons=[c.finish_reason for c in completions],
    )
    return out


def evaluate(cfg: EvalConfig) -> tuple[dict[str, float], list[dict]]:
    """Generate, grade and score; returns ``(metrics, per-prompt records)``.

    ``metrics`` holds ``compute_val_metrics``'s keys for every k (``val/avg@k``,
    ``val/pass@k``, ``val/num_prompts`` and per data source) plus ``eval/num_rows`` (rows
    kept after prompt-length filtering), ``eval/num_overlong_prompts``, ``eval/num_samples``,
    ``eval/response_length_mean`` (generated tokens), ``eval/clip_ratio`` (share of
    responses cut at ``max_new_tokens``) and ``eval/generate_s`` (seconds).

    Raises:
        see :func:`resolve_model`, :func:`~dapo_megatron.data.dataset.load_prompt_dataset`.
    """
    cfg.validate()
    workdir = tempfile.mkdtemp(prefix="dapo_eval_")
    try:
        if cfg.keep_converted:
            workdir_model = os.path.abspath(cfg.keep_converted)
            os.makedirs(workdir_model, exist_ok=True)
        else:
            workdir_model = workdir
        hf_dir, gguf_file = resolve_model(cfg.model, cfg.gguf_file, workdir_model)
        # torch and transformers (~8 s) once the model is known to exist
        from dapo_megatron.data.dataset import load_prompt_dataset
        from dapo_megatron.metrics import compute_val_metrics
        from dapo_megatron.rewards import RewardPool
        from dapo_megatron.rollout.engines.engine import SamplingParams
        from dapo_megatron.rollout.engines.factory import build_engine, load_tokenizer

        tokenizer = load_tokenizer(hf_dir, gguf_file)
        dataset = load_prompt_dataset(cfg.data, tokenizer, cfg.max_prompt_length)
        prompts = group_prompts(dataset.records, cfg.dedup, cfg.max_prompts)
        _log(f"{len(dataset)} rows ({dataset.stats.num_overlong} over --max-prompt-length dropped) -> "
             f"{len(prompts)} prompts x n={cfg.n}")
        pool = RewardPool(num_workers=cfg.num_workers, timeout_s=cfg.timeout_s)
        try:
            engine = build_engine(engine_spec(cfg, hf_dir, gguf_file, tokenizer))
            params = SamplingParams(n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                    max_new_tokens=cfg.max_new_tokens, seed=cfg.seed)
            step = cfg.batch_size or len(prompts)
            outputs = []
            t0 = time.perf_counter()
            for start in range(0, len(prompts), step):
                chunk = prompts[start:start + step]
                outputs += engine.generate([p.record.prompt_ids for p in chunk], params,
                                           prompt_seeds=[p.index for p in chunk])
                _log(f"generated {min(start + step, len(prompts))}/{len(prompts)} prompts")
            gen_s = time.perf_counter() - t0
            if hasattr(engine, "shutdown"):  # SGLang: stop its scheduler processes
                engine.shutdown()
            texts = [[tokenizer.decode(c.response_ids, skip_special_tokens=True) for c in comps]
                     for comps in outputs]
            requests = [(p.record.data_source, t, p.record.ground_truth, p.record.extra_info)
                        for p, ts in zip(prompts, texts) for t in ts]
            flat = pool.grade(requests)
        finally:
            pool.close()
        records = []
        for i, (p, comps, ts) in enumerate(zip(prompts, outputs, texts)):
            records.append(prompt_record(p, comps, ts, flat[i * cfg.n:(i + 1) * cfg.n], cfg.ks))
        sources, accs = [r["data_source"] for r in records], [r["accs"] for r in records]
        metrics: dict[str, float] = {}
        for k in cfg.ks:
            metrics.update(compute_val_metrics(sources, accs, k))
        lengths = [n for r in records for n in r["response_lengths"]]
        reasons = [f for r in records for f in r["finish_reasons"]]
        metrics.update({
            "eval/num_rows": float(len(dataset)),
            "eval/num_overlong_prompts": float(dataset.stats.num_overlong),
            "eval/num_samples": float(len(lengths)),
            "eval/response_length_mean": sum(lengths) / len(lengths),
            "eval/clip_ratio": reasons.count("length") / len(reasons),
            "eval/generate_s": gen_s,
        })
        return metrics, records
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def write_jsonl(records: Sequence[dict], path: str) -> None:
    """Write one JSON object per line, atomically (temp file + ``os.replace``)."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def format_table(metrics: dict[str, float], records: Sequence[dict], cfg: EvalConfig) -> str:
    """The closing table (stderr): one row per data source and one for all prompts, with the
    prompt count, avg@n and pass@k for every k; then samples, mean response length, clip ratio
    and generation time. Values are those of ``metrics`` (:func:`evaluate`)."""
    sources = sorted({r["data_source"] for r in records})
    head = ["data source", "prompts", f"avg@{cfg.n}", *(f"pass@{k}" for k in cfg.ks)]
    rows = []
    for name, prefix in [*((s, f"val/{s}/") for s in sources), ("all", "val/")]:
        rows.append([name, str(int(metrics[f"{prefix}num_prompts"])), f"{metrics[f'{prefix}avg@{cfg.ks[0]}']:.4f}",
                     *(f"{metrics[f'{prefix}pass@{k}']:.4f}" for k in cfg.ks)])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = "  ".join(["{:<%d}" % widths[0], *("{:>%d}" % w for w in widths[1:])])
    lines = [fmt.format(*head), *(fmt.format(*r) for r in rows)]
    lines.append(f"{int(metrics['eval/num_samples'])} samples (n={cfg.n}), mean response "
                 f"{metrics['eval/response_length_mean']:.1f} tokens, {100 * metrics['eval/clip_ratio']:.1f}% cut at "
                 f"--max-new-tokens, generation {metrics['eval/generate_s']:.1f} s")
    return "\n".join(lines)


def run(cfg: EvalConfig) -> None:
    """Evaluate, write ``--output``, print the metrics line (stdout) and the table (stderr)."""
    metrics, records = evaluate(cfg)
    if cfg.output:
        write_jsonl(records, cfg.output)
        _log(f"wrote {len(records)} prompts to {cfg.output}")
    print(json.dumps(metrics, sort_keys=True), flush=True)
    print(format_table(metrics, records, cfg), file=sys.stderr, flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """:func:`run`; bad input (a flag out of range, a missing / damaged model or checkpoint, a bad
    dataset) is one line and exit status 2 (:mod:`dapo_megatron.cli`). Returns the exit status."""
    from dapo_megatron.cli import report_input_error, run_tool

    def input_errors():  # imported only when run() raised: a bad flag or path never loads torch (~1.2 s)
        from dapo_megatron.checkpointing import CheckpointError
        from dapo_megatron.data import DatasetError

        return CheckpointError, DatasetError

    try:
        cfg = parse_args(argv)
    except ValueError as err:  # EvalConfig.validate: a flag out of its range
        return report_input_error(PROG, err)
    return run_tool(PROG, lambda _: run(cfg), None, input_errors)


if __name__ == "__main__":  # an entry point keeps the guard (docs/design.md §5.2)
    sys.exit(main())
