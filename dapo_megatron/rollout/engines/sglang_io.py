"""SGLang's request and response bodies: the one place a generation request is built and the one
reading of an output row, for every path (the colocated ``sglang.Engine``, the HTTP row client
:mod:`~dapo_megatron.rollout.engines.row_client` over SGLang servers or ``dapo-rollout-server``).

Checked against sglang 0.5.23 (``python/sglang/srt/managers/io_struct.py`` ``GenerateReqInput`` /
``SamplingParams`` fields; ``tests/sglang_reference.py`` ``REQUEST_FIELDS`` checks every body built
here). Plain python: no SGLang import, no HTTP.

* Requests: :func:`build_sampling_params` (one row's ``sampling_params``, its own seed),
  :func:`build_generate_request` (a batch: every prompt ``n`` times), :func:`build_row_request`
  (one row continued after its prefix, with its ``rid``), :func:`build_rows_request` (a streamed
  batch of rows; :func:`with_progress` sets each row's ``stream_interval``).
* Responses: :func:`row_outcome` is the one reading of a row's end (the abort-after-EOS rule);
  :func:`parse_completion` / :func:`parse_generate_output` (batch generation: only ``stop`` /
  ``length`` accepted), :func:`parse_row_output` (a :class:`RowRequest`'s answer) and
  :func:`parse_versioned_row` (a row labelled with the weight version its server reports) are
  built on it.

Design: docs/design.md §2.3 (the rollout rooms) and §3.8 (the one reading of an aborted row).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

from dapo_megatron.rollout.engines.engine import (
    Completion,
    GenerationOutput,
    RowRequest,
    RowResult,
    SamplingParams,
    resolve_prompt_seeds,
    sample_seed,
    validate_prompt_ids,
)
from dapo_megatron.rollout.engines.routes import decode_sglang_routes, num_route_tokens

EVENTS_PER_ROW = 8
"""Progress events a row of ``max_new_tokens`` tokens sends at most in a streamed ``/generate`` (plus
its first token's and its last): its ``stream_interval`` is ``ceil(max_new_tokens / EVENTS_PER_ROW)``
(:mod:`~dapo_megatron.rollout.engines.generate_stream`)."""


def progress_interval(max_new_tokens: int) -> int:
    """``sampling_params.stream_interval`` of a row with this budget (:data:`EVENTS_PER_ROW`)."""
    return max(1, math.ceil(int(max_new_tokens) / EVENTS_PER_ROW))


def with_progress(sampling_params: dict) -> dict:
    """A copy of one row's ``sampling_params`` with its :func:`progress_interval`."""
    return {**sampling_params, "stream_interval": progress_interval(sampling_params.get("max_new_tokens", 128))}


# ---------------------------------------------------------------------------- requests
def build_sampling_params(params: SamplingParams, seed: Optional[int]) -> dict[str, Any]:
    """SGLang ``sampling_params`` dict of one response row with its own ``sampling_seed``.

    ``n`` is expanded into rows by the caller (one request per response), so each row has
    its own seed (:func:`~dapo_megatron.rollout.engines.engine.sample_seed`); ``no_stop_trim``
    keeps the stop token in the output.
    """
    sp: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k),
        "no_stop_trim": True,
        "skip_special_tokens": False,
    }
    if params.stop_token_ids:
        sp["stop_token_ids"] = list(params.stop_token_ids)
    if params.stop:
        # SGLang's ``stop`` (sampling/sampling_params.py: ``stop_strs``, normalised to a list) ends a row at
        # the token whose decoded tail holds one (managers/schedule_batch.py ``Req._check_str_based_finish``);
        # with ``no_stop_trim`` the ids keep that token, as the HF engine does
        sp["stop"] = list(params.stop)
    if seed is not None:
        sp["sampling_seed"] = seed
    return sp


def build_generate_request(prompt_ids: Sequence[Sequence[int]], params: SamplingParams,
                           prompt_seeds: Optional[Sequence[int]] = None) -> dict[str, Any]:
    """The batched ``/generate`` payload (also the kwargs of ``Engine.generate``): each prompt
    repeated ``n`` times, one sampling-params dict per row (seeded per response, see
    :func:`~dapo_megatron.rollout.engines.engine.sample_seed`), logprobs of the output only."""
    validate_prompt_ids(prompt_ids)
    seeds = resolve_prompt_seeds(prompt_ids, prompt_seeds)
    rows = [list(p) for p in prompt_ids for _ in range(params.n)]
    return {
        "input_ids": rows,
        "sampling_params": [build_sampling_params(params, sample_seed(params.seed, ps, j))
                            for ps in seeds for j in range(params.n)],
        "return_logprob": True,
    }


