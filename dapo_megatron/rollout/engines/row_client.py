"""The one HTTP client of generation rows on SGLang-compatible servers (SGLang's ``/generate``, or
``dapo-rollout-server``, which serves the same protocol): every ``/generate`` and
``/abort_request`` of the trainer goes through :class:`RowClient`.

Its users: synchronous server mode (``rollout/engines/server_sync.py`` ``ServerRollout``: batch
:meth:`RowClient.generate` on the rank's server, the streamed rollout's
:meth:`~RowClient.submit` / :meth:`~RowClient.poll` / :meth:`~RowClient.abort`) and asynchronous training (``rollout/async_rollout.py``
``RolloutController``: :meth:`RowClient.dispatch` of rows over the healthy servers, with
mark-down and retry, abort and continue across a weight sync, validation rows).

Bodies are built and outputs read by :mod:`~dapo_megatron.rollout.engines.sglang_io` (the one row
parser); streamed requests are bounded by their server's silence, never by their total time
(:mod:`~dapo_megatron.rollout.engines.generate_stream`).

Server health (:attr:`RowClient.health`, one per server, under the client's lock): ``"healthy"``
servers get rows; a server whose ``/generate`` fails (unreachable, reset, an HTTP error, or no
byte for ``silence_timeout_s``) or whose ``/health`` probe fails becomes ``"down"``
(:meth:`RowClient.mark_down`) and leaves dispatch at once; a down server that answers ``/health``
again is ``"back"`` (:meth:`RowClient.members_for_sync`) and turns ``"healthy"`` once a weight
sync has put the current weights into it (:meth:`RowClient.mark_synced`).

Design: docs/design.md §2.3 (the rollout rooms) and §3.8 (the async dispatch, faults, streamed generation).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

from dapo_megatron.platform.http import each_server, http_get, http_post
from dapo_megatron.rollout.engines.engine import GenerationOutput, RowRequest, RowResult, SamplingParams
from dapo_megatron.rollout.engines.generate_stream import Liveness, StreamedGenerate, stream_generate, wait_streams
from dapo_megatron.rollout.engines.sglang_io import (build_generate_request, build_row_request, build_rows_request,
                                                     parse_generate_output, parse_row_output, parse_versioned_row,
                                                     with_progress)

logger = logging.getLogger("dapo_megatron.rollout.async")


def probe_health(urls: Sequence[str], timeout_s: float) -> list[Optional[str]]:
    """``GET /health`` of every server at once, each within ``timeout_s``: per server None
    (healthy) or the error naming its URL (down, unhealthy, or silent). Never raises."""
    def one(url):
        try:
            http_get(url, "/health", timeout_s)
        except Exception as err:  # reported per server
            return str(err)
        return None

    return each_server(list(urls), one)


def check_health(urls: Sequence[str], timeout_s: float) -> None:
    """``GET /health`` of every server (at once), each within ``timeout_s``.

    SGLang answers 200 when healthy and 503 while starting, shutting down or after a failed
    health generation (``entrypoints/http_server.py`` ``health_generate``).

    Raises:
        RuntimeError: naming every server that is down, unhealthy, or silent for ``timeout_s``.
    """
    failed = [e for e in probe_health(urls, timeout_s) if e is not None]
    if failed:
        raise RuntimeError(f"rollout server health check failed: {'; '.join(failed)}")


@dataclasses.dataclass(frozen=True)
class ServerFailure:
    """What :meth:`RowClient.generate_rows` answers for a row whose server failed: the server's
    index and the error (naming its URL: unreachable, reset, an HTTP error, no answer within
    the timeout, or a malformed answer)."""

    server: int
    message: str


class _ServerStreams:
    """The asynchronous rows in flight on one server (:meth:`RowClient.submit` / ``poll`` / ``abort``).

    Each submitted run of rows of one prompt (a group's rows share their prefill) is one
    streamed batched ``/generate`` request with one ``rid`` per row, read in a thread
    (:class:`~dapo_megatron.rollout.engines.generate_stream.StreamedGenerate`). The requests
    share the server's :class:`~dapo_megatron.rollout.engines.generate_stream.Liveness`: a request
    waiting in the server's queue is not silent while the others decode; the server fails when
    none of them sent a byte for ``silence_timeout_s`` (checked whenever this waits on it)."""

    def __init__(self, url: str, silence_timeout_s: float, timeout_s: float,
                 routes_shape: Optional[tuple[int, int, int]] = None):
        self.url, self.silence_timeout_s, self.timeout_s = url, silence_timeout_s, timeout_s
        self.routes_shape = routes_shape
        self.requests: list[tuple[StreamedGenerate, list[RowRequest], list[str]]] = []  # in flight, in order
        self.answered = threading.Event()  # set by every request that answers: wakes poll()
        self.liveness = Liveness()

    def start(self, batch: list[RowRequest], rids: list[str]) -> None:
        payload = build_rows_request([(r["input_ids"], r["sampling_params"])
                                      for r in (build_row_request(row, rid) for row, rid in zip(batch, rids))], rids,
                                     routes_start=None if self.routes_shape is None else batch[0].routes_start)
        stream = StreamedGenerate(self.url, payload, connect_timeout_s=self.timeout_s, liveness=self.liveness,
                                  answered=self.answered)
        self.requests.append((stream, batch, rids))

    def wait(self, until_all: bool, timeout_s: Optional[float]) -> None:
        """Wait for every request (``until_all``) or for one to answer (at most ``timeout_s``),
        under the silence bound (:func:`~dapo_megatron.rollout.engines.generate_stream.wait_streams`)."""
        streams = [s for s, _, _ in self.requests]
        if until_all:
            wait_streams(streams, self.silence_timeout_s, self.timeout_s)
            return
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not any(s.done.is_set() for s in streams):
            if self.liveness.silent_s() >= self.silence_timeout_s:
                wait_streams(streams, self.silence_timeout_s, self.timeout_s)  # cancels them, naming the server
                return
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            self.answered.wait(min(left if left is not None else 1.0, max(0.01, self.silence_timeout_s / 4)))

    def abort(self) -> None:
        """``/abort_request`` with each row's ``rid`` (sglang 0.5.23 ``tokenizer_manager.py``
        ``abort_request`` ignores a rid that is not a request's own, so a batch's prefix would not
        do), then wait for every answer."""
        for stream, _, rids in self.requests:
            if not stream.done.is_set():
                for rid in rids:
                    http_post(self.url, "/abort_request", {"rid": rid}, self.timeout_s)
        self.wait(True, None)

    def collect(self, version: int, only_done: bool, eos_token_ids: frozenset) -> list[RowResult]:
        self.answered.clear()  # before reading: an answer arriving now is seen by the next poll's check
        done = [r for r in self.requests if r[0].done.is_set() or not only_done]
        self.requests = [r for r in self.requests if r not in done]
        out = []
        for stream, rows, _ in done:
            if stream.error is not None:
                raise RuntimeError(f"streamed rows on {stream.url}: {stream.error}")
            out += [parse_row_output(item, row, version, eos_token_ids, self.routes_shape)
                    for item, row in zip(stream.result, rows)]
        return out


class RowClient:
    """Rows on SGLang-compatible servers over HTTP (module docstring).

    Args:
        urls: the servers (base URLs).
        silence_timeout_s: bound on a server's silence during a streamed ``/generate``
            (``rollout.server_silence_timeout_s``): a server that sends no byte for that long fails,
            as one that is unreachable does; no bound on a request's total time.
        timeout_s: bound on opening a connection, an ``/abort_request`` and a ``/health`` probe
            (``rollout.server_timeout_s``).
        eos_token_ids: the model's stop tokens (an aborted row that ends on one has finished:
            :func:`~dapo_megatron.rollout.engines.sglang_io.row_outcome`).
        rid_prefix: the prefix of the rows' ``rid``, unique among the servers' clients (``dapo-<rank>``).
        on_down: called with a server's index when it turns ``"down"`` (outside the client's lock).
        routes_shape: routing replay, ``(L, K, E)`` of the model: the rows (:meth:`submit`,
            :meth:`generate_rows`) ask for ``return_routed_experts`` from their ``routes_start``
            (SGLang's ``routed_experts_start_len``, one per request: rows continued from
            different positions go in different requests) and return their routes; None: off.
    """

    poll_timeout_s = 0.5
    """The longest a :meth:`poll` with ``max_tokens`` waits for a request to answer (seconds): like
    SGLang's offline engine, a server cannot stop after a token count, so a streamed round is a
    time slice."""

    def __init__(self, urls: Sequence[str], *, silence_timeout_s: float, timeout_s: float,
                 eos_token_ids: Sequence[int] = (), rid_prefix: str = "dapo",
                 on_down: Optional[Callable[[int], None]] = None,
                 routes_shape: Optional[tuple[int, int, int]] = None):
        self.urls = list(urls)
        self.routes_shape = None if routes_shape is None else tuple(int(x) for x in routes_shape)
        self.silence_timeout_s, self.timeout_s = float(silence_timeout_s), float(timeout_s)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.rid_prefix, self.on_down = rid_prefix, on_down
        self.health = ["healthy"] * len(self.urls)
        self.server_errors: list[Optional[str]] = [None] * len(self.urls)  # the last failure of each
        self._lock = threading.Lock()
        self._pool: Optional[ThreadPoolExecutor] = None
        self._streams: dict[int, _ServerStreams] = {}
        self._rids = itertools.count()

    def close(self) -> None:
        """Release the request threads (idempotent)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    # ---- server health ------------------------------------------------------------------
    def mark_down(self, e: int, message: str) -> bool:
        """Server ``e`` failed: out of dispatch. Returns True when it was not down already
        (then :attr:`on_down` is called)."""
        with self._lock:
            newly = self.health[e] != "down"
            if newly:
                logger.warning("rollout server %s leaves dispatch: %s", self.urls[e], message)
            self.health[e], self.server_errors[e] = "down", message
        if newly and self.on_down is not None:
            self.on_down(e)
        return newly

    def healthy(self) -> list[int]:
        """The servers that get rows, ascending.

        Raises:
            RuntimeError: none is healthy (every server named with its last error).
        """
        with self._lock:
            live = [e for e, h in enumerate(self.health) if h == "healthy"]
            if not live:
                raise RuntimeError("every rollout server failed (rollout.server_urls): " + "; ".join(
                    f"{u}: {err}" for u, err in zip(self.urls, self.server_errors)) + ". Restart them (or list the "
                    "live ones in rollout.server_urls) and resume from the last checkpoint")
            return live

    def members_for_sync(self) -> list[int]:
        """The servers the next weight sync goes to: ``GET /health`` of every server (at once,
        ``timeout_s`` each): a healthy server that fails it goes down; a down one that answers is
        ``"back"`` (synced, then dispatched: :meth:`mark_synced`). Returns their indices
        (ascending), possibly none."""
        errors = probe_health(self.urls, self.timeout_s)
        for e, err in enumerate(errors):
            if err is not None:
                self.mark_down(e, err)
        with self._lock:
            for e, err in enumerate(errors):
                if err is None and self.health[e] == "down":
                    logger.info("rollout server %s answers /health again: it joins the next weight sync", self.urls[e])
                    self.health[e] = "back"
            return [e for e, h in enumerate(self.health) if h != "down"]

    def mark_synced(self, servers: Sequence[int], version: Optional[int] = None) -> None:
        """A weight sync put the current weights (``version``) into ``servers``: they turn ``"healthy"``."""
        with self._lock:
            for e in servers:
                if self.health[e] != "healthy":
                    logger.info("rollout server %s is back in dispatch at weight version %s", self.urls[e], version)
                self.health[e] = "healthy"

    # ---- a batch on one server ----------------------------------------------------------
    def generate(self, server: int, prompt_ids: Sequence[Sequence[int]], params: SamplingParams,
                 prompt_seeds: Optional[Sequence[int]] = None, *,
                 routes_shape: Optional[tuple[int, int, int]] = None) -> GenerationOutput:
        """Every prompt ``params.n`` times on server ``server``
        (:func:`~dapo_megatron.rollout.engines.sglang_io.build_generate_request`): one streamed
        ``/generate``, failed only when the server sends no byte for ``silence_timeout_s``. With ``routes_shape``
        (routing replay) the request asks for ``return_routed_experts`` and every completion
        carries its routes (:func:`~dapo_megatron.rollout.engines.sglang_io.parse_completion`).

        Raises:
            RuntimeError: the server failed, refused the request or was silent too long (naming
                it), or a row was aborted or malformed.
        """
        url = self.urls[server]
        req = build_generate_request(prompt_ids, params, prompt_seeds)
        if routes_shape is not None:
            req["return_routed_experts"] = True  # meta_info.routed_experts, SGLang's format
        req["sampling_params"] = [with_progress(sp) for sp in req["sampling_params"]]
        out = stream_generate(url, req, silence_s=self.silence_timeout_s, connect_timeout_s=self.timeout_s)
        return parse_generate_output(out, len(prompt_ids), params.n, prompt_lens=[len(p) for p in prompt_ids],
                                     routes_shape=routes_shape)

    # ---- rows on every server at once (asynchronous training) ---------------------------
    def generate_rows(self, rows: Sequence[tuple], version: int) -> list:
        """Rows ``(server index, input ids, sampling_params)`` (with :attr:`routes_shape`, a fourth
        item: the row's ``routes_start``), one streamed batched ``/generate`` per server (with
        routes, per server and ``routes_start``), all servers at once; per row, in the order
        given, its :func:`~dapo_megatron.rollout.engines.sglang_io.parse_versioned_row` (budget its
        ``max_new_tokens``, stop tokens :attr:`eos_token_ids` and its ``stop_token_ids``;
        ``version`` where the server reports none), or a :class:`ServerFailure` for every row of a
        server that failed. Never raises for a server's failure.
        """
        by_server: dict[int, list[int]] = {}
        for k, row in enumerate(rows):
            by_server.setdefault(row[0], []).append(k)

        def parse(ks, start, out):
            return [parse_versioned_row(item, r, version, budget=int(rows[k][2]["max_new_tokens"]),
                                        stop_ids=self.eos_token_ids | frozenset(rows[k][2].get("stop_token_ids") or ()),
                                        routes=None if start is None else (len(rows[k][1]), start, *self.routes_shape))
                    for r, (k, item) in enumerate(zip(ks, out))]

        def one(e):
            ks = by_server[e]
            try:
                # with routes, one routed_experts_start_len per request: a request per start, all in flight
                # at once; without, one request (start None)
                by_start: dict[Optional[int], list[int]] = {}
                for k in ks:
                    start = None if self.routes_shape is None else (int(rows[k][3]) if len(rows[k]) > 3 else 0)
                    by_start.setdefault(start, []).append(k)
                live = Liveness()
                streams = {start: StreamedGenerate(self.urls[e], build_rows_request(
                    [(rows[k][1], rows[k][2]) for k in part], routes_start=start), connect_timeout_s=self.timeout_s,
                    liveness=live) for start, part in by_start.items()}
                wait_streams(list(streams.values()), self.silence_timeout_s, self.timeout_s)
                got = {}
                for start, stream in streams.items():
                    if stream.error is not None:
                        raise RuntimeError(stream.error)
                    got.update(zip(by_start[start], parse(by_start[start], start, stream.result)))
                return [got[k] for k in ks]
            except Exception as err:  # this server's rows only: the dispatch retries them on another
                failure = ServerFailure(e, f"rollout server {self.urls[e]}: /generate of {len(ks)} rows failed: {err}")
                return [failure] * len(ks)

        servers = sorted(by_server)
        if len(servers) > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max(1, len(self.urls)), thread_name_prefix="rollout-http")
            parts = list(self._pool.map(one, servers))
        else:
            parts = [one(e) for e in servers]
        results: list = [None] * len(rows)
        for e, part in zip(servers, parts):
            for k, res in zip(by_server[e], part):
                results[k] = res
        return results

    def dispatch(self, pending: list, request: Callable[[Any], tuple[int, list[int], dict]],
                 accept: Callable[[Any, tuple], bool], version: int, *,
                 between_rounds: Callable[[], int], generate: Optional[Callable] = None) -> int:
        """Generate rows on the healthy servers until every one is done: the one dispatch and
        retry loop of asynchronous training (its generation batches and its validation).

        Each round sends every pending row (``request(key)`` → ``(deal, input ids,
        sampling_params)``, with routes ``(deal, input ids, sampling_params, routes_start)``) to healthy server ``live[deal % len(live)]`` (``live``:
        :meth:`healthy` at the start of the round), one batched ``/generate`` per server
        (``generate(rows, version)``, default :meth:`generate_rows`). A row whose server failed
        marks that server down (:meth:`mark_down`: out of dispatch at once) and is sent again,
        as ``request(key)`` builds it then, in the next round, on a server still healthy; a row
        that came back is handed to ``accept(key, (ids, logprobs, kind, version))``, which
        returns False for a row to send again (an aborted row continued after a weight sync).
        Before a round that sends rows again (retried or continued), ``between_rounds()`` waits
        while a sync holds the servers and returns the version the servers hold then (it may raise
        to stop). Keys are sent in the order given.

        Returns:
            the rows sent again after their server failed.

        Raises:
            RuntimeError: no healthy server is left (:meth:`healthy`, every server named).
        """
        generate = generate or self.generate_rows
        retried = 0
        while pending:
            live = self.healthy()
            rows = []
            for key in pending:
                deal, ids, sp, *start = request(key)
                rows.append((live[deal % len(live)], ids, sp, *start))
            results = generate(rows, version)
            still = []
            for key, res in zip(pending, results):
                if isinstance(res, ServerFailure):  # its server leaves dispatch; the row goes to another
                    self.mark_down(res.server, res.message)
                    still.append(key)
                    retried += 1
                elif not accept(key, res):
                    still.append(key)
            pending = still
            if pending:  # retried, or a sync's abort: continue once it is over, on the new weights
                version = between_rounds()
        return retried

    # ---- asynchronous rows on one server (the streamed rollout) --------------------------
    @property
    def num_in_flight(self) -> int:
        """Rows submitted and not yet returned by :meth:`poll` or :meth:`abort`."""
        return sum(len(rows) for s in self._streams.values() for _, rows, _ in s.requests)

    def submit(self, rows: Sequence[RowRequest], server: int = 0) -> None:
        """Start the rows on server ``server``, each with its own ``rid``, seed and remaining
        budget, continued after its prefix
        (:func:`~dapo_megatron.rollout.engines.sglang_io.build_row_request`); the consecutive rows
        of one prompt are one streamed request (they share their prefill).

        Raises:
            ValueError: a row key already in flight.
        """
        keys = {row.key for s in self._streams.values() for _, rs, _ in s.requests for row in rs}
        batches: list[list[RowRequest]] = []
        for row in rows:
            if row.key in keys:
                raise ValueError(f"RowClient.submit: row key {row.key!r} is already in flight")
            keys.add(row.key)
            # with routes, one routed_experts_start_len per request (sglang_io.build_rows_request)
            if batches and batches[-1][0].prompt_seed == row.prompt_seed and (
                    self.routes_shape is None or batches[-1][0].routes_start == row.routes_start):
                batches[-1].append(row)
            else:
                batches.append([row])
        streams = self._streams.get(server)
        if streams is None:
            streams = self._streams[server] = _ServerStreams(self.urls[server], self.silence_timeout_s,
                                                             self.timeout_s, self.routes_shape)
        for batch in batches:
            # fixed width: dapo-rollout-server aborts every row whose rid starts with the given one
            streams.start(batch, [f"{self.rid_prefix}-{next(self._rids):012d}" for _ in batch])

    def poll(self, max_tokens: Optional[int] = None, version: int = 0) -> list[RowResult]:
        """The rows of the requests that answered, labelled weights ``version``: waits until
        one does (at most :attr:`poll_timeout_s` when ``max_tokens`` is set), or until all do
        when None.

        Raises:
            RuntimeError: a request failed (naming the server).
        """
        out = []
        for s in self._streams.values():
            if s.requests:
                s.wait(max_tokens is None, self.poll_timeout_s)
                out += s.collect(version, True, self.eos_token_ids)
        return out

    def abort(self, version: int = 0) -> list[RowResult]:
        """Stop every row in flight (``/abort_request`` per rid) and wait for every answer: the
        tokens sampled so far, finish reason ``"abort"`` (``"stop"`` / ``"length"`` where the row
        had already finished, :func:`~dapo_megatron.rollout.engines.sglang_io.parse_row_output`)."""
        out = []
        for s in self._streams.values():
            s.abort()
            out += s.collect(version, False, self.eos_token_ids)
        return out
