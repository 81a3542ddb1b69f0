"""The async controller's requests over HTTP: a generation batch's rows and validation's rows.

Both go out through the controller's one dispatch loop (``dispatch(pending, request, accept,
version)``: :meth:`RowClient.dispatch <dapo_megatron.rollout.engines.row_client.RowClient.dispatch>`
over the healthy servers, waiting out a weight sync between rounds); here is what each row asks
for and what becomes of its answer: the tokens appended to its sample with the version that sampled
them, an aborted row continued after the sync, a finished one settled by the trajectory hook.

Design: docs/design.md §3.8 (asynchronous training on separate servers).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

from dapo_megatron.rollout.engines.engine import Completion, SamplingParams, completions_to_group, sample_seed
from dapo_megatron.rollout.engines.routes import routes_start_of
from dapo_megatron.rollout.engines.sglang_io import build_sampling_params
from dapo_megatron.rollout.trajectory import Trajectory, settle_row
from dapo_megatron.rollout.types import Group, Sample

_EMPTY = Completion([], [], "")

Dispatch = Callable[[list, Callable[[Any], tuple], Callable[[Any, tuple], bool], int], int]
"""``dispatch(pending keys, request, accept, version) -> rows retried`` (the controller's)."""


def server_groups(records: Sequence[Any], positions: Sequence[int], version: int, *, params: SamplingParams,
                  trajectory: Trajectory, routes_shape: Optional[tuple], dispatch: Dispatch
                  ) -> tuple[list[Group], int, int, int]:
    """Synchronous server mode's ``SyncFeeder.generate_groups`` over HTTP, interruptible.

    Group ``g`` of the request is seeded and numbered ``positions[g]`` (batch admission:
    ``first + g``) and dealt to server ``g % len(urls)`` (:func:`~dapo_megatron.rollout.engines.layout.engine_share`);
    the first round is exactly synchronous server mode's request per server. A row that a weight sync
    aborts (the sync pauses the servers with ``mode=abort``) comes back with the tokens it
    sampled; once the sync is over it is resubmitted as prompt + those tokens with the
    remaining budget and the same seed (the server's draws are keyed on the absolute
    position, so the row continues as it would have), and its new tokens get a new version
    span. Every token's version is the one its output reports (``meta_info.weight_version``).
    ``holder = 0``: trainer rank 0 holds the token lists. ``params``: ``n`` rows per group, their
    sampling parameters; ``routes_shape``: routing replay (each row asks for its routes from where
    its sample's end), None: off; ``trajectory`` settles each finished row (a continued one goes out
    again next round, not counted as a resubmission).

    Returns:
        ``(groups, rows resubmitted, prefix tokens re-prefilled, rows retried)``: rows
        retried are those sent again after their server failed (the server's error marks
        it down: :meth:`RowClient.mark_down <dapo_megatron.rollout.engines.row_client.RowClient.mark_down>`;
        they restart from the prefix they had, on a healthy server, with their own seed, so they
        draw what they would have drawn).

    Raises:
        RuntimeError: no healthy server is left (every server named).
    """
    n, p = params.n, params
    groups = []
    for g, rec in enumerate(records):
        comps = [_EMPTY] * n
        grp = completions_to_group(positions[g], rec.prompt_ids, comps, prompt_index=rec.index,
                                   data_source=rec.data_source, ground_truth=rec.ground_truth,
                                   extra_info=rec.extra_info)
        grp.prompt_seed = positions[g]
        for s in grp.samples:
            s.holder, s.finish_reason = 0, ""
        groups.append(grp)
    resubmitted = reprefilled = 0
    next_turn = set()  # rows a multi-turn trajectory continues (not resubmissions after a sync)

    def request(key):
        nonlocal resubmitted, reprefilled
        g, j = key
        s = groups[g].samples[j]
        budget = p.max_new_tokens - len(s.response_ids)
        sp = build_sampling_params(dataclasses.replace(p, n=1, max_new_tokens=budget),
                                   sample_seed(p.seed, positions[g], j))
        if key in next_turn:
            next_turn.discard(key)
        elif s.response_ids:
            resubmitted += 1
            reprefilled += len(s.response_ids)
        # all servers healthy: server g % len(urls), synchronous server mode's deal
        ids = list(s.prompt_ids) + list(s.response_ids)
        if routes_shape is None:
            return g, ids, sp
        return g, ids, sp, routes_start_of(len(ids), s.routes)  # continued: its routes from where s's end

    def accept(key, res) -> bool:
        g, j = key
        ids, lps, kind, row_version = res[:4]
        routes = res[4] if len(res) > 4 else None  # routing replay (RowClient.generate_rows)
        s = groups[g].samples[j]
        if kind == "abort" and trajectory.ends_turn(s, ids):
            kind = "stop"  # the abort's extra decode step completed a tool call's stop string: the turn ended
        if ids:
            s.append_tokens(row_version, ids, lps, routes=routes)
        if kind == "abort":  # aborted by a weight sync: continued once it is over, on the new weights (a
            return False  # row it aborted right after its stop token or at its budget is "stop" / "length": sglang_io.row_outcome)
        if not s.versions:
            s.versions = [(0, row_version)]
        if settle_row(s, kind, trajectory, version=row_version, max_new_tokens=p.max_new_tokens):
            next_turn.add(key)  # the trajectory appended context: the next turn goes out next round
            return False
        return True

    retried = dispatch([(g, j) for g in range(len(records)) for j in range(n)], request, accept, version)
    return groups, resubmitted, reprefilled, retried


def validation_rows(prompts: Sequence[Sequence[int]], params: SamplingParams, version: int, *,
                    trajectory: Trajectory, dispatch: Dispatch) -> tuple[list[list[Any]], int]:
    """Validation's responses on the healthy servers (the controller paused: every request on the
    weights ``version`` of the last sync).

    The requests of synchronous server-mode validation (``ServerRollout.generate(prompts,
    params, range(len(prompts)))``): response ``j`` of prompt ``i`` is one row seeded
    :func:`~dapo_megatron.rollout.engines.engine.sample_seed` ``(params.seed, i, j)``, with
    ``params``' sampling parameters, so it draws the same tokens on whichever server it
    runs. Prompt ``i``'s rows go to healthy server ``live[i % len(live)]``. A multi-turn
    trajectory runs its turns as the rollout does (:func:`server_groups`): a row it continues goes
    out again as prompt + the response so far (context included), with the remaining budget and
    its own seed.

    Returns:
        ``(outputs, rows retried)``: per prompt its ``params.n`` completions, in seed order
        (multi-turn: its :class:`~dapo_megatron.rollout.types.Sample` s, each with its whole
        response), and the rows sent again after their server failed.

    Raises:
        RuntimeError: no healthy server is left (every server named), or a row came back aborted
            (something paused the servers).
    """
    n = params.n
    out: list[list[Any]] = [[_EMPTY] * n for _ in prompts]
    turns: dict[tuple[int, int], Sample] = {}  # multi-turn: the samples a trajectory continues

    def request(key):
        i, j = key
        done = list(turns[key].response_ids) if key in turns else []
        return i, list(prompts[i]) + done, build_sampling_params(
            dataclasses.replace(params, n=1, max_new_tokens=params.max_new_tokens - len(done)),
            sample_seed(params.seed, i, j))

    def accept(key, res) -> bool:
        i, j = key
        ids, lps, kind, row_version = res[:4]  # (a fifth item, the routes, under routing replay: not kept)
        if kind == "abort":
            raise RuntimeError(f"validation row {j} of problem {i} was aborted on its server: nothing may pause "
                               "the rollout servers during validation")
        if not trajectory.multi_turn:
            out[i][j] = Completion(ids, lps, kind)
            return True
        s = turns.pop(key, None) or Sample(prompt_ids=list(prompts[i]), response_ids=[], rollout_logprobs=[],
                                           finish_reason="", holder=0)
        s.append_tokens(row_version, ids, lps)
        if not s.versions:
            s.versions = [(0, row_version)]
        if settle_row(s, kind, trajectory, version=row_version, max_new_tokens=params.max_new_tokens):
            turns[key] = s  # the trajectory appended context: the next turn goes out next round
            return False
        out[i][j] = s
        return True

    retried = dispatch([(i, j) for i in range(len(prompts)) for j in range(n)], request, accept, version)
    return out, retried