# ---------------------------------------------------------------------------- responses
def parse_completion(item: dict, row: int, *, prompt_len: int = 0,
                     routes_shape: Optional[tuple[int, int, int]] = None) -> Completion:
    """One SGLang output dict → :class:`Completion`.

    With ``routes_shape = (L, K, E)`` (routing replay; the request had ``return_routed_experts``)
    ``meta_info.routed_experts`` becomes ``Completion.routes``, ``[prompt_len + R - 1, L, K]``
    (:func:`~dapo_megatron.rollout.engines.routes.decode_sglang_routes`).

    Raises:
        RuntimeError: the request was aborted or failed (message included), or the output
            lacks ``meta_info.output_token_logprobs`` (``return_logprob`` not set).
    """
    meta = item.get("meta_info") if isinstance(item, dict) else None
    if not isinstance(meta, dict):
        raise RuntimeError(f"SGLang output row {row} has no meta_info: {str(item)[:200]}")
    fr = meta.get("finish_reason")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind not in ("stop", "length"):
        detail = fr.get("message") if isinstance(fr, dict) else None
        raise RuntimeError(f"SGLang request row {row} finished with {kind!r}"
                           + (f": {detail}" if detail else "") + " (aborted or failed; expected 'stop' or 'length')")
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise RuntimeError(f"SGLang output row {row} has no meta_info.output_token_logprobs; "
                           "generate must be called with return_logprob=True")
    ids = [int(e[1]) for e in entries]
    logprobs = [float(e[0]) for e in entries]
    output_ids = item.get("output_ids")
    if output_ids is not None and list(output_ids) != ids:
        raise RuntimeError(f"SGLang output row {row}: output_ids ({len(output_ids)} tokens) disagree with the "
                           f"token ids of output_token_logprobs ({len(ids)} tokens)")
    if any(lp != lp for lp in logprobs):
        raise RuntimeError(f"SGLang output row {row} has NaN logprobs")
    routes = None
    if routes_shape is not None:
        L, K, E = routes_shape
        routes = decode_sglang_routes(meta, num_tokens=num_route_tokens(prompt_len, len(ids)), num_layers=L,
                                      topk=K, num_experts=E, row=row)
    return Completion(ids, logprobs, kind, routes)


