"""SGLang's flattened-bucket weight format: a bucket of named tensors as one flat byte buffer.

A weight sync into SGLang moves buckets of full HF tensors. Sending each bucket as ONE flat
buffer plus metadata costs one CUDA-IPC handle (colocated) or one NCCL broadcast (server)
per bucket instead of one per tensor. The format is SGLang's own (sglang 0.5.11
``python/sglang/srt/weight_sync/tensor_bucket.py``, the same since 0.5.6):

* ``FlattenedTensorBucket(named_tensors)`` concatenates ``tensor.flatten().view(torch.uint8)``
  of every tensor IN LIST ORDER into one ``uint8`` tensor (``supports_multi_dtypes = True``:
  one buffer may mix dtypes, because the offsets are bytes);
* each tensor's ``FlattenedTensorMetadata(name, shape, dtype, start_idx, end_idx, numel)``
  holds its byte range ``[start_idx, end_idx)`` (``numel`` = bytes), and
  ``reconstruct_tensors`` views ``flat[start_idx:end_idx].view(dtype).reshape(shape)``.

Receivers: the colocated engine's ``update_weights_from_tensor(load_format="flattened_bucket")``
deserializes, per SGLang TP rank, a dict ``{"flattened_tensor", "metadata"}``
(``model_executor/model_runner.py`` ``_update_weights_from_flattened_bucket``); the server's
``update_weights_from_distributed(load_format="flattened_bucket")`` builds the same bucket
from ``(names, dtypes, shapes)`` and receives ONE broadcast of the flat buffer into it
(``_update_bucketed_weights_from_distributed``). Either way the receiver finds each tensor
by the metadata's order and offsets, so the metadata must describe the buffer exactly as it
was packed: a packer that regroups tensors by dtype while keeping the metadata of the old
order loads tensors under other names (a fault other stacks shipped). :class:`FlatBucketPacker`
never reorders; its layout is that of ``FlattenedTensorBucket(named_tensors)`` byte for byte
(``tests/unit/bridge/test_flat_bucket.py`` checks it against SGLang's class where SGLang is installed).

Memory: the packer copies tensors one at a time into a buffer of the bucket size on the
tensors' device, so a sync holds one bucket beyond the model however large the model is; a
tensor larger than the bucket is sent from its own storage (no copy). On CUDA every bucket
gets a FRESH buffer (:func:`reuses_buffer`): the engine reads it through a CUDA-IPC handle, and
only a fresh tensor keeps torch's IPC reference counting in charge of when its memory may be
written again (a block a consumer still holds stays out of the caching allocator: torch's
``CudaIPCSentData`` limbo, ``torch/csrc/CudaIPCTypes.cpp``; ``torch.cuda.ipc_collect`` returns
it once released, which :func:`~dapo_megatron.rollout.engines.engine_group.sync_flat_buckets` calls
after every bucket, as slime does). Refilling one buffer would rest on SGLang having finished its copies when it
answers, which it does not promise: slime forbids the reuse ("can race with the consumer-side
copy and corrupt weights", ``slime/backends/megatron_utils/update_weight/
update_weight_from_tensor.py`` ``_build_flattened_tensor_data``, PR #2220) and verl packs each
bucket from fresh clones (``verl/workers/rollout/sglang_rollout/utils.py``
``get_named_tensor_buckets``). The caching allocator hands the previous bucket's block back once
the engine has let it go, so this costs no extra memory in steady state. On CPU (the tests'
shared-memory transport, whose consumer copies before it answers) one buffer is reused: fresh
CPU memory costs page faults worth several copies.

Design: docs/design.md §2 (rollout-TP groups) and §6.
"""

from __future__ import annotations

import functools
import io
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any, Iterable, Iterator, Optional

import torch
import torch.multiprocessing  # noqa: F401  registers torch's tensor reductions with ForkingPickler

NamedTensor = tuple[str, torch.Tensor]


