"""Load HF weights into Megatron model chunks, and stream them back out as HF tensors.

Both directions go through :mod:`.mapping`; nothing here knows a layout rule.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Optional

import torch
import torch.distributed as dist

from .mapping import (
    ModelLayout,
    canonical_megatron_name,
    expected_hf_names,
    exported_entries,
    hf_names_of,
    hf_shapes,
    hf_to_megatron_shard,
    match_rule,
    megatron_name_of,
    megatron_shard_shape,
    megatron_to_hf,
)

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
                                      padded_num_query_groups=model.config.num_query_groups)


def local_parameters(model_chunks) -> dict[str, torch.nn.Parameter]:
    """This rank's parameters keyed by canonical Megatron name with GLOBAL layer indices.

    The global layer index comes from each layer's own ``layer_number`` (1-based, set by
    megatron-core from the PP/VP offset), so uneven or interleaved pipelines map correctly.
    """
    out: dict[str, torch.nn.Parameter] = {}
    for chunk in _as_list(model_chunks):
        model = unwrap_model(chunk)
        layers = model.decoder.layers
        for name, param in model.named_parameters():
            m = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name)
            if m:
                global_layer = layers[int(m.group(1))].layer_number - 1
                name = f"decoder.layers.{global_layer}.{m.group(2)}"
            out[canonical_megatron_name(name)] = param
    return out


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
    :class:`~.sources.SafetensorsSource` therefore reads only those) and keeps its TP
    shard. No collective is issued.

    Args:
        model_chunks: a ``GPTModel`` (or a list of chunks, possibly DDP/Float16-wrapped)
            built by ``build_gpt_model``.
        hf_state: ``Mapping[hf_name, Tensor]`` with full HF shapes (any float dtype; cast
            to the parameter dtype).
        strict: raise on any missing or unexpected HF tensor (checked against the whole
            model, not only this rank's stage, so every rank raises the same error).
        parallel: the layout the model was built for (its TP rank and size pick the shard).

    Returns:
        :class:`LoadReport`.

    Raises:
        KeyError: strict and HF tensors are missing / unexpected (names listed), or a
            Megatron parameter matches no rule.
        ValueError: an HF tensor has the wrong shape (naming it and both shapes), or a
            tied ``lm_head.weight`` differs from ``model.embed_tokens.weight``.
    """
    layout = model_layout(model_chunks)
    tp_rank, tp_size = parallel.tp_rank, parallel.tp_size
    expected = expected_hf_names(layout)
    available = set(hf_state.keys())
    report = LoadReport()
    report.missing = [n for n in expected if n not in available]
    allowed = set(expected)
    if layout.tie_word_embeddings:
        allowed.add("lm_head.weight")  # tied alias, checked below
    report.unexpected = sorted(n for n in available if n not in allowed and not _IGNORED_HF_KEYS.search(n))
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
        rule, layer = match_rule(layout, name)
        if rule.megatron == "output_layer.weight" and layout.tie_word_embeddings:
            # PP > 1: megatron-core's copy of the tied embedding on the last stage.
            rule, layer = match_rule(layout, "embedding.word_embeddings.weight")
        names = hf_names_of(rule, layer)
        absent = [n for n in names if n not in available]
        if absent:
            continue  # only reachable when not strict: listed in report.missing
        want = megatron_shard_shape(layout, megatron_name_of(rule, layer), tp_size)
        if tuple(param.shape) != want:
            raise ValueError(f"Megatron parameter {name!r} has shape {tuple(param.shape)}, the mapping expects "
                             f"{want}: the model was built from a different config")
        shard = hf_to_megatron_shard(layout, megatron_name_of(rule, layer), [hf_state[n] for n in names],
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

    @property
    def numel(self) -> int:
        total = 0
        for _, shape in self.hf:
            n = 1
            for d in shape:
                n *= d
            total += n
        return total


def _export_plan(layout: ModelLayout, params: dict, parallel: ParallelDims) -> list[_Entry]:
    """Export entries in a fixed order, with the PP stage owning each (one collective)."""
    pp_size = parallel.pp_size
    mine = sorted(params)
    if pp_size > 1:
        held: list = [None] * pp_size
        dist.all_gather_object(held, mine, group=parallel.pp_group)
    else:
        held = [mine]
    owner_of: dict[str, int] = {}
    for stage, names in enumerate(held):
        for n in names:
            owner_of.setdefault(n, stage)  # tied output_layer on the last stage is never exported
    plan = []
    for rule, layer in exported_entries(layout):
        name = megatron_name_of(rule, layer)
        if name not in owner_of:
            raise KeyError(f"Megatron parameter {name!r} is held by no pipeline stage (model does not fit its config)")
        shapes = hf_shapes(layout, rule)
        plan.append(_Entry(name, rule.split, tuple(zip(hf_names_of(rule, layer), shapes)), owner_of[name]))
    return plan


def _gather_tp(param: torch.Tensor, split: str, parallel: ParallelDims) -> list[torch.Tensor]:
    """TP shards of a parameter in rank order (collective over the TP group)."""
    tp_size = parallel.tp_size
    if split == "replicated" or tp_size == 1:
        return [param.detach()]
    local = param.detach().contiguous()
    group = parallel.tp_group
    if dist.get_backend(group) == "nccl":
        out = local.new_empty((tp_size, *local.shape))  # on the parameter's device, as NCCL needs
        dist.all_gather_into_tensor(out, local, group=group)
        return list(out.unbind(0))
    shards = [torch.empty_like(local) for _ in range(tp_size)]
    dist.all_gather(shards, local, group=group)
    return shards


def iter_hf_weights(
    model_chunks, *, parallel: ParallelDims, bucket_bytes: Optional[int] = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the model as full HF-named tensors; a COLLECTIVE generator.

    Every rank of the model-parallel group (all TP and PP ranks) must iterate it to the
    end (or all stop at the same point). Every rank receives every tensor, in the same
    deterministic order: embedding, layer 0 … L-1 (rule order of the family table),
    final norm, ``lm_head`` (only when untied; tied embeddings are exported once as
    ``model.embed_tokens.weight``). Vocabulary padding rows are trimmed.

    Mechanics: per Megatron tensor, the PP stage that owns it all-gathers the TP shards
    (``all_gather_into_tensor`` on NCCL, ``all_gather`` on gloo) and converts them with
    :func:`.mapping.megatron_to_hf`; then the HF tensors are broadcast from the owning
    stage over the PP group, coalesced into one flat buffer per bucket. A bucket holds
    consecutive tensors of one owner stage up to ``bucket_bytes`` (a larger tensor is a
    bucket of its own); ``None`` means one Megatron tensor per bucket. At most one bucket
    of gathered tensors is held by the generator at a time.

    Args:
        model_chunks: model (chunks) built by ``build_gpt_model``; DDP wrappers allowed.
        parallel: the layout the model was built for (TP group gathers, PP group broadcasts).
        bucket_bytes: bound on the bytes of HF tensors per PP broadcast, or None.

    Yields:
        ``(hf_name, tensor)``: full HF shape, the parameter dtype, the parameter device.
        With PP > 1 the tensors are views into the bucket's broadcast buffer; a consumer
        that keeps references keeps that buffer alive (copy what you keep, drop the rest,
        to stay within one bucket of memory).

    Raises:
        ValueError: ``bucket_bytes`` <= 0. KeyError: a parameter no stage holds.
    """
    if bucket_bytes is not None and bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive number of bytes or None, got {bucket_bytes}")
    layout = model_layout(model_chunks)
    params = local_parameters(model_chunks)
    plan = _export_plan(layout, params, parallel)
    pp_size, pp_rank, pp_group, pp_ranks = parallel.pp_size, parallel.pp_rank, parallel.pp_group, parallel.pp_ranks
    any_param = next(iter(params.values()))
    dtype = any_param.dtype
    elem = torch.empty((), dtype=dtype).element_size()

    buckets: list[list[_Entry]] = []
    for entry in plan:
        cur = buckets[-1] if buckets else None
        fits = (
            cur is not None
            and bucket_bytes is not None
            and cur[0].owner == entry.owner
            and (sum(e.numel for e in cur) + entry.numel) * elem <= bucket_bytes
        )
        if fits:
            cur.append(entry)
        else:
            buckets.append([entry])

    for bucket in buckets:
        owner = bucket[0].owner
        named: list[tuple[str, torch.Tensor]] = []
        if pp_rank == owner:
            for entry in bucket:
                param = params[entry.megatron]
                if param.dtype != dtype:
                    raise ValueError(f"Megatron parameter {entry.megatron!r} has dtype {param.dtype}, others "
                                     f"{dtype}: export needs one parameter dtype")
                named.extend(megatron_to_hf(layout, entry.megatron, _gather_tp(param, entry.split, parallel)))
        if pp_size > 1:
            total = sum(e.numel for e in bucket)
            if pp_rank == owner:
                flat = torch.cat([t.reshape(-1) for _, t in named]) if len(named) > 1 else named[0][1].reshape(-1)
                flat = flat.contiguous()
            else:
                # the owner broadcasts a buffer on its parameters' device: allocate on the same one
                flat = any_param.new_empty(total)
            dist.broadcast(flat, src=pp_ranks[owner], group=pp_group)
            named, offset = [], 0
            for entry in bucket:
                for hf_name, shape in entry.hf:
                    n = 1
                    for d in shape:
                        n *= d
                    named.append((hf_name, flat[offset: offset + n].view(shape)))
                    offset += n
        for item in named:
            yield item
        del named


def export_hf_state_dict(model_chunks, *, parallel: ParallelDims,
                         bucket_bytes: Optional[int] = 256 * 2**20) -> dict[str, torch.Tensor]:
    """The whole model as an HF state dict on every rank (collective; built on
    :func:`iter_hf_weights`). Tensors are copies on CPU in the parameter dtype."""
    return {name: t.detach().to("cpu", copy=True)
            for name, t in iter_hf_weights(model_chunks, parallel=parallel, bucket_bytes=bucket_bytes)}