def parse_generate_output(outputs: Any, num_prompts: int, n: int, *, prompt_lens: Optional[Sequence[int]] = None,
                          routes_shape: Optional[tuple[int, int, int]] = None) -> GenerationOutput:
    """SGLang's batched ``generate`` result (list of ``num_prompts * n`` dicts, row order
    of :func:`build_generate_request`) → ``outputs[i][j]``; with ``routes_shape`` (and the
    prompts' lengths) every completion carries its routes (:func:`parse_completion`).

    Raises:
        RuntimeError: wrong number of rows, or any row failed (see :func:`parse_completion`).
    """
    if isinstance(outputs, dict):
        outputs = [outputs]
    if not isinstance(outputs, list) or len(outputs) != num_prompts * n:
        got = len(outputs) if isinstance(outputs, list) else type(outputs).__name__
        raise RuntimeError(f"SGLang generate returned {got} outputs, expected {num_prompts} prompts x n={n}")
    lens = list(prompt_lens) if prompt_lens is not None else [0] * num_prompts
    rows = [parse_completion(item, r, prompt_len=lens[r // n], routes_shape=routes_shape)
            for r, item in enumerate(outputs)]
    return [rows[i * n:(i + 1) * n] for i in range(num_prompts)]


def build_row_request(row: RowRequest, rid: str) -> dict[str, Any]:
    """``Engine.async_generate`` kwargs of one :class:`~dapo_megatron.rollout.engines.engine.RowRequest`:
    the prompt followed by the row's prefix, the remaining budget, the row's own seed."""
    params = dataclasses.replace(row.params, n=1, max_new_tokens=row.budget)
    return {"input_ids": list(row.prompt_ids + row.prefix_ids), "sampling_params": build_sampling_params(params, row.seed),
            "return_logprob": True, "rid": rid}


def build_rows_request(rows: Sequence[tuple[Sequence[int], dict]], rids: Optional[Sequence[str]] = None, *,
                       routes_start: Optional[int] = None) -> dict[str, Any]:
    """The streamed batched ``/generate`` body of ``rows`` (``(input ids, sampling_params)`` each,
    e.g. of :func:`build_row_request`): every row's ``sampling_params`` :func:`with_progress`,
    logprobs of the output, one ``rid`` per row when given (``"stream": true`` is added by
    :class:`~dapo_megatron.rollout.engines.generate_stream.StreamedGenerate`).

    ``routes_start`` (routing replay; None: off): ``return_routed_experts`` with
    ``routed_experts_start_len = routes_start``, ONE value for every row of the request (sglang
    0.5.23 ``managers/io_struct.py:264-268`` declares it an int, and ``GenerateReqInput.__getitem__``
    gives each row the batch's value): rows continued from different positions go in different
    requests (:class:`~dapo_megatron.rollout.engines.row_client.RowClient` splits them)."""
    req: dict[str, Any] = {"input_ids": [list(ids) for ids, _ in rows],
                           "sampling_params": [with_progress(sp) for _, sp in rows], "return_logprob": True}
    if rids is not None:
        req["rid"] = list(rids)
    if routes_start is not None:
        req["return_routed_experts"] = True
        if routes_start:
            req["routed_experts_start_len"] = int(routes_start)
    return req



def row_outcome(item: Any, *, budget: int, stop_ids=frozenset(), row: int = 0) -> tuple[list[int], list[float], str]:
    """One SGLang output of a row → ``(token ids, logprobs, finish kind)``: the one reading of a
    row's end, for every path (the streamed rollout's rows :func:`parse_row_output`, the async
    controller's rows :func:`parse_versioned_row`).

    ``"stop"`` / ``"length"`` as SGLang reports them; an aborted output (``"abort"``: a weight
    sync's ``/pause_generation``, an ``/abort_request``) holds the tokens sampled so far and stays
    ``"abort"`` (to be continued) UNLESS it already ends on a stop token (``stop_ids``: the model's
    EOS ids and the row's ``stop_token_ids``) — then ``"stop"`` — or fills ``budget`` (the
    request's ``max_new_tokens``) — then ``"length"``. SGLang lets an aborted running row decode
    one more token (sglang 0.5.23 ``managers/scheduler.py:5797-5812``) and applies the abort
    before checking EOS and length (``managers/schedule_batch.py:2011``,
    ``update_finish_state``), so such an output is a finished row reported as an abort;
    continued, it would run on past its EOS (or its budget).

    Raises:
        RuntimeError: a failed request, or a malformed output (see :func:`parse_completion`).
    """
    meta = item.get("meta_info") if isinstance(item, dict) else None
    fr = meta.get("finish_reason") if isinstance(meta, dict) else None
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind == "abort":
        entries = meta.get("output_token_logprobs") or []
        ids, logprobs = [int(e[1]) for e in entries], [float(e[0]) for e in entries]
        if ids and ids[-1] in stop_ids:
            kind = "stop"
        elif len(ids) >= budget:
            kind = "length"
        return ids, logprobs, kind
    c = parse_completion(item, row)
    return list(c.response_ids), list(c.logprobs), c.finish_reason


def parse_row_output(item: Any, row: RowRequest, version: int, eos_token_ids: frozenset = frozenset(),
                     routes_shape: Optional[tuple[int, int, int]] = None) -> RowResult:
    """One SGLang output of a row (``build_row_request``) → :class:`RowResult` (:func:`row_outcome`
    with the row's remaining budget and stop tokens: ``eos_token_ids`` and the row's
    ``stop_token_ids``); with ``routes_shape`` its routes from ``row.routes_start`` on
    (:func:`row_routes`). Raises as :func:`row_outcome`."""
    ids, logprobs, kind = row_outcome(item, budget=row.budget,
                                      stop_ids=frozenset(row.params.stop_token_ids) | frozenset(eos_token_ids))
    routes = None
    if routes_shape is not None:
        routes = row_routes(item, len(row.prompt_ids) + len(row.prefix_ids), len(ids), row.routes_start,
                            routes_shape)
    return RowResult(row.key, ids, logprobs, kind, version, routes)


def row_routes(item: Any, input_len: int, num_new: int, routes_start: int, routes_shape: tuple[int, int, int],
               row: int = 0):
    """The routes of one row's output, positions ``[routes_start, input_len + num_new - 1)``
    (``meta_info.routed_experts`` of a request with ``routed_experts_start_len = routes_start``),
    compact ``[rows, L, K]``; an output with no new token and no routes (a row aborted in the
    waiting queue) gives 0 rows.

    Raises:
        RuntimeError / ValueError: routes missing or malformed
            (:func:`~dapo_megatron.rollout.engines.routes.decode_sglang_routes`).
    """
    L, K, E = routes_shape
    meta = item.get("meta_info") if isinstance(item, dict) else None
    want = max(0, num_route_tokens(input_len, num_new) - routes_start)
    if not num_new and (not isinstance(meta, dict) or meta.get("routed_experts") is None):
        return decode_sglang_routes({"routed_experts": []}, num_tokens=0, num_layers=L, topk=K, num_experts=E)
    return decode_sglang_routes(meta, num_tokens=want, num_layers=L, topk=K, num_experts=E, row=row)




def parse_versioned_row(item: Any, row: int, fallback_version: int, *, budget: int,
                        stop_ids: frozenset = frozenset(),
                        routes: Optional[tuple[int, int, int, int, int]] = None) -> tuple:
    """One SGLang output row → ``(token ids, logprobs, finish kind, weight version)``: the ids,
    logprobs and kind of :func:`row_outcome`; the version is the output's ``meta_info.weight_version``
    (the weights that sampled it: SGLang reports the version of its last update),
    ``fallback_version`` when the server reports none. With ``routes = (input length,
    routes_start, L, K, E)`` (routing replay) a fifth item: the row's routes (:func:`row_routes`).

    Raises:
        RuntimeError: a failed row (any other finish kind), or a malformed one.
    """
    meta = item.get("meta_info") if isinstance(item, dict) else None
    try:
        version = int(meta.get("weight_version"))
    except (TypeError, ValueError, AttributeError):
        version = fallback_version
    ids, logprobs, kind = row_outcome(item, budget=budget, stop_ids=stop_ids, row=row)
    if routes is None:
        return ids, logprobs, kind, version
    input_len, start, *shape = routes
    return ids, logprobs, kind, version, row_routes(item, input_len, len(ids), start, tuple(shape), row)
