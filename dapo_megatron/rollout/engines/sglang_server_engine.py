"""Client of one separately launched SGLang server as a :class:`~dapo_megatron.rollout.engines.engine.RolloutEngine`
(:class:`SGLangServerEngine`): generation through the HTTP row client's plain ``/generate``, weights
one broadcast per tensor over a process group with the server's workers, sleep and wake through
``/release_memory_occupation`` and ``/resume_memory_occupation``. (The trainer's server mode is
:class:`~dapo_megatron.rollout.engines.server_sync.ServerRollout`, whose weights go as flattened
buckets, :mod:`dapo_megatron.bridge.servers`.) The endpoints and their answers:
:mod:`~dapo_megatron.rollout.engines.sglang_engine`'s module docstring.

Design: docs/design.md §2.2 (the wire form, tested against ``tests/sglang_standin.py``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from dapo_megatron.bridge.buckets import bucket_metadata
from dapo_megatron.bridge.receiver import ParamSpec
from dapo_megatron.bridge.servers import distributed_update_request, init_custom_process_group
from dapo_megatron.platform import collectives, device as rank_device
from dapo_megatron.platform.http import BackgroundCall, http_post
from dapo_megatron.rollout.engines.engine import GenerationOutput, RolloutEngine, SamplingParams
from dapo_megatron.rollout.engines.row_client import RowClient
from dapo_megatron.rollout.engines.sglang_engine import SGLangMemory, check_result


class SGLangServerEngine(SGLangMemory, RolloutEngine):
    """Client of a separately launched SGLang server (``python -m sglang.launch_server``).

    Generation goes over HTTP ``/generate``. Weights go over a process group shared by
    this trainer rank (rank 0) and the server's workers (ranks 1..world_size-1), created by
    :meth:`init_weights_update_group`; each bucket is announced with
    ``/update_weights_from_distributed`` (names, dtypes, shapes in order) and its tensors
    are then broadcast from rank 0 in that order. Only one trainer rank (the one holding
    the gathered full tensors) may call ``update_weights``. Sleep / wake go through
    ``/release_memory_occupation`` and ``/resume_memory_occupation`` with the same tags and
    weight-validity rules as :class:`~dapo_megatron.rollout.engines.sglang_engine.SGLangEngine`.
    Seeds apply only when the server was launched with ``--enable-deterministic-inference``.

    Args:
        base_url: e.g. ``"http://10.0.0.5:30000"``.
        param_specs: ``(specs, aliases)`` of the served model (e.g. from
            :func:`dapo_megatron.bridge.receiver.hf_param_specs`) for the sync checks.
        device: device the broadcast tensors are moved to (a CUDA device for NCCL, ``"cpu"``
            for gloo); None: this rank's device (:func:`dapo_megatron.platform.device`).
        timeout_s: HTTP timeout per call, seconds.
        update_bucket_mb: bucket size of ``update_weights`` in MiB.
        enable_memory_saver: the server was launched with ``--enable-memory-saver``.
        weights_cpu_backup: the server was launched with ``--enable-weights-cpu-backup``.
    """

    def __init__(self, base_url: str, param_specs: tuple[dict[str, ParamSpec], dict[str, str]], *,
                 device: Optional[str] = None, timeout_s: float = 600.0, update_bucket_mb: int = 512,
                 enable_memory_saver: bool = True, weights_cpu_backup: bool = False):
        super().__init__()
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self._specs = param_specs
        if device is None:
            device = rank_device()
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.update_bucket_bytes = int(update_bucket_mb) * 2**20
        self.enable_memory_saver = enable_memory_saver
        self.weights_cpu_backup = weights_cpu_backup
        self.group = None
        self.group_name: Optional[str] = None
        self._released: set[str] = set()
        self._flush_pending = False
        # generation: the HTTP row client, one plain /generate bounded by timeout_s (not streamed)
        self.client = RowClient([self.base_url], silence_timeout_s=timeout_s, timeout_s=timeout_s, stream=False)

    def _post(self, path: str, payload: Optional[dict] = None) -> Any:
        result = http_post(self.base_url, path, payload, self.timeout_s)
        check_result(result, path)
        return result

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams,
                 prompt_seeds: Optional[Sequence[int]] = None) -> GenerationOutput:
        """See :meth:`RolloutEngine.generate` (one batched ``/generate`` request:
        :meth:`~dapo_megatron.rollout.engines.row_client.RowClient.generate`)."""
        self._check_can_generate()
        return self.client.generate(0, prompt_ids, params, prompt_seeds)

    def init_weights_update_group(self, master_address: str, master_port: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl") -> None:
        """Create the trainer↔server group: the server's workers join with ranks
        ``1..world_size-1`` (``rank_offset=1``) while this process joins as rank 0."""
        payload = {"master_address": master_address, "master_port": int(master_port), "rank_offset": 1,
                   "world_size": int(world_size), "group_name": group_name, "backend": backend}
        call = BackgroundCall(self._post, "/init_weights_update_group", payload)
        self.group = init_custom_process_group(backend, f"tcp://{master_address}:{master_port}", world_size, 0,
                                               group_name)
        call.join(self.timeout_s)
        self.group_name = group_name

    def _param_specs(self) -> tuple[dict[str, ParamSpec], dict[str, str]]:
        return self._specs

    def _load_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        if self.group is None:
            raise RuntimeError("SGLangServerEngine.update_weights: call init_weights_update_group() first")
        self._bring_weights_back()
        call = BackgroundCall(self._post, "/update_weights_from_distributed",
                           distributed_update_request(bucket_metadata(bucket), self.group_name, flush_cache=False))
        for _, tensor in bucket:
            collectives.broadcast(tensor.detach().to(self.device).contiguous(), src=0, group=self.group)
        call.join(self.timeout_s)

    def _release(self, tags: list[str]) -> None:
        self._post("/release_memory_occupation", {"tags": tags})

    def _resume(self, tags: list[str]) -> None:
        self._post("/resume_memory_occupation", {"tags": tags})

    def _flush(self) -> None:
        # plain text on success ("Cache flushed. ..."); HTTP 400 with the message otherwise
        http_post(self.base_url, "/flush_cache", None, self.timeout_s, text=True)
