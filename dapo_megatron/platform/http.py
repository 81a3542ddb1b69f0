"""JSON over HTTP to SGLang-compatible servers (SGLang's own, or ``dapo-rollout-server``): one
call with a timeout whose every failure is one ``RuntimeError`` naming the URL and the server's
message (:func:`http_post`, :func:`http_get`), a call on every server at once
(:func:`each_server`), and a call in a thread while the caller runs the matching collective
(:class:`BackgroundCall`: a server joins a broadcast only once its HTTP request is in).

The standard library only (no torch): the row client, the server weight sync
(:mod:`dapo_megatron.bridge.servers`) and the SGLang engines share it.

Design: docs/design.md §3.8 (faults: every HTTP call bounded).
"""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from typing import Any, Optional, Sequence


def sglang_error_message(body: bytes) -> str:
    """SGLang's message in an error response body: ``{"message"}`` (weight-update endpoints),
    ``{"error": {"message"}}`` (generate, release / resume memory), FastAPI's 422
    ``{"detail": ...}``, or the plain text of ``/flush_cache``."""
    text = body.decode(errors="replace").strip()
    try:
        obj = json.loads(text)
    except ValueError:
        return text[:1000] or "(empty response body)"
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:1000]
        for k in ("message", "error", "detail"):
            if obj.get(k):
                return (obj[k] if isinstance(obj[k], str) else json.dumps(obj[k]))[:1000]
    return text[:1000]


def http_post(base_url: str, path: str, payload: Optional[dict], timeout: float, *, text: bool = False) -> Any:
    """POST JSON to ``base_url + path``.

    Returns:
        the decoded JSON body (None for an empty body or JSON ``null``), or with ``text``
        the body as a string (``/flush_cache`` answers plain text).

    Raises:
        RuntimeError: HTTP error status (naming the endpoint, with SGLang's message) or an
            unreachable server.
    """
    url = base_url.rstrip("/") + path
    data = json.dumps(payload if payload is not None else {}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    body = _http_call(req, url, timeout)
    if text:
        return body.decode(errors="replace")
    return json.loads(body) if body.strip() else None


def http_get(base_url: str, path: str, timeout: float) -> Any:
    """GET ``base_url + path``: the decoded JSON body (None for an empty body, e.g. ``/health``'s
    200). Raises ``RuntimeError`` as :func:`http_post` does."""
    url = base_url.rstrip("/") + path
    body = _http_call(urllib.request.Request(url, method="GET"), url, timeout)
    return json.loads(body) if body.strip() else None


def _http_call(req: urllib.request.Request, url: str, timeout: float) -> bytes:
    """One HTTP request, every failure a ``RuntimeError`` naming the URL: an error status (with
    SGLang's message), an unreachable server, or no answer within ``timeout`` seconds (a hung
    server must not hang the trainer)."""
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.read()
    except urllib.error.HTTPError as err:
        raise RuntimeError(f"SGLang server {url} returned HTTP {err.code}: "
                           f"{sglang_error_message(err.read())}") from None
    except urllib.error.URLError as err:
        if isinstance(err.reason, (TimeoutError, socket.timeout)):
            raise RuntimeError(f"SGLang server {url} did not answer within {timeout:g} s") from None
        raise RuntimeError(f"SGLang server {url} unreachable: {err.reason}") from None
    except (TimeoutError, socket.timeout):  # the connection opened, the answer never came
        raise RuntimeError(f"SGLang server {url} did not answer within {timeout:g} s") from None
    except (ConnectionError, OSError) as err:  # reset or closed mid-answer: the server died
        raise RuntimeError(f"SGLang server {url} unreachable: {err}") from None


def each_server(urls: Sequence[str], fn) -> list:
    """``fn(url)`` for every URL at once (threads); returns the results in order, raising one
    ``RuntimeError`` that lists every URL that failed."""
    results: list[Any] = [None] * len(urls)
    errors: list[Optional[str]] = [None] * len(urls)

    def run(i):
        try:
            results[i] = fn(urls[i])
        except Exception as err:  # collected: all failing servers are named at once
            errors[i] = str(err)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(urls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [e for e in errors if e is not None]
    if failed:
        raise RuntimeError("; ".join(failed))
    return results


class BackgroundCall:
    """``fn(*args)`` in a daemon thread while this thread does the matching collective (an HTTP call
    that makes a server join a process group or a broadcast). :attr:`done` is set when it returned
    or raised; :attr:`result` / :attr:`error` hold the outcome."""

    def __init__(self, fn, *args):
        self.result, self.error, self.done = None, None, threading.Event()
        threading.Thread(target=self._run, args=(fn, *args), daemon=True).start()

    def _run(self, fn, *args):
        try:
            self.result = fn(*args)
        except BaseException as err:  # re-raised by join(), or read by the broadcasting thread
            self.error = err
        finally:
            self.done.set()

    def join(self, timeout: Optional[float] = None) -> Any:
        """The call's result, waiting at most ``timeout`` seconds.

        Raises:
            RuntimeError: no answer in time. Whatever the call raised.
        """
        if not self.done.wait(timeout):
            raise RuntimeError("SGLang server did not answer in time")
        if self.error is not None:
            raise self.error
        return self.result
