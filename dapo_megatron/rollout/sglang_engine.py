"""SGLang rollout engines (GPU): colocated offline ``sglang.Engine`` and a server mode.

SGLang is imported lazily (it needs CUDA); everything that does not need it — request
building, response parsing, bucketing, metadata order, error reporting, the HTTP client
and the weight-update process group — is plain python and tested on CPU
(``tests/unit/rollout/test_sglang_engine.py``). ``tests/gpu/test_sglang_contract.py`` checks the real
engine on a CUDA machine.

SGLang APIs used (sglang >= 0.5; ``python/sglang/srt/entrypoints/engine.py`` and
``http_server.py``):

* ``Engine.generate(input_ids=[[...]], sampling_params=[{...}], return_logprob=True)`` →
  one dict per row with ``meta_info.output_token_logprobs`` = ``[(logprob, token_id, text)]``
  and ``meta_info.finish_reason`` = ``{"type": "stop" | "length" | "abort", ...}``.
* ``Engine.update_weights_from_tensor(named_tensors, load_format=None, flush_cache=True)``,
  ``Engine.flush_cache()``, ``Engine.release_memory_occupation()`` /
  ``resume_memory_occupation()`` (the engine must be launched with
  ``enable_memory_saver=True``).
* HTTP: ``POST /generate`` (same fields), ``POST /init_weights_update_group``
  (``master_address, master_port, rank_offset, world_size, group_name, backend``),
  ``POST /update_weights_from_distributed`` (``names, dtypes, shapes, group_name,
  flush_cache``; the server then receives one ``broadcast(src=0)`` per tensor in the
  order of ``names``), ``POST /flush_cache``, ``POST /release_memory_occupation``,
  ``POST /resume_memory_occupation``. Results are ``{"success": bool, "message": str}``.

Logprobs: SGLang returns the logprob of each sampled token under its processed sampling
distribution (temperature applied; with top-p/top-k, see its ``SGLANG_RETURN_ORIGINAL_LOGPROB``
switch). With top_p == 1 and top_k == -1 this equals what the actor recomputes.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch

from dapo_megatron.rollout.buckets import bucket_metadata, dtype_name
from dapo_megatron.rollout.engine import (
    Completion,
    GenerationOutput,
    ParamSpec,
    RolloutEngine,
    SamplingParams,
    hf_param_specs,
    resolve_prompt_seeds,
    sample_seed,
    validate_prompt_ids,
)


def _import_sglang():
    try:
        import sglang  # noqa: F401
    except ImportError as err:  # pragma: no cover - depends on the GPU image
        raise ImportError("SGLangEngine needs the `sglang` package and a CUDA GPU: pip install -e .[gpu] "
                          "(or use rollout engine 'hf' on CPU)") from err
    return sglang


# ---------------------------------------------------------------------------- requests
def build_sampling_params(params: SamplingParams, seed: Optional[int]) -> dict[str, Any]:
    """SGLang ``sampling_params`` dict of one response row with its own ``sampling_seed``.

    ``n`` is expanded into rows by the caller (one request per response), so each row has
    its own seed (:func:`~dapo_megatron.rollout.engine.sample_seed`); ``no_stop_trim``
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
    if seed is not None:
        sp["sampling_seed"] = seed
    return sp


