"""Weight-sync verification: checksums the sender computes over exactly what it sent, compared with
the receiver's over what it loaded, before the engine generates with the new version.

The checksum (:func:`checksum`) is the wrapping int64 sum of a tensor's bytes read as 64-bit words
(the bytes past the last whole word added one by one): one vectorised reduction, as fast as a
read of the tensor (no hash over Python loops); any single flipped bit changes it (it moves the
word by ``±2**k``), and so does a tensor swapped with another of different contents. It is blind
to a permutation inside one tensor, which the sender's own re-layout could cause and no
receiver-side sum can see: the functional probe (``rollout.weight_probe``, :func:`probe_error`)
covers that.

Which tensors a sync checks (:func:`sampled`): tensor ``i`` of the bridge's fixed export order is
checked at version ``v`` when ``i % period == v % period``; ``period = 1`` checks every tensor of
every sync, ``period = k`` a rotating ``1/k`` of them, every tensor once in any ``k`` consecutive
syncs (``rollout.check_weight_update_period``). Whatever the period, every sync also checks its
structure: each bucket carries the sender's version and bucket index in a trailer the receiver
reads (a stale bucket, one from another sync or out of order, fails), and every tensor the
sender's digest lists must have been loaded.

Roles: the bridge (:func:`dapo_megatron.bridge.iter_hf_weights` with ``digest=``) computes the
sender checksums on the rank that fills a bucket, before any broadcast, and ships them in the
bucket's trailer, so every rank's :class:`SyncDigest` holds the owner's values; each engine
compares what it loaded (the HF engine: its parameters; an engine in another process: what
:func:`readback_checksum` makes of SGLang's ``get_weights_by_name``). docs/design.md §1 step 7.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch


class WeightSyncVerifyError(RuntimeError):
    """A weight sync whose receiver does not hold what the sender sent; the message names the
    tensor, the engine or server and the version."""


def checksum_tensor(t: torch.Tensor) -> torch.Tensor:
    """The checksum of ``t`` as a 0-d int64 tensor on ``t``'s device, without a host sync (int64 sums
    wrap around in torch on every device); :func:`checksum` reads it."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    raw = t.reshape(-1).view(torch.uint8)
    n = raw.numel()
    whole = n // 8 * 8
    if whole == n and n and t.data_ptr() % 8 == 0:  # the common case: whole, aligned words, one reduction
        return raw.view(torch.int64).sum()
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    if whole:
        head = raw[:whole]
        try:
            words = head.view(torch.int64)
        except RuntimeError:  # the storage offset is not 8-byte aligned: align through a copy
            words = head.clone().view(torch.int64)
        total = words.sum()
    if whole < n:
        total = total + raw[whole:].to(torch.int64).sum()
    return total


def checksum(t: torch.Tensor) -> int:
    """Wrapping int64 sum of ``t``'s bytes as 64-bit little-endian words (see the module docstring).

    Independent of the dtype's element size and of the tensor's shape: equal bytes, equal sums.
    A non-contiguous tensor is summed over a contiguous copy."""
    return _wrap(int(checksum_tensor(t)))


def read_checksums(values: dict) -> dict:
    """``{name: checksum_tensor or None}`` → ``{name: int or None}`` with one host read."""
    names = [n for n, v in values.items() if v is not None]
    out = {n: None for n, v in values.items() if v is None}
    if names:
        stacked = torch.stack([values[n].to("cpu") if values[n].device.type != "cpu" else values[n] for n in names])
        out.update(zip(names, (_wrap(v) for v in stacked.tolist())))
    return out


def _wrap(x: int) -> int:
    return (x + 2**63) % 2**64 - 2**63


def sampled(index: int, version: int, period: int) -> bool:
    """Whether tensor ``index`` (of the fixed export order) is checksummed in the sync of ``version``."""
    return period <= 1 or index % period == version % period


