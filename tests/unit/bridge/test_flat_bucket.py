"""The flattened-bucket payload of a weight sync into SGLang (bridge/flat_bucket.py).

Where SGLang is installed (even ``pip install --no-deps``), its own ``FlattenedTensorBucket``
packs the reference buffers and reconstructs what a TP worker would load; otherwise the
documented format is checked (tests/sglang_reference.py).
"""

import pytest
import torch

import sglang_reference as ref
from dapo_megatron.bridge import flat_bucket
from dapo_megatron.bridge.buckets import iter_buckets
from dapo_megatron.bridge.flat_bucket import FlatBucketPacker, serialize_for_engine, sglang_bucket_dict


@pytest.fixture()
def tensor_bucket(monkeypatch):
    """SGLang's tensor_bucket module (or None), visible to the package code under test."""
    flat_bucket._sglang_metadata_class.cache_clear()
    module = ref.install_tensor_bucket(monkeypatch.setitem)
    yield module
    flat_bucket._sglang_metadata_class.cache_clear()


def _mixed(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [("a.weight", torch.randn(3, 5, generator=g).to(torch.bfloat16)),
            ("b.weight", torch.randn(7, generator=g)),
            ("c.bias", torch.randn(2, 2, generator=g).to(torch.bfloat16)),
            ("d.weight", torch.randn(4, 4, generator=g)),
            ("e.idx", torch.arange(6, dtype=torch.int64))]


def _bits(t):
    return t.contiguous().view(-1).view(torch.uint8)


def _reference_flat(named, tensor_bucket):
    """The buffer SGLang's own FlattenedTensorBucket(named_tensors) builds (else its documented
    construction: the uint8 bytes of every tensor concatenated in list order)."""
    if tensor_bucket is not None:
        b = tensor_bucket.FlattenedTensorBucket(named_tensors=named)
        return b.get_flattened_tensor(), [(m.name, m.start_idx, m.end_idx) for m in b.get_metadata()]
    flat = torch.cat([t.flatten().view(torch.uint8) for _, t in named])
    spans, off = [], 0
    for n, t in named:
        spans.append((n, off, off + t.numel() * t.element_size()))
        off += t.numel() * t.element_size()
    return flat, spans


def test_packed_bucket_is_sglangs_layout_byte_for_byte(tensor_bucket):
    named = [(n, t) for n, t in _mixed() if t.dtype == torch.float32] + [("x", torch.ones(3, dtype=torch.bfloat16))]
    (bucket,) = FlatBucketPacker(bucket_bytes=1 << 20).buckets(iter(named))
    flat, spans = _reference_flat(named, tensor_bucket)
    assert torch.equal(bucket.flat, flat)
    assert [(e.name, e.start, e.end) for e in bucket.entries] == spans


def test_metadata_keeps_the_stream_order_and_reconstructs_every_tensor_bitwise(tensor_bucket):
    named = _mixed()
    names, loaded = [], []
    for b in FlatBucketPacker(bucket_bytes=1 << 20).buckets(iter(named)):  # one bucket at a time: the buffer is reused
        names.append(b.names)
        payload = sglang_bucket_dict(b)
        if tensor_bucket is not None:
            assert all(type(m) is tensor_bucket.FlattenedTensorMetadata for m in payload["metadata"])
        loaded += [(n, t.clone()) for n, t in ref.reconstruct(payload, tensor_bucket)]
    # b.weight (fp32) would start at byte 30, e.idx (int64) at byte 100: each opens a new bucket
    assert names == [["a.weight"], ["b.weight", "c.bias", "d.weight"], ["e.idx"]]
    assert [n for n, _ in loaded] == [n for n, _ in named], "metadata in the order of the stream, never by dtype"
    for (name, want), (_, got) in zip(named, loaded):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(_bits(got), _bits(want)), name


def test_dtype_regrouped_buffer_with_old_order_metadata_loads_wrong_tensors(tensor_bucket):
    """Why the packer never regroups: a buffer concatenated by dtype (fp32 first) described by
    metadata of the original order hands the receiver other tensors' bytes under each name."""
    named = [("w0", torch.full((4,), 1.0)), ("w1", torch.full((4,), 2.0).to(torch.bfloat16)),
             ("w2", torch.full((2,), 3.0))]
    (good,) = FlatBucketPacker(bucket_bytes=1 << 20).buckets(iter(named))
    regrouped = torch.cat([_bits(named[0][1]), _bits(named[2][1]), _bits(named[1][1])])
    payload = sglang_bucket_dict(good)
    wrong = dict(ref.reconstruct({"flattened_tensor": regrouped, "metadata": payload["metadata"]}, tensor_bucket))
    right = dict(ref.reconstruct(payload, tensor_bucket))
    assert not torch.equal(wrong["w1"].float(), named[1][1].float()), "the regrouped buffer mislabels w1"
    assert all(torch.equal(right[n], t) for n, t in named)


def test_bucket_boundaries_match_iter_buckets_and_reuse_one_buffer():
    sizes = [8, 8, 10, 30, 4, 4]  # fp32 elements: 32, 32, 40, 120, 16, 16 bytes
    named = [(f"t{i}", torch.full((s,), float(i))) for i, s in enumerate(sizes)]
    packer = FlatBucketPacker(bucket_bytes=64)
    got, ptrs = [], []
    for b in packer.buckets(iter(named)):
        got.append(b.names)
        ptrs.append(b.flat.data_ptr())
        assert all(torch.equal(t, dict(named)[n]) for n, t in b.tensors())
    assert got == [[n for n, _ in b] for b in iter_buckets(iter(named), 64)] == [["t0", "t1"], ["t2"], ["t3"],
                                                                               ["t4", "t5"]]
    big = dict(named)["t3"]
    assert ptrs[2] == big.data_ptr(), "a tensor larger than a bucket is sent from its own storage"
    assert ptrs[0] == ptrs[1] == ptrs[3] == packer._buffer.data_ptr(), "one reusable buffer for the others"
    with pytest.raises(ValueError, match="bucket_bytes"):
        FlatBucketPacker(0)


def test_engine_payloads_get_a_fresh_buffer_per_bucket_off_the_cpu():
    """Issue 18 item 3: a CUDA-IPC payload is never refilled for the next bucket (SGLang may still
    be copying from it; torch's IPC reference counting only protects memory nobody rewrites).
    Off the CPU (the meta device stands for CUDA here) every bucket has its own storage, and the
    packer holds none of them once resumed (at most the bucket the engine still holds is alive)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    assert flat_bucket.reuses_buffer(torch.device("cpu"))
    assert not flat_bucket.reuses_buffer(torch.device("cuda", 0)) and not flat_bucket.reuses_buffer("meta")
    named = [(f"t{i}", torch.full((8,), float(i))) for i in range(7)]  # 32 bytes each: 2 per bucket
    packer = FlatBucketPacker(bucket_bytes=64, device="meta")
    kept = list(packer.buckets(iter(named)))  # a consumer that still holds every payload
    assert [b.names for b in kept] == [["t0", "t1"], ["t2", "t3"], ["t4", "t5"], ["t6"]]
    assert len({StorageWeakRef(b.flat.untyped_storage()).cdata for b in kept}) == 4, "a buffer was refilled"
    del kept
    previous = None
    for b in packer.buckets(iter(named)):
        if previous is not None:
            assert previous.expired(), "the packer still holds the previous bucket's buffer"
        previous = StorageWeakRef(b.flat.untyped_storage())
        del b


def test_packer_drops_each_tensor_before_asking_for_the_next():
    # what lets the bridge reuse a bucket's memory (its storage must be unreferenced)
    from conftest import ReleaseRecorder

    sizes = (4, 4, 40, 4, 4, 4)  # 16-byte tensors, one larger than a bucket (sent from its own storage)
    stream = ReleaseRecorder((f"t{i}", torch.full((n,), float(i))) for i, n in enumerate(sizes))
    got = {}
    for bucket in FlatBucketPacker(bucket_bytes=32).buckets(stream):
        for entry in bucket.entries:
            got[entry.name] = bucket.flat[entry.start:entry.end].view(entry.dtype).clone()
        del bucket
    assert len(stream.held) == len(sizes) - 1 and not any(stream.held)
    assert all(torch.equal(got[n], t) for n, t in stream.named)


def test_engine_sync_drops_each_bucket_before_asking_for_the_next_tensor():
    # sync_flat_buckets (the SGLang engine's loop): a bucket larger than the packer's is sent
    # from the tensor's own memory, which must be free again when the next tensor is asked for
    from conftest import ReleaseRecorder
    from dapo_megatron.rollout.engines.engine_group import RolloutGroup, sync_flat_buckets

    sizes = (4, 40, 4, 4, 40)
    stream = ReleaseRecorder((f"t{i}", torch.full((n,), float(i))) for i, n in enumerate(sizes))
    payloads = []
    sent = sync_flat_buckets(stream, RolloutGroup.single(), FlatBucketPacker(bucket_bytes=32),
                             apply=payloads.append)
    assert sent == len(payloads) == 4  # [t0], [t1] (own storage), [t2, t3], [t4] (own storage)
    assert len(stream.held) == len(sizes) - 1 and not any(stream.held)


def test_packer_is_lazy_one_tensor_at_a_time():
    pulled = []

    def stream():
        for i in range(6):
            pulled.append(i)
            yield f"t{i}", torch.zeros(4)  # 16 bytes

    it = FlatBucketPacker(bucket_bytes=32).buckets(stream())
    assert next(it).names == ["t0", "t1"] and pulled == [0, 1, 2], "t2 is read to close the bucket, no more"


def test_serialized_payload_passes_sglangs_unpickler_only_with_sglangs_metadata_class(tensor_bucket):
    (bucket,) = FlatBucketPacker(bucket_bytes=1 << 20).buckets(iter(_mixed()[:1]))
    data = serialize_for_engine(sglang_bucket_dict(bucket))
    if tensor_bucket is None:
        # the CPU stand-in class lives in dapo_megatron: SGLang's unpickler refuses it, which is why
        # the package uses SGLang's own FlattenedTensorMetadata wherever SGLang imports
        with pytest.raises(RuntimeError, match=r"Blocked unsafe global \(dapo_megatron\."):
            ref.deserialize(data)
        return
    obj = ref.deserialize(data)
    (name, t), = ref.reconstruct(obj, tensor_bucket)
    assert name == "a.weight" and torch.equal(t, _mixed()[0][1])
