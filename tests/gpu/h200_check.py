"""GPU checks that fit one bare H200 machine (torch + CUDA, transformers, safetensors, pytest;
megatron-core and small wheels carried in ``.whl/``; no Transformer Engine, SGLang, DALI or
network). Run it with ``bash tests/gpu/h200_check.sh``; ``--cpu`` runs the same checks on
CPU / gloo (a dry run of everything but the CUDA specifics, part of the CPU suite through
``tests/integration/test_gpu_scripts.py``).

First, ``cuda_ipc``: a spawned child opens a CUDA tensor of this process (CUDA IPC, what SGLang's
weight updates and the torchrun check below rely on) and adds 1 to it in place, under a time limit
(``H200_IPC_TIMEOUT_S``, 60 s): a sandboxed runtime may refuse CUDA IPC or hang in it. Where it
fails or times out, the line says so (``SKIP cuda_ipc: ...``), the checks that need CUDA IPC are
reported as ``SKIP`` and the rest run. ``--cpu`` shares a CPU tensor the same way.

World of one process on CUDA with NCCL, tiny random Llama (tied embeddings) and Qwen2
(q/k/v biases, untied) models, megatron-core's local layer spec. Per family:

* ``logprobs_fp32``: ``MegatronActor.compute_logprobs`` against a teacher-forced
  transformers forward of the same weights, max |Δ| ≤ 1e-4;
* ``logprobs_bf16``: the bf16 actor against the fp32 oracle, max |Δ| ≤ 0.1 and mean
  |Δ| ≤ 0.02;
* ``train_step``: one ``train_mini_batch`` with the distributed optimizer: applied (not
  skipped), finite loss and grad norm, every parameter moved;
* ``sync_parity``: ``iter_hf_weights`` into an ``HFEngine`` on the same GPU after the
  step: the engine's tensors equal the actor's HF export bitwise, and the logprobs of its
  sampled responses equal the actor's recomputation (max |Δ| ≤ 1e-4, fp32);

and once for all of them:

* ``collectives``: every tensor handed to a collective by the steps above is on
  ``collective_device(group)`` (real devices under NCCL; ``tests/collective_spy.py``);
* ``device_index``: ``local_device_index()`` is ``LOCAL_RANK % device_count()``;
* ``sglang_torchrun`` (issue 18 items 1, 3, 7): two torchrun workers each build a colocated
  ``SGLangEngine`` through the factory, with the fake ``sglang`` of ``tests/fake_sglang`` (no
  SGLang here; its scheduler children do SGLang's tcp:// ``init_process_group``): each starts
  within a minute under torchrun, a weight sync in 64 KiB buckets on this GPU (fresh CUDA-IPC
  payloads read by the scheduler process) reads back every bucket right after it loads and at
  the end, and the engine's shutdown leaves the reward graders alive;
* ``fp8_sp_shapes`` (issue 18 item 2): the actor's micro-batches at TP 1/2/4/8, sequence
  parallel on / off, THD / BSHD, every FP8 recipe and odd lengths pass Transformer Engine
  shape checks on the local shard, as ``tests/unit/actor/test_packing.py`` encodes them (TE is
  not on this machine: the step itself is ``tests/gpu/full_image_check.sh``'s ``fp8_sp_tp2_step``).

Prints one line per check (``PASS`` / ``FAIL`` / ``SKIP name: detail``) and ``N passed, N failed``
(``, N skipped`` when a check was skipped); the exit status is 1 when a check failed. ``--only NAME`` (repeatable) runs a subset.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: conftest (tiny configs), collective_spy, unit.actor.test_packing
sys.path.insert(1, HERE)  # full_image_check's torchrun engine check

import torch  # noqa: E402

FAMILIES = ("llama_tied", "qwen2_bias")
TEMPERATURE = 0.8


class Checks:
    """Runs named checks, one line each; a failure never stops the next check."""

    def __init__(self, only=()):
        self.only, self.passed, self.failed, self.skipped = set(only), 0, 0, 0

    def selected(self, name):
        return not self.only or any(name.startswith(o) for o in self.only)

    def skip(self, name, reason):
        if self.selected(name):
            self.skipped += 1
            print(f"SKIP {name}: {reason}", flush=True)

    def summary(self):
        return f"{self.passed} passed, {self.failed} failed" + (f", {self.skipped} skipped" if self.skipped else "")

    def run(self, name, fn, *args):
        if not self.selected(name):
            return None
        t0 = time.perf_counter()
        try:
            detail = fn(*args)
        except Exception as err:  # one line, then the traceback for the log
            self.failed += 1
            print(f"FAIL {name}: {type(err).__name__}: {err} ({time.perf_counter() - t0:.1f} s)", flush=True)
            traceback.print_exc(file=sys.stderr)
            return None
        self.passed += 1
        shown = detail if isinstance(detail, str) else f"{type(detail).__name__} built"
        print(f"PASS {name}: {shown} ({time.perf_counter() - t0:.1f} s)", flush=True)
        return detail


IPC_CHECKS = ("sglang_torchrun",)  # the checks whose processes open CUDA tensors of another process


def _ipc_child(shared, answer):
    """In the spawned child: add 1 in place to the parent's tensor, answer its new sum (or the error)."""
    try:
        shared.add_(1)
        if shared.is_cuda:
            torch.cuda.synchronize()
        answer.put(("ok", float(shared.sum())))
    except Exception as err:  # the parent reports it; it must not wait for an answer that never comes
        answer.put(("error", f"{type(err).__name__}: {err}"))


