"""The async controller's streamed admission (``rollout.streaming`` under ``async_training``) on a
real ``dapo-rollout-server``: GRESO prompt skipping and keep-rate sizing replayed independently,
and their state carried across a checkpoint.

The controller runs alone (no trainer: its thread speaks HTTP and grades; nothing else is
involved), over 6 prompts of a real :class:`~dapo_megatron.data.PromptStream` in batches of 3, so
each prompt comes back every other batch and skipping decides often. The grader is a rule:
a response is correct iff its last token id is a multiple of 3, so the random tiny model gives
kept, all-correct and all-wrong groups. No weight sync happens (the servers hold version 0),
so η = ``STEPS - 1`` admits exactly ``STEPS`` steps and the controller then waits.
"""

import hashlib
import math

import pytest

from dapo_megatron.algorithms.overlong import OverlongConfig
from dapo_megatron.data import PromptStream
from dapo_megatron.data.dataset import PromptRecord
from dapo_megatron.rollout.async_rollout import RolloutController
from dapo_megatron.rollout.engines.engine import SamplingParams
from dapo_megatron.rollout.sampling.buffer import RolloutBuffer
from dapo_megatron.rollout.sampling.config import BufferConfig
from dapo_megatron.rollout.sampling.prompt_skip import PromptSkipConfig, PromptSkipper
from dapo_megatron.rollout.sampling.feeder import PromptQueue
from integration.test_async_rollout import NUM_STOP_IDS
from rollout_server import RolloutServer, tiny_async_model

STEPS, N_PROMPTS, BATCH, N, TRAIN, CAP_BATCHES = 8, 6, 3, 2, 2, 3
SEED, K, P = 5, 1, 0.5
RECORDS = [PromptRecord(index=i, data_source="mod3", prompt_ids=[1, 300 + 7 * i, 900 + i], messages=[],
                        ground_truth="0", extra_info={}) for i in range(N_PROMPTS)]
PARAMS = SamplingParams(n=N, temperature=1.0, max_new_tokens=6, seed=13)


def decode(ids):
    return " ".join(str(t) for t in ids)


def correct(response_ids) -> bool:
    return bool(response_ids) and response_ids[-1] % 3 == 0


class Mod3Grader:
    def grade(self, requests):
        out = []
        for _, text, _, _ in requests:
            ok = correct([int(t) for t in text.split()])
            out.append({"score": 1.0 if ok else -1.0, "acc": ok, "pred": text})
        return out


def _stream():
    return PromptStream(RECORDS, BATCH, 0, 1, seed=3, shuffle=True)


def _controller(url, log):
    """A streamed-admission controller over a fresh stream; every request it sends is appended to
    ``log`` as ``[(prompt index, position, response token lists), ...]``."""
    cfg = BufferConfig(train_batch_size=TRAIN, n=N, gen_batch_size=BATCH, max_num_gen_batches=CAP_BATCHES,
                       overlong=OverlongConfig(enable=False), on_cap="train_on_kept", max_staleness=STEPS - 1)
    cfg.validate()
    stream = _stream()
    skip = PromptSkipConfig(enable=True, zero_variance_visits=K, skip_probability=P)
    skip.validate()
    ctrl = RolloutController(RolloutBuffer(cfg, Mod3Grader(), decode), stream.next_batch, [url], PARAMS,
                             silence_timeout_s=60, version=0, policy_version=0,
                             prompts=PromptQueue(stream.next_batch, BATCH, RECORDS.__getitem__),
                             skipper=PromptSkipper(skip, seed=SEED))
    real = ctrl._generate_batch

    def generate_batch(records, positions, version):
        out = real(records, positions, version)
        log.append([(rec.index, pos, [list(s.response_ids) for s in g.samples])
                    for rec, pos, g in zip(records, positions, out[0])])
        return out

    ctrl._generate_batch = generate_batch
    return ctrl, stream


def _uniform(idx, enc):  # GRESO's draw, computed here from its definition (prompt_skip.py)
    d = hashlib.blake2b(f"skip:{SEED}:{idx}:{enc}".encode(), digest_size=8).digest()
    return (int.from_bytes(d, "little") >> 11) / 2.0 ** 53


