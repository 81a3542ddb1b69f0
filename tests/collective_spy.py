"""Record every ``torch.distributed`` collective with the device of each tensor handed to it.

Used by ``tests/integration/test_collective_devices.py`` (CPU, gloo, an NCCL layout declared) and by
``tests/gpu/h200_check.py`` (CUDA, real NCCL).

* :class:`CollectiveSpy` wraps the collectives of ``torch.distributed`` and every alias of
  them held by an already imported ``megatron`` / ``dapo_megatron`` module (megatron-core
  keeps ``dist_reduce_scatter_func = torch.distributed.reduce_scatter_tensor`` at import
  time), and records one :class:`Call` per call: the op, the group, the group's backend,
  the device of each tensor argument and the device :func:`collective_device` demands.
  ``isend`` / ``irecv`` are left alone (``P2POp`` checks their identity); their batched
  form ``batch_isend_irecv`` is recorded.
* :class:`PlacementTracker` (CPU only) gives every tensor created while it is active the
  device it would have on a GPU machine (its "placement"): a factory call without
  ``device=`` gives the host (torch's default device is the CPU, also on a GPU machine);
  ``device="cuda"`` / an index / ``torch.device("cuda", i)`` gives that GPU, although
  the CPU compatibility layer then allocates on the CPU; ``*_like`` / ``new_*`` inherit
  from their source, ``.to(...)`` / ``.cuda()`` / ``.cpu()`` move, ``x.device`` answers
  x's placement, and any other op gives its result the placement of its tensor inputs (a
  GPU input wins, as a 0-dim CPU scalar mixes with a CUDA tensor). Tensors made by the
  autograd engine (gradients in backward) have no placement: they are reported as None. A tensor that reaches an NCCL collective while its
  placement is the host is exactly the defect "No backend type associated with device
  type cpu" on a GPU machine, which this makes visible on a CPU.
"""

from __future__ import annotations

import inspect
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

#: collectives that take tensors; object collectives below take Python objects
TENSOR_COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base",
    "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all_single", "all_to_all",
    "gather", "scatter", "send", "recv", "batch_isend_irecv",
)
OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                      "barrier")

_PLACEMENT = "_dapo_placement"  # attribute holding a tensor's placement (a torch.device)


def placement_of(t: torch.Tensor) -> Optional[torch.device]:
    """The tracked placement of ``t``, or None when it was created outside the tracker."""
    return getattr(t, _PLACEMENT, None)


def set_placement(t: torch.Tensor, dev) -> None:
    setattr(t, _PLACEMENT, _as_device(dev))


def _as_device(dev) -> Optional[torch.device]:
    if dev is None:
        return None
    if isinstance(dev, torch.device):
        return torch.device("cuda", dev.index or 0) if dev.type == "cuda" else torch.device(dev.type)
    if isinstance(dev, bool):
        return None
    if isinstance(dev, int):
        return torch.device("cuda", dev)
    if isinstance(dev, str):
        return _as_device(torch.device(dev))
    return None


@dataclass
class Call:
    """One recorded collective.

    Attributes:
        op: function name (``all_reduce``, ...).
        backend: the group's backend as the code under test sees it (may be a declared one).
        devices: the placement (tracker) or device (GPU) of each tensor argument, in order;
            None for a tensor of unknown placement.
        expected: the device :func:`collective_device` demands for the group.
        where: the first caller frame outside torch, this module and the package's collective
            wrappers (``platform/collectives.py``, ``platform/parallel_dims.py``), ``path:line`` with the
            path from its package root (``dapo_megatron/actor/actor.py:546``,
            ``megatron/core/...``).
    """

    op: str
    backend: str
    devices: list
    expected: Optional[torch.device]
    where: str

    @property
    def ok(self) -> bool:
        """Every tensor of known placement is on the expected device."""
        return all(d is None or d == self.expected for d in self.devices)

    @property
    def unknown(self) -> bool:
        """Some tensor has no placement (made by the autograd engine, outside the tracker)."""
        return any(d is None for d in self.devices)


#: the package's collective wrappers (every collective of the package goes through them): a call is
#: reported at the line that called the wrapper
_WRAPPERS = ("/dapo_megatron/platform/collectives.py", "/dapo_megatron/platform/parallel_dims.py")


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):  # skip _caller and the wrapper
        f = frame.filename
        if "/torch/" in f or f.endswith("collective_spy.py") or f.endswith(_WRAPPERS):
            continue
        for root in ("/dapo_megatron/", "/megatron/", "/tests/"):
            if root in f:
                f = root[1:] + f.rsplit(root, 1)[1]
                break
        return f"{f}:{frame.lineno}"
    return "?"