def build_generate_request(prompt_ids: Sequence[Sequence[int]], params: SamplingParams,
                           prompt_seeds: Optional[Sequence[int]] = None) -> dict[str, Any]:
    """The batched ``/generate`` payload (also the kwargs of ``Engine.generate``): each prompt
    repeated ``n`` times, one sampling-params dict per row (seeded per response, see
    :func:`~dapo_megatron.rollout.engine.sample_seed`), logprobs of the output only."""
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
def parse_completion(item: dict, row: int) -> Completion:
    """One SGLang output dict → :class:`Completion`.

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
    return Completion(ids, logprobs, kind)


def parse_generate_output(outputs: Any, num_prompts: int, n: int) -> GenerationOutput:
    """SGLang's batched ``generate`` result (list of ``num_prompts * n`` dicts, row order
    of :func:`build_generate_request`) → ``outputs[i][j]``.

    Raises:
        RuntimeError: wrong number of rows, or any row failed (see :func:`parse_completion`).
    """
    if isinstance(outputs, dict):
        outputs = [outputs]
    if not isinstance(outputs, list) or len(outputs) != num_prompts * n:
        got = len(outputs) if isinstance(outputs, list) else type(outputs).__name__
        raise RuntimeError(f"SGLang generate returned {got} outputs, expected {num_prompts} prompts x n={n}")
    rows = [parse_completion(item, r) for r, item in enumerate(outputs)]
    return [rows[i * n:(i + 1) * n] for i in range(num_prompts)]


def check_result(result: Any, what: str) -> None:
    """Raise ``RuntimeError`` when an SGLang control call reports failure.

    SGLang returns ``(success, message)`` tuples from the offline engine and
    ``{"success": bool, "message": str}`` over HTTP; ``None`` counts as success.
    """
    if result is None:
        return
    if isinstance(result, (tuple, list)) and result and isinstance(result[0], bool):
        ok, msg = result[0], (result[1] if len(result) > 1 else "")
    elif isinstance(result, dict) and "success" in result:
        ok, msg = bool(result["success"]), result.get("message", "")
    else:
        return
    if not ok:
        raise RuntimeError(f"SGLang {what} failed: {msg}")


def distributed_update_request(bucket: Sequence[tuple[str, torch.Tensor]], group_name: str,
                               flush_cache: bool = False) -> dict[str, Any]:
    """``/update_weights_from_distributed`` payload for one bucket: names, dtypes and shapes in
    exactly the order the tensors will then be broadcast."""
    meta = bucket_metadata(bucket)
    return {
        "names": [name for name, _, _ in meta],
        "dtypes": [dtype_name(dt) for _, _, dt in meta],
        "shapes": [list(shape) for _, shape, _ in meta],
        "group_name": group_name,
        "flush_cache": flush_cache,
    }


# ---------------------------------------------------------------------------- HTTP
def http_post(base_url: str, path: str, payload: Optional[dict], timeout: float) -> Any:
    """POST JSON to ``base_url + path`` and return the decoded JSON (or None for an empty body).

    Raises:
        RuntimeError: HTTP error status or unreachable server, naming the endpoint and
            including the server's message.
    """
    url = base_url.rstrip("/") + path
    data = json.dumps(payload if payload is not None else {}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
    except urllib.error.HTTPError as err:
        raise RuntimeError(f"SGLang server {url} returned HTTP {err.code}: "
                           f"{err.read().decode(errors='replace')[:500]}") from None
    except urllib.error.URLError as err:
        raise RuntimeError(f"SGLang server {url} unreachable: {err.reason}") from None
    return json.loads(body) if body.strip() else None


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout: timedelta = timedelta(minutes=10)):
    """Create a process group outside the default one (trainer rank 0 + engine workers).

    The same construction SGLang's ``init_weights_update_group`` uses on its side
    (``rendezvous`` on a TCP store, ``PrefixStore(group_name)``, ``_new_process_group_helper``),
    so both ends meet. Works with ``"nccl"`` (GPU) and ``"gloo"`` (CPU tests).
    """
    import inspect

    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    params = inspect.signature(_new_process_group_helper).parameters
    opts = {"backend_options": None} if "backend_options" in params else {"pg_options": None}
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      timeout=timeout, **opts)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class _Background:
    """Run an HTTP call in a thread while this thread does the matching collective."""

    def __init__(self, fn, *args):
        self.result, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(fn, *args), daemon=True)
        self.thread.start()

    def _run(self, fn, *args):
        try:
            self.result = fn(*args)
        except BaseException as err:  # re-raised in join()
            self.error = err

    def join(self, timeout: Optional[float] = None):
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise RuntimeError("SGLang server did not answer in time")
        if self.error is not None:
            raise self.error
        return self.result


# ---------------------------------------------------------------------------- engines
def _memory_tags_except_weights() -> list[str]:
    """SGLang's memory tags other than ``"weights"`` (``kv_cache``, and ``cuda_graph`` in
    newer versions): what ``wake_up`` still has to resume after a sync while asleep."""
    try:
        from sglang.srt.constants import GPU_MEMORY_ALL_TYPES
    except ImportError:  # older SGLang: weights and kv_cache only
        return ["kv_cache"]
    return [t for t in GPU_MEMORY_ALL_TYPES if t != "weights"]


class SGLangEngine(RolloutEngine):
    """Colocated offline ``sglang.Engine`` in this process (one per node / TP group).

    Args:
        model_path: HF model directory (config, tokenizer, initial weights).
        dtype: ``"bfloat16"`` (default), another SGLang dtype string, or a ``torch.dtype``.
        tp_size: SGLang tensor parallel size.
        mem_fraction_static: share of GPU memory for weights + KV cache.
        enable_memory_saver: needed for ``sleep``/``wake_up`` (release/resume memory).
        update_bucket_mb: bucket size of ``update_weights`` in MiB.
        engine_kwargs: further ``sglang.Engine`` (``ServerArgs``) arguments.

    ``update_weights`` checks names and shapes against the HF model built from the
    checkpoint's config on the meta device, streams buckets through
    ``update_weights_from_tensor(flush_cache=False)`` and flushes the prefix cache once at
    the end of a complete sync.
    """

    def __init__(self, model_path: str, *, dtype: Any = "bfloat16", tp_size: int = 1,
                 mem_fraction_static: float = 0.5, enable_memory_saver: bool = True, update_bucket_mb: int = 512,
                 engine_kwargs: Optional[dict] = None):
        super().__init__()
        sglang = _import_sglang()
        self.model_path = model_path
        self.update_bucket_bytes = int(update_bucket_mb) * 2**20
        self.enable_memory_saver = enable_memory_saver
        if isinstance(dtype, torch.dtype):
            dtype = dtype_name(dtype)
        self.engine = sglang.Engine(model_path=model_path, dtype=dtype, tp_size=tp_size,
                                    mem_fraction_static=mem_fraction_static,
                                    enable_memory_saver=enable_memory_saver, **(engine_kwargs or {}))
        self._asleep = False
        self._weights_resident = True  # False between sleep() and the next weight load / wake_up()
        self._flush_pending = False

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams,
                 prompt_seeds: Optional[Sequence[int]] = None) -> GenerationOutput:
        """See :meth:`RolloutEngine.generate`; raises ``RuntimeError`` on aborted rows or when asleep."""
        if self._asleep:
            raise RuntimeError("SGLangEngine.generate called while asleep; call wake_up() first")
        req = build_generate_request(prompt_ids, params, prompt_seeds)
        out = self.engine.generate(**req)
        return parse_generate_output(out, len(prompt_ids), params.n)

    def _param_specs(self) -> tuple[dict[str, ParamSpec], dict[str, str]]:
        from transformers import AutoConfig

        return hf_param_specs(AutoConfig.from_pretrained(self.model_path))

    def _load_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        if not self._weights_resident:  # synced while asleep: bring back the weights only (KV cache later)
            check_result(self.engine.resume_memory_occupation(tags=["weights"]), "resume_memory_occupation(weights)")
            self._weights_resident = True
        check_result(self.engine.update_weights_from_tensor(named_tensors=bucket, flush_cache=False),
                     f"update_weights_from_tensor ({len(bucket)} tensors, first {bucket[0][0]!r})")

    def _on_sync_finished(self) -> None:
        if self._asleep:
            self._flush_pending = True  # the KV cache is released; flush after wake_up
        else:
            check_result(self.engine.flush_cache(), "flush_cache")

    def sleep(self) -> None:
        """Release weights and KV cache GPU memory (``release_memory_occupation``).

        ``update_weights`` may be called while asleep (the trainer syncs right after the
        actor's update): it first resumes only the weights (``tags=["weights"]``), so the
        KV cache stays released until :meth:`wake_up`, as in verl's colocated flow.
        """
        if not self.enable_memory_saver:
            raise RuntimeError("SGLangEngine.sleep needs enable_memory_saver=True at construction")
        if not self._asleep:
            check_result(self.engine.release_memory_occupation(), "release_memory_occupation")
            self._asleep = True
            self._weights_resident = False

    def wake_up(self) -> None:
        """Take the memory back (``resume_memory_occupation``). SGLang does not back up the
        released weights unless launched with ``enable_weights_cpu_backup``: sync weights
        (``update_weights``) after ``wake_up`` and before generating, as the trainer does
        after every step."""
        if self._asleep:
            if self._weights_resident:
                rest = _memory_tags_except_weights()
                check_result(self.engine.resume_memory_occupation(tags=rest), f"resume_memory_occupation({rest})")
            else:
                check_result(self.engine.resume_memory_occupation(), "resume_memory_occupation")
            self._asleep = False
            self._weights_resident = True
            if self._flush_pending:
                check_result(self.engine.flush_cache(), "flush_cache")
                self._flush_pending = False

    def shutdown(self) -> None:
        self.engine.shutdown()


class SGLangServerEngine(RolloutEngine):
    """Client of a separately launched SGLang server (``python -m sglang.launch_server``).

    Generation goes over HTTP ``/generate``. Weights go over a process group shared by
    this trainer rank (rank 0) and the server's workers (ranks 1..world_size-1), created by
    :meth:`init_weights_update_group`; each bucket is announced with
    ``/update_weights_from_distributed`` (names, dtypes, shapes in order) and its tensors
    are then broadcast from rank 0 in that order. Only one trainer rank (the one holding
    the gathered full tensors) may call ``update_weights``.

    Args:
        base_url: e.g. ``"http://10.0.0.5:30000"``.
        param_specs: ``(specs, aliases)`` of the served model (e.g. from
            :func:`dapo_megatron.rollout.engine.hf_param_specs`) for the sync checks.
        device: device the broadcast tensors are moved to (``"cuda"`` for NCCL, ``"cpu"``
            for gloo).
        timeout_s: HTTP timeout per call, seconds.
        update_bucket_mb: bucket size of ``update_weights`` in MiB.
    """

    def __init__(self, base_url: str, param_specs: tuple[dict[str, ParamSpec], dict[str, str]], *,
                 device: str = "cuda", timeout_s: float = 600.0, update_bucket_mb: int = 512):
        super().__init__()
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self._specs = param_specs
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.update_bucket_bytes = int(update_bucket_mb) * 2**20
        self.group = None
        self.group_name: Optional[str] = None

    def _post(self, path: str, payload: Optional[dict] = None) -> Any:
        result = http_post(self.base_url, path, payload, self.timeout_s)
        check_result(result, path)
        return result

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams,
                 prompt_seeds: Optional[Sequence[int]] = None) -> GenerationOutput:
        """See :meth:`RolloutEngine.generate` (one batched ``/generate`` request)."""
        req = build_generate_request(prompt_ids, params, prompt_seeds)
        return parse_generate_output(self._post("/generate", req), len(prompt_ids), params.n)

    def init_weights_update_group(self, master_address: str, master_port: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl") -> None:
        """Create the trainer↔server group: the server's workers join with ranks
        ``1..world_size-1`` (``rank_offset=1``) while this process joins as rank 0."""
        payload = {"master_address": master_address, "master_port": int(master_port), "rank_offset": 1,
                   "world_size": int(world_size), "group_name": group_name, "backend": backend}
        call = _Background(self._post, "/init_weights_update_group", payload)
        self.group = init_custom_process_group(backend, f"tcp://{master_address}:{master_port}", world_size, 0,
                                               group_name)
        call.join(self.timeout_s)
        self.group_name = group_name

    def _param_specs(self) -> tuple[dict[str, ParamSpec], dict[str, str]]:
        return self._specs

    def _load_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        if self.group is None:
            raise RuntimeError("SGLangServerEngine.update_weights: call init_weights_update_group() first")
        call = _Background(self._post, "/update_weights_from_distributed",
                           distributed_update_request(bucket, self.group_name, flush_cache=False))
        for _, tensor in bucket:
            torch.distributed.broadcast(tensor.detach().to(self.device).contiguous(), src=0, group=self.group)
        call.join(self.timeout_s)

    def _on_sync_finished(self) -> None:
        self._post("/flush_cache")

    def sleep(self) -> None:
        """``/release_memory_occupation`` (server launched with ``--enable-memory-saver``)."""
        self._post("/release_memory_occupation")

    def wake_up(self) -> None:
        """``/resume_memory_occupation``."""
        self._post("/resume_memory_occupation")
