"""Size-bounded buckets of named tensors for weight sync (Megatron → rollout engine).

Both ends of a sync must agree on the order of tensors: the sender streams buckets in
the order it produced them and the receiver (SGLang's ``update_weights_from_tensor`` or an
NCCL broadcast with metadata sent first) reads them in that same order. These helpers
therefore never reorder anything (in particular never group by dtype, a fault class other
stacks shipped: one side sorted by dtype, the other did not).

Design: docs/design.md §1 (step 7, weight sync).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from dapo_megatron.bridge.mapping import keep_together

NamedTensor = tuple[str, torch.Tensor]


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s elements (``numel * element_size``), ignoring storage sharing."""
    return tensor.numel() * tensor.element_size()


def iter_buckets(named_tensors: Iterable[NamedTensor], bucket_bytes: int) -> Iterator[list[NamedTensor]]:
    """Group ``(name, tensor)`` pairs into consecutive buckets of at most ``bucket_bytes``.

    The input is consumed lazily, so a caller that gathers each tensor on demand (the
    bridge's TP/PP gather) holds at most one bucket of full tensors at a time.

    Args:
        named_tensors: iterable of ``(hf_name, tensor)``; any shape and dtype.
        bucket_bytes: upper bound on the summed ``numel * element_size`` of a bucket,
            in bytes (``bucket_mb * 2**20`` for a config given in MiB). Must be > 0.

    Yields:
        Non-empty lists of ``(name, tensor)`` in the input order. A tensor larger than
        ``bucket_bytes`` forms a bucket of its own (it is never split); the current
        partial bucket is flushed before it so that order is kept. A tensor that the engine
        must receive in one call with the next (an MLA ``q_a_proj``, which SGLang fuses with the
        following ``kv_a_proj_with_mqa``: :func:`dapo_megatron.bridge.mapping.keep_together`)
        never ends a bucket, which may then exceed ``bucket_bytes`` by that next tensor.

    Raises:
        ValueError: ``bucket_bytes`` <= 0, or an element is not a ``(str, Tensor)`` pair.
    """
    if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive int (bytes), got {bucket_bytes!r}")
    bucket: list[NamedTensor] = []
    size = 0
    for item in named_tensors:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise ValueError(f"named_tensors must yield (str, torch.Tensor) pairs, got {type(item).__name__}: "
                             f"{item if not isinstance(item, tuple) else tuple(type(x).__name__ for x in item)}")
        name, tensor = item
        nbytes = tensor_nbytes(tensor)
        if bucket and size + nbytes > bucket_bytes and not keep_together(bucket[-1][0]):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
        if size >= bucket_bytes and not keep_together(name):  # full, or a single oversized tensor
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def bucket_metadata(bucket: Iterable[NamedTensor]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The ``(name, shape, dtype)`` triples of a bucket, in bucket order.

    This is what a receiver needs to allocate buffers before an NCCL broadcast (SGLang's
    ``update_weights_from_distributed(names, dtypes, shapes)``) and what both sides compare
    to check they agree on the order.
    """
    return [(name, tuple(t.shape), t.dtype) for name, t in bucket]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``: the dtype spelling SGLang's HTTP API expects
    (it resolves it with ``getattr(torch, name)``)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; raises ``ValueError`` for a name that is not a torch dtype."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}; expected e.g. 'bfloat16', 'float32'")
    return dtype