def _tensors_in(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    if isinstance(value, dist.P2POp):
        return [value.tensor]
    return []


@dataclass
class CollectiveSpy:
    """Wrap the collectives; see the module docstring.

    Args:
        device_of: placement of a tensor (``tensor.device`` on a GPU, :func:`placement_of`
            under a :class:`PlacementTracker`).
        expected_device: the device a group's tensors must be on
            (``dapo_megatron.platform.distributed.collective_device``).
        backend_of: the backend the code under test sees for a group.
    """

    device_of: Callable[[torch.Tensor], Any]
    expected_device: Callable[[Any], torch.device]
    backend_of: Callable[[Any], str]
    calls: list[Call] = field(default_factory=list)
    _undo: list = field(default_factory=list)

    def _wrap(self, name: str, fn):
        sig = inspect.signature(fn)
        spy = self

        def wrapper(*args, **kwargs):
            try:
                bound = sig.bind_partial(*args, **kwargs)
                params = bound.arguments
            except TypeError:
                params = {}
            if name == "batch_isend_irecv":
                ops = params.get("p2p_op_list", args[0] if args else [])
                group = ops[0].group if ops else None
            else:
                group = params.get("group")
            tensors = [] if name in OBJECT_COLLECTIVES else [
                t for k, v in params.items() if k != "group" for t in _tensors_in(v)]
            spy.calls.append(Call(name, spy.backend_of(group), [spy.device_of(t) for t in tensors],
                                  spy.expected_device(group), _caller()))
            return fn(*args, **kwargs)

        wrapper.__wrapped__ = fn
        return wrapper

    def __enter__(self) -> "CollectiveSpy":
        originals = {n: getattr(dist, n) for n in TENSOR_COLLECTIVES + OBJECT_COLLECTIVES if hasattr(dist, n)}
        wrappers = {n: self._wrap(n, fn) for n, fn in originals.items()}
        by_id = {id(fn): wrappers[n] for n, fn in originals.items()}
        for n, w in wrappers.items():
            self._undo.append((dist, n, originals[n]))
            setattr(dist, n, w)
        for modname, mod in list(sys.modules.items()):  # aliases kept at import time
            if mod is None or not modname.startswith(("megatron", "dapo_megatron")):
                continue
            for attr, value in list(vars(mod).items()):
                if callable(value) and id(value) in by_id:
                    self._undo.append((mod, attr, value))
                    setattr(mod, attr, by_id[id(value)])
        return self

    def __exit__(self, *exc) -> None:
        for obj, attr, value in reversed(self._undo):
            setattr(obj, attr, value)
        self._undo.clear()

    def tensor_calls(self) -> list[Call]:
        return [c for c in self.calls if c.op not in OBJECT_COLLECTIVES]

    def mismatches(self) -> list[Call]:
        return [c for c in self.tensor_calls() if not c.ok]

    def report(self, calls=None) -> str:
        return "\n".join(f"  {c.op:<24} backend={c.backend:<5} expected={c.expected} got={c.devices} at {c.where}"
                         for c in (self.calls if calls is None else calls))


_FACTORIES = {"zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "rand", "randn", "randint",
              "randperm", "linspace", "logspace", "eye", "empty_strided", "scalar_tensor", "from_numpy", "range"}
_LIKE = {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like"}
_NEW = {"new_zeros", "new_ones", "new_empty", "new_full", "new_tensor", "new_empty_strided"}
_HOST = torch.device("cpu")
_DEVICE_ATTR = torch.Tensor.device


class PlacementTracker(TorchFunctionMode):
    """Track where each tensor would live on a GPU machine; see the module docstring.

    Enter it after ``dapo_megatron.platform.cpu_compat`` (which turns CUDA placements into
    CPU ones below it): it sees each call first, with the placement the code asked for.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__" and getattr(func, "__self__", None) is _DEVICE_ATTR:
            # ``x.device`` answers the placement, so ``torch.empty(..., device=x.device)`` follows x
            return placement_of(args[0]) or func(*args, **kwargs)
        is_method = getattr(func, "__objclass__", None) is not None or (
            args and isinstance(args[0], torch.Tensor) and getattr(torch.Tensor, name, None) is func)
        target = None  # the placement of the result, when the call decides it
        if name in _FACTORIES and not is_method:
            target = _as_device(kwargs.get("device")) or _HOST
        elif name in _LIKE:
            target = _as_device(kwargs.get("device")) or placement_of(args[0])
        elif name in _NEW and is_method:
            target = _as_device(kwargs.get("device")) or placement_of(args[0])
        elif name == "to" and is_method:
            target = self._to_target(args, kwargs)
        elif name == "cuda" and is_method:
            target = _as_device(args[1] if len(args) > 1 else kwargs.get("device")) or torch.device("cuda", 0)
        elif name == "cpu" and is_method:
            target = _HOST
        out = func(*args, **kwargs)
        if name in ("to", "cuda", "cpu") and is_method and out is args[0] and target is not None \
                and target != placement_of(args[0]):
            out = out.clone()  # a move to another device copies on a GPU machine; keep the source as it was
        inputs = [t for a in list(args) + list(kwargs.values()) for t in _tensors_in(a)]
        if target is None:
            placed = [placement_of(t) for t in inputs]
            gpu = [p for p in placed if p is not None and p != _HOST]
            target = gpu[0] if gpu else (_HOST if placed and all(p == _HOST for p in placed) else None)
        if target is not None:
            for t in _tensors_in(out):
                if not any(t is i for i in inputs):  # in-place results keep their placement
                    set_placement(t, target)
        return out

    @staticmethod
    def _to_target(args, kwargs):
        if "device" in kwargs:
            return _as_device(kwargs["device"])
        for a in args[1:]:
            if isinstance(a, torch.Tensor):
                return placement_of(a)
            if isinstance(a, (torch.device, str)) or (isinstance(a, int) and not isinstance(a, bool)):
                return _as_device(a)
        if "other" in kwargs and isinstance(kwargs["other"], torch.Tensor):
            return placement_of(kwargs["other"])
        return placement_of(args[0])


def place_module(module: torch.nn.Module, dev) -> None:
    """Declare the placement of a module's parameters and buffers (a model built before the
    tracker, or with ``use_cpu_initialization``, which a GPU run does not use)."""
    for t in list(module.parameters()) + list(module.buffers()):
        set_placement(t, dev)
