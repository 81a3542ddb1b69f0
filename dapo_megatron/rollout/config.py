"""The ``rollout.*`` section: generation settings of the training and validation rollouts.

Design: docs/design.md §2.3 (the rollout rooms).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from dapo_megatron.platform.sglang_server_args import check_engine_kwargs
from dapo_megatron.tools.calls import ToolCallConfig


@dataclass
class MultiTurnConfig(ToolCallConfig):
    """``rollout.multi_turn``: the trajectory hook of the rollout (verl's
    ``actor_rollout_ref.rollout.multi_turn`` block, flat as verl has it;
    :mod:`dapo_megatron.rollout.trajectory`), and the keys of the tool-calling trajectory
    (``format``, ``max_assistant_turns``, ``max_tool_response_length``,
    ``tool_response_truncate_side``: verl's names; :class:`~dapo_megatron.tools.calls.ToolCallConfig`),
    which ``trajectory: dapo_megatron.tools.trajectory:ToolTrajectory`` selects. The sandbox the
    tool programs run in is the top-level ``sandbox`` block."""

    enable: bool = False
    """multi-turn rollouts: every finished row goes through the trajectory named by ``trajectory``,
    which may append context tokens (trained with ``Sample.response_mask`` 0) and continue the
    response. False: single-turn, unchanged."""
    trajectory: str = ""
    """with ``enable``: the trajectory factory as ``"package.module:attribute"``, called with
    ``(rollout.multi_turn, tokenizer)``, returning a ``dapo_megatron.rollout.trajectory.Trajectory``;
    the Python tool's: ``dapo_megatron.tools.trajectory:ToolTrajectory``."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad field."""
        if self.enable and ":" not in str(self.trajectory):
            raise ValueError(f"trajectory={self.trajectory!r}: enable=true needs a Trajectory factory as "
                             "'package.module:attribute'")
        if not self.enable and self.trajectory:
            raise ValueError(f"trajectory={self.trajectory!r} is set but enable=false: set enable: true to use it")
        try:
            super().validate()
        except ValueError as err:  # its messages name multi_turn.<key>; the loader prefixes rollout.multi_turn.
            raise ValueError(str(err).removeprefix("multi_turn.")) from None


@dataclass
class RolloutConfig:
    """Generation settings (verl ``actor_rollout_ref.rollout.*`` names)."""

    name: str = "hf"
    """rollout engine: "hf" (transformers, CPU default) or "sglang" (GPU)."""
    mode: str = "colocated"
    """"colocated": the engines share the trainer's GPUs (they sleep while the actor trains);
    "server": SGLang servers the user started (``python -m sglang.launch_server``, on other GPUs
    or nodes) listed in ``server_urls``; weights go to them over one NCCL group per pipeline
    stage (examples/run_dapo_server_mode.sh)."""
    tensor_model_parallel_size: int = 1
    """colocated: GPUs per engine (verl's name). The world is cut into rollout groups of this
    many consecutive ranks on one node; each group's first rank creates one engine spanning the
    group's GPUs and the others serve it; prompts are dealt over engines. Must divide the world
    size, fit in one node, and suit the model's heads (checked at start). Server mode: each
    server has its own ``--tp-size``; leave this at 1."""
    server_urls: list[str] = field(default_factory=list)
    """server mode: the servers' base URLs (``http://host:port``); server ``e`` is driven by
    trainer rank ``e`` (so at most world-size servers)."""
    server_timeout_s: float = 60.0
    """server mode: bound (seconds) on every control call (health, pause, flush, group init) and
    on each bucket of the weight sync; a server silent that long stops the step naming it."""
    server_silence_timeout_s: float = 600.0
    """server mode: bound (seconds) on a server's silence while it generates: every ``/generate`` is
    streamed (SGLang's ``"stream": true``), and a server that sends no byte on its requests in flight
    for this long fails (a stalled or hung server), however long the batch takes in all. A row
    reports progress every ``response_length / 8`` tokens (``rollout/engines/generate_stream.py``),
    so this must exceed the time one row takes to decode that many."""
    temperature: float = 1.0
    """sampling temperature of training rollouts, > 0 (the actor's logprobs use the same temperature)."""
    top_p: float = 1.0
    """nucleus mass for training rollouts, in (0, 1]; keep 1.0 so rollout logprobs match the actor's
    distribution."""
    top_k: int = -1
    """-1 (off) or k >= 1."""
    response_length: int = 20480
    """max new tokens per response (L_max of the paper's Eq. 13); must equal
    ``buffer.overlong.max_response_length``."""
    update_weights_bucket_megabytes: int = 512
    """bucket size of the weight sync (MiB): the bridge gathers (and with PP > 1 broadcasts) one
    bucket at a time, and SGLang receives one flattened bucket per call. A CPU actor keeps one
    bucket of host memory between syncs (``bridge.ExportBuffers``)."""
    check_weight_update: bool = True
    """verify every weight sync before the engines generate with it (``bridge/verify.py``; what is
    checked and what each receiver guarantees: docs/design.md §1.1): a failure stops the step with
    one error naming the tensor, the engine or server and the version. Observes only."""
    check_weight_update_period: int = 32
    """checksum tensor ``i`` of the export order in the syncs where ``i % period == version %
    period``: 1 checks every tensor of every sync (its cost: docs/design.md §1.1); the structural
    checks and the probe run every sync whatever the period."""
    check_weight_update_readback: bool = True
    """SGLang engines and servers: read the sample back with ``get_weights_by_name`` (a model class
    without it fails the check naming this key: set it false there, leaving the structural checks)."""
    check_weight_update_readback_elements: int = 1 << 20
    """the most elements of one tensor a readback reads (its first rows, which the sender checksums
    alike; SGLang answers JSON text, docs/design.md §1.1); 0 reads every tensor whole."""
    weight_probe: bool = True
    """after every sync, the logprobs of a fixed probe sequence under the engine must equal the
    actor's within ``weight_probe_tolerance`` (catches a wrong layout or name map the checksums
    cannot see). Engines that score a sequence (HF); the others take part in the actor's side."""
    weight_probe_tolerance: float = 0.0
    """the probe's bound on the mean per-token |logprob difference| (nats); 0: by the sent dtype
    (1e-3 for float32, 0.1 for bfloat16 / float16)."""
    gpu_memory_utilization: float = 0.5
    """SGLang ``mem_fraction_static`` (GPU only), in (0, 1)."""
    val_n: int = 32
    """responses per DISTINCT validation problem (the k of avg@k / pass@k). Rows that are copies of
    one problem (same data_source, prompt, ground truth) are sampled once as a group of val_n:
    the AIME 2024 parquet (30 problems × 32 copies) with val_n=32 gives the paper's avg@32 over
    30 × 32 samples."""
    val_temperature: float = 1.0
    """validation sampling temperature, > 0 (paper: 1.0)."""
    val_top_p: float = 0.7
    """validation top-p, in (0, 1] (paper: 0.7)."""
    val_max_prompts: int = 0
    """validate on the first this many distinct problems (0 = all)."""
    deterministic: bool = False
    """SGLang only: launch the engine with ``enable_deterministic_inference``, the only mode in
    which SGLang honours the per-response sampling seeds, so GPU rollouts repeat exactly; slower
    generation (PyTorch sampler, batch-invariant kernels, no piecewise CUDA graphs). False: GPU
    rollouts are not seed-reproducible (the HF engine always is)."""
    streaming: bool = False
    """streaming dynamic sampling (``rollout/sampling/streaming.py``): groups graded as their responses
    finish, new prompts submitted as the keep rate says they are needed, the step's rollout
    stopped as soon as ``buffer.train_batch_size`` groups are kept. False: whole generation
    batches of ``buffer.gen_batch_size`` prompts (verl's dynamic sampling). Under
    ``async_training``: the controller's streamed admission (keep-rate-sized requests, prompt
    skipping; docs/design.md §3.8)."""
    partial_rollout: Optional[bool] = None
    """continue interrupted responses from their tokens, with their logprobs and the weight versions
    that sampled each span (``Sample.versions``). With ``streaming``: the responses still running
    when the step has its N groups are kept and continued next step (slime ``--partial-rollout``);
    false aborts and discards them. Under ``async_training``: a weight sync aborts the rows in
    flight and continues them on the new weights (verl's name, AReaL's interruptible generation);
    false: the sync waits for the request in flight. null (default): true under
    ``async_training.enable``, false otherwise. A synchronous batch step never ends with rows in
    flight: true needs ``streaming`` or ``async_training``."""
    stream_poll_tokens: int = 16
    """with ``streaming``: tokens each engine samples per round between two keep/stop decisions
    (HF engine; SGLang polls in time slices instead). Not used under ``async_training`` (a
    request there is one ``/generate`` per server, generated to its end)."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """SGLang only: further ``sglang.Engine`` arguments (``ServerArgs`` fields), e.g.
    ``load_format: dummy`` (weights are synced from the actor right after start) or
    ``enable_weights_cpu_backup: true``; every key is checked against SGLang's argument list."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """the trajectory hook: single-turn unless ``multi_turn.enable``."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad field."""
        if self.name not in ("hf", "sglang"):
            raise ValueError(f"name={self.name!r} must be 'hf' or 'sglang'")
        if self.mode not in ("colocated", "server"):
            raise ValueError(f"mode={self.mode!r} must be 'colocated' or 'server'")
        tp = self.tensor_model_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_model_parallel_size={tp!r} must be an int >= 1")
        if self.mode == "server":
            if self.name != "sglang":
                raise ValueError(f"mode='server' needs name='sglang' (got name={self.name!r})")
            if not self.server_urls:
                raise ValueError("server_urls is empty: mode='server' needs the URLs of the SGLang servers you "
                                 "started (python -m sglang.launch_server ... --host 0.0.0.0 --port 30000)")
            bad = [u for u in self.server_urls if not str(u).startswith(("http://", "https://"))]
            if bad:
                raise ValueError(f"server_urls={bad} must start with http:// or https://")
            if len(set(self.server_urls)) != len(self.server_urls):
                raise ValueError(f"server_urls={list(self.server_urls)} lists a server twice")
            if self.engine_kwargs:
                raise ValueError(f"engine_kwargs={self.engine_kwargs} configure colocated engines; a server takes "
                                 "its flags on its command line (python -m sglang.launch_server --help)")
            if tp != 1:
                raise ValueError(f"tensor_model_parallel_size={tp} applies to colocated engines; in mode='server' "
                                 "each server has its own --tp-size: leave it at 1")
        elif self.server_urls:
            raise ValueError(f"server_urls={list(self.server_urls)} is set but mode={self.mode!r}: set "
                             "mode: server to use them")
        for key in ("server_timeout_s", "server_silence_timeout_s"):  # checked in every mode: a typo waits
            if not getattr(self, key) > 0:
                raise ValueError(f"{key}={getattr(self, key)!r} must be > 0 seconds")
        # the engines' SamplingParams domains (rollout/engines/engine.py), checked before any engine exists
        for key in ("temperature", "val_temperature"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key}={getattr(self, key)!r} must be > 0 (the logits are divided by it; "
                                 "for greedy decoding set top_k: 1)")
        for key in ("top_p", "val_top_p"):
            if not 0 < getattr(self, key) <= 1:
                raise ValueError(f"{key}={getattr(self, key)!r} must be in (0, 1] (1.0 = off)")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k={self.top_k} must be -1 (off) or >= 1")
        if not 0 < self.gpu_memory_utilization < 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization!r} must be in (0, 1) (SGLang's "
                             "mem_fraction_static: the share of GPU memory for weights and KV cache)")
        for key in ("response_length", "update_weights_bucket_megabytes", "val_n"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)!r} must be >= 1")
        if self.check_weight_update_period < 1:
            raise ValueError(f"check_weight_update_period={self.check_weight_update_period} must be >= 1 "
                             "(1 = every tensor of every sync)")
        if self.check_weight_update_readback_elements < 0:
            raise ValueError(f"check_weight_update_readback_elements={self.check_weight_update_readback_elements} "
                             "must be >= 0 (0 = whole tensors)")
        if self.weight_probe_tolerance < 0:
            raise ValueError(f"weight_probe_tolerance={self.weight_probe_tolerance} must be >= 0 (0 = by dtype)")
        if self.stream_poll_tokens < 1:
            raise ValueError(f"stream_poll_tokens={self.stream_poll_tokens} must be >= 1")
        if self.val_max_prompts < 0:
            raise ValueError(f"val_max_prompts={self.val_max_prompts} must be >= 0 (0 = all)")
        if self.name != "sglang" and self.deterministic:
            raise ValueError(f"deterministic=true applies to the 'sglang' engine only (name={self.name!r}; the HF "
                             "engine is always seed-reproducible): set deterministic: false")
        if self.name != "sglang" and self.engine_kwargs:
            raise ValueError(f"engine_kwargs={self.engine_kwargs} apply to the 'sglang' engine only "
                             f"(name={self.name!r})")
        if self.engine_kwargs:
            check_engine_kwargs(self.engine_kwargs, key="engine_kwargs")