@dataclass(frozen=True)
class FlatEntry:
    """One tensor of a flat bucket: its byte range ``[start, end)`` in the buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def reuses_buffer(device: torch.device) -> bool:
    """Whether :class:`FlatBucketPacker` refills one buffer on ``device`` (CPU only) rather than
    allocating a fresh one per bucket (every other device: the module docstring's IPC rule)."""
    return torch.device(device).type == "cpu"


@dataclass
class FlatBucket:
    """A packed bucket: ``flat`` (1-D ``uint8``, exactly the entries' bytes) and its entries
    in buffer order. On CPU ``flat`` is a view of the packer's reusable buffer: it is valid until
    the packer packs the next bucket (the generator is resumed); elsewhere it is the bucket's own
    memory (:func:`reuses_buffer`)."""

    flat: torch.Tensor
    entries: list[FlatEntry]

    @property
    def nbytes(self) -> int:
        return self.flat.numel()

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def tensors(self) -> list[NamedTensor]:
        """The bucket's tensors as views of ``flat`` (what SGLang's ``reconstruct_tensors`` gives)."""
        return [(e.name, self.flat[e.start:e.end].view(e.dtype).reshape(e.shape)) for e in self.entries]

    def signature(self) -> list[tuple[str, tuple[int, ...], str, int, int]]:
        """``(name, shape, dtype, start, end)`` of every entry: what every rank of a rollout group
        must agree on before their payloads go to one engine."""
        return [(e.name, e.shape, str(e.dtype).removeprefix("torch."), e.start, e.end) for e in self.entries]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class FlatBucketPacker:
    """Pack a stream of ``(name, tensor)`` into consecutive :class:`FlatBucket` s.

    Bucket boundaries depend only on the names, shapes and dtypes of the stream (never on
    values or devices), so every rank of a rollout group, fed the same stream, cuts the same
    buckets. The rule is :func:`~dapo_megatron.bridge.buckets.iter_buckets`' (a tensor joins
    the current bucket when the bucket stays within ``bucket_bytes``; a tensor larger than
    ``bucket_bytes`` is a bucket of its own), plus one: a tensor whose start would not be a
    multiple of its element size starts a new bucket, because SGLang views each byte range
    as its dtype (``view`` needs an aligned offset) and the server-side bucket is packed
    without padding. With one dtype per model (the bridge's export) this never triggers.

    Args:
        bucket_bytes: bucket size in bytes (``rollout.update_weights_bucket_megabytes`` MiB), > 0.
        device: device of the buffers; None: the device of each tensor. Tensors on another
            device are copied to it. One buffer is reused on CPU, a fresh one is allocated per
            bucket elsewhere (:func:`reuses_buffer`).

    Raises:
        ValueError: ``bucket_bytes`` <= 0.
    """

    def __init__(self, bucket_bytes: int, device: Optional[torch.device | str] = None):
        if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be a positive int (bytes), got {bucket_bytes!r}")
        self.bucket_bytes = bucket_bytes
        self.device = torch.device(device) if device is not None else None
        self._buffer: Optional[torch.Tensor] = None

    def _buffer_on(self, device: torch.device) -> torch.Tensor:
        if not reuses_buffer(device):  # a CUDA-IPC payload: its own memory (module docstring)
            return torch.empty(self.bucket_bytes, dtype=torch.uint8, device=device)
        if self._buffer is None or self._buffer.device != device:
            self._buffer = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=device)
        return self._buffer

    def release(self) -> None:
        """Free the reusable buffer (the next bucket allocates it again)."""
        self._buffer = None

    def buckets(self, named_tensors: Iterable[NamedTensor]) -> Iterator[FlatBucket]:
        """Yield the packed buckets of ``named_tensors`` (consumed lazily, one tensor at a time).

        On CPU each yielded bucket's ``flat`` is overwritten when the generator is resumed: use
        (or send and wait for the receiver of) one bucket before asking for the next. Elsewhere
        the packer drops its reference to a bucket's buffer when resumed, before allocating the
        next one (a sync holds at most the bucket the engine has not released).
        """
        entries: list[FlatEntry] = []
        offset = 0
        buffer: Optional[torch.Tensor] = None
        for name, tensor in named_tensors:
            nbytes = _nbytes(tensor)
            device = self.device or tensor.device
            misaligned = offset % tensor.element_size() != 0
            if entries and (offset + nbytes > self.bucket_bytes or misaligned):
                yield FlatBucket(buffer[:offset], entries)
                entries, offset, buffer = [], 0, None  # released before the next one is allocated
            if not entries and nbytes > self.bucket_bytes:
                # larger than a bucket: its own bytes are the bucket (a copy only if not contiguous)
                own = tensor.detach().to(device).contiguous().reshape(-1).view(torch.uint8)
                yield FlatBucket(own, [FlatEntry(name, tuple(tensor.shape), tensor.dtype, 0, nbytes)])
                del own, tensor  # the bridge reuses memory nobody holds
                continue
            if buffer is None or buffer.device != device:
                buffer = self._buffer_on(device)
            # one copy of the tensor's bytes into the buffer, casting nothing
            buffer[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
            entries.append(FlatEntry(name, tuple(tensor.shape), tensor.dtype, offset, offset + nbytes))
            offset += nbytes
            del tensor  # copied: held by nothing when the bridge produces the next
        if entries:
            yield FlatBucket(buffer[:offset], entries)


# ---------------------------------------------------------------------------- SGLang's objects
@functools.lru_cache(maxsize=None)  # a failed `import sglang` is retried in full by Python: once is enough
def _sglang_metadata_class():
    """SGLang's ``FlattenedTensorMetadata`` when SGLang imports, else None.

    The engine unpickles payloads with ``SafeUnpickler`` (sglang 0.5.11
    ``srt/utils/common.py``), which refuses classes outside an allow-list of modules
    (``sglang.srt.weight_sync.tensor_bucket.`` is on it, ``dapo_megatron.`` is not): the
    metadata objects of a real payload must be SGLang's own class.
    """
    try:  # sglang needs CUDA
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata
    except Exception:  # not installed, or no CUDA to import it
        return None
    return FlattenedTensorMetadata


@dataclass
class FlattenedTensorMetadataCPU:
    """Field-for-field SGLang's ``FlattenedTensorMetadata`` (sglang 0.5.11
    ``weight_sync/tensor_bucket.py``), used only where SGLang does not import (CPU tests):
    a real engine would refuse to unpickle it, and there is none without SGLang."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def sglang_bucket_dict(bucket: FlatBucket) -> dict[str, Any]:
    """The object one SGLang TP worker deserializes for a ``flattened_bucket`` update:
    ``{"flattened_tensor": uint8 flat, "metadata": [FlattenedTensorMetadata, ...]}``
    (sglang 0.5.11 ``model_runner.py`` ``_update_weights_from_flattened_bucket``)."""
    cls = _sglang_metadata_class() or FlattenedTensorMetadataCPU
    metadata = [cls(name=e.name, shape=torch.Size(e.shape), dtype=e.dtype, start_idx=e.start, end_idx=e.end,
                    numel=e.nbytes) for e in bucket.entries]
    return {"flattened_tensor": bucket.flat, "metadata": metadata}


def serialize_for_engine(obj: Any) -> bytes:
    """SGLang's ``MultiprocessingSerializer.serialize(obj)`` with its torch-reduction patch.

    ``MultiprocessingSerializer.serialize`` pickles with ``ForkingPickler``, so a CUDA tensor
    becomes a CUDA-IPC handle (no data is copied) and a CPU tensor moves to shared memory
    (sglang 0.5.11 ``srt/utils/common.py``). ``monkey_patch_torch_reductions``
    (``srt/utils/patch_torch.py``) makes the handle name its GPU by UUID instead of by index,
    so an SGLang TP worker whose ``CUDA_VISIBLE_DEVICES`` numbers GPUs differently still
    opens the right one. Where SGLang does not import (CPU tests), the same ``ForkingPickler``
    dump is done here: the bytes have the same format.
    """
    serialize = _sglang_serialize()
    if serialize is not None:
        return serialize(obj)
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return buf.getvalue()


@functools.lru_cache(maxsize=None)
def _sglang_serialize():
    """SGLang's ``MultiprocessingSerializer.serialize`` with the reduction patch applied, or None."""
    try:  # sglang needs CUDA
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    except Exception:  # not installed, or no CUDA to import it
        return None
    monkey_patch_torch_reductions()
    return MultiprocessingSerializer.serialize