def ipc_probe(cpu: bool) -> int:
    """``--ipc-probe``: share a tensor with a spawned child (CUDA IPC on a GPU, shared memory with
    ``--cpu``); the child's in-place add must show in this process (shared, not copied). Runs in a
    process of its own so that the caller can bound it in time (``check_cuda_ipc``)."""
    import torch.multiprocessing as mp

    n = 4096
    shared = torch.arange(n, dtype=torch.float32, device="cpu" if cpu else "cuda")
    if cpu:
        shared.share_memory_()
    ctx = mp.get_context("spawn")
    answer = ctx.SimpleQueue()
    child = ctx.Process(target=_ipc_child, args=(shared, answer))
    child.start()
    status, value = answer.get()
    child.join()
    if status != "ok":
        print(f"the child could not use the shared tensor: {value}")
        return 1
    want = float(n * (n - 1) / 2 + n)
    seen = float(shared.sum())  # CUDA IPC memory is the parent's: the child's add is visible here
    if value != want or seen != want or child.exitcode != 0:
        print(f"child saw sum {value}, this process {seen}, want {want} (exit {child.exitcode})")
        return 1
    print(f"a spawned child added 1 in place to a {shared.device.type} tensor of this process "
          f"({n} floats) and the change is visible here")
    return 0


