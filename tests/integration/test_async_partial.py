"""async_training's interruptible weight sync (``rollout.partial_rollout``, its default there) on a
real dapo-rollout-server: the sync's ``/pause_generation`` aborts the rows of a ``/generate`` in
flight, they continue after it from their prefix, and each token carries the version that
sampled it.

η = 1, a sync every step: the controller generates the step of policy version ``p + 1`` with
the weights of version ``p`` while the trainer trains step ``p + 1``, and the harness holds each generation
batch after the first until a sync starts, and the sync 0.15 s longer, so it lands on that
``/generate``. The tiny
random model does not stop by itself (one EOS id), so rows run (almost always) 384 tokens: long enough to be
decoding when the pause arrives. The learning rate is 1e-30: the weights do not change (below
float32's resolution), so a continued row must draw exactly the tokens an uninterrupted
``/generate`` with its seed draws (the server seeds each draw by the row's seed and absolute
position), while its versions still advance with every sync. ``buffer.filter_groups=false``:
every group is trained.
"""

import threading
import time

import pytest
import torch

from dapo_megatron.platform import spawn
from integration.test_async_rollout import CONFIG
from rollout_server import RolloutServer, tiny_async_model

STEPS, LENGTH = 3, 384
PARTIAL_CONFIG = [
    f"trainer.total_training_steps={STEPS}", "buffer.max_staleness=1", "async_training.enable=true",
    "rollout.partial_rollout=true", "buffer.filter_groups=false", "buffer.gen_batch_size=2",
    "buffer.max_num_gen_batches=1", "actor.optim.lr=1e-30", "actor.ppo_max_token_len_per_gpu=4096",
    f"rollout.response_length={LENGTH}", f"buffer.overlong.max_response_length={LENGTH}",
    "buffer.overlong.overlong_buffer_len=64",
]


def _worker(hf_dir, url, run_dir, out_path):
    import dataclasses

    from dapo_megatron.config import DAPOConfig, load_config
    from dapo_megatron.platform import init_distributed
    from dapo_megatron.rollout.engines.engine import sample_seed
    from dapo_megatron.platform.http import http_post
    from dapo_megatron.rollout.engines.sglang_io import build_sampling_params
    from dapo_megatron.trainer import DAPOTrainer

    cfg = load_config(DAPOConfig, None, CONFIG + PARTIAL_CONFIG + [
        f"model.hf_path={hf_dir}", f"trainer.default_local_dir={run_dir}", f"rollout.server_urls=[{url}]"])
    trainer = DAPOTrainer(cfg, init_distributed(cfg.parallel, seed=cfg.trainer.seed))
    rollout, ctrl, collected = trainer.rollout, trainer.rollout.controller, {}
    go, real_generate, real_sync, real_collect = threading.Event(), ctrl._generate, rollout.sync_weights, \
        rollout.collect
    state = {"calls": 0, "aborted": False}

    def generate(rows, version):
        # a generation batch after the first waits for the next sync to start, so the sync lands on it;
        # the continuation of aborted rows (right after a sync) does not wait
        if state["calls"] and not state["aborted"]:
            assert go.wait(120), "no weight sync came"
            go.clear()
        state["calls"] += 1
        res = real_generate(rows, version)
        state["aborted"] = any(r[2] == "abort" for r in res)
        return res

    def sync_weights(actor, version):
        if rollout.background.started:
            go.set()
            time.sleep(0.15)  # the /generate reaches the server and decodes
        return real_sync(actor, version)

    def collect(step):
        batch = real_collect(step)
        collected["groups"] = batch.groups
        return batch

    ctrl._generate, rollout.sync_weights, rollout.collect = generate, sync_weights, collect
    steps = {}
    try:
        while trainer.step < STEPS:
            p = trainer.step
            metrics = trainer.train_step()
            steps[trainer.step] = {"policy_version": p, "metrics": metrics, "samples": [
                (g.prompt_seed, j, list(s.prompt_ids), s.response_ids, s.rollout_logprobs, s.versions,
                 s.token_versions()) for g in collected["groups"] for j, s in enumerate(g.samples)]}
    finally:
        rollout.close()
    # the uninterrupted row of every trained sample: its prompt, its seed, the whole budget
    params = rollout.train_params()
    for st in steps.values():
        st["uninterrupted"] = [
            http_post(url, "/generate", {"input_ids": prompt, "return_logprob": True, "sampling_params":
                                         build_sampling_params(dataclasses.replace(params, n=1),
                                                               sample_seed(params.seed, seed, j))}, 120)
            for seed, j, prompt, *_ in st["samples"]]
    torch.save(steps, out_path)


@pytest.fixture(scope="module")
def steps(smollm2_gguf, tmp_path_factory):
    root = tmp_path_factory.mktemp("async_partial")
    hf_dir = tiny_async_model(smollm2_gguf, root / "tiny_hf")
    server = RolloutServer(hf_dir, root / "server.log")
    try:
        spawn(_worker, 1, hf_dir, server.url, str(root / "run"), str(root / "steps.pt"))
    finally:
        server.stop()
    return torch.load(root / "steps.pt", weights_only=False)


def test_each_sync_lands_on_a_generate_in_flight_and_its_rows_continue(steps):
    assert sorted(steps) == [1, 2, 3]
    for k in (2, 3):  # generated ahead with the weights of version k - 2, interrupted by the sync of k - 1
        m = steps[k]["metrics"]
        assert m["rollout/resubmitted_rows"] > 0 and m["async/partial_ratio"] > 0, (k, m["rollout/resubmitted_rows"])
        assert m["async/max_partial_span"] == 1 and m["train/staleness_max"] == 1


def test_versions_per_token_are_exact_and_continued_rows_draw_the_uninterrupted_tokens(steps):
    interrupted = 0
    for k, st in steps.items():
        p = st["policy_version"]
        for (seed, j, prompt, ids, lps, versions, per_token), full in zip(st["samples"], st["uninterrupted"]):
            assert len(per_token) == len(ids) <= LENGTH
            starts = [a for a, _ in versions]
            assert starts[0] == 0 and starts == sorted(set(starts)), versions  # spans ascend
            assert all(v <= p for v in per_token) and all(b >= a for a, b in zip(per_token, per_token[1:]))
            if len(versions) > 1:  # cut by the sync of version p: the old weights' tokens, then p's
                interrupted += 1
                (_, old), (cut, new) = versions
                assert (old, new) == (p - 1, p) and 0 < cut < len(ids), (k, versions)
                assert per_token == [p - 1] * cut + [p] * (len(ids) - cut)
            assert ids == full["output_ids"], (k, seed, j, versions)
            assert lps == pytest.approx([e[0] for e in full["meta_info"]["output_token_logprobs"]], abs=1e-5)
    assert interrupted >= 2