def _replay(log):
    """The requests streamed admission must send, step by step, given the responses the servers
    returned (the log's): the stream order, the skips, the keep-rate sizes, the step boundaries
    and each step's metrics, from the rules alone."""
    order = []  # the stream's order, epoch after epoch
    st = _stream()
    for _ in range(40):
        order += [rec.index for rec in st.next_batch()]
    kept_c = graded_c = 0.0
    streak, enc = {}, {}
    pos, req, surplus = 0, 0, 0
    steps = []
    for _ in range(STEPS):
        kept_c, graded_c = kept_c / 2, graded_c / 2
        fetched = -(-pos // BATCH)  # the queue draws a batch from the stream when it has no prompt left
        kept, submitted, skipped, sizes = surplus, 0, 0, []
        while kept < TRAIN and submitted < CAP_BATCHES * BATCH:
            rate = (kept_c + 1) / (graded_c + 1)
            want = min(math.ceil((TRAIN - kept) / rate), BATCH, CAP_BATCHES * BATCH - submitted)
            expect = []
            while len(expect) < want:
                idx = order[pos]
                e = enc.get(idx, 0)
                enc[idx] = e + 1
                if streak.get(idx, 0) >= K and _uniform(idx, e) < P:
                    skipped += 1
                else:
                    expect.append((idx, pos))
                pos += 1
            assert [(i, p) for i, p, _ in log[req]] == expect, f"request {req}"
            for idx, _, responses in log[req]:
                accs = [correct(r) for r in responses]
                zero = all(accs) or not any(accs)
                streak[idx] = min(streak.get(idx, 0) + 1, K) if zero else 0
                graded_c += 1
                kept_c += not zero
                kept += not zero
            submitted += len(expect)
            sizes.append(want)
            req += 1
        surplus = max(0, kept - TRAIN)
        steps.append({"sizes": sizes, "submitted": submitted, "skipped": skipped,
                      "keep_rate": (kept_c + 1) / (graded_c + 1), "kept": min(kept, TRAIN),
                      "batches": -(-pos // BATCH) - fetched})
    return steps, req


@pytest.fixture(scope="module")
def server(smollm2_gguf, tmp_path_factory):
    root = tmp_path_factory.mktemp("async_skip")
    srv = RolloutServer(tiny_async_model(smollm2_gguf, root / "tiny_hf", NUM_STOP_IDS), root / "server.log")
    yield srv
    srv.stop()


def _take_all(ctrl, first=0, last=STEPS):
    return [ctrl.take(v, timeout_s=120) for v in range(first, last)]


@pytest.fixture(scope="module")
def full(server):
    log = []
    ctrl, _ = _controller(server.url, log)
    ctrl.start()
    try:
        steps = _take_all(ctrl)
    finally:
        ctrl.stop()
    return log, steps


def test_streamed_admission_skips_and_sizes_requests_as_greso(full):
    log, steps = full
    expected, num_requests = _replay(log)
    assert num_requests == len(log)  # no request beyond the STEPS admitted steps
    for v, ((groups, metrics), e) in enumerate(zip(steps, expected)):
        assert metrics["rollout/prompts_submitted"] == e["submitted"], v
        assert metrics["rollout/skipped_prompts"] == e["skipped"], v
        assert metrics["rollout/keep_rate"] == pytest.approx(e["keep_rate"], rel=1e-12), v
        assert len(groups) == e["kept"], v
        # a step's batches: the generation batches drawn from the stream for its prompts (skipped ones too)
        assert metrics["rollout/num_gen_batches"] == e["batches"], v
    # the scenario exercises what it tests: skips happen, a request is smaller than a batch,
    # and a candidate is explored again (a prompt with a zero-variance streak drawn later)
    assert sum(e["skipped"] for e in expected) >= 2
    assert any(s < BATCH for e in expected for s in e["sizes"])
    # the trained groups are the kept ones, in submission order, none twice
    positions = [g.prompt_seed for groups, _ in steps for g in groups]
    assert len(positions) == len(set(positions))
    kept_positions = [p for req in log for _, p, rs in req
                      if len({correct(r) for r in rs}) > 1]
    assert positions == kept_positions[:len(positions)]


def test_streamed_admission_state_survives_a_checkpoint(server, full):
    """Paused after its 5th request (mid-step), its state saved, the controller stopped; a new one
    restores the state (and the stream's) and goes on: the same requests and the same trained
    groups as the uninterrupted run, no prompt lost or trained twice."""
    import threading

    full_log, full_steps = full
    log = []
    ctrl, stream = _controller(server.url, log)
    fifth = threading.Event()
    real = ctrl._generate_batch

    def generate_batch(records, positions, version):
        out = real(records, positions, version)
        if len(log) == 5:  # no 6th request: paused from the controller's thread, before it is done
            ctrl.pause(wait=False)
            fifth.set()
        return out

    ctrl._generate_batch = generate_batch
    ctrl.start()
    try:
        assert fifth.wait(120)
        ctrl.pause()  # waits for the 5th request's grading and offer
        state, stream_state = ctrl.state_dict(), stream.state_dict()
    finally:
        ctrl.stop()
    assert len(log) == 5 and state["fill"]["submitted"] > 0  # mid-step: prompts of the open step are in it
    adm = state["admission"]
    assert adm["skipper"]["encounters"] and adm["keep_rate"]["graded"] > 0
    log2 = []
    resumed, stream2 = _controller(server.url, log2)
    stream2.load_state_dict(stream_state)
    resumed.load_state_dict(state)
    resumed.start()
    try:
        steps = _take_all(resumed)
    finally:
        resumed.stop()
    assert [[(i, p) for i, p, _ in r] for r in log + log2] == [[(i, p) for i, p, _ in r] for r in full_log]
    got = [[(g.prompt_seed, [s.response_ids for s in g.samples]) for g in gs] for gs, _ in steps]
    want = [[(g.prompt_seed, [s.response_ids for s in g.samples]) for g in gs] for gs, _ in full_steps]
    assert got == want
    for (_, m), (_, fm) in zip(steps, full_steps):
        for key in ("rollout/prompts_submitted", "rollout/skipped_prompts", "rollout/keep_rate",
                    "rollout/num_gen_batches"):
            assert m[key] == fm[key], key


def test_a_batch_admission_checkpoint_is_refused_by_a_streamed_controller(server):
    ctrl, _ = _controller(server.url, [])
    batch_state = {"gen_batches_done": 0, "ready": [], "fill": {}}
    with pytest.raises(ValueError, match=r"^the checkpoint was written with rollout.streaming=false .* resume it "
                                         r"with rollout.streaming=false$"):
        ctrl.load_state_dict(batch_state)
    ctrl.stop()
