"""One factory for the rollout of every layout, and the checks that run before any model loads
(docs/design.md §2.3).

:func:`check_rollout_fits` and :func:`prompt_stream` run before the model is built, so a run
that cannot work stops in seconds; :func:`build_rollout` runs after the actor (an SGLang
engine sizes its KV cache from the GPU memory left free) and returns the
:class:`~dapo_megatron.rollout.rollout.Rollout` of this rank, composed by :func:`compose_rollout`
with its step source: the synchronous feeder, or with ``async_training.enable`` the background
driver that runs the same feeder ahead of training (the one place that reads that key).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from dapo_megatron.config.run import DAPOConfig
from dapo_megatron.data import PromptStream
from dapo_megatron.platform import ParallelDims, device
from dapo_megatron.platform.memory import check_memory
from dapo_megatron.rewards import RewardPool
from dapo_megatron.rewards.distributed import DistributedGrader
from dapo_megatron.rollout.background import BackgroundDriver
from dapo_megatron.rollout.engines.factory import build_training_rollout
from dapo_megatron.rollout.engines.layout import check_rollout_tp_fits_model
from dapo_megatron.rollout.engines.routes import replay_routes_layout
from dapo_megatron.rollout.rollout import Rollout
from dapo_megatron.rollout.sampling.buffer import RolloutBuffer
from dapo_megatron.rollout.sampling.feeder import PromptQueue
from dapo_megatron.rollout.sampling.prompt_skip import PromptSkipper
from dapo_megatron.rollout.sampling.streaming import StreamingCollector
from dapo_megatron.rollout.trajectory import build_trajectory

logger = logging.getLogger("dapo_megatron.rollout")


def check_rollout_fits(cfg: DAPOConfig, parallel: ParallelDims, hf_config: Any) -> None:
    """Before any model loads: an SGLang engine of ``rollout.tensor_model_parallel_size`` GPUs
    can shard the model, and a colocated actor + engine fits each GPU (the estimate logged on
    rank 0), so the run stops now rather than at the first OOM minutes later.

    Raises:
        ValueError: naming the rollout TP key, or the memory that does not fit.
    """
    r = cfg.rollout
    if r.mode == "colocated" and r.name == "sglang":  # the HF engine does not shard
        check_rollout_tp_fits_model(hf_config, r.tensor_model_parallel_size)
        if torch.cuda.is_available():
            gpu_bytes = torch.cuda.get_device_properties(device()).total_memory
            estimate = check_memory(cfg, hf_config, parallel.world_size, gpu_bytes=gpu_bytes)
            if parallel.rank == 0:
                logger.info("%s", estimate.report())


def prompt_stream(cfg: DAPOConfig, parallel: ParallelDims, train_data: Any) -> PromptStream:
    """The training prompts this rank reads: its DP rank's share of each generation batch, or,
    streamed or with ``buffer.prompt_skip``, the whole batch on every rank (the streamed and the
    skipping decisions are replicated).

    Raises:
        ValueError: ``buffer.gen_batch_size`` does not divide over the DP ranks; from
            :class:`~dapo_megatron.data.PromptStream` (fewer prompts than a batch).
    """
    b, d = cfg.buffer, cfg.data
    if b.gen_batch_size % parallel.dp_size:
        raise ValueError(f"buffer.gen_batch_size={b.gen_batch_size} must be divisible by the DP size "
                         f"{parallel.dp_size}")
    if cfg.rollout.streaming or b.prompt_skip.enable:
        return PromptStream(train_data, b.gen_batch_size, 0, 1, seed=d.seed, shuffle=d.shuffle)
    return PromptStream(train_data, b.gen_batch_size // parallel.dp_size, parallel.dp_rank, parallel.dp_size,
                        seed=d.seed, shuffle=d.shuffle)


def build_rollout(cfg: DAPOConfig, parallel: ParallelDims, *, tokenizer: Any, hf_config: Any, train_data: Any,
                  val_data: Any, stream: PromptStream) -> Rollout:
    """The :class:`Rollout` of this rank for ``cfg.rollout.mode`` / ``tensor_model_parallel_size``:
    its engine (:func:`~dapo_megatron.rollout.engines.factory.build_training_rollout`), its reward
    pool, the dynamic-sampling buffer and, with ``rollout.streaming``, the streamed collector, with
    it or ``buffer.prompt_skip`` the prompt queue over the replicated stream, and the trajectory
    hook every generation loop settles its rows with (``rollout.multi_turn``, :func:`~dapo_megatron.rollout.trajectory.build_trajectory`: single-turn
    by default); collective in server mode. Build it after the actor: an SGLang engine sizes
    its KV cache from the GPU memory left free.

    Raises:
        ValueError: ``rollout.streaming`` with an engine that has no asynchronous generation
            (on every rank: :class:`~dapo_megatron.rollout.sampling.streaming.EngineClient`); a
            ``rollout.multi_turn.trajectory`` that does not build.
    """
    trajectory = build_trajectory(cfg.rollout.multi_turn, tokenizer)
    if trajectory.multi_turn:
        trajectory.bind_sandbox(cfg.sandbox)  # a tool trajectory probes its sandbox now, not mid-rollout
    routes = replay_routes_layout(cfg.actor.routing_replay, hf_config)  # routing replay: the one layout of the run
    # async_training: rank 0's controller sends every server its rows (the one module reading the key)
    engine, num_engines, engine_index = build_training_rollout(cfg, tokenizer, hf_config, parallel, routes,
                                                               one_driver=cfg.async_training.enable)
    if trajectory.stop and hasattr(engine, "set_stop_decoder"):  # the HF engine matches stop strings itself
        engine.set_stop_decoder(lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
    reward_pool = RewardPool(num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s)
    reward_pool.wait_ready()

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    b = cfg.buffer
    buffer = RolloutBuffer(b, DistributedGrader(reward_pool, parallel), decode)
    collector = prompt_queue = None
    if cfg.rollout.streaming or b.prompt_skip.enable:  # the skipper of batch mode is the step source's
        prompt_queue = PromptQueue(stream.next_batch, b.gen_batch_size, train_data.__getitem__)
    if cfg.rollout.streaming and not cfg.async_training.enable:  # async: rank 0's controller admits itself
        collector = StreamingCollector(buffer, PromptSkipper(b.prompt_skip, seed=cfg.trainer.seed),
                                       partial_rollout=cfg.partial_rollout,
                                       poll_tokens=cfg.rollout.stream_poll_tokens, trajectory=trajectory,
                                       max_new_tokens=cfg.rollout.response_length)
    return compose_rollout(cfg, parallel, engine=engine, num_engines=num_engines, engine_index=engine_index,
                           train_data=train_data, val_data=val_data, stream=stream, reward_pool=reward_pool,
                           decode=decode, buffer=buffer, collector=collector, prompt_queue=prompt_queue,
                           routes_layout=routes, trajectory=trajectory)


def compose_rollout(cfg: DAPOConfig, parallel: ParallelDims, **parts: Any) -> Rollout:
    """A :class:`Rollout` of ``parts`` (its keyword arguments) with its step source: the synchronous
    feeder, or with ``async_training.enable`` (server mode; ``config/run.py`` refuses it otherwise)
    the background driver (:class:`~dapo_megatron.rollout.background.BackgroundDriver`: rank 0's
    controller thread runs the step feeder ahead of training; ``trigger_parameter_sync_step``,
    ``rollout.partial_rollout``). A new way of driving the feeder is chosen here."""
    rollout = Rollout(cfg, parallel, **parts)
    a = cfg.async_training
    if a.enable:  # generation beside training
        rollout.run_ahead(BackgroundDriver(rollout, sync_every=a.trigger_parameter_sync_step,
                                           partial_rollout=cfg.partial_rollout))
    return rollout
