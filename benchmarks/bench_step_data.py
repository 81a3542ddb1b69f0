"""The step's data path alone, before and after ``rollout.plan.step_data``: bytes moved and seconds per step.

    OMP_NUM_THREADS=1 python benchmarks/bench_step_data.py [--prompts 512 --n 16 --min-response 2048
        --max-response 20480 --dp 4 --mini-batch 32 --repeats 2 --token-scale 1.0]

DP ranks on gloo (CPU processes, TP = PP = 1), one generation batch of ``--prompts`` prompts
× ``--n`` responses, all groups kept, one PPO epoch of mini-batches of ``--mini-batch``
groups. Response lengths are uniform in ``[min, max] × --token-scale`` tokens (seeded),
prompts 64-512 tokens. Both paths get the same batch, generated where it is generated
in a run: DP rank ``d`` holds the responses of prompts ``[d P / DP, (d + 1) P / DP)``.

before: the path of the trainer before ``rollout.plan.step_data`` (``dapo_megatron/trainer.py``
at commit a92c2b1: ``_generate_groups``, ``DistributedGrader``, ``_old_logprobs``,
``train_step``), rebuilt here: ``all_gather_object`` of every rank's completions (token ids
and logprobs as Python lists), grades of requests ``r::world`` all-gathered as dicts, a DP
split of all samples for the old logprobs, their all-gather over DP as Python lists, then a
second DP split per mini-batch.

after: the trainer's path through the public API: :meth:`~dapo_megatron.rollout.rollout.Rollout.collect`
of a :class:`~dapo_megatron.rollout.rollout.Rollout` (the trainer's, built from its parts, on a
scripted engine per rank: the prompt stream, each prompt on engine ``position % DP``,
:func:`~dapo_megatron.rollout.plan.step_data.gather_groups` (int64 records), the trainer's
selector :class:`~dapo_megatron.rollout.sampling.buffer.RolloutBuffer` grading through
:class:`~dapo_megatron.rewards.distributed.DistributedGrader` (3 float64 per response
all-reduced), every group kept), then :func:`~dapo_megatron.actor.step_plan.route_step`
(the plan once, each response sent once to the rank that trains it), the old-logprob pass's
micro-batches (:func:`~dapo_megatron.actor.step_plan.old_logprob_micro_batches`), old
logprobs kept where computed, mismatch metrics pooled over DP.

streamed (``rollout.streaming``): one streamed step through the public
:class:`~dapo_megatron.rollout.sampling.streaming.StreamingCollector` over the trainer's
selector (:class:`~dapo_megatron.rollout.sampling.buffer.RolloutBuffer`; N = half the prompts,
``--poll-tokens`` per round, the rest aborted and carried), on a scripted engine per rank that
returns the same seeded completions row by row, then :func:`~dapo_megatron.actor.step_plan.route_step`
and the old logprobs as above. before: the client the trainer used before issue 20 (``_RankRows``), which
all-gathers every finished row's tokens and logprobs to every rank each round; after:
:class:`~dapo_megatron.rollout.sampling.streaming.EngineClient` (records replicated, tokens
sent once by :func:`~dapo_megatron.rollout.plan.step_data.send_tokens`).

Not timed, the same in both: generating the responses (made before the timed runs; the scripted
engines return them), decoding and grading them (a grade computed from the response's last
token stands in for the graders) and the actor's forward pass (the old logprobs are the rollout
logprobs, a float32 tensor per sample, as ``compute_logprobs`` returns them).

Bytes moved: the bytes every rank receives, summed over ranks, per collective as torch
runs it: ``all_gather_object`` pads every rank's pickle to the largest and all-gathers
those (``torch/distributed/distributed_c10d.py``), ``all_gather`` / ``all_to_all_single``
their tensors, ``all_reduce`` ``2 (w - 1) / w`` of its tensor per rank (the ring
algorithm). Counted in a separate, untimed pass. Seconds: the slowest rank's wall time
from a barrier to the end of the path, best of ``--repeats``.

Last line: before / after of the seconds per step, batch and streamed.
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dapo_megatron.platform.console import quiet_third_party  # noqa: E402

quiet_third_party()  # in every spawned rank too: before megatron-core's import-time warnings

VOCAB = 151_936  # Qwen2.5's vocabulary, the paper's model family


# --------------------------------------------------------------------------- the batch
def _records(args):
    from dapo_megatron.data.dataset import PromptRecord

    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(64, 513, (args.prompts,), generator=g).tolist()
    return [PromptRecord(index=k, data_source="math_dapo",
                         prompt_ids=torch.randint(0, VOCAB, (n,), generator=g).tolist(), messages=[],
                         ground_truth=str(k), extra_info={"index": k}) for k, n in enumerate(lengths)]


def _completions(args, k):
    """The ``n`` completions of prompt ``k`` (seeded by ``k``: the same wherever generated)."""
    from dapo_megatron.rollout.engines.engine import Completion

    g = torch.Generator().manual_seed(args.seed * 100_003 + k)
    lo, hi = int(args.min_response * args.token_scale), int(args.max_response * args.token_scale)
    out = []
    for length in torch.randint(lo, hi + 1, (args.n,), generator=g).tolist():
        ids = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        lps = (-torch.rand(length, generator=g, dtype=torch.float32)).tolist()
        out.append(Completion(ids, lps, "length" if length == hi else "stop"))
    return out


def _grade(request_text_or_ids) -> dict:
    """The stand-in grader: +1 when the response's last token is even (half the responses)."""
    return {"score": 1.0 if request_text_or_ids[-1] % 2 == 0 else -1.0, "acc": request_text_or_ids[-1] % 2 == 0,
            "pred": str(request_text_or_ids[-1])}