@dataclass
class SyncDigest:
    """What the sender sent in one sync, as every rank sees it.

    Attributes:
        version: the weight version being synced.
        period: see :func:`sampled`.
        sums: HF name → the sender's checksum, for the tensors this sync checks.
        sent: every HF name the sender sent, in order.
        errors: structural failures seen while the stream was read (a stale or out-of-order
            bucket), reported by the receiving engine
            (:meth:`~dapo_megatron.bridge.receiver.WeightReceiver.verify_loaded`).
        seconds: time spent computing and comparing checksums on this rank (the overhead that
            ``benchmarks/bench_sync*.py`` report).
    """

    version: int
    period: int = 1
    dtype: Optional[str] = None  # the sent dtype ("float32", "bfloat16"), set by the bridge
    #: receivers that read back (SGLang, servers): each checksum covers the tensor's first rows up to
    #: this many elements (:func:`readback_rows`); None: whole tensors (in-process receivers)
    readback_elements: Optional[int] = None
    sums: dict[str, int] = field(default_factory=dict)
    sent: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def wants(self, index: int) -> bool:
        return sampled(index, self.version, self.period)

    def checked_part(self, t: torch.Tensor) -> torch.Tensor:
        """What of ``t`` the checksum covers: ``t``, or its head rows for a readback receiver
        (:func:`readback_rows`)."""
        if self.readback_elements is None or t.dim() == 0:
            return t
        return t[:readback_rows(tuple(t.shape), self.readback_elements)]

    def mismatch(self, name: str, loaded: Optional[int], where: str) -> Optional[str]:
        """The error message when ``loaded`` (the receiver's checksum of ``name``; None: the receiver
        does not hold it) differs from the sender's, else None."""
        want = self.sums.get(name)
        if want is None or loaded == want:
            return None
        got = ("nothing (never loaded, or an SGLang model class without get_weights_by_name: "
               "rollout.check_weight_update_readback)") if loaded is None else f"{loaded & (2**64 - 1):#018x}"
        return (f"weight sync to version {self.version}: {where} holds a different {name!r} than the trainer sent "
                f"(checksum sent {want & (2**64 - 1):#018x}, loaded {got}); the engine keeps its previous "
                "weights invalid and will not generate with this version")


def digest_dtype(digest: SyncDigest) -> Optional[torch.dtype]:
    """The sent dtype as a ``torch.dtype`` (None before the bridge set it)."""
    return getattr(torch, digest.dtype) if digest.dtype else None


