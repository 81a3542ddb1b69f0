"""The colocated SGLang rollout engine (GPU): an offline ``sglang.Engine`` in the trainer's process.

SGLang is imported lazily (it needs CUDA); everything that does not need it — engine
arguments, request building, response parsing, error reporting, the memory bookkeeping of
sleep / wake — is plain python and tested on CPU (``tests/unit/rollout/test_sglang_engine.py``).
``tests/gpu/test_sglang_contract.py`` and ``tests/gpu/full_image_check.sh`` check the real
engine on a CUDA machine.

Versions: written against sglang 0.5.11 and re-read in 0.5.23 (the Docker image's pin): the
endpoints and request fields used below are unchanged in 0.5.23 (``managers/io_struct.py``, now
msgspec Structs whose HTTP schema ignores unknown fields, ``utils/msgspec_utils.py:95-100``;
``tests/sglang_reference.py`` ``REQUEST_FIELDS`` and the test of every body); ``ServerArgs``
became a msgspec Struct (``platform/sglang_server_args.py``) and the default prefill CUDA
graph cannot sleep (``colocated_graph_kwargs``). Every API below exists from 0.5.5 on (setup.py's
lower bound; ``cuda_graph`` became a memory tag in 0.5.5, ``enable_weights_cpu_backup`` /
``enable_deterministic_inference`` / ``sampling_seed`` in 0.5.3), read in the sources of each
release's wheel. Files are those of ``python/sglang/srt/`` in sglang 0.5.11 unless 0.5.23 is named:

* Processes: what ``Engine(...)`` spawns, inherits and changes, and its kill-every-child atexit
  that :class:`SGLangEngine` replaces, are :mod:`dapo_megatron.platform.sglang_env`'s (docs/design.md §6).
* ``Engine(**kwargs)`` builds ``server_args.ServerArgs(**kwargs)``
  (``entrypoints/engine.py``): the colocated engine passes the arguments it sets itself
  (:data:`~dapo_megatron.platform.sglang_server_args.MANAGED_ENGINE_ARGS`) and the checked
  ``rollout.engine_kwargs`` (:func:`check_engine_kwargs`).
* ``Engine.generate(input_ids=[[...]], sampling_params=[{...}], return_logprob=True)`` →
  one dict per row with ``meta_info.output_token_logprobs`` = ``[(logprob, token_id, text)]``
  and ``meta_info.finish_reason`` = ``{"type": "stop" | "length" | "abort", ...}``.
* Asynchronous rows (:meth:`SGLangEngine.submit` / ``poll`` / ``abort``): one
  ``Engine.async_generate(input_ids=prompt + prefix, sampling_params, return_logprob=True,
  rid=...)`` task per row on the engine's own event loop (``Engine.loop``, which the offline
  ``generate`` also drives with ``run_until_complete``), and
  ``Engine.tokenizer_manager.abort_request(rid)`` (``managers/tokenizer_manager.py``). The
  scheduler aborts by rid PREFIX (``managers/scheduler.py`` ``abort_request``:
  ``req.rid.startswith(recv_req.rid)``), so rids are fixed-width; a running request is
  finished with ``FINISH_ABORT`` after one more decode step and returns the tokens (and
  logprobs) it sampled; a queued one returns none (``_handle_abort_req``).
  ``schedule_batch.py`` ``check_finished`` sets the abort before checking EOS / length, so an
  aborted output that ends on a stop token or fills the budget is finished, not partial.
  Continuation is seed-exact under ``enable_deterministic_inference``: the sampler's noise is
  ``murmur_hash32(seed, position, token)`` (``layers/sampler.py`` ``multinomial_with_seed``),
  so a row resubmitted as prompt + prefix draws what it would have drawn uninterrupted.
* ``Engine.update_weights_from_tensor(named_tensors, load_format=None, flush_cache=True)``
  → ``(success, message)``; with ``load_format="flattened_bucket"``, ``named_tensors`` is the
  list of serialized flattened buckets, one per TP worker (see ``rollout/engines/engine_group.py``); ``Engine.flush_cache()`` → ``FlushCacheReqOutput(success,
  message)`` (``managers/io_struct.py``); ``Engine.release_memory_occupation(tags)`` /
  ``resume_memory_occupation(tags)`` → None (``managers/tokenizer_control_mixin.py``).
* Memory tags (``constants.py``): ``kv_cache``, ``weights``, ``cuda_graph``. Releasing
  ``weights`` unmaps their memory (``managers/scheduler_update_weights_mixin.py``,
  ``release_memory_occupation``: ``memory_saver_adapter.pause("weights")``);
  ``resume`` maps it back WITHOUT its contents unless the engine was launched with
  ``enable_weights_cpu_backup`` (``model_executor/model_runner.py``: the weights region
  is created with ``enable_cpu_backup``). Hence :attr:`~dapo_megatron.bridge.receiver.WeightReceiver.weights_valid`.
* Sampling seeds: ``sampling_seed`` is honoured only with ``enable_deterministic_inference``
  (``sampling/sampling_batch_info.py``: the seed tensor is built only ``if enable_deterministic``;
  ``layers/sampler.py``): :class:`SGLangEngine`'s ``deterministic``.

Logprobs: SGLang returns the logprob of each sampled token under its processed sampling
distribution (temperature applied; with top-p/top-k, see its ``SGLANG_RETURN_ORIGINAL_LOGPROB``
switch). With top_p == 1 and top_k == -1 this equals what the actor recomputes.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import itertools
from typing import Any, Optional, Sequence

import torch
from transformers import AutoConfig, GenerationConfig

from dapo_megatron.bridge.buckets import dtype_name
from dapo_megatron.bridge.flat_bucket import FlatBucketPacker
from dapo_megatron.bridge.receiver import ParamSpec, hf_param_specs
from dapo_megatron.bridge.verify import readback_checksum, readback_shape
from dapo_megatron.platform import device as rank_device, local_device_index
from dapo_megatron.platform import sglang_env
from dapo_megatron.rollout.engines.engine import (GenerationOutput, RolloutEngine, RowRequest, RowResult, SamplingParams,
                                                  eos_ids)
from dapo_megatron.rollout.engines.engine_group import RolloutGroup, sync_flat_buckets
from dapo_megatron.rollout.engines.sglang_io import (
    build_generate_request,
    build_row_request,
    parse_generate_output,
    parse_row_output,
)
from dapo_megatron.platform.sglang_server_args import check_engine_kwargs, colocated_graph_kwargs


def _import_sglang():
    try:
        import sglang  # noqa: F401
    except ImportError as err:  # pragma: no cover - depends on the GPU image
        raise ImportError("SGLangEngine needs the `sglang` package and a CUDA GPU: pip install -e .[gpu] "
                          "(or use rollout engine 'hf' on CPU)") from err
    return sglang


# ---------------------------------------------------------------------------- engine arguments
#: SGLang's ``--dtype`` choices (``server_args.py``) and the spellings of ``model.params_dtype``.
_SGLANG_DTYPES = {"auto": "auto", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16",
                  "fp16": "float16", "half": "float16", "float32": "float32", "fp32": "float32",
                  "float": "float32"}

def sglang_dtype(dtype: Any) -> str:
    """SGLang's ``dtype`` string for a ``torch.dtype`` or a dtype name (``"bf16"`` →
    ``"bfloat16"``, ``"fp32"`` → ``"float32"``).

    Raises:
        ValueError: a dtype SGLang does not serve in, naming the accepted spellings.
    """
    name = dtype_name(dtype) if isinstance(dtype, torch.dtype) else str(dtype)
    if name not in _SGLANG_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not an SGLang dtype; use one of {sorted(_SGLANG_DTYPES)}")
    return _SGLANG_DTYPES[name]


def check_result(result: Any, what: str) -> None:
    """Raise ``RuntimeError`` with SGLang's message when a control call reports failure.

    Result forms (sglang 0.5.11): ``(success, message)`` tuples (offline
    ``update_weights_from_tensor``), objects with ``.success`` / ``.message``
    (``FlushCacheReqOutput`` of the offline ``flush_cache``), ``{"success", "message"}``
    dicts (HTTP weight-update endpoints) and ``None`` (release / resume memory: success).

    Raises:
        RuntimeError: ``success`` is False (SGLang's message included), or the result has
            none of these forms.
    """
    if result is None:
        return
    if isinstance(result, (tuple, list)) and result and isinstance(result[0], bool):
        ok, msg = result[0], (result[1] if len(result) > 1 else "")
    elif isinstance(result, dict) and "success" in result:
        ok, msg = bool(result["success"]), result.get("message", "")
    elif hasattr(result, "success"):
        ok, msg = bool(result.success), getattr(result, "message", "")
    else:
        raise RuntimeError(f"SGLang {what} returned an unexpected result {str(result)[:200]!r} "
                           "(expected (success, message), .success or None)")
    if not ok:
        raise RuntimeError(f"SGLang {what} failed: {msg or '(SGLang gave no message; see the server log)'}")


# ---------------------------------------------------------------------------- engines
#: SGLang's memory tags (``sglang.srt.constants.GPU_MEMORY_TYPE_*``, all three since 0.5.5),
#: in the order its scheduler resumes them.
KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"
MEMORY_TAGS = (CUDA_GRAPH, WEIGHTS, KV_CACHE)


class SGLangMemory:
    """Sleep / wake bookkeeping of :class:`SGLangEngine`, apart from how SGLang is called.

    Keeps the set of released memory tags, releases ``kv_cache`` and ``cuda_graph`` (and
    ``weights`` unless ``keep_weights``) on :meth:`sleep`, resumes only ``weights`` before a
    sync into a sleeping engine (the KV cache stays released until :meth:`wake_up`, as in
    verl's colocated flow), and marks the weights invalid when they are released without a
    CPU backup. Subclasses provide ``_release(tags)``, ``_resume(tags)``, ``_flush()`` and
    set ``enable_memory_saver``, ``weights_cpu_backup``, ``_released``, ``_flush_pending``.
    """

    @property
    def is_asleep(self) -> bool:
        """Some memory is released: ``generate`` is refused until :meth:`wake_up`."""
        return bool(self._released)

    def sleep(self, keep_weights: bool = False) -> None:
        """Release the KV cache and CUDA graphs, and the weights unless ``keep_weights``.

        Released weights come back with their contents only when the engine keeps a CPU
        backup (``enable_weights_cpu_backup``); otherwise :attr:`weights_valid` turns False
        and the next ``update_weights`` (allowed while asleep) restores them.

        Raises:
            RuntimeError: the engine was launched without the memory saver, or SGLang
                reports a failure.
        """
        if not self.enable_memory_saver:
            raise RuntimeError(f"{type(self).__name__}.sleep needs the engine launched with the memory saver "
                               "(enable_memory_saver=True / --enable-memory-saver)")
        tags = [t for t in MEMORY_TAGS if t not in self._released and (t != WEIGHTS or not keep_weights)]
        if not tags:
            return
        self._release(tags)
        self._released.update(tags)
        if WEIGHTS in tags and not self.weights_cpu_backup:
            self._weights_valid = False  # the memory comes back without its contents

    def wake_up(self) -> None:
        """Resume every released tag; flush the prefix cache when a sync happened while asleep.
        Check :attr:`weights_valid` afterwards: weights released without a backup and not
        re-synced since are garbage."""
        if self._released:
            tags = [t for t in MEMORY_TAGS if t in self._released]
            self._resume(tags)
            self._released.clear()
        if self._flush_pending:
            self._flush()
            self._flush_pending = False

    def _bring_weights_back(self) -> None:
        """Before loading a bucket into a sleeping engine: map the weights' memory back."""
        if WEIGHTS in self._released:
            self._resume([WEIGHTS])
            self._released.discard(WEIGHTS)

    def _on_sync_finished(self) -> None:
        if KV_CACHE in self._released:
            self._flush_pending = True  # the KV cache is released; flush after wake_up
        else:
            self._flush()

    def _check_can_generate(self) -> None:
        if self._released:
            raise RuntimeError(f"{type(self).__name__}.generate called while asleep "
                               f"({sorted(self._released)} released); call wake_up() first")
        self._require_valid_weights()


class SGLangEngine(SGLangMemory, RolloutEngine):
    """Colocated offline ``sglang.Engine`` in this process, on this rank's GPU, or, with
    ``tp_size > 1``, on the GPUs of this rank's rollout group (this rank leads it; the other
    ranks are :class:`~dapo_megatron.rollout.engines.engine_group.EngineGroupMember` s).

    Args:
        model_path: HF model directory (config, tokenizer, initial weights).
        dtype: a ``torch.dtype`` or a name (``"bfloat16"``, ``"bf16"``, ``"float32"``, ...;
            :func:`sglang_dtype`).
        tp_size: SGLang tensor parallel size (GPUs ``base_gpu_id .. base_gpu_id + tp_size - 1``).
        mem_fraction_static: share of the GPU's memory for weights + KV cache
            (``rollout.gpu_memory_utilization``).
        enable_memory_saver: needed for ``sleep`` / ``wake_up`` (release / resume memory); with
            it the engine runs without a prefill CUDA graph unless ``engine_kwargs`` choose one
            (:func:`~dapo_megatron.platform.sglang_server_args.colocated_graph_kwargs`).
        base_gpu_id: first GPU of the engine; None: this rank's GPU,
            :func:`dapo_megatron.platform.local_device_index` (torchrun sets no
            ``CUDA_VISIBLE_DEVICES``: without it every rank's engine would start on GPU 0).
        deterministic: launch with ``enable_deterministic_inference``: SGLang honours the
            per-response ``sampling_seed`` only then, so rollouts repeat exactly (same
            prompts, seeds, weights, batch composition no longer matters). Cost: it forces
            the PyTorch sampling backend, batch-invariant attention (FlashAttention 3 on
            H100, FlashInfer/Triton elsewhere) and kernels (sglang 0.5.23
            ``arg_groups/attention_hook.py:580`` ``handle_deterministic_inference``,
            ``arg_groups/overrides.py:1030``), so generation is slower. False (default): GPU
            rollouts are not seed-reproducible.
        update_bucket_mb: bucket size of ``update_weights`` in MiB.
        engine_kwargs: further ``sglang.Engine`` (``ServerArgs``) arguments, checked by
            :func:`check_engine_kwargs` (e.g. ``load_format: dummy``: random weights at start,
            since the trainer syncs right after; the weights then count as invalid until the
            first sync; ``enable_weights_cpu_backup: true``: released weights survive sleep).
        group: this rank's :class:`~dapo_megatron.rollout.engines.engine_group.RolloutGroup` (``tp_size``
            ranks, this one first); None: this process alone (with ``tp_size > 1`` its one copy
            of each bucket is read by every TP worker, across GPUs).

    ``update_weights`` checks names and shapes against the HF model built from the
    checkpoint's config on the meta device, then loads as :meth:`_load_stream` says.

    Raises:
        ValueError: a bad ``dtype`` or ``engine_kwargs`` key, a group this rank does not lead
            or whose size is not ``tp_size``, or fewer visible GPUs than the engine spans.
        ImportError: no SGLang.
    """

    def __init__(self, model_path: str, *, dtype: Any = "bfloat16", tp_size: int = 1,
                 mem_fraction_static: float = 0.5, enable_memory_saver: bool = True,
                 base_gpu_id: Optional[int] = None, deterministic: bool = False, update_bucket_mb: int = 512,
                 engine_kwargs: Optional[dict] = None, group: Optional["RolloutGroup"] = None,
                 record_routes: Optional[tuple[int, int, int]] = None):
        super().__init__()
        dtype = sglang_dtype(dtype)
        extra = check_engine_kwargs(engine_kwargs, key="engine_kwargs")
        extra.update(colocated_graph_kwargs(extra, enable_memory_saver))  # no prefill graph under sleep
        self.record_routes = record_routes
        if record_routes is not None:  # routing replay: the server captures every token's experts
            extra["enable_return_routed_experts"] = True
        group = group or RolloutGroup.single(torch.distributed.get_rank() if torch.distributed.is_initialized() else 0)
        if not group.is_leader or group.size not in (1, tp_size):
            raise ValueError(f"SGLangEngine(tp_size={tp_size}) is created by the leader of a rollout group of "
                             f"{tp_size} ranks (or by one process alone); got rank {group.rank} of group {group.ranks}")
        sglang = _import_sglang()
        if base_gpu_id is None:
            base_gpu_id = local_device_index()
        if torch.cuda.is_available() and torch.cuda.device_count() < base_gpu_id + tp_size:
            raise ValueError(
                f"rollout.tensor_model_parallel_size={tp_size}: the engine of rank {group.rank} spans GPUs "
                f"{base_gpu_id}..{base_gpu_id + tp_size - 1}, but this process sees {torch.cuda.device_count()} "
                "GPU(s): give every rank all GPUs of its node (torchrun does; under Slurm do not bind one GPU "
                "per task)")
        self.group = group
        self.tp_size = int(tp_size)
        self.model_path = model_path
        self.update_bucket_bytes = int(update_bucket_mb) * 2**20
        self.enable_memory_saver = enable_memory_saver
        self.weights_cpu_backup = bool(extra.get("enable_weights_cpu_backup", False))
        self.deterministic = bool(deterministic)
        self.base_gpu_id = int(base_gpu_id)
        # sglang_env's module docstring: SGLang sizes its KV pool from the memory free now; its
        # scheduler children inherit our environment (no torchrun agent store for their tcp://
        # init_process_group; CUDA graphs under the memory saver); its kill-all atexit goes
        sglang_env.release_allocator_cache()
        before = sglang_env.child_pids()
        with sglang_env.engine_launch_env():
            self.engine = sglang.Engine(model_path=model_path, dtype=dtype, tp_size=tp_size,
                                        mem_fraction_static=mem_fraction_static,
                                        enable_memory_saver=enable_memory_saver, base_gpu_id=self.base_gpu_id,
                                        enable_deterministic_inference=self.deterministic, **extra)
        self._engine_pids = sglang_env.engine_child_pids(self.engine, before)
        sglang_env.detach_engine_atexit(self.engine)
        atexit.register(self.shutdown)
        self._released: set[str] = set()
        self._flush_pending = False
        # load_format="dummy": random weights until the first sync
        self._weights_valid = extra.get("load_format", "auto") != "dummy"
        self._tasks: dict[str, tuple[RowRequest, Any]] = {}  # rid -> (row, asyncio task), in submission order
        self._rids = itertools.count()
        self.poll_timeout_s = 0.5
        self._eos: Optional[frozenset] = None

    @property
    def eos_token_ids(self) -> frozenset:
        """The model's EOS ids (``config.json`` / ``generation_config.json``), which end a row."""
        if self._eos is None:
            sources = [AutoConfig.from_pretrained(self.model_path)]
            try:
                sources.append(GenerationConfig.from_pretrained(self.model_path))
            except OSError:  # no generation_config.json
                pass
            self._eos = frozenset(eos_ids(*sources))
        return self._eos

    # ---- asynchronous rows (module docstring) ----------------------------------------
    supports_async = True

    @property
    def num_in_flight(self) -> int:
        return len(self._tasks)

    def submit(self, rows: Sequence[RowRequest]) -> None:
        """One ``async_generate`` task per row on the engine's event loop (it runs during
        :meth:`poll` / :meth:`abort`; the scheduler process generates meanwhile)."""
        self._check_can_generate()
        keys = {row.key for row, _ in self._tasks.values()}
        for row in rows:
            if row.key in keys:
                raise ValueError(f"SGLangEngine.submit: row key {row.key!r} is already in flight")
            keys.add(row.key)
            rid = f"dapo-{id(self):x}-{next(self._rids):012d}"  # fixed width: SGLang aborts by rid prefix
            req = build_row_request(row, rid)
            if self.record_routes is not None:
                # the whole sequence's routes, sliced from row.routes_start in _collect: the offline
                # Engine.async_generate's keywords are not checked here for routed_experts_start_len
                req["return_routed_experts"] = True
            task = self.engine.loop.create_task(self.engine.async_generate(**req))
            self._tasks[rid] = (row, task)

    def poll(self, max_tokens: Optional[int] = None) -> list[RowResult]:
        """Rows finished so far: waits until at least one finishes (at most ``poll_timeout_s``
        seconds when ``max_tokens`` is set; SGLang cannot stop after a token count, so the
        streaming round is a time slice here), or until all finish when ``max_tokens`` is None."""
        if not self._tasks:
            return []
        pending = [task for _, task in self._tasks.values()]
        if max_tokens is None:
            self.engine.loop.run_until_complete(asyncio.wait(pending))
        else:
            self.engine.loop.run_until_complete(asyncio.wait(pending, timeout=self.poll_timeout_s,
                                                             return_when=asyncio.FIRST_COMPLETED))
        return self._collect(only_done=True)

    def abort(self) -> list[RowResult]:
        """``abort_request(rid)`` for every row in flight, then their outputs (partial, or
        finished where the abort came too late)."""
        for rid in self._tasks:
            self.engine.tokenizer_manager.abort_request(rid=rid)
        if self._tasks:
            self.engine.loop.run_until_complete(asyncio.wait([task for _, task in self._tasks.values()]))
        return self._collect(only_done=False)

    def _collect(self, only_done: bool) -> list[RowResult]:
        out = []
        for rid, (row, task) in list(self._tasks.items()):
            if only_done and not task.done():
                continue
            del self._tasks[rid]
            if self.record_routes is None:
                out.append(parse_row_output(task.result(), row, self.weight_version, self.eos_token_ids))
                continue
            res = parse_row_output(task.result(), dataclasses.replace(row, routes_start=0), self.weight_version,
                                   self.eos_token_ids, self.record_routes)
            out.append(res._replace(routes=res.routes[row.routes_start:]))
        return out

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams,
                 prompt_seeds: Optional[Sequence[int]] = None) -> GenerationOutput:
        """:meth:`RolloutEngine.generate`; ``RuntimeError`` for aborted rows or while asleep."""
        self._check_can_generate()
        req = build_generate_request(prompt_ids, params, prompt_seeds)
        if self.record_routes is not None:
            req["return_routed_experts"] = True  # meta_info.routed_experts (sglang 0.5.11 GenerateReqInput)
        out = self.engine.generate(**req)
        return parse_generate_output(out, len(prompt_ids), params.n, prompt_lens=[len(p) for p in prompt_ids],
                                     routes_shape=self.record_routes)

    def _param_specs(self) -> tuple[dict[str, ParamSpec], dict[str, str]]:
        return hf_param_specs(AutoConfig.from_pretrained(self.model_path))

    #: read the verified sample back with ``get_weights_by_name`` (``rollout.check_weight_update_readback``)
    verify_readback: bool = True

    def _loaded_checksums(self, names: list[str], dtype, readback_elements: Optional[int] = None) -> dict:
        """Each named tensor read back with ``Engine.get_weights_by_name(name, truncate_size=rows)``
        and checksummed in the sent dtype, its head rows within ``readback_elements``
        (:func:`~dapo_megatron.bridge.verify.readback_checksum`; what SGLang answers and why:
        docs/design.md §1.1)."""
        if not self.verify_readback:
            return {}
        tracker = self._weight_tracker()
        out = {}
        for name in names:
            shape = readback_shape(tracker.specs[tracker.resolve(name)].shape, readback_elements)
            out[name] = readback_checksum(self.engine.get_weights_by_name(name, truncate_size=shape[0] if shape else 1),
                                          dtype, shape)
        return out

    def _load_stream(self, named_tensors) -> None:
        """Every bucket as one flattened bucket per TP worker, each from the GPU of its rollout-group
        rank (:func:`~dapo_megatron.rollout.engines.engine_group.sync_flat_buckets`); the prefix cache is
        flushed once when the sync finishes (``_on_sync_finished``)."""
        self._bring_weights_back()
        if getattr(self, "_packer", None) is None or self._packer.bucket_bytes != self.update_bucket_bytes:
            self._packer = FlatBucketPacker(self.update_bucket_bytes, rank_device())
        expected = None
        if torch.cuda.is_available() and self.group.size == self.tp_size:  # TP worker i: GPU base_gpu_id + i
            expected = [str(torch.cuda.get_device_properties(self.base_gpu_id + i).uuid) for i in range(self.tp_size)]
        try:
            sync_flat_buckets(named_tensors, self.group, self._packer, apply=self._update_from_payloads,
                              expected_devices=expected)
        finally:  # every bucket is acknowledged: the GPU buffer is not held through rollout and training
            self._packer.release()

    def _update_from_payloads(self, payloads: list[bytes]) -> None:
        """``Engine.update_weights_from_tensor`` with one serialized flattened bucket per TP rank
        (sglang 0.5.11 ``entrypoints/engine.py``: with ``load_format="flattened_bucket"`` the
        list is passed through as ``serialized_named_tensors``, entry i to TP worker i). An engine
        driven by one process alone hands its one copy to every worker, which then reads it from
        that GPU (what ``update_weights_from_tensor`` does itself without a load format)."""
        if len(payloads) == 1 and self.tp_size > 1:
            payloads = payloads * self.tp_size
        check_result(self.engine.update_weights_from_tensor(named_tensors=payloads, load_format="flattened_bucket",
                                                            flush_cache=False),
                     f"update_weights_from_tensor (flattened_bucket, {len(payloads)} TP rank(s))")

    def _release(self, tags: list[str]) -> None:
        check_result(self.engine.release_memory_occupation(tags=tags), f"release_memory_occupation({tags})")

    def _resume(self, tags: list[str]) -> None:
        check_result(self.engine.resume_memory_occupation(tags=tags), f"resume_memory_occupation({tags})")

    def _flush(self) -> None:
        check_result(self.engine.flush_cache(), "flush_cache")

    def shutdown(self) -> None:
        """Stop the engine's own processes (scheduler(s), detokenizer) and wait for them; other
        children of this process (reward graders) live on, unlike with ``Engine.shutdown``, which
        kills every child (:func:`~dapo_megatron.platform.sglang_env.shutdown_engine`). Idempotent;
        also run at exit."""
        if getattr(self, "_engine_pids", None) is None:
            return
        pids, self._engine_pids = self._engine_pids, None
        sglang_env.shutdown_engine(self.engine, pids)
        atexit.unregister(self.shutdown)