def check_cuda_ipc(cpu: bool, timeout_s: float):
    """Run ``--ipc-probe`` in its own process group, killed after ``timeout_s``. Returns (ok, detail)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--ipc-probe"] + (["--cpu"] if cpu else [])
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the probe and its spawned child
        proc.communicate()
        return False, (f"timed out after {timeout_s:g} s (this machine's runtime may not allow CUDA IPC); "
                       f"the checks that need it are skipped")
    lines = [ln for ln in out.splitlines() if ln.strip()]
    last = lines[-1] if lines else "(no output)"
    if proc.returncode != 0:
        return False, f"exit {proc.returncode}: {last[:300]}; the checks that need CUDA IPC are skipped"
    return True, f"{last} (probe {time.perf_counter() - t0:.1f} s)"


def _samples(vocab, n, seed):
    from unit.actor.test_packing import random_samples

    return random_samples(n, vocab, seed=seed, max_prompt=12, max_resp=10, min_resp=2)


def _oracle_logprobs(hf_model, samples, device):
    """Teacher-forced transformers forward, one sequence at a time, fp32 log-softmax at T."""
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids], device=device)
            logits = hf_model(input_ids=ids).logits[0].float() / TEMPERATURE
            P = len(s.prompt_ids)
            lp = torch.log_softmax(logits[P - 1:P - 1 + len(s.response_ids)], -1)
            out.append(lp.gather(-1, torch.tensor(s.response_ids, device=device)[:, None])[:, 0].cpu())
    return out


class Family:
    """One tiny model: its HF oracle on the device and the Megatron actors built from it."""

    def __init__(self, name, device, parallel):
        from conftest import random_hf_model, tiny_hf_config

        self.name, self.device, self.parallel = name, device, parallel
        self.hf_config = tiny_hf_config(name)
        self.hf = random_hf_model(self.hf_config, seed=3).to(device)
        self.state = {k: v.detach().cpu() for k, v in self.hf.state_dict().items()}
        self.samples = _samples(self.hf_config.vocab_size, 6, seed=11)
        self.oracle = _oracle_logprobs(self.hf, self.samples, device)

    def actor(self, params_dtype):
        from dapo_megatron.actor.actor import ActorConfig, MegatronActor, OptimConfig
        from dapo_megatron.bridge import load_hf_weights
        from dapo_megatron.models import ModelConfig, build_gpt_model

        # on CUDA megatron-core allocates the parameters on torch.cuda.current_device()
        model = build_gpt_model(self.hf_config, ModelConfig(transformer_impl="local", params_dtype=params_dtype),
                                parallel=self.parallel)
        load_hf_weights(model, self.state, strict=True, parallel=self.parallel)
        cfg = ActorConfig(ppo_max_token_len_per_gpu=256, optim=OptimConfig(lr=1e-3, weight_decay=0.0))
        return MegatronActor(model, cfg, total_steps=4, parallel=self.parallel, vocab_size=self.hf_config.vocab_size)


def check_logprobs(fam: Family, actor, dtype_name, max_bound, mean_bound=None):
    lps = actor.compute_logprobs([fam.samples[:3], fam.samples[3:]], TEMPERATURE)
    diff = torch.cat([(a - b).abs() for a, b in zip(lps, fam.oracle)])
    mx, mean = float(diff.max()), float(diff.mean())
    assert mx <= max_bound, f"{dtype_name} actor vs transformers: max |d| {mx:.3g} > {max_bound}"
    if mean_bound is not None:
        assert mean <= mean_bound, f"{dtype_name} actor vs transformers: mean |d| {mean:.3g} > {mean_bound}"
    return f"max |d| {mx:.2e}, mean {mean:.2e} over {diff.numel()} tokens"


def check_train_step(fam: Family, actor):
    before = {n: p.detach().clone() for n, p in actor.model_chunks[0].module.named_parameters()}
    lps = actor.compute_logprobs([fam.samples], TEMPERATURE)
    g = torch.Generator().manual_seed(5)
    for s, lp in zip(fam.samples, lps):
        s.old_logprobs = (lp + 0.05 * torch.randn(lp.shape, generator=g)).tolist()
        s.advantage = float(torch.randn((), generator=g))
    n_tok = sum(len(s.response_ids) for s in fam.samples)
    out = actor.train_mini_batch([fam.samples[:3], fam.samples[3:]], TEMPERATURE, global_num_tokens=n_tok).metrics
    assert out["skipped"] == 0.0, f"the step was skipped: {out}"
    assert math.isfinite(out["loss"]) and math.isfinite(out["grad_norm"]) and out["grad_norm"] > 0, out
    assert out["num_tokens"] == n_tok, out
    still = [n for n, p in actor.model_chunks[0].module.named_parameters() if torch.equal(p, before[n])]
    assert not still, f"parameters the optimizer step did not move: {still[:5]}"
    return f"loss {out['loss']:.4f}, grad norm {out['grad_norm']:.4f}, {len(before)} tensors updated"


def check_sync_parity(fam: Family, actor):
    from transformers import AutoModelForCausalLM

    from dapo_megatron.bridge import export_hf_state_dict, iter_hf_weights
    from dapo_megatron.platform import device
    from dapo_megatron.rollout.engines.engine import SamplingParams
    from dapo_megatron.rollout.engines.hf_engine import HFEngine
    from dapo_megatron.rollout.types import Sample

    # an engine with its own random weights, replaced by the sync
    engine = HFEngine(AutoModelForCausalLM.from_config(fam.hf_config), dtype=torch.float32, device=device(),
                      eos_token_ids=[2])
    engine.update_weights(iter_hf_weights(actor.model_chunks, parallel=actor.parallel, bucket_bytes=2**20), version=1)
    want = export_hf_state_dict(actor.model_chunks, parallel=actor.parallel)
    have = dict(engine.model.named_parameters())
    off = [n for n, t in want.items() if n in have and not torch.equal(have[n].detach().cpu(), t)]
    assert not off and engine.weights_valid and engine.weight_version == 1, f"tensors differ after sync: {off[:5]}"
    prompts = [s.prompt_ids for s in fam.samples[:3]]
    out = engine.generate(prompts, SamplingParams(n=2, temperature=TEMPERATURE, max_new_tokens=8, seed=0))
    samples = [Sample(prompt_ids=list(p), response_ids=list(c.response_ids), rollout_logprobs=list(c.logprobs),
                      finish_reason=c.finish_reason) for p, group in zip(prompts, out) for c in group]
    lps = actor.compute_logprobs([samples], TEMPERATURE)
    diff = torch.cat([(lp - torch.tensor(s.rollout_logprobs)).abs() for lp, s in zip(lps, samples)])
    assert float(diff.max()) <= 1e-4, f"rollout vs actor logprobs after the sync: max |d| {float(diff.max()):.3g}"
    return (f"{len(want)} tensors equal; rollout vs actor max |d| {float(diff.max()):.2e} over "
            f"{diff.numel()} sampled tokens")


def check_collectives(spy):
    calls = spy.tensor_calls()
    bad = spy.mismatches()
    assert calls, "no tensor collective was recorded"
    assert not bad, "tensors off their group's device:\n" + spy.report(bad)
    backends = sorted({c.backend for c in calls})
    return f"{len(calls)} tensor collectives, backends {backends}, all on {calls[0].expected}"


def check_device_index():
    from dapo_megatron.platform import local_device_index

    count = torch.cuda.device_count()
    if count == 0:
        return "no CUDA device (dry run): skipped"
    saved = os.environ.get("LOCAL_RANK")
    try:
        for r in (0, count, 2 * count + 1):
            os.environ["LOCAL_RANK"] = str(r)
            assert local_device_index() == r % count
    finally:
        os.environ["LOCAL_RANK"] = saved or "0"
    return f"LOCAL_RANK % {count} GPU(s)"


def check_sglang_torchrun():
    import tempfile

    from full_image_check import run_engine_under_torchrun

    with tempfile.TemporaryDirectory(prefix="h200_torchrun_") as work:
        return run_engine_under_torchrun(work, real_sglang=False, timeout_s=150, max_start_s=60)


def check_fp8_sp_shapes():
    from unit.actor.test_packing import test_fp8_gemm_inputs_fit_transformer_engine_at_every_tp_and_layout as check

    recipes = ("delayed", "tensorwise", "mxfp8", "blockwise")
    for recipe in recipes:
        check(recipe)
    return f"TP 1/2/4/8 x SP x thd/bshd x {len(recipes)} recipes: every GEMM input passes TE's FP8 checks"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="dry run on CPU / gloo (no CUDA specifics)")
    p.add_argument("--only", action="append", default=[], help="run the checks whose name starts with this")
    p.add_argument("--ipc-probe", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.ipc_probe:
        if args.cpu:
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        return ipc_probe(args.cpu)
    if not args.cpu and not torch.cuda.is_available():
        print("FAIL setup: no CUDA device visible (use --cpu for a dry run)")
        print("0 passed, 1 failed")
        return 1
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # nothing below may touch a GPU
        assert not torch.cuda.is_available()
    t0 = time.perf_counter()
    import torch.distributed as dist

    import dapo_megatron.platform.distributed as pdist
    from collective_spy import CollectiveSpy
    from dapo_megatron.platform import init_distributed

    checks = Checks(args.only)
    ipc_ok = True
    if any(checks.selected(n) for n in ("cuda_ipc",) + IPC_CHECKS):  # first: the later checks depend on it
        timeout_s = float(os.environ.get("H200_IPC_TIMEOUT_S", "60"))
        ipc_ok, detail = check_cuda_ipc(args.cpu, timeout_s)
        if ipc_ok:
            checks.run("cuda_ipc", lambda: detail)
        else:
            checks.skip("cuda_ipc", detail)
    parallel = init_distributed(seed=0)
    dev = pdist.device()
    print(f"# torch {torch.__version__}, device {dev}"
          + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else "")
          + f", backend {dist.get_backend()}", flush=True)
    spy = CollectiveSpy(device_of=lambda t: t.device, expected_device=pdist.collective_device,
                        backend_of=pdist.group_backend)
    with spy:
        for name in FAMILIES:
            fam = checks.run(f"setup_{name}", lambda n=name: Family(n, dev, parallel))
            if fam is None:
                continue
            actor32 = checks.run(f"actor_fp32_{name}", lambda: fam.actor("float32"))
            if actor32 is not None:
                checks.run(f"logprobs_fp32_{name}", check_logprobs, fam, actor32, "fp32", 1e-4)
                if checks.run(f"train_step_{name}", check_train_step, fam, actor32) is not None:
                    checks.run(f"sync_parity_{name}", check_sync_parity, fam, actor32)
            actor16 = checks.run(f"actor_bf16_{name}", lambda: fam.actor("bfloat16"))
            if actor16 is not None:
                checks.run(f"logprobs_bf16_{name}", check_logprobs, fam, actor16, "bf16", 0.1, 0.02)
    checks.run("collectives", check_collectives, spy)
    checks.run("device_index", check_device_index)
    if ipc_ok:
        checks.run("sglang_torchrun", check_sglang_torchrun)
    else:
        checks.skip("sglang_torchrun", "needs CUDA IPC, which cuda_ipc found unavailable on this machine")
    checks.run("fp8_sp_shapes", check_fp8_sp_shapes)
    print(f"# {time.perf_counter() - t0:.0f} s", flush=True)
    print(checks.summary(), flush=True)
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
