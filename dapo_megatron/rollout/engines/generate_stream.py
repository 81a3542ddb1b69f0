"""Streamed ``/generate`` (SGLang's ``"stream": true``): generation requests that show progress,
bounded by a server's silence instead of their total time.

A non-streamed ``/generate`` of a whole batch sends nothing until its last row ends, so the
only bound that can be put on it is on its total time, which a long batch (thousands of rows
of 20k tokens) passes while the server is working. A streamed request sends bytes as rows
decode, so the client bounds the *silence* of a server (``rollout.server_silence_timeout_s``):
a server none of whose streams in flight sent a byte for that long is failed (its ``/health``
answer is put in the message), whatever the total time.

The protocol, from sglang 0.5.23 (paths under ``python/sglang/srt/``):

* ``entrypoints/http_server.py:949-981`` (``serve_generate_request``): with ``obj.stream`` the
  answer is ``text/event-stream``: every output is one event ``b"data: " + json + b"\\n\\n"``,
  then ``data: [DONE]\\n\\n``; an error raised while streaming (a ``ValueError``) is sent as an
  event ``{"error": {"message", "type", "code", "retryable"}}`` before the ``[DONE]``.
* ``managers/tokenizer_manager.py:2186-2231`` (``_handle_batch_request`` /
  ``_stream_batch_responses``): a batched request streams the rows interleaved, each event
  ONE row's output with ``"index"`` = the row's position in the batch, in the order they come.
* ``managers/tokenizer_manager.py:2630-2700`` (``_handle_batch_output``): by default
  (``--incremental-streaming-output`` off) every event carries the row's output so far
  (``output_ids``, ``meta_info.output_token_logprobs``); with it, only the new tokens and their
  logprobs (``_slice_streaming_output_meta_info``, line 364). Either way
  ``meta_info.completion_tokens`` is the row's count so far
  (``scheduler_components/output_streamer.py:522``) and ``finish_reason`` is None until the
  row's last event. :class:`StreamedGenerate` reads both forms with one rule: an event's
  tokens are the LAST ``len(output_ids)`` of ``completion_tokens``.
* ``scheduler_components/output_streamer.py:453-468``: a row sends its first token at once,
  then every ``stream_interval`` tokens (the request's ``sampling_params.stream_interval``,
  else the server's ``--stream-interval``, default 1). :func:`~dapo_megatron.rollout.engines.sglang_io.progress_interval`
  sets it per row so a row sends about ``sglang_io.EVENTS_PER_ROW`` events: without ``--incremental-streaming-output``
  each event repeats the row's tokens so far, and one per token would cost O(length²) bytes.

``dapo-rollout-server`` (``dapo_megatron/rollout_server/``) serves the same protocol, so the tests run
this client against a real server on CPU.

Design: docs/design.md §3.8 (faults: every ``/generate`` bounded by the server's silence).
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.parse
from typing import Any, Optional, Sequence

from dapo_megatron.platform.http import http_get, sglang_error_message


class Liveness:
    """When one server last sent a byte on any of its streamed requests in flight.

    Shared by every :class:`StreamedGenerate` to one server, so a request that waits in the
    server's queue while others decode is not silent: the server is (``silent_s``)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._in_flight = 0
        self._last = time.monotonic()

    def opened(self) -> None:
        with self._lock:
            if not self._in_flight:  # the clock starts with the first request in flight
                self._last = time.monotonic()
            self._in_flight += 1

    def closed(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def beat(self) -> None:
        self._last = time.monotonic()

    def silent_s(self) -> float:
        """Seconds since the last byte, while a request is in flight (else 0)."""
        with self._lock:
            return time.monotonic() - self._last if self._in_flight else 0.0


class _Row:
    __slots__ = ("ids", "logprobs", "final")

    def __init__(self):
        self.ids: list = []
        self.logprobs: Optional[list] = None
        self.final: Optional[dict] = None


class StreamedGenerate:
    """One streamed ``/generate`` of a batch (``payload["input_ids"]``: a list of rows), read in a
    thread. When :attr:`done` is set, :attr:`result` holds one output dict per row, in the
    batch's order, in the form of a non-streamed answer (the row's whole ``output_ids`` and
    ``meta_info.output_token_logprobs``, the ``meta_info`` of its last event), or :attr:`error`
    says why not (naming the server).

    Args:
        url: the server's base URL.
        payload: the ``/generate`` body (``"stream": true`` is added).
        connect_timeout_s: bound on opening the connection; after that only the silence bound
            applies (:func:`wait_streams`, :meth:`cancel`).
        liveness: the server's :class:`Liveness` (shared by its streams); None: one of its own.
        answered: an event set when the request ends (wakes a poller of several).
    """

    def __init__(self, url: str, payload: dict, *, connect_timeout_s: float, liveness: Optional[Liveness] = None,
                 answered: Optional[threading.Event] = None):
        self.url = url
        self.num_rows = len(payload["input_ids"])
        self.liveness = liveness if liveness is not None else Liveness()
        self.result: Optional[list[dict]] = None
        self.error: Optional[str] = None
        self.done = threading.Event()
        self._answered = answered
        self._connect_timeout_s = float(connect_timeout_s)
        self._body = json.dumps({**payload, "stream": True}).encode()
        self._rows = [_Row() for _ in range(self.num_rows)]
        self._conn: Optional[http.client.HTTPConnection] = None
        self._cancelled: Optional[str] = None
        self._lock = threading.Lock()
        self.liveness.opened()
        threading.Thread(target=self._run, name="generate-stream", daemon=True).start()

    def cancel(self, reason: str) -> None:
        """End the request from another thread: :attr:`error` becomes ``reason`` (a server that
        stopped sending; the connection is shut, which makes the server abort its rows)."""
        with self._lock:
            if self.done.is_set() or self._cancelled is not None:
                return
            self._cancelled = reason
            conn = self._conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _run(self) -> None:
        try:
            self.result = self._read()
        except Exception as err:  # reported through .error, naming the server
            self.error = self._cancelled or (str(err) if str(err).startswith("SGLang server")
                                             else f"SGLang server {self.url}/generate (streamed): {err}")
        finally:
            conn = self._conn
            if conn is not None:
                conn.close()
            self.liveness.closed()
            self.done.set()
            if self._answered is not None:
                self._answered.set()

    def _read(self) -> list[dict]:
        where = f"SGLang server {self.url}/generate"
        u = urllib.parse.urlsplit(self.url)
        cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        conn = cls(u.hostname, u.port, timeout=self._connect_timeout_s)
        with self._lock:
            self._conn = conn
        try:
            conn.connect()
        except (TimeoutError, socket.timeout):
            raise RuntimeError(f"{where} did not accept a connection within {self._connect_timeout_s:g} s") from None
        except OSError as err:
            raise RuntimeError(f"{where} unreachable: {err}") from None
        conn.sock.settimeout(None)  # from here the silence bound applies (wait_streams / cancel)
        with self._lock:
            if self._cancelled:
                raise RuntimeError(self._cancelled)
        path = (u.path.rstrip("/") or "") + "/generate"
        conn.request("POST", path, body=self._body, headers={"Content-Type": "application/json",
                                                              "Accept": "text/event-stream"})
        resp = conn.getresponse()
        self.liveness.beat()
        if resp.status != 200:
            raise RuntimeError(f"{where} returned HTTP {resp.status}: {sglang_error_message(resp.read())}")
        data: list[bytes] = []
        while True:
            line = resp.readline()
            if not line:
                raise RuntimeError(f"{where}: the stream ended before 'data: [DONE]' (the server closed it)")
            self.liveness.beat()
            line = line.rstrip(b"\r\n")
            if line.startswith(b"data:"):
                data.append(line[5:].lstrip(b" "))
                continue
            if line or not data:  # another SSE field, or a blank line with no event
                continue
            event, data = b"\n".join(data), []
            if event == b"[DONE]":
                missing = [i for i, r in enumerate(self._rows) if r.final is None]
                if missing:
                    raise RuntimeError(f"{where}: the stream ended with rows {missing[:10]} of {self.num_rows} "
                                       "unfinished")
                return [r.final for r in self._rows]
            self._event(json.loads(event), where)

    def _event(self, out: Any, where: str) -> None:
        if not isinstance(out, dict):
            raise RuntimeError(f"{where}: a stream event is not a JSON object: {str(out)[:200]}")
        if "error" in out and "meta_info" not in out:  # http_server.py: a ValueError while streaming
            err = out["error"]
            raise RuntimeError(f"{where}: {err.get('message') if isinstance(err, dict) else err}")
        index = out.pop("index", None)
        if index is None and self.num_rows == 1:
            index = 0
        if not isinstance(index, int) or not 0 <= index < self.num_rows:
            raise RuntimeError(f"{where}: a stream event has index {index!r} for a batch of {self.num_rows} rows")
        row, meta = self._rows[index], out.get("meta_info") or {}
        if row.final is not None:
            raise RuntimeError(f"{where}: an event for row {index} after its last one")
        ids = list(out.get("output_ids") or [])
        total = meta.get("completion_tokens", len(ids))
        row.ids = _tail(row.ids, ids, total, f"{where}: row {index} output_ids")
        lps = meta.get("output_token_logprobs")
        if lps is not None:
            row.logprobs = _tail(row.logprobs or [], list(lps), total, f"{where}: row {index} output_token_logprobs")
        if meta.get("finish_reason") is not None:
            meta = dict(meta)
            if row.logprobs is not None:
                meta["output_token_logprobs"] = row.logprobs
                meta["output_token_logprobs_length"] = len(row.logprobs)
            row.final = {**out, "output_ids": row.ids, "meta_info": meta}


def _tail(have: list, new: list, total: int, what: str) -> list:
    """The row's items after an event whose ``new`` items are the last of ``total``: the whole
    list so far (SGLang's default) or the new part only (``--incremental-streaming-output``)."""
    keep = int(total) - len(new)
    if not 0 <= keep <= len(have):
        raise RuntimeError(f"{what}: an event with {len(new)} items of {total} after {len(have)} (a broken stream)")
    return have[:keep] + new


def wait_streams(streams: Sequence[StreamedGenerate], silence_s: float, health_timeout_s: float) -> None:
    """Wait until every stream is done. A stream whose server (its :class:`Liveness`) sent no byte
    for ``silence_s`` seconds is cancelled with an error naming the server, the bound and its
    ``/health`` answer; never on total time. Never raises for a server's failure (see each
    stream's :attr:`~StreamedGenerate.error`)."""
    step = min(1.0, max(0.01, silence_s / 4))
    checked: dict[int, str] = {}  # liveness id -> /health answer, probed once per silent server
    while True:
        pending = [s for s in streams if not s.done.is_set()]
        if not pending:
            return
        for s in pending:
            silent = s.liveness.silent_s()
            if silent >= silence_s:
                key = id(s.liveness)
                if key not in checked:
                    try:
                        http_get(s.url, "/health", health_timeout_s)
                        checked[key] = "/health answers 200: the server is up but its generation stalled"
                    except RuntimeError as err:
                        checked[key] = f"/health: {err}"
                s.cancel(f"SGLang server {s.url}/generate: no bytes for {silent:.1f} s on its streamed requests "
                         f"(rollout.server_silence_timeout_s={silence_s:g}); {checked[key]}")
        pending[0].done.wait(step)


def stream_generate(url: str, payload: dict, *, silence_s: float, connect_timeout_s: float) -> list[dict]:
    """One streamed ``/generate`` of a batch, waited for under the silence bound: one output dict
    per row (:class:`StreamedGenerate`).

    Raises:
        RuntimeError: the server failed, refused the request, or was silent too long (naming it).
    """
    s = StreamedGenerate(url, payload, connect_timeout_s=connect_timeout_s)
    wait_streams([s], silence_s, connect_timeout_s)
    if s.error is not None:
        raise RuntimeError(s.error)
    return s.result
