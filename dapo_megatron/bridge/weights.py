"""Load HF weights into Megatron model chunks, and stream them back out as HF tensors.

Both directions go through :mod:`.mapping`; nothing here knows a layout rule.

Design: docs/design.md §1 step 7 (weight sync).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Optional

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

from dapo_megatron.platform import collectives
from dapo_megatron.platform.distributed import collective_device

from .mapping import (
    ModelLayout,
    canonical_megatron_name,
    expected_hf_names,
    exported_entries,
    hf_names_of,
    hf_shapes,
    gathers_in_place,
    hf_row_ranges,
    hf_to_megatron_shard,
    match_rule,
    megatron_name_of,
    megatron_shard_shape,
    megatron_to_hf_into,
)
from .verify import SyncDigest, Timer, checksum_tensor, read_trailer, trailer_words, write_trailer

if TYPE_CHECKING:
    from dapo_megatron.platform import ParallelDims

# HF keys that may appear in a state dict without being weights of the model.
_IGNORED_HF_KEYS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def unwrap_model(chunk: torch.nn.Module) -> torch.nn.Module:
    """Strip Megatron DDP / Float16Module wrappers (``.module`` chains)."""
    while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
        chunk = chunk.module
    return chunk


def _as_list(model_chunks) -> list[torch.nn.Module]:
    if isinstance(model_chunks, torch.nn.Module):
        return [model_chunks]
    chunks = list(model_chunks)
    if not chunks:
        raise ValueError("model_chunks is empty")
    return chunks


def model_layout(model_chunks) -> ModelLayout:
    """:class:`ModelLayout` of a model built by ``dapo_megatron.models.build_gpt_model``.

    Raises:
        ValueError: the model carries no ``hf_config`` (build it with ``build_gpt_model``).
    """
    model = unwrap_model(_as_list(model_chunks)[0])
    hf_config = getattr(model, "hf_config", None)
    if hf_config is None:
        raise ValueError("model has no hf_config attribute: build it with dapo_megatron.models.build_gpt_model")
    return ModelLayout.from_hf_config(hf_config, padded_vocab_size=model.vocab_size,
                                      padded_num_query_groups=model.config.num_query_groups,
                                      mla_down_split=getattr(model, "transformer_impl", "local") != "transformer_engine")


# megatron-core's TopKRouter.expert_bias: a buffer (router.py:189), the state of the aux-loss-free balancing
_BIAS_BUFFER = "mlp.router.expert_bias"
_LOCAL_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


def local_parameters(model_chunks) -> dict[str, torch.nn.Parameter]:
    """This rank's parameters keyed by canonical Megatron name with GLOBAL layer (and expert)
    indices.

    The global layer index comes from each layer's own ``layer_number`` (1-based, set by
    megatron-core from the PP/VP offset), so uneven or interleaved pipelines map correctly.
    The routers' ``expert_bias`` buffers (DeepSeek-V3's score-correction bias) are included.
    A routed expert's global index is its MoE layer's ``local_expert_indices[i]`` (megatron-core
    moe/moe_layer.py: ``ep_rank · E/EP + i``), for the per-expert ``SequentialMLP`` and the TE
    grouped-GEMM names alike.
    """
    out: dict[str, torch.nn.Parameter] = {}
    for chunk in _as_list(model_chunks):
        model = unwrap_model(chunk)
        layers = model.decoder.layers
        # the routers' score-correction biases are buffers (not trained by the optimizer), but state
        # the engine routes with: the bridge moves them like parameters
        biases = [(n, b) for n, b in model.named_buffers() if n.endswith(_BIAS_BUFFER) and b is not None]
        for name, param in list(model.named_parameters()) + biases:
            name = canonical_megatron_name(name)
            m = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name)
            if m:
                layer = layers[int(m.group(1))]
                rest = m.group(2)
                e = _LOCAL_EXPERT_RE.match(rest)
                if e:
                    rest = f"mlp.experts.local_experts.{layer.mlp.local_expert_indices[int(e.group(1))]}.{e.group(2)}"
                name = f"decoder.layers.{layer.layer_number - 1}.{rest}"
            out[name] = param
    return out


def split_coords(parallel: ParallelDims, expert: bool) -> tuple[int, int]:
    """(rank, size) of the group that splits a parameter's FFN: expert-TP for a routed expert's,
    TP for every other."""
    return (parallel.etp_rank, parallel.etp_size) if expert else (parallel.tp_rank, parallel.tp_size)


@dataclass
class LoadReport:
    """What :func:`load_hf_weights` did on this rank.

    Attributes:
        loaded: Megatron names (global layers) written on this rank.
        missing: HF names the model needs but the source lacks (empty when strict).
        unexpected: HF names in the source that no rule consumes (empty when strict).
    """

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


@torch.no_grad()
def load_hf_weights(
    model_chunks, hf_state: Mapping[str, torch.Tensor], strict: bool = True, *, parallel: ParallelDims
) -> LoadReport:
    """Copy HF-named full tensors into this rank's Megatron parameter shards.

    Every rank reads only the HF tensors its own parameters need (a lazy
    :class:`~.sources.SafetensorsSource` therefore reads only those: an EP rank reads its own
    experts) and keeps its TP shard (expert-TP shard for a routed expert). No collective is
    issued.

    Args:
        model_chunks: a ``GPTModel`` (or a list of chunks, possibly DDP/Float16-wrapped)
            built by ``build_gpt_model``.
        hf_state: ``Mapping[hf_name, Tensor]`` with full HF shapes (any float dtype; cast
            to the parameter dtype).
        strict: raise on any missing or unexpected HF tensor (checked against the whole
            model, not only this rank's stage, so every rank raises the same error). The
            multi-token-prediction layers of a DeepSeek-V3 / GLM checkpoint (``model.layers.{i}.*``
            with ``num_hidden_layers <= i < num_hidden_layers + num_nextn_predict_layers``) are
            not the model's and not unexpected: they are skipped, as SGLang's loaders skip them.
        parallel: the layout the model was built for (its TP rank and size pick the shard; the
            expert-TP ones for routed experts, whose global indices the model itself holds).

    Returns:
        :class:`LoadReport`.

    Raises:
        KeyError: strict and HF tensors are missing / unexpected (names listed), or a
            Megatron parameter matches no rule.
        ValueError: an HF tensor has the wrong shape (naming it and both shapes), or a
            tied ``lm_head.weight`` differs from ``model.embed_tokens.weight``.
    """
    layout = model_layout(model_chunks)
    expected = expected_hf_names(layout)
    available = set(hf_state.keys())
    report = LoadReport()
    report.missing = [n for n in expected if n not in available]
    allowed = set(expected)
    if layout.tie_word_embeddings:
        allowed.add("lm_head.weight")  # tied alias, checked below
    report.unexpected = sorted(n for n in available if n not in allowed and not _IGNORED_HF_KEYS.search(n)
                               and not layout.is_mtp_name(n))
    if strict and (report.missing or report.unexpected):
        raise KeyError(
            f"HF weights do not fit the {layout.model_type} config: missing {report.missing[:10]}"
            f"{' ...' if len(report.missing) > 10 else ''} ({len(report.missing)}), unexpected "
            f"{report.unexpected[:10]}{' ...' if len(report.unexpected) > 10 else ''} ({len(report.unexpected)})"
        )
    if layout.tie_word_embeddings and "lm_head.weight" in available and "model.embed_tokens.weight" in available:
        if not torch.equal(hf_state["lm_head.weight"], hf_state["model.embed_tokens.weight"]):
            raise ValueError("hf_config.tie_word_embeddings=True but HF lm_head.weight differs from "
                             "model.embed_tokens.weight: the config does not fit these weights")
    for name, param in local_parameters(model_chunks).items():
        rule, layer, expert = match_rule(layout, name)
        if rule.megatron == "output_layer.weight" and layout.tie_word_embeddings:
            # PP > 1: megatron-core's copy of the tied embedding on the last stage.
            rule, layer, expert = match_rule(layout, "embedding.word_embeddings.weight")
        names = hf_names_of(rule, layer, expert)
        absent = [n for n in names if n not in available]
        if absent:
            continue  # only reachable when not strict: listed in report.missing
        tp_rank, tp_size = split_coords(parallel, rule.expert)
        want = megatron_shard_shape(layout, megatron_name_of(rule, layer, expert), tp_size)
        if tuple(param.shape) != want:
            raise ValueError(f"Megatron parameter {name!r} has shape {tuple(param.shape)}, the mapping expects "
                             f"{want}: the model was built from a different config")
        shard = hf_to_megatron_shard(layout, megatron_name_of(rule, layer, expert), [hf_state[n] for n in names],
                                     tp_rank, tp_size)
        param.data.copy_(shard.to(param.dtype))
        report.loaded.append(name)
    return report


@dataclass(frozen=True)
class _Entry:
    megatron: str  # global canonical Megatron name
    split: str
    hf: tuple[tuple[str, tuple[int, ...]], ...]  # (hf_name, full shape)
    owner: int  # PP stage that holds the parameter
    ep_owner: Optional[int] = None  # routed expert: the EP rank of the stage that holds it; None: every rank

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for _, shape in self.hf)


def _export_plan(layout: ModelLayout, params: dict, parallel: ParallelDims) -> list[_Entry]:
    """Export entries in a fixed order, with the PP stage (and, for a routed expert, the EP
    rank) owning each.

    Each rank first checks its own exported parameters (one dtype, the TP shard shape the
    mapping expects, which lays out the sync's buffers); the result travels with the rank's
    parameter names in the plan's collectives (over EP, then PP), so every rank raises the
    same error instead of one raising while the others wait in a broadcast.

    Raises:
        ValueError: a parameter of an unexpected shape, or more than one parameter dtype
            (naming the parameter and the stage). KeyError: a parameter no stage holds.
    """
    pp_size = parallel.pp_size
    entries = exported_entries(layout)
    exported = {megatron_name_of(rule, layer, expert): rule for rule, layer, expert in entries}
    mine = sorted(params)
    problems, dtypes = [], set()
    for name in mine:
        if name not in exported:
            continue  # the tied output_layer of the last stage
        size = split_coords(parallel, exported[name].expert)[1]
        param, want = params[name], megatron_shard_shape(layout, name, size)
        if not name.endswith(_BIAS_BUFFER):  # the router bias stays fp32; the bucket's copy casts it
            dtypes.add(str(param.dtype))
        if tuple(param.shape) != want:
            problems.append(f"Megatron parameter {name!r} has shape {tuple(param.shape)}, the mapping expects {want} "
                            f"at {'ETP' if exported[name].expert else 'TP'}={size}: the model was built from a "
                            "different config")
    # names → EP rank holding them (routed experts); the other parameters every EP rank holds
    ep_of: dict[str, int] = {n: parallel.ep_rank for n in mine if n in exported and exported[n].expert}
    if parallel.ep_size > 1:
        peers = parallel.all_gather_objects((mine, problems, sorted(dtypes), ep_of), "ep")
        mine = sorted({n for names, _, _, _ in peers for n in names})
        problems = [p for _, probs, _, _ in peers for p in probs]
        dtypes = {d for _, _, ds, _ in peers for d in ds}
        ep_of = {n: r for _, _, _, held in peers for n, r in held.items()}
    held = [(mine, problems, sorted(dtypes), ep_of)]
    if pp_size > 1:
        held = parallel.all_gather_objects(held[0], "pp")
    for stage, (_, stage_problems, _, _) in enumerate(held):
        if stage_problems:
            more = f" (and {len(stage_problems) - 1} more)" if len(stage_problems) > 1 else ""
            raise ValueError(f"pipeline stage {stage}: {stage_problems[0]}{more}")
    all_dtypes = sorted({d for _, _, stage_dtypes, _ in held for d in stage_dtypes})
    if len(all_dtypes) > 1:
        raise ValueError(f"the exported Megatron parameters have dtypes {all_dtypes} across the pipeline stages: "
                         "the export needs one parameter dtype")
    owner_of: dict[str, int] = {}
    ep_owner_of: dict[str, int] = {}
    for stage, (names, _, _, stage_ep_of) in enumerate(held):
        for n in names:
            owner_of.setdefault(n, stage)  # tied output_layer on the last stage is never exported
        for n, r in stage_ep_of.items():
            ep_owner_of.setdefault(n, r)
    plan = []
    for rule, layer, expert in entries:
        name = megatron_name_of(rule, layer, expert)
        if name not in owner_of:
            raise KeyError(f"Megatron parameter {name!r} is held by no pipeline stage (model does not fit its config)")
        shapes = hf_shapes(layout, rule)
        plan.append(_Entry(name, layout.split_of(rule), tuple(zip(hf_names_of(rule, layer, expert), shapes)), owner_of[name],
                           ep_owner_of.get(name) if rule.expert else None))
    return plan


def _storage_use_count(buf: torch.Tensor) -> Optional[int]:
    """Strong references to ``buf``'s storage (the tensor itself, and every view of it); None
    where torch does not expose the counter. torch's CUDA-graph trees decide the same way
    whether an output buffer may be overwritten (torch/_inductor/cudagraph_trees.py,
    ``StorageWeakRefWrapper.expired``: ``torch._C._storage_Use_Count`` of a ``StorageWeakRef``)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    return int(count(StorageWeakRef(buf.untyped_storage()).cdata))


class ExportBuffers:
    """The memory :func:`iter_hf_weights` stages buckets in, kept from one call to the next.

    Without it every call allocates its buffers and frees them when it ends. A new CPU
    allocation costs page faults worth several copies of its bytes (measured on the
    development machine: 1.5 GB/s into fresh memory, 8.5 GB/s into reused memory), so a CPU
    weight sync that allocates is slower than its transport: the trainer keeps one of these
    for CPU actors (one bucket of host memory between syncs). On GPU it passes none: kept
    buffers would be out of the rollout engine's reach between syncs.

    On CPU the bucket buffer is reused for the next bucket once nothing outside holds a view
    of it (its storage's reference count, as torch's CUDA-graph trees check their output
    buffers: torch/_inductor/cudagraph_trees.py, ``StorageWeakRefWrapper.expired``). A
    consumer that keeps a bucket's tensors (without copying them) keeps that buffer: the next
    bucket gets new memory, so nothing it holds is ever overwritten. A collective holds its
    tensors for a moment after ``wait()`` returns (gloo's worker thread drops its reference
    once it has finished the work; seen here within 1 ms), so once a bucket's collectives
    are done the generator waits up to :attr:`collective_grace_s` for those references to go
    before it hands the bucket out. On CUDA every bucket gets new memory from the caching
    allocator, which recycles freed blocks itself, and recycles a block shared with SGLang
    over CUDA IPC only once SGLang has dropped its handle (torch's deferred free of IPC-shared
    blocks), a guarantee a reuse by reference count would bypass. The two scratch buffers
    (never handed out) are reused on every device. On CPU at EP > 1 a second bucket buffer
    holds the bucket an EP rank packs ahead of its broadcast turn (:meth:`ahead`), or the expert
    bucket whose broadcasts run while the consumer copies the bucket before it (:meth:`other`).
    """

    #: how long (s) the references of a bucket's finished collectives may take to go (CPU)
    collective_grace_s: float = 0.05
    #: how long (s) a CPU bucket buffer still referenced at the next bucket may take to be
    #: released (a consumer's own collective on it, e.g. the server sync's broadcast of a
    #: bucket larger than its packer's); a consumer that keeps tensors pays this per bucket
    reuse_grace_s: float = 0.002

    def __init__(self):
        # [0]: the bucket being filled or received; [1]: an EP owner's bucket packed ahead (:meth:`ahead`)
        self._bufs: list[Optional[torch.Tensor]] = [None, None]
        self._refs: list[Optional[int]] = [None, None]  # storage use count of each when only we hold it
        self._scratch: list[Optional[torch.Tensor]] = [None, None]
        self._plan: Optional[tuple] = None  # (key, _BucketPlan) of the last call (iter_hf_weights)

    @property
    def _bucket(self) -> Optional[torch.Tensor]:
        """The bucket buffer (the one :meth:`bucket` hands out)."""
        return self._bufs[0]

    @staticmethod
    def _fits(buf: Optional[torch.Tensor], like: torch.Tensor, numel: int) -> bool:
        return buf is not None and buf.dtype == like.dtype and buf.device == like.device and buf.numel() >= numel

    def _unheld(self, which: int, views: int = 0, grace_s: float = 0.0) -> bool:
        buf, own = self._bufs[which], self._refs[which]
        deadline = time.monotonic() + grace_s
        while True:
            count = _storage_use_count(buf)
            if count is None or own is None:
                return False
            if count == own + views:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(50e-6)

    def _take(self, which: int, like: torch.Tensor, numel: int, capacity: int) -> torch.Tensor:
        buf = self._bufs[which]
        grace_s = self.reuse_grace_s if buf is not None and buf.device.type == "cpu" else 0.0
        held = buf is not None and not self._unheld(which, grace_s=grace_s)
        if buf is not None and not held and buf.device.type == "cpu" and self._fits(buf, like, numel):
            return buf[:numel]
        self._bufs[which] = buf = None  # ours is dropped before the next is allocated
        size = numel if held or like.device.type != "cpu" else max(numel, capacity)
        self._bufs[which] = buf = like.new_empty(size)
        self._refs[which] = _storage_use_count(buf)
        return buf[:numel]

    def bucket(self, like: torch.Tensor, numel: int, capacity: int) -> torch.Tensor:
        """A flat buffer of ``numel`` elements (``like``'s dtype and device) that nothing else
        holds; any former contents. A new CPU buffer has ``capacity`` elements (the call's
        largest bucket) unless the last one is still held, in which case it has ``numel``."""
        return self._take(0, like, numel, capacity)

    def ahead(self, like: torch.Tensor, numel: int, capacity: int) -> torch.Tensor:
        """As :meth:`bucket`, from a second buffer: a bucket an EP owner packs ahead of its turn
        while the bucket buffer is in use (:func:`iter_hf_weights`, CPU)."""
        return self._take(1, like, numel, capacity)

    def other(self, flat: torch.Tensor, like: torch.Tensor, numel: int, capacity: int) -> torch.Tensor:
        """As :meth:`bucket`, from the buffer that does not hold ``flat`` (a view of either buffer):
        a bucket received while the consumer still reads ``flat``'s (:func:`iter_hf_weights`, CPU)."""
        return self._take(1 - self._which(flat), like, numel, capacity)

    def _which(self, flat: Optional[torch.Tensor]) -> int:
        """1 when ``flat`` views the second buffer, else 0."""
        if flat is not None and self._bufs[1] is not None and \
                flat.untyped_storage().data_ptr() == self._bufs[1].untyped_storage().data_ptr():
            return 1
        return 0

    def settle(self, flat: Optional[torch.Tensor] = None) -> None:
        """Wait (CPU, up to :attr:`collective_grace_s`) until the bucket's finished collectives
        have dropped their references, the caller holding exactly one view of the buffer
        (``flat``, of either buffer; None: the bucket buffer)."""
        which = self._which(flat)
        buf = self._bufs[which]
        if buf is None or buf.device.type != "cpu" or self._refs[which] is None:
            return
        self._unheld(which, views=1, grace_s=self.collective_grace_s)

    def scratch(self, like: torch.Tensor, numel: int, index: int) -> torch.Tensor:
        """Scratch buffer ``index`` (0 or 1) of ``numel`` elements, for shards that are re-laid
        out (never handed out): one is gathered into while the other is re-laid out."""
        if not self._fits(self._scratch[index], like, numel):
            self._scratch[index] = None
            self._scratch[index] = like.new_empty(numel)
        return self._scratch[index][:numel]

    def release(self) -> None:
        """Drop the buffers (the next call allocates them again; a collective still running
        keeps what it writes into alive by itself)."""
        self._bufs, self._refs = [None, None], [None, None]
        self._scratch = [None, None]


_INTO_TENSOR_ON: dict[str, bool] = {"nccl": True}  # backend -> has all_gather_into_tensor


def _all_gather_flat(out: torch.Tensor, local: torch.Tensor, group):
    """Start gathering the group's shards of ``local``, in rank order, into the contiguous
    ``out`` (``world × local.numel()`` elements); returns the work to wait on.
    ``all_gather_into_tensor`` (NCCL, and gloo in the torch releases that have it), else
    ``all_gather`` into views of ``out``. On NCCL the collective runs on its own stream, which
    first waits for the current stream's queued work (the re-layout copies that last read
    ``out``'s memory), and ``wait()`` makes the current stream wait for the collective
    (torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp, the class comment and
    ``WorkNCCL::wait``)."""
    backend = str(dist.get_backend(group))
    flat_in = local.reshape(-1)
    if _INTO_TENSOR_ON.get(backend, True):
        try:
            work = collectives.all_gather_into_tensor(out.view(-1), flat_in, group=group, async_op=True)
            _INTO_TENSOR_ON[backend] = True
            return work
        except RuntimeError as e:  # an older gloo: "no support for _allgather_base in Gloo process group"
            if backend == "nccl" or "_allgather_base" not in str(e):
                raise
            _INTO_TENSOR_ON[backend] = False
    world = dist.get_world_size(group)
    return collectives.all_gather(out.view(world, -1).unbind(0), flat_in, group=group, async_op=True)


@dataclass(frozen=True)
class _Slot:
    """Where one Megatron parameter's HF tensors live in its bucket's flat buffer."""

    entry: _Entry
    offset: int  # elements into the bucket buffer
    numel: int  # elements reserved: the HF tensors', or the gathered shards' when gathered in place
    gathered: bool  # TP-split at TP > 1 (ETP > 1 for a routed expert): its shards are all-gathered
    in_place: bool  # gathered straight into the slot (column / vocab), not into scratch
    shard_shape: tuple[int, ...]
    split_size: int = 1  # the size of the group that splits it (TP, or ETP for a routed expert)
    # not gathered, and each HF tensor a run of the parameter's rows (:func:`.mapping.hf_row_ranges`):
    # (start, stop) per HF tensor; None: written into the bucket through a re-layout
    rows: Optional[tuple[tuple[int, int], ...]] = None

    @property
    def expert(self) -> bool:
        return self.entry.ep_owner is not None

    @property
    def whole(self) -> bool:
        """Not gathered, and its HF tensors are consecutive runs of rows covering the whole parameter
        (gate/up, down_proj, norms at TP = 1): its region of the bucket holds the parameter's bytes as
        they are (:meth:`hf_views` and :meth:`param_views` give the same tensors)."""
        if self.rows is None or self.gathered:
            return False
        return (self.rows[0][0] == 0 and self.rows[-1][1] == self.shard_shape[0]
                and all(a[1] == b[0] for a, b in zip(self.rows, self.rows[1:]))
                and self.numel == math.prod(self.shard_shape))

    def param_views(self, param: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The HF tensors as views of the (unsplit, contiguous) parameter itself: no copy."""
        return [(name, param[start:stop]) for (name, _), (start, stop) in zip(self.entry.hf, self.rows)]

    def hf_views(self, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        region = flat[self.offset:self.offset + self.numel]
        if self.in_place:  # rank-order concatenation along dim 0; vocab: trailing padding rows not exposed
            (name, shape), = self.entry.hf
            return [(name, region.view(-1, *shape[1:])[: shape[0]])]
        out, off = [], 0
        for name, shape in self.entry.hf:
            n = math.prod(shape)
            out.append((name, region[off:off + n].view(shape)))
            off += n
        return out


def iter_hf_weights(
    model_chunks, *, parallel: ParallelDims, bucket_bytes: Optional[int] = None, pp_broadcast: bool = True,
    buffers: Optional[ExportBuffers] = None, digest: Optional[SyncDigest] = None, expert_owners: bool = False,
    param_views: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the model as full HF-named tensors; a COLLECTIVE generator.

    Every rank of the model-parallel group (all TP and PP ranks) must iterate it to the
    end (or all stop at the same point). Every rank receives every tensor, in the same
    deterministic order: embedding, layer 0 … L-1 (rule order of the family table),
    final norm, ``lm_head`` (only when untied; tied embeddings are exported once as
    ``model.embed_tokens.weight``). Vocabulary padding rows are trimmed.

    Mixtures of experts: every expert of every layer is yielded under its HF checkpoint name
    (``model.layers.{l}.mlp.experts.{e}.gate_proj.weight`` ...). A routed expert is held by one EP
    rank of its stage; its shards are gathered over that rank's expert-TP group, and the bucket
    (which holds one EP rank's experts only) is then broadcast over the stage's EP group before
    the PP broadcast. The EP group spans DP ranks, so with EP > 1 EVERY rank of the world must
    iterate (the colocated sync does; ``pp_broadcast=False`` from DP rank 0 alone cannot).

    Mechanics: a bucket holds consecutive Megatron tensors of one owner stage up to
    ``bucket_bytes`` of HF tensors (a larger tensor is a bucket of its own; ``None`` means one
    Megatron tensor per bucket), laid out in ONE flat buffer (at TP > 1 it also holds the
    vocabulary padding rows of an embedding or LM head, never handed out). On the owning PP
    stage each tensor's TP shards are all-gathered (``all_gather_into_tensor`` from the
    parameter itself, one collective per tensor; ``all_gather`` into views on a gloo without
    it): column- and vocab-parallel tensors straight into
    their place in the bucket buffer (their rank-order concatenation is the HF tensor), the
    others into one of two scratch buffers, then copied once into their HF layout in the
    bucket (:func:`.mapping.megatron_to_hf_into`: QKV de-interleave, gate/up split,
    row-parallel columns) while the next tensor's gather runs. With PP > 1 the owner broadcasts the bucket buffer as it is over the PP group.
    The bucket buffer is reused for the next bucket once the consumer has dropped every view
    of it (CPU; on GPU the caching allocator recycles it, see :class:`ExportBuffers`); memory
    beyond the model: one bucket buffer (the largest bucket) plus two scratch buffers of the
    largest re-laid-out tensor, more only while the consumer keeps tensors. A consumer lets the buffer be reused by dropping each tensor before asking for
    the next (``del`` the loop variable: a ``for`` loop still holds the previous item while
    it asks for the next).

    Args:
        model_chunks: model (chunks) built by ``build_gpt_model``; DDP wrappers allowed.
        parallel: the layout the model was built for (TP group gathers, PP group broadcasts).
        bucket_bytes: bound on the bytes of HF tensors per bucket, or None.
        pp_broadcast: False: yield only the tensors of this rank's pipeline stage and skip
            the broadcast over the PP group (a receiver fed by one rank per stage, e.g. the
            servers of ``rollout.mode=server``); the TP gather stays collective over the
            stage's TP group, and the plan over the PP group.
        expert_owners: with ``pp_broadcast=False`` at EP > 1 (the servers fed by each expert owner):
            yield only the buckets this rank fills, without the EP broadcast: the non-expert ones on
            the ranks of DP shard 0, the experts of its own EP rank on the ranks of expert-data-
            parallel rank 0 (:attr:`~dapo_megatron.platform.parallel_dims.ParallelDims.expert_owner`);
            in turn order: EP rank 0's experts with the non-expert tensors (plan order), then EP
            rank 1's, ... (:func:`expert_turn` of each name), so that one sender per (stage, EP rank)
            can send its part in its turn. Every rank of DP shard 0 or of an owner's EP group
            iterates (TP and expert-TP gathers); the others yield nothing.
        buffers: memory kept between calls (:class:`ExportBuffers`, which also keeps the bucket
            plan: rebuilt only when a rank's parameters, the layout or the bucket size changed);
            None: this call's own, freed when it ends.
        param_views: a tensor that needs no transport (no TP gather, no EP or PP broadcast of its
            bucket) and no re-layout (each HF tensor a run of its parameter's rows,
            :func:`.mapping.hf_row_ranges`: norms, embedding and LM head, ``o_proj``, gate/up and
            ``down_proj`` at TP = 1) is yielded as a VIEW OF THE PARAMETER ITSELF instead of a copy in
            the bucket: for a consumer that copies each tensor before asking for the next and never
            writes into it or hands it to another process (``WeightReceiver.copies_on_load``). On the
            CPU MoE benchmark this is 145 of 397 MiB not copied twice. On CPU at EP > 1 it also sends an
            expert bucket of whole unsplit parameters without packing: one broadcast per parameter from
            the owner's parameter into its place in the other EP ranks' bucket buffer (the trailer in a
            broadcast of its own), the owner yielding views of its parameters (the other 126 MiB there).
            Such a bucket's broadcasts start one bucket ahead (into the second bucket buffer, while the
            consumer copies the bucket before it; every EP rank at the same point of the plan, only
            buckets without collectives in between), and where the consumer declared its memory
            (:func:`load_targets`, the HF engine) the receiving ranks broadcast into it directly.
        digest: verify the sync (:mod:`dapo_megatron.bridge.verify`): each bucket
            gets a trailer of int64 words after its tensors, written by the rank that fills it
            before any broadcast (the version, the bucket's index, the checksum of each HF tensor
            ``digest.wants``) and read by every rank after the broadcasts into ``digest``
            (``sums``, ``sent``; a trailer of another version or index is a stale bucket, listed
            in ``digest.errors``). None: no checksum; the trailer's room (a few words per bucket)
            is there unwritten, so that verified and unverified syncs reuse the same buffer.

    Yields:
        ``(hf_name, tensor)``: full HF shape, contiguous, the parameter dtype, the parameter
        device; a view into its bucket's buffer (or, with ``param_views``, into its parameter). Copy what you keep: a consumer that keeps
        references keeps that buffer alive, and the generator's memory then grows with what
        it keeps.

    Raises:
        ValueError: ``bucket_bytes`` <= 0, parameters of more than one dtype, or a parameter
            whose shape the mapping does not expect (named).
        KeyError: a parameter no stage holds.
    """
    if bucket_bytes is not None and bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive number of bytes or None, got {bucket_bytes}")
    if not pp_broadcast and parallel.ep_size > 1 and not expert_owners:
        raise ValueError(f"iter_hf_weights(pp_broadcast=False) at expert_model_parallel_size={parallel.ep_size}: "
                         "an expert's bucket is broadcast over the EP group, which spans DP ranks that a "
                         "one-rank-per-stage receiver does not run; pass expert_owners=True (one sender per "
                         "expert owner) or use rollout.mode=colocated")
    if expert_owners and pp_broadcast:
        raise ValueError("iter_hf_weights(expert_owners=True) needs pp_broadcast=False (one sender per stage and "
                         "expert owner)")
    layout = model_layout(model_chunks)
    params = local_parameters(model_chunks)
    buffers = ExportBuffers() if buffers is None else buffers
    shape = _cached_bucket_plan(buffers, layout, params, parallel, bucket_bytes)
    slotted, trailers, hf_index = shape.slotted, shape.trailers, shape.hf_index
    pp_size, pp_rank, pp_ranks = parallel.pp_size, parallel.pp_rank, parallel.pp_ranks
    any_param = params[shape.first_param]  # the exported dtype
    dtype = any_param.dtype
    if digest is not None:
        digest.dtype = str(dtype).removeprefix("torch.")
    mine = [(k, slots) for k, slots in enumerate(slotted) if pp_broadcast or slots[0].entry.owner == pp_rank]
    if expert_owners:  # only what this rank fills, EP owner 0's turn (with the non-expert tensors) first
        owner = parallel.expert_owner
        mine = [(k, slots) for k, slots in mine
                if (parallel.dp_rank == 0 if slots[0].entry.ep_owner is None else slots[0].entry.ep_owner == owner)]
        mine.sort(key=lambda item: item[1][0].entry.ep_owner or 0)  # stable: plan order within a turn
    capacity = max((sum(trailers[k]) for k, _ in mine), default=0)

    def fills(slots: list[_Slot]) -> bool:  # this rank writes the bucket (it holds its parameters)
        ep_owner = slots[0].entry.ep_owner
        return pp_rank == slots[0].entry.owner and (ep_owner is None or ep_owner == parallel.ep_rank)

    def ep_broadcast(slots: list[_Slot]) -> bool:  # the bucket goes to the other EP ranks of its stage
        return (pp_rank == slots[0].entry.owner and slots[0].entry.ep_owner is not None and parallel.ep_size > 1
                and not expert_owners)

    def fill(k: int, slots: list[_Slot], flat: torch.Tensor, direct: bool) -> dict[int, list]:
        """Bucket ``k`` written into ``flat`` (and its trailer); with ``direct``, the slots whose HF
        tensors are runs of rows of their parameter are not copied: their views, by slot position."""
        views: dict[int, list] = {}
        if direct:
            for i, slot in enumerate(slots):
                if slot.rows is not None:
                    param = params[slot.entry.megatron].detach()
                    if param.dtype == dtype and param.is_contiguous():
                        views[i] = slot.param_views(param)
        signer = None if digest is None else _Signer(flat, slots, hf_index[k], digest)
        _fill_bucket(flat, [s for i, s in enumerate(slots) if i not in views] if views else slots, params, layout,
                     parallel, buffers, shape.scratch_numel, signer)
        if signer is not None:
            for i, named in views.items():
                signer.written(slots[i], named)
            signer.write(_trailer_view(flat, trailers[k]), k)
        return views  # the signer views the buffer: dropped here, held across the yields it would make
        # ExportBuffers reallocate

    cpu = any_param.device.type == "cpu"

    def direct(slots: list[_Slot]) -> bool:
        """CPU, EP > 1, a consumer that copies on load (``param_views``), no PP broadcast: an expert bucket
        whose every tensor is a whole unsplit parameter laid out as is (:attr:`_Slot.whole`) travels without
        packing, one broadcast per parameter straight from the owner's parameter into its slot of the other
        ranks' bucket buffer (the trailer, when verified, in a broadcast of its own), and the owner hands out
        views of its parameters: each owner's experts are copied once less (the layout alone decides, so
        every EP rank of the stage takes the same branch)."""
        return (cpu and param_views and ep_broadcast(slots) and not (pp_size > 1 and pp_broadcast)
                and all(slot.whole for slot in slots))

    # CPU, EP > 1: at the start of a run of EP-broadcast buckets, every EP rank that does not own the first
    # one packs its own first bucket of the run into the second buffer before that broadcast, so that the
    # owners pack side by side instead of each waiting in the broadcast while the next one packs (on a GPU
    # the pack is a device copy, far faster than the transport). A bucket sent :func:`direct` is not packed.
    pack_ahead = cpu and parallel.ep_size > 1 and not expert_owners
    packed: Optional[tuple[int, torch.Tensor]] = None  # (bucket index, its filled buffer)
    previous_ep = False

    def start(k: int, slots: list[_Slot], flat: torch.Tensor) -> _Direct:
        return _start_direct(flat, slots, params, parallel, parallel.ep_ranks[slots[0].entry.ep_owner], fills(slots),
                             trailers[k], None if digest is None else _Signer(flat, slots, hf_index[k], digest), k,
                             buffers)

    def quiet(slots: list[_Slot]) -> bool:  # a bucket without collectives of its own (local at TP = 1)
        return not ep_broadcast(slots) and not (pp_size > 1 and pp_broadcast) and not any(s.gathered for s in slots)

    def next_direct(pos: int) -> Optional[int]:
        """The position of the next bucket sent :func:`direct` when only quiet buckets come before it."""
        for j in range(pos + 1, len(mine)):
            if direct(mine[j][1]):
                return j
            if not quiet(mine[j][1]):
                return None
        return None

    # CPU, a bucket sent direct: its broadcasts start before the consumer copies the bucket before it (one
    # bucket ahead, into the other bucket buffer), so the transport runs while the engine copies; every EP
    # rank starts them at the same point of the plan (the buckets in between have no collectives).
    pending: Optional[_Direct] = None
    for pos, (k, slots) in enumerate(mine):
        owner, ep_owner = slots[0].entry.owner, slots[0].entry.ep_owner
        pp_bcast, ep_bcast = pp_size > 1 and pp_broadcast, ep_broadcast(slots)
        views: dict[int, list] = {}
        sent = direct(slots)
        started: Optional[_Direct] = None
        if pending is not None and pending.bucket == k:
            started, pending = pending, None
            flat = started.flat
        elif packed is not None and packed[0] == k:
            flat, packed = packed[1], None
        else:
            flat = (buffers.bucket(any_param, sum(trailers[k]), capacity) if pending is None
                    else buffers.other(pending.flat, any_param, sum(trailers[k]), capacity))
            if fills(slots) and not sent:
                views = fill(k, slots, flat, param_views and not ep_bcast and not pp_bcast)
        if pack_ahead and ep_bcast and not previous_ep and not fills(slots):
            run = itertools.takewhile(lambda item: ep_broadcast(item[1]) and item[1][0].entry.owner == owner,
                                      mine[pos:])
            j, own = next(((j, s) for j, s in run if fills(s) and not direct(s)), (None, None))
            if j is not None:
                ahead = buffers.ahead(any_param, sum(trailers[j]), capacity)
                fill(j, own, ahead, False)
                packed = (j, ahead)
                del ahead
            del own
        previous_ep = ep_bcast
        if sent:
            views = _finish_direct(started if started is not None else start(k, slots, flat), buffers)
            del started
        elif ep_bcast:  # the other EP ranks of the stage
            parallel.broadcast(flat, "ep", src=parallel.ep_ranks[ep_owner])
        if pp_bcast:
            parallel.broadcast(flat, "pp", src=pp_ranks[owner])
        buffers.settle(flat)
        named = [item for i, slot in enumerate(slots) for item in (views[i] if i in views else slot.hf_views(flat))]
        if digest is not None:
            _read_signature(flat, named, trailers[k], hf_index[k], k, digest)
        if pending is None and packed is None and cpu:
            j = next_direct(pos)
            if j is not None:  # into the buffer this bucket does not use: the consumer still reads it
                ahead = buffers.other(flat, any_param, sum(trailers[mine[j][0]]), capacity)
                pending = start(mine[j][0], mine[j][1], ahead)
                del ahead
        del flat, views  # from here the consumer's views alone decide whether the buffer is reused
        try:
            for item in named:
                yield item
        except BaseException:
            if pending is not None:  # its broadcasts may still be running into the other buffer
                buffers.release()
            raise
        del named, item


@dataclass
class _BucketPlan:
    """The buckets of one model's export (they depend on the layout, the parameters' names, shapes
    and dtype, the parallel coordinates and the bucket size only; kept in :class:`ExportBuffers`)."""

    slotted: list[list[_Slot]]
    scratch_numel: int  # the largest TP-gathered tensor that needs a re-layout
    trailers: list[tuple[int, int]]  # each bucket's trailer: (offset, numel) in the bucket's elements
    hf_index: list[int]  # the export-order index of each bucket's first HF tensor
    first_param: str  # an exported parameter this rank holds (its dtype is the export's)


def _bucket_plan(layout: ModelLayout, params: dict, parallel: ParallelDims,
                 bucket_bytes: Optional[int]) -> _BucketPlan:
    """:func:`_export_plan` (collective over EP, then PP) cut into buckets and laid out in slots."""
    plan = _export_plan(layout, params, parallel)
    first = next(e.megatron for e in plan if e.megatron in params)
    elem = params[first].element_size()
    buckets: list[list[_Entry]] = []
    for entry in plan:
        cur = buckets[-1] if buckets else None
        fits = (
            cur is not None
            and bucket_bytes is not None
            and cur[0].owner == entry.owner
            and cur[0].ep_owner == entry.ep_owner
            and (sum(e.numel for e in cur) + entry.numel) * elem <= bucket_bytes
        )
        if fits:
            cur.append(entry)
        else:
            buckets.append([entry])

    # every rank computes the same slots (they depend on the layout only), so a PP broadcast
    # of the owner's buffer lands in the same places on every stage
    slotted: list[list[_Slot]] = []
    scratch_numel = 0
    for bucket in buckets:
        slots, offset = [], 0
        for entry in bucket:
            tp_size = split_coords(parallel, entry.ep_owner is not None)[1]
            shard_shape = megatron_shard_shape(layout, entry.megatron, tp_size)
            gathered = tp_size > 1 and entry.split != "replicated"
            in_place = gathered and gathers_in_place(entry.split)
            numel = tp_size * math.prod(shard_shape) if in_place else entry.numel
            if gathered and not in_place:
                scratch_numel = max(scratch_numel, tp_size * math.prod(shard_shape))
            rows = None if gathered else hf_row_ranges(layout, entry.megatron)
            slots.append(_Slot(entry, offset, numel, gathered, in_place, shard_shape, tp_size,
                               None if rows is None else tuple(rows)))
            offset += numel
        slotted.append(slots)
    # verification: one trailer of int64 words after each bucket's tensors, 8-byte aligned
    per_word = max(1, 8 // elem)
    trailers: list[tuple[int, int]] = []
    hf_index: list[int] = []
    count = 0
    for slots in slotted:
        hf_index.append(count)
        n_hf = sum(len(slot.entry.hf) for slot in slots)
        count += n_hf
        end = slots[-1].offset + slots[-1].numel
        # room for the trailer whether or not this sync verifies: the buffer's size, and so its reuse
        # (ExportBuffers), does not depend on verification; unverified, it is neither written nor read
        start = -(-end // per_word) * per_word
        trailers.append((start, trailer_words(n_hf) * 8 // elem))
    return _BucketPlan(slotted, scratch_numel, trailers, hf_index, first)


def _cached_bucket_plan(buffers: ExportBuffers, layout: ModelLayout, params: dict, parallel: ParallelDims,
                        bucket_bytes: Optional[int]) -> _BucketPlan:
    """:func:`_bucket_plan`, or the one ``buffers`` kept from the last call when nothing it depends on
    changed on ANY rank of this rank's EP and PP groups (one MIN all-reduce of a hit flag over EP, then
    PP, the groups :func:`_export_plan` gathers over, in its order: every rank then takes the same
    branch, and a rank whose parameters changed makes every rank rebuild and re-check). The plan names
    parameters, never holds them: each call reads the parameters it is handed."""
    key = (layout, bucket_bytes,
           tuple((n, tuple(p.shape), p.dtype, p.device.type) for n, p in params.items()),
           tuple(getattr(parallel, a) for a in ("rank", "world_size", "tp_rank", "tp_size", "pp_rank", "pp_size",
                                                 "ep_rank", "ep_size", "etp_rank", "etp_size", "dp_rank",
                                                 "expert_owner")))
    hit = buffers._plan is not None and buffers._plan[0] == key
    for group, size in (("ep", parallel.ep_size), ("pp", parallel.pp_size)):
        if size > 1:
            flag = torch.tensor([int(hit)], dtype=torch.int32, device=collective_device(parallel.group(group)))
            hit = bool(parallel.all_reduce(flag, group, op=collectives.ReduceOp.MIN).item())
    if not hit:
        buffers._plan = None
        buffers._plan = (key, _bucket_plan(layout, params, parallel, bucket_bytes))
    return buffers._plan[1]


_ROUTED_EXPERT_RE = re.compile(r"\.experts\.(\d+)\.")


def expert_turn(hf_name: str, num_experts: int, ep_size: int) -> int:
    """The EP rank that holds HF tensor ``hf_name`` (a routed expert ``...experts.{e}....``: ``e //
    (num_experts / ep_size)``, megatron-core's ``MoELayer.local_expert_indices``), 0 for every other
    tensor: the turn in which :func:`iter_hf_weights` with ``expert_owners`` lists it."""
    m = _ROUTED_EXPERT_RE.search(hf_name)
    return int(m.group(1)) // (num_experts // ep_size) if m and ep_size > 1 else 0


def _trailer_view(flat: torch.Tensor, trailer: tuple[int, int]) -> torch.Tensor:
    start, numel = trailer
    return flat[start:start + numel].view(torch.int64)


class _Signer:
    """The sender's checksums of one bucket, each taken as soon as its tensor is final in the bucket
    (right after its re-layout or copy, while it is still in cache), then the trailer."""

    def __init__(self, flat: torch.Tensor, slots: list[_Slot], first: int, digest: SyncDigest):
        self.flat, self.digest, self.sums, self.base = flat, digest, {}, first
        self.first: dict[int, int] = {}  # id(slot) -> export index of its first HF tensor
        index = first
        for slot in slots:
            self.first[id(slot)] = index
            index += len(slot.entry.hf)
        self.count = index - first

    def written(self, slot: _Slot, views: Optional[list] = None) -> None:
        """Checksums of ``slot``'s sampled HF tensors: ``views`` (its tensors where they are not in the
        bucket: views of the parameter), else its place in the bucket."""
        first = self.first[id(slot)]
        if not any(self.digest.wants(first + j) for j in range(len(slot.entry.hf))):
            return  # most slots at the default period: no views built, nothing timed
        with Timer(self.digest):
            for j, (_, t) in enumerate(slot.hf_views(self.flat) if views is None else views):
                if self.digest.wants(first + j):
                    # on the device, no host read per tensor; a readback receiver's check covers the head rows
                    self.sums[first + j] = checksum_tensor(self.digest.checked_part(t))

    def write(self, words: torch.Tensor, bucket: int) -> None:
        """The trailer (version, bucket index, the checksum of each HF tensor, 0 where unchecked),
        before any broadcast."""
        with Timer(self.digest):
            write_trailer(words, self.digest.version, bucket,
                          [self.sums.get(self.base + i) for i in range(self.count)])


def _read_signature(flat: torch.Tensor, named: list, trailer: tuple[int, int], first: int, bucket: int,
                    digest: SyncDigest) -> None:
    """On every rank, after the broadcasts: the sender's checksums into ``digest``; a trailer of
    another sync or another bucket is a stale bucket (recorded, raised by the receiver)."""
    version, index, sums = read_trailer(_trailer_view(flat, trailer))
    names = [name for name, _ in named]
    if (version, index, len(sums)) != (digest.version, bucket, len(names)):
        digest.errors.append(
            f"weight sync to version {digest.version}: the bucket starting at {names[0]!r} (bucket {bucket}) "
            f"arrived with the trailer of version {version}, bucket {index} ({len(sums)} tensors): a stale or "
            "misordered bucket (a pipeline stage or expert rank reused a buffer it did not receive into)")
        return
    for i, (name, value) in enumerate(zip(names, sums)):
        digest.sent.append(name)
        if digest.wants(first + i):
            digest.sums[name] = value


_LOAD_TARGETS = threading.local()


@contextlib.contextmanager
def load_targets(targets: Mapping[str, torch.Tensor]):
    """Within the block (this thread), :func:`iter_hf_weights` may write a received HF tensor straight into
    ``targets[name]``, the memory its consumer would copy it into, and yield that tensor itself (the
    consumer's copy of a tensor onto itself is then a no-op: torch's ``copy_`` returns early for the
    same data). For a consumer that copies each tensor by name into memory of its own in this process
    (``WeightReceiver.copies_on_load``: the HF engine enters it around its load loop, which drives the
    generator). Used on CPU at EP > 1 for the expert buckets broadcast without packing: the receiving
    ranks' broadcasts land in the engine's parameters (one copy of 126 MiB fewer per rank on the MoE
    benchmark). A target is used only where it has the exported dtype and the tensor's shape, is
    contiguous, on CPU, and a slot's HF tensors lie back to back in one storage (``gate_up_proj[e]``
    for an expert's gate and up); else the bucket buffer receives, as without the block."""
    previous = getattr(_LOAD_TARGETS, "targets", None)
    _LOAD_TARGETS.targets = targets
    try:
        yield
    finally:
        _LOAD_TARGETS.targets = previous


def _target_region(slot: _Slot, dtype: torch.dtype) -> Optional[tuple[torch.Tensor, list]]:
    """``(region, named)``: the consumer's memory (:func:`load_targets`) that ``slot``'s HF tensors can be
    received into as one flat region, and those tensors by name; None where there is none."""
    targets = getattr(_LOAD_TARGETS, "targets", None)
    if targets is None:
        return None
    named, end = [], None
    for name, shape in slot.entry.hf:
        t = targets.get(name)
        if (t is None or t.dtype != dtype or t.device.type != "cpu" or tuple(t.shape) != tuple(shape)
                or not t.is_contiguous() or (end is not None and (t.untyped_storage().data_ptr() != named[0][1]
                                                                 .untyped_storage().data_ptr()
                                                                 or t.data_ptr() != end))):
            return None
        named.append((name, t))
        end = t.data_ptr() + t.numel() * t.element_size()
    first = named[0][1]
    if sum(t.numel() for _, t in named) != slot.numel:
        return None
    return first.as_strided((slot.numel,), (1,), first.storage_offset()), named


@dataclass
class _Direct:
    """An expert bucket sent without packing whose broadcasts are in flight (:func:`_start_direct`)."""

    bucket: int  # its index in the plan
    flat: torch.Tensor  # the bucket buffer the other ranks receive into
    works: list
    views: dict[int, list]  # by slot position: the owner's views of its parameters; elsewhere the consumer's
    # tensors received into in place (:func:`load_targets`)


def _start_direct(flat: torch.Tensor, slots: list[_Slot], params: dict, parallel: ParallelDims, src: int,
                  owner: bool, trailer: tuple[int, int], signer: Optional[_Signer], bucket: int,
                  buffers: ExportBuffers) -> _Direct:
    """Start one EP-broadcast bucket of :attr:`_Slot.whole` slots sent without packing (collective over
    the EP group: the same asynchronous broadcasts, in slot order, on every rank): the owner (``owner``,
    global rank ``src``) broadcasts each parameter as it is, the other ranks receive it into its slot of
    ``flat`` (or straight into its consumer's memory, :func:`load_targets`); then the trailer's words,
    broadcast into the other ranks' trailers whether or not the sync verifies (``signer`` not None: written
    first with the owner's checksums of the very parameters it broadcast, taken while they travel; None:
    unwritten, unread). :func:`_finish_direct` waits for them."""
    group = parallel.group("ep")
    works, views = [], {}
    try:
        for i, slot in enumerate(slots):
            if owner:
                param = params[slot.entry.megatron].detach()
                if not param.is_contiguous():
                    param = param.contiguous()  # what is sent, and what the owner hands out
                views[i] = slot.param_views(param)
                region = param.view(-1)
            else:
                target = _target_region(slot, flat.dtype)
                if target is None:
                    region = flat[slot.offset:slot.offset + slot.numel]
                else:
                    region, views[i] = target
            works.append(collectives.broadcast(region, src=src, group=group, async_op=True))
        # the trailer's words travel whether or not this sync verifies (unwritten then), as the packed
        # bucket's trailer room does: the collectives never depend on verification, and a verified sync
        # costs its checksums only
        words = _trailer_view(flat, trailer)
        if owner and signer is not None:
            for i, slot in enumerate(slots):
                signer.written(slot, views[i])
            signer.write(words, bucket)
        works.append(collectives.broadcast(words, src=src, group=group, async_op=True))
        del words
    except BaseException:
        buffers.release()  # broadcasts may still be running into the bucket buffer: never hand it out again
        raise
    return _Direct(bucket, flat, works, views)


def _finish_direct(sent: _Direct, buffers: ExportBuffers) -> dict[int, list]:
    """Wait for every broadcast :func:`_start_direct` started; returns, by slot position, the owner's views
    of its parameters, and on the other ranks the consumer's tensors received into in place (the others
    are the bucket buffer's)."""
    try:
        for work in sent.works:
            work.wait()
    except BaseException:
        buffers.release()  # broadcasts may still be running into the bucket buffer: never hand it out again
        raise
    sent.works = []
    return sent.views


def _fill_bucket(flat: torch.Tensor, slots: list[_Slot], params: dict, layout: ModelLayout,
                 parallel: ParallelDims, buffers: ExportBuffers, scratch_numel: int,
                 signer: Optional[_Signer] = None) -> None:
    """The owner stage's HF tensors of one bucket, written into ``flat`` (collective over the
    TP group: one all-gather per TP-split tensor, issued in slot order on every TP rank).

    Pipelined: a tensor that needs a re-layout is gathered into one of two scratch buffers
    while the previous one is re-laid out from the other, so the copies hide behind the
    transport; every gather has finished when this returns."""
    try:
        _fill_bucket_pipelined(flat, slots, params, layout, parallel, buffers, scratch_numel, signer)
    except BaseException:
        # collectives of this bucket may still be running into its buffers: give them up (each
        # work keeps what it writes into alive) so that no later call hands that memory out
        buffers.release()
        raise


def _fill_bucket_pipelined(flat: torch.Tensor, slots: list[_Slot], params: dict, layout: ModelLayout,
                           parallel: ParallelDims, buffers: ExportBuffers, scratch_numel: int,
                           signer: Optional[_Signer] = None) -> None:
    in_place_works = []
    pending = None  # (work, slot, shards): gathered into scratch, re-laid out after the next gather starts
    turns = 0

    def relayout(work, slot: _Slot, shards: list[torch.Tensor]) -> None:
        work.wait()
        megatron_to_hf_into(layout, slot.entry.megatron, shards, [t for _, t in slot.hf_views(flat)])
        if signer is not None:
            signer.written(slot)

    for slot in slots:
        param = params[slot.entry.megatron].detach()
        tp_size = slot.split_size
        group = parallel.etp_group if slot.expert else parallel.tp_group
        if slot.in_place:
            in_place_works.append(_all_gather_flat(flat[slot.offset:slot.offset + slot.numel], param, group))
        elif slot.gathered:
            gathered = buffers.scratch(param, scratch_numel, turns % 2)[: tp_size * math.prod(slot.shard_shape)]
            turns += 1
            work = _all_gather_flat(gathered, param, group)
            if pending is not None:
                relayout(*pending)  # the other scratch buffer, while this gather runs
            pending = (work, slot, list(gathered.view(tp_size, *slot.shard_shape).unbind(0)))
        else:
            megatron_to_hf_into(layout, slot.entry.megatron, [param], [t for _, t in slot.hf_views(flat)])
            if signer is not None:
                signer.written(slot)
    if pending is not None:
        relayout(*pending)
    for work in in_place_works:
        work.wait()
    if signer is not None:
        for slot in slots:
            if slot.in_place:
                signer.written(slot)


def export_hf_state_dict(model_chunks, *, parallel: ParallelDims,
                         bucket_bytes: Optional[int] = 256 * 2**20) -> dict[str, torch.Tensor]:
    """The whole model as an HF state dict on every rank (collective; built on
    :func:`iter_hf_weights`). Tensors are copies on CPU in the parameter dtype."""
    out = {}
    for name, tensor in iter_hf_weights(model_chunks, parallel=parallel, bucket_bytes=bucket_bytes):
        out[name] = tensor.detach().to("cpu", copy=True)
        del tensor  # copied: the bridge reuses its bucket memory
    return out
