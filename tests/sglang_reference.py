"""SGLang's own receiving-side code for the CPU tests, where it can be had.

SGLang's package imports CUDA-only dependencies at ``import sglang`` (triton, its kernels),
but the two pieces a weight sync meets are plain python: ``FlattenedTensorBucket`` /
``FlattenedTensorMetadata`` (``srt/weight_sync/tensor_bucket.py``, imports torch only) and
the pickle format of ``MultiprocessingSerializer`` (``ForkingPickler`` dump, ``SafeUnpickler``
load; ``srt/utils/common.py``). :func:`install_tensor_bucket` loads the real
``tensor_bucket.py`` of an installed SGLang (``pip install --no-deps sglang==0.5.11`` is
enough; its ``__init__`` is never run) under its real module name, so the package code under
test picks up SGLang's class exactly as it would in the image. Without SGLang it returns None
and the tests check the documented format instead (:func:`reconstruct`).

:class:`SafeUnpickler` is SGLang 0.5.23's allow-list (``srt/utils/common.py`` ``SafeUnpickler``,
its exact (module, name) pairs) so a payload whose classes SGLang would refuse fails here too.
"""

from __future__ import annotations

import importlib.util
import io
import os
import pickle
import sys
import types

import torch

TENSOR_BUCKET = "sglang.srt.weight_sync.tensor_bucket"

# sglang 0.5.23 python/sglang/srt/utils/common.py:3144-3359, SafeUnpickler.ALLOWED_GLOBALS: exact
# (module, name) pairs, 202 of them (0.5.11 allowed whole module prefixes such as "torch.")
ALLOWED_GLOBALS = frozenset((module, name) for module, names in {
    "_codecs": ("encode",),
    "builtins": (
        "bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset", "int", "list", "range",
        "set", "slice", "str", "tuple",),
    "collections": ("Counter", "OrderedDict", "defaultdict", "deque",),
    "copyreg": ("__newobj__", "__newobj_ex__",),
    "functools": ("partial",),
    "itertools": ("chain", "repeat",),
    "multiprocessing.reduction": ("_rebuild_partial", "_rebuild_socket",),
    "multiprocessing.resource_sharer": ("DupFd",),
    "sglang.srt.disaggregation.encoder.receiver": ("EmbeddingData",),
    "sglang.srt.managers.io_struct": ("EmbeddingReqInput", "GenerateReqInput",),
    "sglang.srt.managers.schedule_batch": ("Modality",),
    "sglang.srt.model_executor.model_runner": ("LocalSerializedTensor",),
    "sglang.srt.model_executor.model_runner_components.weight_updater": ("LocalSerializedTensor",),
    "sglang.srt.multimodal.modality": ("Modality",),
    "sglang.srt.utils.patch_torch": ("_rebuild_cuda_tensor_modified", "_rebuild_npu_tensor_modified",),
    "sglang.srt.weight_sync.tensor_bucket": ("FlattenedTensorBucket", "FlattenedTensorMetadata",),
    "torch": (
        "BFloat16Storage", "BFloat16Tensor", "BoolStorage", "BoolTensor", "ByteStorage", "ByteTensor",
        "CharStorage", "CharTensor", "ComplexDoubleStorage", "ComplexFloatStorage", "DoubleStorage",
        "DoubleTensor", "FloatStorage", "FloatTensor", "HalfStorage", "HalfTensor", "IntStorage",
        "IntTensor", "LongStorage", "LongTensor", "QInt32Storage", "QInt8Storage", "QUInt2x4Storage",
        "QUInt4x2Storage", "QUInt8Storage", "ShortStorage", "ShortTensor", "Size", "Tensor",
        "UntypedStorage", "bcomplex32", "bfloat16", "bit", "bits16", "bits1x8", "bits2x4", "bits4x2",
        "bits8", "bool", "cdouble", "cfloat", "chalf", "complex128", "complex32", "complex64", "device",
        "double", "dtype", "float", "float16", "float32", "float4_e2m1fn_x2", "float64", "float8_e4m3fn",
        "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "half", "int", "int1",
        "int16", "int2", "int3", "int32", "int4", "int5", "int6", "int64", "int7", "int8", "long",
        "per_channel_affine", "per_channel_affine_float_qparams", "per_channel_symmetric",
        "per_tensor_affine", "per_tensor_symmetric", "qint32", "qint8", "quint2x4", "quint4x2", "quint8",
        "short", "uint1", "uint16", "uint2", "uint3", "uint32", "uint4", "uint5", "uint6", "uint64",
        "uint7", "uint8",),
    "torch._tensor": ("_rebuild_from_type_v2",),
    "torch._utils": (
        "_rebuild_device_tensor_from_cpu_tensor", "_rebuild_device_tensor_from_numpy",
        "_rebuild_meta_tensor_no_storage", "_rebuild_parameter", "_rebuild_parameter_with_state",
        "_rebuild_qtensor", "_rebuild_sparse_tensor", "_rebuild_tensor", "_rebuild_tensor_v2",
        "_rebuild_tensor_v3", "_rebuild_wrapper_subclass",),
    "torch.cuda": (
        "BFloat16Storage", "BFloat16Tensor", "BoolStorage", "BoolTensor", "ByteStorage", "ByteTensor",
        "CharStorage", "CharTensor", "ComplexDoubleStorage", "ComplexFloatStorage", "DoubleStorage",
        "DoubleTensor", "FloatStorage", "FloatTensor", "HalfStorage", "HalfTensor", "IntStorage",
        "IntTensor", "LongStorage", "LongTensor", "ShortStorage", "ShortTensor",),
    "torch.cuda.sparse": (
        "BFloat16Tensor", "ByteTensor", "CharTensor", "DoubleTensor", "FloatTensor", "HalfTensor",
        "IntTensor", "LongTensor", "ShortTensor",),
    "torch.multiprocessing.reductions": (
        "rebuild_cuda_tensor", "rebuild_meta_tensor", "rebuild_nested_tensor",
        "rebuild_sparse_compressed_tensor", "rebuild_sparse_coo_tensor", "rebuild_storage_empty",
        "rebuild_storage_fd", "rebuild_storage_filename", "rebuild_tensor", "rebuild_typed_storage",
        "rebuild_typed_storage_child",),
    "torch.nn.parameter": ("Parameter",),
    "torch.serialization": ("_get_layout",),
    "torch.sparse": (
        "BFloat16Tensor", "ByteTensor", "CharTensor", "DoubleTensor", "FloatTensor", "HalfTensor",
        "IntTensor", "LongTensor", "ShortTensor",),
    "torch.storage": ("TypedStorage", "UntypedStorage", "_UntypedStorage",),
    "torch_npu.multiprocessing.reductions": ("rebuild_npu_tensor",),
    "types": ("SimpleNamespace",),
}.items() for name in names)


