"""Weight sync into a tensor-parallel colocated SGLang engine: every rank of a rollout group
hands its GPU's copy of each bucket to the engine its leader drives.

A rollout group is ``rollout.tensor_model_parallel_size`` consecutive ranks on one node
(:mod:`dapo_megatron.rollout.engines.layout`). Its first rank (the leader) creates one
``sglang.Engine(tp_size=<group size>, base_gpu_id=<its GPU>)``, whose TP worker ``i`` runs on
GPU ``base_gpu_id + i`` (sglang 0.5.11 ``entrypoints/engine.py``
``_launch_scheduler_processes``: ``gpu_id = base_gpu_id + tp_rank * gpu_id_step``), i.e. on
the GPU of the group's ``i``-th rank. Per bucket of the sync (:func:`sync_flat_buckets`):

1. every rank of the group, fed the same full HF tensors by the bridge, packs the bucket into
   its flat buffer on its own GPU (:class:`~dapo_megatron.bridge.flat_bucket.FlatBucketPacker`)
   and serializes it as CUDA-IPC handles (SGLang's ``MultiprocessingSerializer`` with its
   torch-reduction patch, :func:`~dapo_megatron.bridge.flat_bucket.serialize_for_engine`);
2. the payloads are gathered over the group's gloo group to the leader, which checks that
   every rank packed the same bucket (names, shapes, dtypes, offsets) on the GPU its SGLang TP
   worker runs on;
3. the leader calls ``update_weights_from_tensor(named_tensors=[payload of TP rank 0, 1, ...],
   load_format="flattened_bucket", flush_cache=False)``: SGLang hands TP worker ``i`` entry
   ``i`` (``managers/tp_worker.py``: ``serialized_named_tensors[self.tp_rank]``), so each worker
   opens the copy on its own GPU and loads its shard of it (``model.load_weights``);
4. the leader broadcasts the outcome over the group; each rank keeps its buffer alive until
   then (the workers read it through the IPC handle while the leader's call runs), and every
   rank raises the same error when the update failed.

The offline engine takes its model-update lock for the update, which waits for running
generate calls (``managers/tokenizer_control_mixin.py`` ``update_weights_from_tensor``:
``model_update_lock.writer_lock``), so no request samples from half-updated weights; the
prefix cache is flushed once at the end of a complete sync (the engines' ``_on_sync_finished``).
On CPU the same path runs with the tensors in shared memory instead of CUDA IPC
(``ForkingPickler``'s own reduction for CPU tensors), which is how the tests check it.

Design: docs/design.md §2 (rollout-TP groups).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from dapo_megatron.platform import collectives
from dapo_megatron.platform import device as rank_device
from dapo_megatron.rollout.engines.engine import GenerationOutput, RolloutEngine, SamplingParams
from dapo_megatron.bridge.receiver import ParamSpec
from dapo_megatron.bridge.flat_bucket import FlatBucketPacker, serialize_for_engine, sglang_bucket_dict

NamedTensor = tuple[str, torch.Tensor]


@dataclass(frozen=True)
class RolloutGroup:
    """The ranks of one engine, as this rank sees them.

    Attributes:
        ranks: global ranks of the group, leader first (consecutive, one node).
        rank: this process's global rank (one of ``ranks``).
        group: a gloo process group over ``ranks`` (payloads are small CPU objects); None when
            the group is this rank alone.
    """

    ranks: tuple[int, ...]
    rank: int
    group: Any = None

    def __post_init__(self):
        if self.rank not in self.ranks:
            raise ValueError(f"rank {self.rank} is not in its rollout group {self.ranks}")
        if len(self.ranks) > 1 and self.group is None:
            raise ValueError(f"a rollout group of {len(self.ranks)} ranks needs its gloo process group")

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def leader(self) -> int:
        return self.ranks[0]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.ranks[0]

    @classmethod
    def single(cls, rank: int = 0) -> "RolloutGroup":
        """A group of one rank (rollout TP 1)."""
        return cls((rank,), rank, None)


def _device_id(flat: torch.Tensor) -> Optional[str]:
    """Which GPU a payload lives on, as the leader compares it: the device UUID (what SGLang's
    reduction patch writes into the handle), None on CPU."""
    if flat.device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(flat.device).uuid)


def sync_flat_buckets(named_tensors: Iterable[NamedTensor], group: RolloutGroup, packer: FlatBucketPacker,
                      apply: Optional[Callable[[list[bytes]], Any]] = None,
                      expected_devices: Optional[Sequence[Optional[str]]] = None) -> int:
    """Send a stream of full HF tensors, bucket by bucket, into the engine of ``group``.

    Collective over ``group``: every rank calls it with the same stream (names, shapes and
    dtypes; the bridge gives every rank every tensor). See the module docstring for the steps.

    Args:
        named_tensors: ``(hf_name, tensor)`` pairs, consumed lazily.
        group: this rank's rollout group.
        packer: packs the stream on this rank's device (one reusable buffer).
        apply: on the leader, the engine call given the payloads in TP-rank order (returns
            SGLang's result; raises on failure); None on the other ranks.
        expected_devices: on the leader, the device id (:func:`_device_id`) each TP rank's
            payload must live on (None entries skip the check, e.g. on CPU).

    Returns:
        the number of buckets sent.

    Raises:
        RuntimeError: on every rank of the group, when any rank failed to pack its bucket, the
            ranks packed different buckets, a payload sits on a GPU that is not its TP worker's,
            or the engine call failed; the message names the rank and the bucket's first tensor.
    """
    if group.is_leader and apply is None:
        raise ValueError("sync_flat_buckets: the leader needs the engine call (apply)")
    sent = 0
    for bucket in packer.buckets(named_tensors):
        try:
            item = (serialize_for_engine(sglang_bucket_dict(bucket)), bucket.signature(), _device_id(bucket.flat), None)
        except Exception:  # reported by the leader on every rank, instead of a hang in the gather
            item = (None, bucket.signature(), None, traceback.format_exc(limit=3))
        # on the leader only (None elsewhere); [item] in a group of one
        gathered = [item] if group.size == 1 else collectives.gather_objects(item, group=group.group, dst=group.leader)
        outcome = None
        if group.is_leader:
            outcome = _apply_gathered(gathered, group, apply, expected_devices)
        if group.size > 1:
            outcome = collectives.broadcast_object(outcome, group=group.group, src=group.leader)
        # from here the engine holds no handle to this rank's buffer: the packer may refill it
        if outcome is not None:
            raise RuntimeError(outcome)
        sent += 1
        on_cuda = bucket.flat.is_cuda
        del bucket, item, gathered  # a bucket larger than the packer's is the bridge's own memory
        if on_cuda:  # blocks the engine has released leave torch's IPC limbo (flat_bucket docstring)
            torch.cuda.ipc_collect()
    return sent


def _apply_gathered(gathered: list, group: RolloutGroup, apply, expected_devices) -> Optional[str]:
    """The leader's part of one bucket: checks, then the engine call. Returns None or the error."""
    first = gathered[0][1][0][0] if gathered[0][1] else "?"
    where = f"weight sync bucket starting at {first!r} (engine led by rank {group.leader})"
    for i, (payload, signature, device, error) in enumerate(gathered):
        if error is not None:
            return f"{where}: rank {group.ranks[i]} failed to pack its payload:\n{error}"
        if signature != gathered[0][1]:
            return (f"{where}: rank {group.ranks[i]} packed a different bucket than the leader (names, shapes, "
                    f"dtypes or offsets differ; the bridge must give every rank the same stream): "
                    f"{signature[:3]} ... vs {gathered[0][1][:3]} ...")
        want = expected_devices[i] if expected_devices is not None else None
        if want is not None and device != want:
            return (f"{where}: rank {group.ranks[i]}'s payload is on GPU {device}, but SGLang TP worker {i} runs on "
                    f"GPU {want}: the ranks of a rollout group must be the consecutive local ranks whose GPUs "
                    "the engine spans (base_gpu_id + i)")
    try:
        apply([payload for payload, _, _, _ in gathered])
    except Exception as err:
        return f"{where}: {err}"
    return None


class EngineGroupMember(RolloutEngine):
    """A non-leader rank of a rollout group: it serves the engine its leader drives.

    It generates nothing (prompts are dealt to engines, i.e. to leaders), sleeps and wakes
    nothing (the leader's engine releases and resumes the memory of all its GPUs), and takes
    part in every weight sync: with ``transport="flat_bucket"`` (an SGLang engine) it sends
    its GPU's copy of each bucket to the leader (:func:`sync_flat_buckets`); with
    ``transport=None`` (an in-process engine on the leader, e.g. the HF engine on CPU) it only
    checks and drains the stream, which the bridge's collectives need it to iterate.

    Args:
        group: this rank's rollout group (not its leader).
        param_specs: ``(specs, aliases)`` of the engine's model, for the same checks as the leader.
        transport: ``"flat_bucket"`` or None (see above).
        update_bucket_mb: bucket size in MiB: must equal the leader's (same bucket boundaries).
        device: device of this rank's payload buffer (its GPU); None: this rank's device.
    """

    def __init__(self, group: RolloutGroup, param_specs: tuple[dict[str, ParamSpec], dict[str, str]], *,
                 transport: Optional[str] = "flat_bucket", update_bucket_mb: int = 512,
                 device: Optional[torch.device | str] = None):
        super().__init__()
        if group.is_leader:
            raise ValueError(f"rank {group.rank} leads its rollout group: it drives the engine itself")
        if transport not in ("flat_bucket", None):
            raise ValueError(f"transport={transport!r} must be 'flat_bucket' or None")
        self.group = group
        self.transport = transport
        self._specs = param_specs
        self.update_bucket_bytes = int(update_bucket_mb) * 2**20
        self._device = device
        self._packer: Optional[FlatBucketPacker] = None

    def generate(self, prompt_ids, params: SamplingParams, prompt_seeds=None) -> GenerationOutput:
        raise RuntimeError(f"rank {self.group.rank} serves the engine of rank {self.group.leader}: it has no engine "
                           "of its own; prompts go to engine leaders (rollout.layout.engine_share)")

    def sleep(self, keep_weights: bool = False) -> None:
        """Nothing: the leader's engine releases the memory of all its GPUs."""

    def wake_up(self) -> None:
        """Nothing: the leader's engine resumes the memory of all its GPUs."""

    @property
    def weights_valid(self) -> bool:
        """True: this rank holds no weights of its own; the leader's engine answers for the group."""
        return True

    def _param_specs(self):
        return self._specs

    def _loaded_checksums(self, names, dtype, readback_elements=None) -> dict:
        """Nothing to compare: this rank holds no weights; the leader's engine verifies the group's."""
        return {}

    def _load_stream(self, named_tensors: Iterable[NamedTensor]) -> None:
        if self.transport is None:
            for item in named_tensors:  # checked by update_weights, held by the leader's engine
                del item  # held by nothing, so the bridge reuses its memory
            return
        if self._packer is None or self._packer.bucket_bytes != self.update_bucket_bytes:
            device = self._device
            if device is None:
                device = rank_device()
            self._packer = FlatBucketPacker(self.update_bucket_bytes, device)
        try:
            sync_flat_buckets(named_tensors, self.group, self._packer)
        finally:  # every bucket is acknowledged: the GPU buffer is not held through rollout and training
            self._packer.release()
