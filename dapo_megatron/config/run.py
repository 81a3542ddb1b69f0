"""The run's root config, :class:`DAPOConfig`: one field per section, checks across sections.

Each section's dataclass lives beside the code it configures; this module only composes
them into the tree that ``dapo-train`` loads (YAML + dotted overrides).

Design: docs/design.md §1 (one training step: the config it reads).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dapo_megatron.actor.config import ActorConfig
from dapo_megatron.algorithms.config import AlgorithmConfig
from dapo_megatron.data.dataset import DataConfig
from dapo_megatron.models.config import ModelConfig
from dapo_megatron.platform.parallel_config import ParallelConfig
from dapo_megatron.rewards.config import RewardConfig
from dapo_megatron.rollout.async_config import AsyncTrainingConfig
from dapo_megatron.rollout.sampling.config import BufferConfig
from dapo_megatron.rollout.config import RolloutConfig
from dapo_megatron.rollout.engines.layout import check_rollout_layout
from dapo_megatron.tools.sandbox import SandboxConfig
from dapo_megatron.tracking import TrackingConfig

from .loader import ConfigError, config_errors
from .trainer import TrainerConfig

__all__ = ["DAPOConfig"]


@dataclass
class DAPOConfig:
    """The whole run (``dapo-train --config X.yaml key.sub=value``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """what to train (HF/GGUF path, dtype, Megatron spec, FP8)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """TP / PP sizes (DP = world / (TP × PP))."""
    data: DataConfig = field(default_factory=DataConfig)
    """prompt datasets (DAPO schema; empty = the embedded arithmetic task)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """generation settings."""
    buffer: BufferConfig = field(default_factory=BufferConfig)
    """dynamic sampling, batch sizes and overlong shaping."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """advantage estimation."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """PPO/DAPO loss, mini/micro-batching and the optimizer."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """grader pool."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """steps, checkpointing, validation cadence, run directory."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """MLflow."""
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    """generation on the servers overlapped with training (verl's fully async names)."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """the tool programs' sandbox (``rollout.multi_turn`` with the tool trajectory; docs/design.md §4.1)."""

    def validate(self) -> None:
        """Checks across sections (each section validates itself); messages name every key in full."""
        if self.model.hf_path is None:
            raise ValueError("model.hf_path is required: an HF model directory or a directory holding "
                             "model.gguf_file")
        if self.buffer.overlong.max_response_length != self.rollout.response_length:
            raise ValueError(
                f"buffer.overlong.max_response_length={self.buffer.overlong.max_response_length} must equal "
                f"rollout.response_length={self.rollout.response_length} (Eq. 13's L_max is the generation budget)"
            )
        if self.rollout.partial_rollout and not (self.rollout.streaming or self.async_training.enable):
            raise ValueError("rollout.partial_rollout=true needs rollout.streaming=true or async_training.enable=true "
                             "(a synchronous batch step generates every response to its end: none is in flight "
                             "to continue)")
        if self.actor.ppo_mini_batch_size > self.buffer.train_batch_size:
            raise ValueError(f"actor.ppo_mini_batch_size={self.actor.ppo_mini_batch_size} groups exceeds "
                             f"buffer.train_batch_size={self.buffer.train_batch_size}")
        if self.buffer.train_batch_size % self.actor.ppo_mini_batch_size:
            raise ValueError(f"buffer.train_batch_size={self.buffer.train_batch_size} must be a multiple of "
                             f"actor.ppo_mini_batch_size={self.actor.ppo_mini_batch_size} (groups)")
        self._validate_async()
        self._validate_routing_replay()
        updates = self.trainer.total_training_steps * self.actor.ppo_epochs * (
            self.buffer.train_batch_size // self.actor.ppo_mini_batch_size)
        with config_errors("actor.optim"):  # trainer.total_training_steps × ppo_epochs × mini-batches per step
            self.actor.optim.check_total_steps(updates)

    def _validate_routing_replay(self) -> None:
        """``actor.routing_replay: rollout`` needs an engine that returns every token's experts:
        the HF engine (its routers' outputs) or SGLang (``return_routed_experts``, launched with
        ``enable_return_routed_experts``); in server mode the servers must be launched with
        ``--enable-return-routed-experts`` (SGLang or dapo-rollout-server), which a server without
        it answers with a 400 naming the flag. Every generation path carries routes (batch,
        ``rollout.streaming``, ``async_training``: a row continued after a weight sync asks for its
        routes from where its sample's end, ``routed_experts_start_len``). A dense model is
        refused where the model is built."""
        if self.actor.routing_replay != "rollout":
            return
        r = self.rollout
        if r.name == "sglang" and (r.engine_kwargs or {}).get("enable_return_routed_experts", True) is False:
            raise ValueError("actor.routing_replay=rollout with rollout.engine_kwargs.enable_return_routed_experts="
                             "false: SGLang then returns no routes; remove the key (the engine sets it)")

    def _validate_async(self) -> None:
        """``async_training`` against the rollout and the staleness bound η = ``buffer.max_staleness``."""
        a = self.async_training
        if not a.enable:
            if a.trigger_parameter_sync_step != 1:
                raise ValueError(f"async_training.trigger_parameter_sync_step={a.trigger_parameter_sync_step} applies "
                                 "to async_training.enable=true only (a synchronous step syncs after every update)")
            return
        if self.rollout.mode != "server":
            raise ValueError(f"async_training.enable=true needs rollout.mode=server (got rollout.mode="
                             f"{self.rollout.mode!r}): the servers generate while the torchrun world trains; set "
                             "rollout.name=sglang, rollout.mode=server and rollout.server_urls")
        eta = self.buffer.max_staleness
        if a.trigger_parameter_sync_step > eta + 1:
            # between syncs the servers' weights fall behind by up to k - 1 steps: a group sampled
            # right before a sync trains k - 1 versions later, so k - 1 > η would stall the rollout
            raise ValueError(f"async_training.trigger_parameter_sync_step={a.trigger_parameter_sync_step} must be <= "
                             f"buffer.max_staleness + 1 = {eta + 1}: weights synced every k steps are up to k - 1 "
                             "versions behind the actor; raise buffer.max_staleness or sync more often")
        t, k = self.trainer, a.trigger_parameter_sync_step
        if t.test_freq > 0 and (t.test_freq % k or t.total_training_steps % k):
            # validation at a step without a sync would grade the servers' older weights as this step's
            raise ValueError(f"trainer.test_freq={t.test_freq} and trainer.total_training_steps={t.total_training_steps} "
                             f"must be multiples of async_training.trigger_parameter_sync_step={k}: validation runs "
                             "on the servers, which hold the actor's weights only at a sync step")

    @property
    def partial_rollout(self) -> bool:
        """``rollout.partial_rollout`` resolved: null is true under ``async_training.enable``
        (a weight sync interrupts and continues the rows in flight), false otherwise."""
        p = self.rollout.partial_rollout
        return self.async_training.enable if p is None else p

    def warnings(self) -> list[str]:
        """Settings that run but are likely a mistake, one line each (``dapo-train`` logs them once,
        ``--check-config`` prints them)."""
        out = []
        if (self.async_training.enable and self.buffer.max_staleness > 0
                and self.actor.old_logprob_source == "rollout"):
            out.append(f"actor.old_logprob_source=rollout with async_training and buffer.max_staleness="
                       f"{self.buffer.max_staleness}: pi_old is then the stale engine's policy and PPO's clip is "
                       "centred on it; actor.old_logprob_source=recompute (pi_old at the current weights, plus the "
                       "token TIS of actor.rollout_is on stale tokens: decoupled PPO) is the corrected form")
        return out

    def check_inputs(self) -> None:
        """Raise :class:`ConfigError` for an input that is not on this machine: the model files
        and what the model needs to run (:meth:`ModelConfig.check_inputs`) and the data files
        (:meth:`DataConfig.check_inputs`). ``dapo-train`` runs it on every rank before
        ``torch.distributed`` starts, and ``--check-config`` runs it alone (the example launchers,
        before torchrun); ``--print-config`` does not (a login node may lack the inputs)."""
        with config_errors("model"):
            self.model.check_inputs()
        with config_errors("data"):
            self.data.check_inputs()

    def check_world_size(self, world_size: int, ranks_per_node: int | None = None) -> None:
        """Raise :class:`ConfigError` unless a launch of ``world_size`` processes
        (``ranks_per_node`` per node, None: unknown) fits this run: TP × PP divides it, the DP
        size divides ``buffer.gen_batch_size`` (each DP rank reads an equal share of every
        generation batch), and the rollout layout fits
        (:func:`~dapo_megatron.rollout.engines.layout.check_rollout_layout`)."""
        with config_errors("parallel"):
            self.parallel.check_world_size(world_size)
        r = self.rollout
        try:
            check_rollout_layout(world_size, r.tensor_model_parallel_size, ranks_per_node, mode=r.mode,
                                 num_servers=len(r.server_urls), one_driver=self.async_training.enable)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        p = self.parallel
        dp = world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)
        if self.buffer.gen_batch_size % dp:
            raise ConfigError(
                f"buffer.gen_batch_size={self.buffer.gen_batch_size} must be divisible by the DP size {dp} "
                f"(world size {world_size} / (TP {p.tensor_model_parallel_size} × PP "
                f"{p.pipeline_model_parallel_size}))"
            )