class SafeUnpickler(pickle.Unpickler):
    """SGLang 0.5.23's ``SafeUnpickler``: only the allowed globals load (``torch.storage.
    _load_from_bytes``, which SGLang maps to a restricted loader, is refused here)."""

    def find_class(self, module, name):
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


def deserialize(data: bytes):
    """``MultiprocessingSerializer.deserialize`` of sglang 0.5.23 (bytes form)."""
    return SafeUnpickler(io.BytesIO(data)).load()


def sglang_source_dir() -> str | None:
    """Directory of an installed ``sglang`` package (found without importing it), or None."""
    spec = importlib.util.find_spec("sglang") if "sglang" not in sys.modules else None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = list(spec.submodule_search_locations)[0]
    return path if os.path.isfile(os.path.join(path, "srt", "weight_sync", "tensor_bucket.py")) else None


def install_tensor_bucket(setitem=None):
    """Load SGLang's real ``tensor_bucket`` module under its own name; returns it, or None.

    ``setitem(mapping, key, value)`` (pytest's ``monkeypatch.setitem``) registers the module
    and its parent packages in ``sys.modules`` so the registration is undone after a test;
    without it they stay (spawned test workers).
    """
    if TENSOR_BUCKET in sys.modules:  # imported already (a full SGLang: the GPU image)
        return sys.modules[TENSOR_BUCKET]
    src = sglang_source_dir()
    if src is None:
        return None
    setitem = setitem or (lambda m, k, v: m.__setitem__(k, v))
    for pkg, path in (("sglang", src), ("sglang.srt", os.path.join(src, "srt")),
                      ("sglang.srt.weight_sync", os.path.join(src, "srt", "weight_sync"))):
        mod = types.ModuleType(pkg)
        mod.__path__ = [path]  # a package whose __init__ is not run
        setitem(sys.modules, pkg, mod)
    spec = importlib.util.spec_from_file_location(TENSOR_BUCKET, os.path.join(src, "srt", "weight_sync",
                                                                               "tensor_bucket.py"))
    module = importlib.util.module_from_spec(spec)
    setitem(sys.modules, TENSOR_BUCKET, module)
    spec.loader.exec_module(module)
    return module


FAKE_SERVER_ARGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_sglang", "sglang", "srt",
                                "server_args.py")


