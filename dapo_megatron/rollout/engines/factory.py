"""The tokenizer and the rollout engine of a model, built one way for the trainer and ``tools/eval.py``.

Both callers go through :func:`load_tokenizer`, :func:`stop_token_ids` and
:func:`build_engine`, so a model evaluated by ``tools/eval.py`` stops its responses on the
same tokens as the engine that generated its training rollouts.

Stop tokens (:func:`stop_token_ids`): the union of the tokenizer's ``eos_token_id``, the
model config's ``eos_token_id`` (an int or a list) and, when the model directory has a
``generation_config.json``, its ``eos_token_id``. That is what SGLang stops on:
``ModelConfig._get_hf_eos_token_id`` (sglang 0.5.x, ``python/sglang/srt/configs/model_config.py``)
takes the union of ``hf_config.eos_token_id`` and ``hf_generation_config.eos_token_id``, and
its scheduler also ends a request on the tokenizer's ``eos_token_id``
(``Req.check_finished``). The HF engine is given the same set explicitly.

Design: docs/design.md §1 (stop tokens) and §2.3.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from dapo_megatron.models.config import moe_layout
from dapo_megatron.platform import device, local_device_index
from dapo_megatron.rollout.engines.engine import RolloutEngine, eos_ids
from dapo_megatron.bridge.receiver import hf_param_specs
from dapo_megatron.rollout.engines.engine_group import EngineGroupMember, RolloutGroup
from dapo_megatron.rollout.engines.hf_engine import HFEngine
from dapo_megatron.rollout.engines.routes import RoutesLayout
from dapo_megatron.rollout.engines.server_sync import ServerRollout
from dapo_megatron.rollout.engines.sglang_engine import SGLangEngine
from dapo_megatron.platform.sglang_env import release_allocator_cache

if TYPE_CHECKING:
    from dapo_megatron.config.run import DAPOConfig

ENGINES = ("hf", "sglang")


def load_tokenizer(hf_path: str, gguf_file: Optional[str] = None):
    """``AutoTokenizer.from_pretrained(hf_path[, gguf_file=...])``, its pad token set to EOS when
    it has none (the engines pad prompt batches with it)."""
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tok = AutoTokenizer.from_pretrained(hf_path, **kwargs)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def stop_token_ids(tokenizer, hf_config, model_path: Optional[str] = None) -> tuple[int, ...]:
    """The token ids that end a response, sorted (see the module docstring for the rule).

    Args:
        tokenizer: anything with ``eos_token_id`` (int or None).
        hf_config: the model's HF config (``eos_token_id``: int, list or None).
        model_path: the model directory; its ``generation_config.json`` is read when present
            (a GGUF directory has none).

    Raises:
        ValueError: none of the three names an EOS id (the engine could never stop early).
    """
    ids = eos_ids(tokenizer, hf_config)
    if model_path and os.path.isfile(os.path.join(model_path, "generation_config.json")):
        ids |= eos_ids(GenerationConfig.from_pretrained(model_path))
    if not ids:
        raise ValueError(f"no EOS token id in the tokenizer, config or generation_config of {model_path!r}: "
                         "the engine could not end a response before its token budget")
    return tuple(sorted(ids))


@dataclass(frozen=True)
class EngineSpec:
    """Everything a rollout engine is built from; :func:`build_engine` turns it into one.

    Attributes:
        name: ``"hf"`` (transformers, CPU or GPU) or ``"sglang"`` (GPU).
        model_path: HF (or GGUF) model directory.
        dtype: compute dtype of the engine's weights.
        eos_token_ids: :func:`stop_token_ids` (the HF engine is given them; SGLang derives the
            same set from ``model_path`` and the tokenizer itself).
        gguf_file: GGUF file name inside ``model_path`` (``hf`` only).
        pretrained: load the weights from ``model_path``; False builds random weights from the
            config (the trainer's engine, whose weights come from the actor's first sync).
        device: ``hf``: the device; None is this rank's (``platform.device()``).
        tp_size, mem_fraction_static, enable_memory_saver, base_gpu_id, deterministic,
            engine_kwargs: ``sglang`` only, see :class:`~dapo_megatron.rollout.engines.sglang_engine.SGLangEngine`.
        update_bucket_mb: ``sglang``: weight-update bucket (MiB); None keeps the engine's default.
        record_routes: routing replay (``actor.routing_replay: rollout``): the engine returns every
            token's experts (``Completion.routes``); ``(L, K, E)`` of the model, None: off.
    """

    name: str
    model_path: str
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    gguf_file: Optional[str] = None
    pretrained: bool = True
    device: Optional[str] = None
    tp_size: int = 1
    mem_fraction_static: float = 0.5
    enable_memory_saver: bool = True
    base_gpu_id: Optional[int] = None
    deterministic: bool = False
    update_bucket_mb: Optional[int] = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    record_routes: Optional[tuple[int, int, int]] = None

    def __post_init__(self):
        if self.name not in ENGINES:
            raise ValueError(f"rollout engine {self.name!r} must be one of {ENGINES}")


def training_engine_spec(cfg: DAPOConfig, tokenizer, hf_config, routes: Optional[RoutesLayout] = None) -> EngineSpec:
    """The trainer's colocated engine: random weights (the actor syncs them before the first
    rollout), ``model.params_dtype``, this rank's GPU, the ``rollout.*`` settings; ``routes``: the
    run's routes layout (routing replay, :func:`~dapo_megatron.rollout.engines.routes.replay_routes_layout`,
    computed where the rollout is built), None: off."""
    rollout = cfg.rollout
    base_gpu_id = None
    if rollout.name == "sglang":
        base_gpu_id = local_device_index()  # this rank's GPU: torchrun sets no CUDA_VISIBLE_DEVICES
    return EngineSpec(
        name=rollout.name, model_path=cfg.model.hf_path, dtype=cfg.model.torch_dtype(),
        eos_token_ids=stop_token_ids(tokenizer, hf_config, cfg.model.hf_path), gguf_file=cfg.model.gguf_file,
        pretrained=False, tp_size=rollout.tensor_model_parallel_size,
        mem_fraction_static=rollout.gpu_memory_utilization,
        base_gpu_id=base_gpu_id, deterministic=rollout.deterministic,
        update_bucket_mb=rollout.update_weights_bucket_megabytes, engine_kwargs=dict(rollout.engine_kwargs or {}),
        record_routes=None if routes is None else routes.engine_shape,
    )


def build_engine(spec: EngineSpec, hf_config=None, group=None) -> RolloutEngine:
    """The engine ``spec`` describes.

    Args:
        spec: see :class:`EngineSpec`.
        hf_config: the model's HF config; needed for ``name="hf"`` with ``pretrained=False``.
        group: ``sglang`` with ``tp_size > 1``: the
            :class:`~dapo_megatron.rollout.engines.engine_group.RolloutGroup` this process leads.

    Raises:
        ValueError: ``pretrained=False`` without ``hf_config``; the engines' own errors.
    """
    bucket = {} if spec.update_bucket_mb is None else {"update_bucket_mb": spec.update_bucket_mb}
    if spec.name == "sglang":
        return SGLangEngine(model_path=spec.model_path, dtype=spec.dtype, tp_size=spec.tp_size,
                            mem_fraction_static=spec.mem_fraction_static,
                            enable_memory_saver=spec.enable_memory_saver, base_gpu_id=spec.base_gpu_id,
                            deterministic=spec.deterministic, engine_kwargs=spec.engine_kwargs or None, group=group,
                            record_routes=spec.record_routes, **bucket)
    if spec.pretrained:
        model: Any = spec.model_path
        extra = {"gguf_file": spec.gguf_file}
    else:
        if hf_config is None:
            raise ValueError("build_engine: an engine with random weights (pretrained=False) needs hf_config")
        model, extra = AutoModelForCausalLM.from_config(hf_config, dtype=spec.dtype), {}
    return HFEngine(model, dtype=spec.dtype, device=spec.device or device(),  # it loads tensor by tensor
                    eos_token_ids=list(spec.eos_token_ids), record_routes=spec.record_routes is not None, **extra)


def build_training_rollout(cfg: DAPOConfig, tokenizer, hf_config, parallel,
                           routes: Optional[RoutesLayout] = None, *,
                           one_driver: bool = False) -> tuple[Any, int, Optional[int]]:
    """The trainer's rollout on this rank: ``(engine, num_engines, engine_index)``, where
    ``engine_index`` is the engine this rank drives (None: it generates nothing); collective in
    server mode.

    colocated (``rollout.mode``): the leader of each of ``parallel``'s rollout groups builds the
    engine (:func:`training_engine_spec`), the other ranks are
    :class:`~dapo_megatron.rollout.engines.engine_group.EngineGroupMember` s; server: a
    :class:`~dapo_megatron.rollout.engines.server_sync.ServerRollout` on every rank (``one_driver``: its
    argument). ``routes``: the run's routes layout (routing replay), its ``engine_shape`` recorded by
    every engine; None: off.
    """
    rollout = cfg.rollout
    if rollout.mode == "server":
        # EP > 1: one sender per EP owner of each stage (its expert-TP rank 0), EP rank 0's with the
        # non-expert tensors (server_sync's module docstring); EP = 1: the stage's DP-0 TP-0 rank
        ep, owner = parallel.ep_size, parallel.expert_owner
        is_sender = (parallel.tp_rank == 0 and parallel.dp_rank == 0) if ep == 1 else \
            (owner is not None and parallel.etp_rank == 0)
        moe = moe_layout(hf_config)
        servers = ServerRollout(
            rollout.server_urls, hf_param_specs(hf_config), stage=parallel.pp_rank, num_stages=parallel.pp_size,
            is_sender=is_sender, expert_turns=ep, expert_turn=owner or 0,
            num_experts=moe.num_experts if moe is not None else 0, device=device(),
            timeout_s=rollout.server_timeout_s, silence_timeout_s=rollout.server_silence_timeout_s,
            bucket_bytes=rollout.update_weights_bucket_megabytes * 2**20,
            eos_token_ids=stop_token_ids(tokenizer, hf_config, cfg.model.hf_path), parallel=parallel,
            one_driver=one_driver, record_routes=None if routes is None else routes.engine_shape)
        return servers, servers.num_engines, servers.engine_index
    index = parallel.rollout_index if parallel.is_rollout_leader else None
    if rollout.name == "sglang":
        # the engine's TP workers size their KV pools from the memory free on each GPU of the group,
        # and refuse to start when it differs too much: every rank hands its cached blocks back first,
        # and the leader starts the engine once all have (sglang_env.release_allocator_cache)
        release_allocator_cache()
        parallel.barrier("rollout")
    if parallel.rollout_tp_size == 1:
        engine = build_engine(training_engine_spec(cfg, tokenizer, hf_config, routes), hf_config)
        return _labelled(engine, cfg, parallel), parallel.num_engines, index
    group = RolloutGroup(parallel.rollout_group_ranks, parallel.rank, parallel.rollout_group)
    if not group.is_leader:
        return (EngineGroupMember(group, hf_param_specs(hf_config),
                                  transport="flat_bucket" if rollout.name == "sglang" else None,
                                  update_bucket_mb=rollout.update_weights_bucket_megabytes),
                parallel.num_engines, None)
    spec = training_engine_spec(cfg, tokenizer, hf_config, routes)  # the HF engine ignores tp_size: one full copy
    engine = build_engine(spec, hf_config, group=group if spec.name == "sglang" else None)
    return _labelled(engine, cfg, parallel), parallel.num_engines, index


def _labelled(engine, cfg: DAPOConfig, parallel):
    """The engine's name in verification errors (``<class> of rank r``) and its readback switch."""
    engine.engine_label = f"{type(engine).__name__} of rank {parallel.rank}"
    if hasattr(engine, "verify_readback"):
        engine.verify_readback = cfg.rollout.check_weight_update_readback
    return engine