class _Pool:
    """A RewardPoolLike over :func:`_grade` (the requests carry the token ids instead of the text)."""

    def grade(self, requests):
        return [_grade(r[1]) for r in requests]


# --------------------------------------------------------------------------- byte counting
class ByteCounter:
    """Wraps the collectives the two paths call and adds up the bytes this rank receives."""

    NAMES = ("all_gather_object", "all_gather", "all_reduce", "all_to_all_single")

    def __init__(self):
        self.bytes = 0
        self.real = {}

    def __enter__(self):
        for name in self.NAMES:
            self.real[name] = getattr(dist, name)
            setattr(dist, name, getattr(self, "_" + name))
        return self

    def __exit__(self, *exc):
        for name, fn in self.real.items():
            setattr(dist, name, fn)

    def _all_gather_object(self, out, obj, group=None):
        w = dist.get_world_size(group)
        sizes = [None] * w
        self.real["all_gather_object"](sizes, len(pickle.dumps(obj)), group=group)
        self.bytes += (w - 1) * (max(sizes) + 8)  # padded pickles + their int64 sizes
        return self.real["all_gather_object"](out, obj, group=group)

    def _all_gather(self, out, t, group=None, async_op=False):
        self.bytes += (dist.get_world_size(group) - 1) * t.numel() * t.element_size()
        return self.real["all_gather"](out, t, group=group, async_op=async_op)

    def _all_reduce(self, t, op=dist.ReduceOp.SUM, group=None, async_op=False):
        w = dist.get_world_size(group)
        self.bytes += int(2 * (w - 1) / w * t.numel() * t.element_size())
        return self.real["all_reduce"](t, op=op, group=group, async_op=async_op)

    def _all_to_all_single(self, out, inp, output_split_sizes=None, input_split_sizes=None, group=None,
                           async_op=False):
        me = dist.get_rank(group)
        sizes = list(output_split_sizes) if output_split_sizes is not None else \
            [out.numel() // dist.get_world_size(group)] * dist.get_world_size(group)
        self.bytes += (sum(sizes) - sizes[me]) * out.element_size()
        return self.real["all_to_all_single"](out, inp, output_split_sizes=output_split_sizes,
                                              input_split_sizes=input_split_sizes, group=group, async_op=async_op)


# --------------------------------------------------------------------------- before
def _all_gather_objects(obj, group=None):
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def path_before(args, par, records, local_completions):
    """The data path of the trainer at a92c2b1 (see the module docstring)."""
    from dapo_megatron.rollout.sampling.buffer import logprob_mismatch_metrics
    from dapo_megatron.actor.dp_split import split_for_dp
    from dapo_megatron.rollout.engines.engine import completions_to_group

    # _generate_groups: every rank gets every completion
    local = [(par.dp_rank, i, k, comps) for i, (k, comps) in enumerate(local_completions)]
    gathered = sorted((x for part in _all_gather_objects(local) for x in part), key=lambda x: x[:2])
    groups = []
    for gid, (_, _, k, comps) in enumerate(gathered):
        rec = records[k]
        groups.append(completions_to_group(gid, rec.prompt_ids, comps, prompt_index=rec.index,
                                           data_source=rec.data_source, ground_truth=rec.ground_truth,
                                           extra_info=rec.extra_info))
    samples = [s for g in groups for s in g.samples]
    # DistributedGrader: rank r grades r::world, the results all-gathered
    requests = [(s.data_source, s.response_ids, s.ground_truth, s.extra_info) for s in samples]
    rank, world = dist.get_rank(), dist.get_world_size()
    parts = _all_gather_objects(_Pool().grade(requests[rank::world]))
    grades = [None] * len(requests)
    for r, part in enumerate(parts):
        grades[r::world] = part
    for s, res in zip(samples, grades):
        s.score, s.acc, s.pred = res["score"], res["acc"], res["pred"]
    # _old_logprobs: a DP split of all samples, the shards' logprobs all-gathered over DP
    shard = split_for_dp(samples, par.dp_size, args.budget)[par.dp_rank]
    mine = [i for mb in shard for i in mb]
    lps = [torch.tensor(samples[i].rollout_logprobs, dtype=torch.float32) for i in mine]
    for part in _all_gather_objects([(i, lp.tolist()) for i, lp in zip(mine, lps)], group=par.dp_group):
        for i, lp in part:
            samples[i].old_logprobs = lp
    logprob_mismatch_metrics(samples)
    # train_step: a second DP split, per mini-batch
    plan = []
    for start in range(0, len(groups), args.mini_batch):
        mini = [s for g in groups[start:start + args.mini_batch] for s in g.samples]
        plan.append((sum(len(s.response_ids) for s in mini if not s.loss_mask_zero),
                     split_for_dp(mini, par.dp_size, args.budget)[par.dp_rank]))
    return plan


# --------------------------------------------------------------------------- after
def _old_logprobs_where_trained(args, par, plan, mine, samples) -> None:
    """The trainer's old-logprob pass on this DP rank's samples, the rollout logprobs standing in
    for the forward (a float32 tensor per sample, as ``compute_logprobs`` returns them): its
    micro-batches, the values kept where computed, the mismatch metrics pooled over DP."""
    from dapo_megatron.actor.step_plan import old_logprob_micro_batches
    from dapo_megatron.rollout.sampling.buffer import logprob_mismatch_metrics

    micro = old_logprob_micro_batches(plan, mine, par.dp_rank, args.budget, [samples[i] for i in mine])
    for j in [j for mb in micro for j in mb]:
        s = samples[mine[j]]
        s.old_logprobs = torch.tensor(s.rollout_logprobs, dtype=torch.float32).tolist()
    logprob_mismatch_metrics([samples[i] for i in mine], group=par.dp_group)


class _BatchEngine:
    """A rollout engine's ``generate`` over :func:`_completions`: the completions of each prompt
    (found by its token ids), made once and kept, so only the first, untimed (byte-counting) pass
    pays for them."""

    weight_version = 0

    def __init__(self, args, records):
        self.args, self.made = args, {}
        self.index_of = {tuple(r.prompt_ids): r.index for r in records}

    def generate(self, prompts, params, seeds):
        out = []
        for ids in prompts:
            k = self.index_of[tuple(ids)]
            if k not in self.made:
                self.made[k] = _completions(self.args, k)
            out.append(self.made[k])
        return out


def _buffer(args, par, train_batch_size):
    """The trainer's selector over the stand-in grader (every group kept, no overlong shaping)."""
    from dapo_megatron.algorithms.overlong import OverlongConfig
    from dapo_megatron.rewards.distributed import DistributedGrader
    from dapo_megatron.rollout.sampling.buffer import RolloutBuffer
    from dapo_megatron.rollout.sampling.config import BufferConfig

    cfg = BufferConfig(train_batch_size=train_batch_size, n=args.n, gen_batch_size=args.prompts,
                       max_num_gen_batches=1, filter_groups=False, overlong=OverlongConfig(enable=False),
                       on_cap="train_on_kept")
    return RolloutBuffer(cfg, DistributedGrader(_Pool(), par), decode=list)  # _grade reads the token ids


def batch_rollout(args, par, records, engine):
    """The trainer's :class:`~dapo_megatron.rollout.rollout.Rollout` of this rank (colocated, TP = 1:
    one engine per rank), as :func:`~dapo_megatron.rollout.build.build_rollout` assembles it."""
    from dapo_megatron.config.run import DAPOConfig
    from dapo_megatron.rollout.build import prompt_stream
    from dapo_megatron.rollout.rollout import Rollout

    cfg = DAPOConfig()
    buffer = _buffer(args, par, args.prompts)
    cfg.buffer = buffer.config
    cfg.rollout.response_length = int(args.max_response * args.token_scale)
    return Rollout(cfg, par, engine=engine, num_engines=par.world_size, engine_index=par.rank, train_data=records,
                   val_data=None, stream=prompt_stream(cfg, par, records), reward_pool=None, decode=list,
                   buffer=buffer, collector=None, prompt_queue=None)


def path_after(args, par, records, rollout):
    """The trainer's data path through the public API (see the module docstring)."""
    from dapo_megatron.actor.step_plan import route_step

    batch = rollout.collect(0)
    samples = batch.samples
    plan, mine = route_step(batch.groups, samples, par, args.mini_batch, args.budget)
    _old_logprobs_where_trained(args, par, plan, mine, samples)
    return plan


# --------------------------------------------------------------------------- streamed
class _ScriptedEngine:
    """A rollout engine's asynchronous interface over :func:`_completions`: response ``j`` of the
    prompt at position ``p`` is ``_completions(args, p)[j]``; a poll advances every row
    ``max_tokens`` tokens and returns those that reached their length, an abort the rest with
    their tokens so far. Its completions are made before the timed part (generation is not timed)."""

    supports_async = True
    weight_version = 0

    def __init__(self, args, positions):
        self.completions = {p: _completions(args, p) for p in positions}
        self.rows: dict = {}  # key -> [row, tokens generated]

    @property
    def num_in_flight(self) -> int:
        return len(self.rows)

    def submit(self, rows) -> None:
        for row in rows:
            self.rows[row.key] = [row, len(row.prefix_ids)]

    def _result(self, row, upto, finish):
        from dapo_megatron.rollout.engines.engine import RowResult

        c = self.completions[row.prompt_seed][row.index]
        start = len(row.prefix_ids)
        return RowResult(row.key, c.response_ids[start:upto], c.logprobs[start:upto], finish, self.weight_version)

    def poll(self, max_tokens=None):
        out = []
        for key, state in list(self.rows.items()):
            row = state[0]
            c = self.completions[row.prompt_seed][row.index]
            state[1] += max_tokens
            if state[1] >= len(c.response_ids):
                out.append(self._result(row, len(c.response_ids), c.finish_reason))
                del self.rows[key]
        return out

    def abort(self):
        out = [self._result(row, upto, "abort") for row, upto in self.rows.values()]
        self.rows = {}
        return out


class _AllGatherRows:
    """The streamed rollout's client before issue 20 (``trainer._RankRows`` at 4cf9916): group
    ``g`` on rank ``g.prompt_seed % world``, every finished or aborted row's tokens and logprobs
    all-gathered to every rank each round (as Python objects), so every sample is held by all."""

    def __init__(self, engine, params, *, num_engines, engine_index, parallel=None):
        self.engine, self.params, self.world, self.rank = engine, params, num_engines, engine_index

    def submit(self, rows) -> None:
        from dapo_megatron.rollout.sampling.streaming import row_request

        mine = [row_request(g, j, self.params) for g, j in rows if g.prompt_seed % self.world == self.rank]
        if mine:
            self.engine.submit(mine)

    def _everywhere(self, local):
        from dapo_megatron.rollout.sampling.streaming import RowUpdate
        from dapo_megatron.rollout.types import HELD_BY_ALL

        return [RowUpdate(r.key, len(r.response_ids), r.finish_reason, r.version, HELD_BY_ALL, r.response_ids,
                          r.logprobs) for part in _all_gather_objects(local) for r in part]

    def poll(self, max_tokens):
        return self._everywhere(self.engine.poll(max_tokens) if self.engine.num_in_flight else [])

    def abort(self):
        return self._everywhere(self.engine.abort())


def _records_client(engine, params, *, num_engines, engine_index, parallel):
    """The streamed rollout's client now: records replicated, tokens where generated."""
    from dapo_megatron.rollout.sampling.streaming import EngineClient

    return EngineClient(engine, params, num_engines=num_engines, engine_index=engine_index, parallel=parallel)


def path_streamed(args, par, records, client):
    """One streamed step (:class:`~dapo_megatron.rollout.sampling.streaming.StreamingCollector` over the
    trainer's selector, ``train_batch_size`` = half the prompts, the rest aborted once it has
    them), then the step's plan, the tokens to where they train and the old logprobs there."""
    from dapo_megatron.actor.step_plan import route_step
    from dapo_megatron.rollout.sampling.prompt_skip import PromptSkipConfig, PromptSkipper
    from dapo_megatron.rollout.sampling.streaming import StreamingCollector
    from dapo_megatron.rollout.sampling.feeder import PromptQueue

    selector = _buffer(args, par, args.prompts // 2)
    collector = StreamingCollector(selector, PromptSkipper(PromptSkipConfig(), seed=0), partial_rollout=True,
                                   poll_tokens=max(1, int(args.poll_tokens * args.token_scale)))
    queue = PromptQueue(lambda: records, args.prompts, records.__getitem__)
    groups, _ = collector.collect(client, queue, policy_version=0)
    samples = [s for g in groups for s in g.samples]
    plan, mine = route_step(groups, samples, par, args.mini_batch, args.budget)
    _old_logprobs_where_trained(args, par, plan, mine, samples)
    return plan


def _time_streamed(args, par, records, client_of) -> dict:
    """Bytes (one counted pass) and seconds (best of ``--repeats``) of :func:`path_streamed`."""
    from dapo_megatron.rollout.engines.engine import SamplingParams

    rank, world = dist.get_rank(), dist.get_world_size()
    params = SamplingParams(max_new_tokens=int(args.max_response * args.token_scale), seed=args.seed)
    positions = [p for p in range(args.prompts) if p % world == rank]

    def client():
        return client_of(_ScriptedEngine(args, positions), params, num_engines=world, engine_index=rank, parallel=par)

    with ByteCounter() as counter:
        path_streamed(args, par, records, client())
    total = torch.tensor([counter.bytes], dtype=torch.float64)
    dist.all_reduce(total)
    result = {"bytes": float(total), "seconds": []}
    for _ in range(args.repeats):
        c = client()
        gc.collect()
        dist.barrier()
        t0 = time.perf_counter()
        path_streamed(args, par, records, c)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        result["seconds"].append(float(dt))
        del c
    return result


# --------------------------------------------------------------------------- the ranks
def _worker(args, out_path):
    from dapo_megatron.platform import ParallelConfig, init_distributed

    par = init_distributed(ParallelConfig(1, 1), seed=0)
    records = _records(args)
    per_dp = args.prompts // par.dp_size
    mine = range(par.dp_rank * per_dp, (par.dp_rank + 1) * per_dp)
    results = {}
    engine = _BatchEngine(args, records)  # "after": the trainer's Rollout, a fresh one per run
    arms = (("before", lambda: [(k, _completions(args, k)) for k in mine], path_before),
            ("after", lambda: batch_rollout(args, par, records, engine), path_after))
    for name, prepare, path in arms:
        data = prepare()
        with ByteCounter() as counter:
            path(args, par, records, data)
        total = torch.tensor([counter.bytes], dtype=torch.float64)
        dist.all_reduce(total)
        results[name] = {"bytes": float(total), "seconds": []}
        del data
        gc.collect()
        for _ in range(args.repeats):
            data = prepare()
            dist.barrier()
            t0 = time.perf_counter()
            path(args, par, records, data)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            results[name]["seconds"].append(float(dt))
            del data
            gc.collect()
    engine.made.clear()  # the streamed arm makes its own completions
    for name, client_of in (("streamed before", _AllGatherRows), ("streamed after", _records_client)):
        results[name] = _time_streamed(args, par, records, client_of)
    if dist.get_rank() == 0:
        torch.save(results, out_path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--n", type=int, default=16, help="responses per prompt")
    p.add_argument("--min-response", type=int, default=2048, help="tokens, before --token-scale")
    p.add_argument("--max-response", type=int, default=20480, help="tokens, before --token-scale")
    p.add_argument("--token-scale", type=float, default=1.0,
                   help="multiplies the response lengths (the paper's 2k-20k at 1.0 needs ~8 GB per rank)")
    p.add_argument("--dp", type=int, default=4)
    p.add_argument("--mini-batch", type=int, default=32, help="groups per mini-batch (the paper: 32 x 16)")
    p.add_argument("--budget", type=int, default=0,
                   help="ppo_max_token_len_per_gpu; 0: longest prompt + longest response")
    p.add_argument("--poll-tokens", type=int, default=2048,
                   help="streamed arm: tokens per engine per round (rollout.stream_poll_tokens), before --token-scale")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.prompts % args.dp:
        p.error(f"--prompts={args.prompts} must be a multiple of --dp={args.dp}")
    if not args.budget:
        args.budget = 512 + int(args.max_response * args.token_scale)
    import tempfile

    from dapo_megatron.platform import spawn

    lo, hi = int(args.min_response * args.token_scale), int(args.max_response * args.token_scale)
    print(f"# {args.prompts} prompts x {args.n} responses of {lo}-{hi} tokens, DP={args.dp} gloo, "
          f"mini-batch {args.mini_batch} groups, micro-batch budget {args.budget} tokens", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "res.pt")
        spawn(_worker, args.dp, args, out)
        res = torch.load(out)
    for name in ("before", "after", "streamed before", "streamed after"):
        r = res[name]
        print(f"{name:>15}: {r['bytes'] / 1e6:12.1f} MB moved (all ranks), "
              f"{min(r['seconds']):8.2f} s per step (runs: {', '.join(f'{s:.2f}' for s in r['seconds'])})")
    ratio = {arm: (res[f"{arm}before"], res[f"{arm}after"]) for arm in ("", "streamed ")}
    print("bytes before / after: " + ", ".join(f"{arm or 'batch '}{b['bytes'] / a['bytes']:.1f}x"
                                               for arm, (b, a) in ratio.items()))
    print("seconds per step before / after: " + ", ".join(f"{arm or 'batch '}{min(b['seconds']) / min(a['seconds']):.2f}x"
                                                          for arm, (b, a) in ratio.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
