"""Run megatron-core on CPU processes (gloo) when CUDA is absent (docs/design.md §5.1).

megatron-core (0.16.1, and 0.19.2 at the same places) assumes a CUDA device in a handful of places. This module patches
exactly those, and nothing else, so that the same actor code runs on a 2-core
laptop (tests, the CPU quick start) and on H100s (where :func:`activate` is a
no-op):

1. ``torch.cuda.current_device()`` returns ``"cpu"``: Megatron passes it as the
   ``device=`` of new tensors (buffers, RoPE, grad buffers).
2. ``torch.cuda.get_rng_state`` / ``set_rng_state`` / ``manual_seed`` map to the
   CPU generator (``manual_seed_all`` is a no-op: ``torch.manual_seed`` calls it); ``torch.cuda.synchronize`` and
   ``torch.cuda.empty_cache`` are no-ops. Megatron's RNG tracker
   (``tensor_parallel.random``) keeps "CUDA" states for the data-parallel and
   model-parallel streams; on CPU those become CPU generator states, so
   ``get_cuda_rng_tracker().fork()`` still switches streams.
3. The private ``tensor_parallel.random._get_cuda_rng_state`` /
   ``_set_cuda_rng_state`` read and write the CPU generator.
4. A :class:`torch.overrides.TorchFunctionMode` (:class:`_CudaToCpuMode`) rewrites
   ``device="cuda"`` (or ``torch.device("cuda", i)``) in tensor factory calls and
   ``.to()`` to CPU, makes ``Tensor.cuda()`` return the tensor itself, and makes
   ``Tensor.type()`` report CPU float tensors as ``torch.cuda.FloatTensor`` (and
   bf16/fp16 likewise): Megatron's optimizers assert on that string. It reads ``.grad``
   of a non-leaf tensor without torch's "not a leaf" warning (:func:`_non_leaf_grad`).

5. The gradient-norm kernel: without Apex/TE, megatron-core falls back to
   ``local_multi_tensor_l2_norm`` (one fp32 ``torch.norm`` per tensor), whose CPU rounding
   depends on the tensor's shape, so the same gradients gave different norms at TP=1 and
   TP=2. :func:`_l2_norm_fp64` accumulates in float64 instead
   (``megatron.core.optimizer.clip_grads.l2_norm_impl``); GPUs keep Apex/TE's kernel.

6. CUDA streams and events for the MoE all-to-all token dispatcher: megatron-core's
   ``MoEAlltoAllTokenDispatcher`` (transformer/moe/token_dispatcher.py, ``__init__`` and
   ``_maybe_dtoh_and_synchronize``; 0.19.2 :469 and :913) creates a ``torch.cuda.Stream`` for its device-to-host
   copies of the split sizes and synchronises on an event recorded on it.
   ``torch.cuda.Stream`` / ``current_stream`` / ``stream`` / ``Event`` become a no-op stream
   and event (:class:`_CpuStream`): on CPU every op is synchronous, so there is nothing to
   order. They are patched only where CUDA is absent, where they would raise.
7. The dispatcher's split sizes: on GPU ``moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True)``
   turns the CUDA split-size tensors into numpy arrays, which ``all_to_all_single`` takes as
   int sequences; for a CPU tensor it returns the tensor itself, which torch's
   ``all_to_all_single`` binding refuses ("incompatible function arguments": it takes
   ``list[int]``). :func:`_maybe_move_tensor_to_cpu` also gives numpy for a CPU tensor, as the
   GPU path does. gloo itself runs ``all_to_all_single`` with uneven splits on CPU tensors
   in torch 2.13 (checked on 2 gloo processes), so no collective is re-implemented.

8. The router's gating GEMM without Transformer Engine: ``moe_utils.RouterGatingLinearFunction``
   tests ``te_general_gemm is not None``, a name bound only when TE imports (``NameError``
   otherwise, megatron-core moe/moe_utils.py, 0.19.2 :1326 and :1359); it is bound to None, which selects the
   function's own ``torch.mm`` path in the router dtype.

Items 1-4 and 6-8 do not change numerics: they only choose the device, RNG or host
copy that megatron-core would have used on a GPU; item 5 makes the CPU grad norm (and so the
clipping factor) exact to fp32 output precision. ``activate()`` is idempotent
and returns False (doing nothing) when CUDA is available.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import warnings

import torch
from torch.overrides import TorchFunctionMode

_ACTIVE = False
_LOCK = threading.Lock()
_MODE: "_CudaToCpuMode | None" = None

_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float16: "torch.cuda.HalfTensor",
}


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


def _cpu_device(device):
    """Map a CUDA device spec (str, torch.device or a bare int index) to CPU."""
    if _is_cuda(device) or (isinstance(device, int) and not isinstance(device, bool)):
        return torch.device("cpu")
    return device


_GRAD = torch._C.TensorBase.__dict__["grad"]  # the ``.grad`` descriptor; the mode sees its bound __get__


def _non_leaf_grad(getter, args: tuple, kwargs: dict):
    """``.grad`` of a non-leaf tensor (the getter's own value), without torch's "not a leaf
    Tensor" UserWarning.

    megatron-core's DistributedOptimizer keeps the shards of fp32 parameters as views
    (``model_param.view(-1)[start:end]``, non-leaf; distrib_optimizer.py notes the group
    "throws grad-access warning", 0.19.2 :467 and :2580), assigns their ``.grad`` by hand and reads it in
    ``zero_grad`` before the first assignment. Under this mode the warning is attributed to
    this module's frame, once per rank, for a read that is by design. The value is the
    getter's: None until megatron assigns a gradient, then that tensor.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf",
                                category=UserWarning)
        return getter(*args, **kwargs)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placements to CPU inside every torch function call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        name = getattr(func, "__name__", "")
        if func is torch.Tensor.cuda:
            return args[0]
        if name == "__get__" and getattr(func, "__self__", None) is _GRAD and not args[0].is_leaf:
            return _non_leaf_grad(func, args, kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            dtype = args[0].dtype
            if dtype in _TYPE_NAMES:
                return _TYPE_NAMES[dtype]
        if name == "to" and args and isinstance(args[0], torch.Tensor) and len(args) > 1:
            if _is_cuda(args[1]) or (isinstance(args[1], int) and not isinstance(args[1], bool)):
                args = (args[0], torch.device("cpu"), *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def native_torch():
    """Torch calls inside the block bypass :class:`_CudaToCpuMode` (item 4): for this project's own
    hot loops that name no CUDA device and call no megatron-core code, e.g. the in-process weight
    sync (``HFEngine._load_stream``, which also drives :func:`dapo_megatron.bridge.iter_hf_weights`).
    The mode costs ~2 us of Python per torch call (measured here: ``t.view(-1)[10:20]`` 6.6 us with
    it, 2.3 us without), several hundred calls per sync. A no-op where the mode is not the current
    torch-function mode (CUDA present, not activated, or another mode pushed on top of it). The
    block must not yield out of a generator (the mode stack is the thread's, not the frame's):
    ``torch.overrides._pop_mode_temporarily`` is the same pop and push."""
    mode = _MODE
    if mode is None or torch.overrides._get_current_function_mode() is not mode:
        yield
        return
    torch.overrides._pop_mode()
    try:
        yield
    finally:
        torch.overrides._push_mode(mode)


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator
    # directly and make the "all devices" variant a no-op to avoid recursion.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None


class _CpuEvent:
    """A CUDA event stand-in: on CPU the work it marks has already run."""

    def synchronize(self) -> None:
        return None

    def wait(self, stream=None) -> None:
        return None

    def query(self) -> bool:
        return True

    def record(self, stream=None) -> None:
        return None


class _CpuStream:
    """A CUDA stream stand-in (see the module docstring, item 6): ordering is a no-op on CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def record_event(self, event=None) -> _CpuEvent:
        return event if event is not None else _CpuEvent()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


_CPU_STREAM = _CpuStream()


def _patch_cuda_streams() -> None:
    cuda = torch.cuda
    cuda.Stream = _CpuStream
    cuda.Event = lambda *args, **kwargs: _CpuEvent()
    cuda.current_stream = lambda device=None: _CPU_STREAM
    cuda.default_stream = lambda device=None: _CPU_STREAM
    cuda.stream = lambda stream=None: stream if isinstance(stream, _CpuStream) else _CPU_STREAM


def _maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    """``megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu`` for CPU tensors too
    (module docstring, item 7): a tensor comes back as numpy when ``as_numpy``, as a CUDA
    tensor does there; ``record_stream`` has no meaning on CPU."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.detach().cpu().numpy()
    return tensor


def _patch_megatron_moe() -> None:
    # megatron-core here, not at the top: platform loads before quiet_third_party has silenced its import warnings
    try:
        from megatron.core.transformer.moe import moe_utils, token_dispatcher
    except ImportError:
        return
    moe_utils.maybe_move_tensor_to_cpu = _maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = _maybe_move_tensor_to_cpu  # bound by name at import
    if not hasattr(moe_utils, "te_general_gemm"):  # item 8: megatron's own torch.mm branch then runs
        moe_utils.te_general_gemm = None


def _patch_megatron_rng() -> None:
    # megatron-core here, not at the top: platform loads before quiet_third_party has silenced its import warnings
    try:
        from megatron.core.tensor_parallel import random as mrandom
    except ImportError:  # megatron-core not installed: nothing to patch
        return
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state()
    )
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (
        torch.set_rng_state(new_state)
    )

    class _QuietForkWarning(logging.Filter):
        # On CPU the "CUDA" stream and the CPU generator are the same generator, so the
        # tracker's "CPU RNG state changed within GPU RNG context" check always fires.
        def filter(self, record: logging.LogRecord) -> bool:
            return "CPU RNG state changed within GPU RNG context" not in record.getMessage()

    logging.getLogger(mrandom.__name__).addFilter(_QuietForkWarning())


def _l2_norm_fp64(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for ``megatron.core.utils.local_multi_tensor_l2_norm`` (same arguments,
    same ``([norm] float32, None)`` result) that accumulates squares in float64."""
    tensors = [t for tl in tensor_lists for t in tl]
    total = sum(float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2 for t in tensors)
    # on the gradients' device, like the fused kernel: megatron all-reduces it over the DP group
    ref = tensors[0] if tensors else noop_flag
    return ref.new_tensor([math.sqrt(total)], dtype=torch.float32), None


def _patch_megatron_grad_norm() -> None:
    # megatron-core here, not at the top: platform loads before quiet_third_party has silenced its import warnings
    try:
        from megatron.core.optimizer import clip_grads
        from megatron.core.utils import local_multi_tensor_l2_norm
    except ImportError:
        return
    if clip_grads.l2_norm_impl is local_multi_tensor_l2_norm:  # no Apex / TE kernel installed
        clip_grads.l2_norm_impl = _l2_norm_fp64


def activate(force: bool = False) -> bool:
    """Install the CPU compatibility layer if CUDA is absent.

    Args:
        force: install even when CUDA is available (tests only).

    Returns:
        True if the layer is active after the call, False when CUDA is available
        and nothing was changed.

    Must be called before megatron-core builds models or optimizers, once per
    process (``dapo_megatron.platform.init_distributed`` does it).
    """
    global _ACTIVE, _MODE
    with _LOCK:
        if _ACTIVE:
            return True
        if torch.cuda.is_available() and not force:
            return False
        _patch_torch_cuda()
        _patch_cuda_streams()
        _patch_megatron_rng()
        _patch_megatron_moe()
        _patch_megatron_grad_norm()
        _MODE = _CudaToCpuMode()
        _MODE.__enter__()
        _ACTIVE = True
        return True