def as_sent(t: torch.Tensor, dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    """A loaded tensor read back in the sent dtype: itself, or its cast where the engine's dtype
    holds every sent value exactly (a wider float); None where it does not (a narrower engine
    dtype: the loaded bits are a rounding of the sent ones, not comparable)."""
    if dtype is None or t.dtype == dtype:
        return t
    if t.dtype.is_floating_point and dtype.is_floating_point and t.element_size() > torch.empty((), dtype=dtype).element_size():
        return t.to(dtype)
    return None


class Timer:
    """Adds the seconds of a ``with`` block to ``digest.seconds`` (no-op for None)."""

    def __init__(self, digest: Optional[SyncDigest]):
        self.digest = digest

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.digest is not None:
            self.digest.seconds += time.perf_counter() - self.t0
        return False


# ------------------------------------------------------------------ the bucket trailer
TRAILER_HEAD = 3  # int64 words: version, bucket index, number of tensors; then one checksum per tensor


def trailer_words(num_tensors: int) -> int:
    return TRAILER_HEAD + num_tensors


def write_trailer(words: torch.Tensor, version: int, bucket: int, sums: Sequence[Optional[torch.Tensor]]) -> None:
    """Fill a bucket's trailer (an int64 view into the bucket buffer) on the rank that filled it:
    ``sums`` are :func:`checksum_tensor` values on the bucket's device (None: unchecked, 0), copied
    without a host read."""
    if words.device.type == "cpu":  # host values: one small tensor, one copy (the 0-d sums read without a sync)
        head = [version, bucket, len(sums)] + [0 if v is None else int(v) for v in sums]
        words[:len(head)].copy_(torch.tensor(head, dtype=torch.int64))
        return
    words[:TRAILER_HEAD].copy_(torch.tensor([version, bucket, len(sums)], dtype=torch.int64))
    if sums:
        zero = torch.zeros((), dtype=torch.int64, device=words.device)
        words[TRAILER_HEAD:TRAILER_HEAD + len(sums)].copy_(torch.stack([zero if v is None else v for v in sums]))


def read_trailer(words: torch.Tensor) -> tuple[int, int, list[int]]:
    """``(version, bucket index, checksums)`` of a bucket's trailer."""
    values = words.cpu().tolist()
    n = values[2]
    return values[0], values[1], [_wrap(v) for v in values[TRAILER_HEAD:TRAILER_HEAD + n]]


# ------------------------------------------------------------------ receivers in another process
def readback_checksum(values: Any, dtype: torch.dtype, shape: Sequence[int]) -> Optional[int]:
    """Checksum of a tensor read back with SGLang's ``get_weights_by_name`` (the parameter as
    ``.float().tolist()`` truncated to ``truncate_size`` rows: sglang ``models/llama.py``
    ``LlamaForCausalLM.get_weights_by_name``, reached through ``model_executor/model_runner.py``
    ``ModelRunner.get_weights_by_name``; the same in ``dapo-rollout-server``), or None when the
    engine returned nothing or another shape. fp32 holds every bf16 / fp16 / fp32 value exactly,
    so the cast back to the sent dtype gives the loaded bits."""
    if values is None:
        return None
    if isinstance(values, dict) and "parameter" in values:  # GetWeightsByNameReqOutput as a dict
        values = values["parameter"]
    try:
        t = torch.tensor(values, dtype=torch.float32)
    except (TypeError, ValueError):
        return None
    if tuple(t.shape) != tuple(shape):
        return None
    return checksum(t.to(dtype))


def readback_rows(shape: Sequence[int], max_elements: Optional[int]) -> int:
    """The rows of a tensor of ``shape`` that a readback reads (``get_weights_by_name``'s
    ``truncate_size``): every row, or the most whole rows within ``max_elements`` elements (at
    least one); ``max_elements`` None or 0: every row. A 0-d tensor counts as one row."""
    if not shape:
        return 1
    rows = int(shape[0])
    if not max_elements:
        return max(1, rows)
    per_row = 1
    for d in shape[1:]:
        per_row *= int(d)
    return max(1, min(rows, max_elements // max(per_row, 1)))


def readback_shape(shape: Sequence[int], max_elements: Optional[int]) -> tuple[int, ...]:
    """The shape of what a readback of a tensor of ``shape`` answers (:func:`readback_rows`)."""
    if not shape:
        return ()
    return (readback_rows(shape, max_elements), *tuple(shape)[1:])


def readback_names(digest: SyncDigest, limit: Optional[int] = None) -> list[str]:
    """The tensors this sync reads back from an out-of-process engine: the checked ones, in the
    sender's order (``limit``: at most that many)."""
    names = [n for n in digest.sent if n in digest.sums]
    return names if limit is None else names[:limit]


# ------------------------------------------------------------------ the functional probe
#: the probe's default bound on the mean |logprob difference| per token, by the sent dtype: fp32 engines
#: agree with the actor to ~1e-5 (README: 2.6e-5 per token on fresh responses), bf16 ones to ~0.02
#: (two implementations rounding activations their own way); a wrong layout or name map moves
#: whole nats.
PROBE_TOLERANCE = {"float32": 1e-3, "float64": 1e-3}
PROBE_TOLERANCE_LOW_PRECISION = 0.1


def probe_ids(vocab_size: int, length: int = 24) -> list[int]:
    """The fixed probe sequence: ``length`` ids spread over the vocabulary (never 0), the same
    every sync and on every rank."""
    return [(17 + 7919 * i) % (vocab_size - 1) + 1 for i in range(length)]


def probe_tolerance(configured: float, dtype: Optional[str]) -> float:
    if configured > 0:
        return configured
    return PROBE_TOLERANCE.get(dtype or "float32", PROBE_TOLERANCE_LOW_PRECISION)


def probe_error(engine_lp: torch.Tensor, actor_lp: torch.Tensor, tolerance: float, *, version: int,
                where: str) -> Optional[str]:
    """The probe's verdict: None, or the error naming the engine, the version and the gap."""
    diff = (engine_lp.float() - actor_lp.float()).abs()
    mean = float(diff.mean())
    if mean <= tolerance:
        return None
    worst = int(diff.argmax())
    return (f"weight sync to version {version}: the probe sequence's logprobs under {where} differ from the "
            f"actor's by {mean:.4g} nats per token on average (largest {float(diff[worst]):.4g} at token "
            f"{worst + 1}), more than rollout.weight_probe_tolerance={tolerance:g}: the engine holds weights the "
            "actor does not (a layout or name map the checksums cannot see); it will not generate with them")