def install_server_args(setitem=None):
    """``sglang.srt.server_args`` for a test whose ``sglang`` is a stub module: the installed
    SGLang's own where it imports, else tests/fake_sglang's ``ServerArgs`` (sglang 0.5.23's form:
    ``__struct_fields__``, msgspec's ``TypeError`` on an unknown field) registered under that name
    (and ``sglang.srt`` when missing). ``setitem``: as :func:`install_tensor_bucket`'s."""
    name = "sglang.srt.server_args"
    if name in sys.modules:
        return sys.modules[name]
    try:
        import sglang.srt.server_args as real  # a full SGLang (the GPU image)

        return real
    except ImportError:
        pass
    setitem = setitem or (lambda m, k, v: m.__setitem__(k, v))
    if "sglang.srt" not in sys.modules:
        srt = types.ModuleType("sglang.srt")
        srt.__path__ = [os.path.dirname(FAKE_SERVER_ARGS)]
        setitem(sys.modules, "sglang.srt", srt)
    spec = importlib.util.spec_from_file_location(name, FAKE_SERVER_ARGS)
    module = importlib.util.module_from_spec(spec)
    setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def reconstruct(bucket_dict: dict, tensor_bucket=None) -> list[tuple[str, torch.Tensor]]:
    """What an SGLang TP worker loads from one deserialized ``flattened_bucket`` payload.

    With SGLang's module: ``FlattenedTensorBucket(flattened_tensor=..., metadata=...)
    .reconstruct_tensors()`` (sglang 0.5.11 ``model_runner.py``
    ``_update_weights_from_flattened_bucket``). Without: the documented format, each tensor
    ``flat[start_idx:end_idx].view(dtype).reshape(shape)`` of a 1-D uint8 ``flat``.
    """
    flat, metadata = bucket_dict["flattened_tensor"], bucket_dict["metadata"]
    assert flat.dtype == torch.uint8 and flat.dim() == 1, (flat.dtype, flat.shape)
    if tensor_bucket is not None:
        meta = [tensor_bucket.FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                                      end_idx=m.end_idx, numel=m.numel) for m in metadata]
        return tensor_bucket.FlattenedTensorBucket(flattened_tensor=flat, metadata=meta).reconstruct_tensors()
    out = []
    for m in metadata:
        assert m.end_idx - m.start_idx == m.numel, m
        out.append((m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)))
    return out


def worker_load(payload: bytes, tensor_bucket=None) -> list[tuple[str, torch.Tensor]]:
    """What SGLang TP worker ``i`` does with entry ``i`` of a ``flattened_bucket`` update: deserialize
    (``managers/tp_worker.py`` ``update_weights_from_tensor``) and reconstruct (clones, so the tensors
    outlive the sender's reusable buffer). With SGLang's module installed the payload must pass its
    ``SafeUnpickler``; without it the package pickles its CPU stand-in metadata class, which only a
    plain unpickler loads."""
    obj = deserialize(payload) if tensor_bucket is not None else pickle.loads(payload)
    return [(name, t.clone()) for name, t in reconstruct(obj, tensor_bucket)]


#: The request fields of the endpoints the package calls, sglang 0.5.23 ``managers/io_struct.py``
#: (msgspec Structs; ``BaseReq`` adds ``rid``, ``http_worker_ipc``). The HTTP schema IGNORES an
#: unknown field (``utils/msgspec_utils.py:95-100``, ``extra_behavior="ignore"``), so a misspelt
#: or retired field would be dropped silently: the tests check every body against these.
_BASE = ("rid", "http_worker_ipc")
REQUEST_FIELDS = {
    "/init_weights_update_group": frozenset(_BASE + ("master_address", "master_port", "rank_offset", "world_size",
                                                    "group_name", "backend")),  # io_struct.py:2126
    "/destroy_weights_update_group": frozenset(_BASE + ("group_name",)),  # io_struct.py:2146
    "/update_weights_from_distributed": frozenset(_BASE + (  # io_struct.py:2002
        "names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests", "weight_version",
        "load_format", "selector", "torch_empty_cache")),
    "/release_memory_occupation": frozenset(_BASE + ("tags",)),  # io_struct.py:2177
    "/resume_memory_occupation": frozenset(_BASE + ("tags",)),  # io_struct.py:2187
    "/pause_generation": frozenset(_BASE + ("mode",)),  # io_struct.py:1927, mode in abort / retract / in_place
    "/continue_generation": frozenset(_BASE + ("torch_empty_cache",)),  # io_struct.py:1949
    "/abort_request": frozenset(_BASE + ("abort_all", "finished_reason", "abort_message", "weight_versions")),
    "/flush_cache": frozenset(_BASE + ("timeout_s",)),  # io_struct.py:1855 (the route reads ?timeout=)
}
#: GenerateReqInput fields the package may send (io_struct.py:177; the whole class has ~70)
GENERATE_FIELDS = frozenset(("input_ids", "text", "sampling_params", "return_logprob", "logprob_start_len", "rid",
                             "stream", "return_routed_experts", "routed_experts_start_len", "top_logprobs_num"))
#: SamplingParams fields (sampling/sampling_params.py:140; SamplingParams(**d) refuses others)
SAMPLING_FIELDS = frozenset((
    "beam_width", "custom_params", "ebnf", "ebnf_full_assistant", "frequency_penalty", "ignore_eos", "is_normalized",
    "json_schema", "logit_bias", "max_new_tokens", "min_new_tokens", "min_p", "n", "no_stop_trim",
    "presence_penalty", "regex", "repetition_penalty", "sampling_seed", "skip_special_tokens",
    "spaces_between_special_tokens", "stop", "stop_regex", "stop_regex_max_len", "stop_regex_strs",
    "stop_str_max_len", "stop_strs", "stop_token_ids", "stream_interval", "structural_tag", "temperature", "top_k",
    "top_p", "watermark"))
