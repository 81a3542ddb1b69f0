"""Per-GPU memory estimate of a colocated run (Megatron actor + SGLang engine on one GPU).

Fail before minutes of model loading when a layout cannot fit, with the numbers and the
knobs to turn. Arithmetic only (no GPU, no model): the inputs are the HF config and the
run config, so it runs anywhere (``tests/unit/platform/test_memory.py`` checks the 7B and 32B H100
examples). It is an estimate of the largest terms, not a measurement; nothing here has
been compared with a GPU run yet.

Bytes per GPU, with ``P`` the parameters of the largest pipeline stage on one TP rank
(embedding / LM head rows padded to ``make_vocab_size_divisible_by × TP``, norms
replicated; for a mixture of experts plus ``1 / (EP × ETP)`` of the stage's routed experts,
whose optimizer shards go over ``EDP = world / (ETP × EP × PP)`` instead of DP) and
``DP = world / (TP × PP)``:

* actor, resident for the whole run (megatron-core distributed optimizer, Megatron-LM's
  "bf16 params, fp32 grads" row: ``6 + 12 / DP`` bytes per parameter): parameters
  ``P × bytes(params_dtype)``; the gradient buffer ``4 P`` (``grad_reduce_in_fp32``);
  fp32 main parameters ``4 P / DP`` (only for 16-bit params) and Adam's two moments
  ``8 P / DP``, sharded over DP. Adam's moments are allocated at the first optimizer
  step, after the engine has sized its KV cache (see the rollout phase). FP8 adds TE's
  cached FP8 weight and its transpose, ``2 P``.
* actor activations of one micro-batch of ``T = actor.ppo_max_token_len_per_gpu`` tokens
  (training only): per layer and token, the tensors kept for backward are
  ``2 · (4h + ((n_q + 2 n_kv) d + n_q d + 3 f) / TP)`` bytes in bf16 (two norm inputs,
  two norm outputs at ``h``; q, k, v and the attention output; the gated MLP's two fc1
  outputs and its fc2 input; fused attention keeps no score matrix), ``h`` not divided by
  TP (no sequence parallelism). Full recompute (``recompute_granularity=full``) keeps
  only each checkpointed block's input ``2 h T`` and recomputes one block
  (``recompute_num_layers`` layers) at a time; ``block`` keeps the other layers whole.
  With PP the first stage holds ``PP`` micro-batches in flight (1F1B). The LM head
  works on the response label rows only (≤ T rows): bf16 logits, their fp32 copy, the
  softmax and its gradient, 16 bytes per ``[T, V/TP]`` element
  (``actor/logprobs.py``).
* engine (SGLang, one per rollout group of ``rollout_tp`` GPUs, ``rollout.tensor_model_parallel_size``): its weights ``2 · N /
  rollout_tp`` (bf16, ``N`` = all parameters) and the KV cache. SGLang sizes the KV pool
  from the memory free when it starts (sglang 0.5.11
  ``model_executor/model_runner_kv_cache_mixin.py`` ``_profile_available_bytes``; 0.5.23 keeps the
  rule, ``model_runner.py:943-948``:
  ``rest = free_after_load − free_before_load × (1 − mem_fraction_static)``), i.e.
  ``KV = gpu_memory_utilization × F0 − weights`` with ``F0`` the memory free at its start
  (the GPU minus the actor's resident state, before Adam's moments, minus the overhead).
  A KV token costs ``2 · L · max(1, n_kv / rollout_tp) · d · 2`` bytes
  (``pool_configurator.py`` ``_compute_cell_size``); the pool must hold at least one
  sequence of ``data.max_prompt_length + rollout.response_length`` tokens.
  ``F0`` is the memory free when the engine starts: the engine is built after
  ``torch.cuda.empty_cache()`` on every GPU of its group (``platform/sglang_env.py``
  ``release_allocator_cache``), so the actor's cached-but-free blocks do not shrink it;
  ``allocator_cache_bytes`` (0) is what a caller that skips that step would subtract.
* overhead: CUDA contexts of the trainer and of SGLang's scheduler, NCCL buffers,
  allocator fragmentation: a constant (``overhead_bytes``, 4 GB by default), plus SGLang's
  working memory outside its static pool (CUDA graphs, decode activations, sampling
  buffers: ``engine_runtime_bytes``, 3 GB by default), of which ``cuda_graph_bytes`` (1 GB)
  are its CUDA graphs. All are assumptions. ``sleep()`` releases the graphs only when the
  scheduler captured them under the memory saver, i.e. with
  ``SGLANG_MEMORY_SAVER_CUDA_GRAPH=1`` in its environment (sglang 0.5.23
  ``model_executor/runner_backend/full_cuda_graph_backend.py:121-124``; the colocated engine sets
  it unless the user set it, ``platform/sglang_env.py``); otherwise they stay resident
  through training and the sync (``cuda_graphs_released=False``: the ``cuda_graphs_resident``
  term). SGLang 0.5.23's default prefill ("breakable") graph cannot be captured under the saver
  (``runner_backend/breakable_cuda_graph_backend.py:84-94``), so colocated engines run without it
  (``platform/sglang_server_args.py`` ``colocated_graph_kwargs``) and the graphs counted
  are the decode graphs. Releasing the KV cache flushes it with ``empty_cache`` (0.5.23
  ``managers/scheduler_components/weight_updater.py:351-366``, ``managers/scheduler.py:5518-5534``),
  so the scheduler's cached activations do not outlive ``sleep()`` either;
  ``tests/gpu/full_image_check.py sleep-memory`` measures what a sleeping engine keeps.

Phases (the engine sleeps while the actor trains):

* rollout: the engine's static pool is ``gpu_memory_utilization × F0``; what is left,
  ``(1 − gpu_memory_utilization) × F0``, must hold Adam's moments and SGLang's runtime;
* train: actor resident + activations + overhead (+ the engine's CUDA graphs when sleep
  keeps them) ≤ GPU (engine memory released);
* sync (weights resumed into the sleeping engine): actor resident + engine weights +
  the sync's buffers + overhead (+ resident CUDA graphs) ≤ GPU. The buffers (``dapo_megatron.bridge.iter_hf_weights``
  and the engine's flat-bucket packer): the bridge's bucket, at least the full (padded)
  embedding, which is a bucket of its own; the engine payload's bucket (a tensor larger than
  it is sent from the bridge's memory); at actor TP > 1 the bridge's two scratch buffers of
  the largest re-laid-out tensor, a layer's full gate/up weight.

Design: docs/design.md §1 (the colocated pair's memory check) and §2 (parallel layouts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from dapo_megatron.config.loader import ConfigError
from dapo_megatron.models.config import has_qk_norm, has_qkv_bias, mla_layout, moe_layout
from dapo_megatron.platform.sglang_env import cuda_graphs_released

GB = 10**9
#: H100 SXM / PCIe "80 GB" as marketed (decimal); the driver reports ~85.0e9 bytes.
H100_80GB = 80 * GB
DEFAULT_OVERHEAD = 4 * GB
DEFAULT_ENGINE_RUNTIME = 3 * GB
DEFAULT_CUDA_GRAPH = 1 * GB
_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


@dataclass
class ModelShape:
    """What the estimate needs of an HF config (Llama / Qwen2 / Qwen3; the MoE families with
    ``experts`` > 0: every layer's MLP is ``experts`` routed experts of FFN ``moe_ffn``, ``topk``
    per token, plus a shared expert of FFN ``shared_ffn`` and its gate; ``ffn`` is then 0)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    experts: int = 0
    moe_ffn: int = 0
    topk: int = 0
    shared_ffn: int = 0
    shared_gate: bool = False
    dense_layers: int = 0
    """DeepSeek-V3 ``first_k_dense_replace``: the first layers are dense MLPs of FFN ``dense_ffn``."""
    dense_ffn: int = 0
    mla: Optional[tuple[int, int, int, int, int]] = None
    """multi-head latent attention (q_lora_rank or 0, kv_lora_rank, qk_nope_head_dim,
    qk_rope_head_dim, v_head_dim), None for GQA."""
    router_bias: bool = False
    """the router has a per-expert score-correction bias (DeepSeek-V3, GLM-4.5)."""

    @classmethod
    def from_hf(cls, hf_config) -> "ModelShape":
        h, nh = hf_config.hidden_size, hf_config.num_attention_heads
        moe = moe_layout(hf_config)
        return cls(
            hidden=h, layers=hf_config.num_hidden_layers, heads=nh,
            kv_heads=getattr(hf_config, "num_key_value_heads", None) or nh,
            head_dim=getattr(hf_config, "head_dim", None) or h // nh,
            ffn=hf_config.intermediate_size if moe is None else 0,
            vocab=hf_config.vocab_size, tied=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=has_qkv_bias(hf_config) or bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=has_qk_norm(hf_config),
            router_bias=bool(moe and moe.expert_bias),
            experts=moe.num_experts if moe else 0, moe_ffn=moe.ffn_hidden_size if moe else 0,
            topk=moe.topk if moe else 0, shared_ffn=moe.shared_ffn_hidden_size if moe else 0,
            shared_gate=bool(moe and moe.shared_expert_gate),
            dense_layers=len(moe.dense_layers) if moe else 0, dense_ffn=moe.dense_ffn_hidden_size if moe else 0,
            mla=None if (m := mla_layout(hf_config)) is None else
            (m.q_lora_rank or 0, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim),
        )

    def _attention_params(self) -> tuple[int, int]:
        """(split over TP, replicated) attention parameters of one layer. MLA (TE spec): the
        down-projections and latent norms replicated (TELinear ``duplicated``), the
        up-projections and ``o_proj`` split by heads."""
        h, n = self.hidden, self.heads
        if self.mla is None:
            q, kv = n * self.head_dim, self.kv_heads * self.head_dim
            return h * (q + 2 * kv) + q * h + (q + 2 * kv if self.qkv_bias else 0), \
                2 * self.head_dim if self.qk_norm else 0
        q_lora, kv_lora, nope, rope, v = self.mla
        q_up = q_lora * n * (nope + rope) if q_lora else h * n * (nope + rope)
        split = q_up + kv_lora * n * (nope + v) + n * v * h
        replicated = (h * q_lora + q_lora if q_lora else 0) + h * (kv_lora + rope) + kv_lora
        return split, replicated

    def layer_params(self) -> tuple[int, int]:
        """``(split over TP, replicated)`` parameters of one decoder layer, routed experts
        excluded (:meth:`expert_params`); the router and the shared expert's gate are replicated.
        With dense layers among MoE ones (DeepSeek-V3), the larger of a dense and an MoE layer's
        (an upper bound per layer: the estimate then holds for every stage)."""
        attn_split, attn_rep = self._attention_params()
        moe_ffn = 3 * self.hidden * (self.ffn + self.shared_ffn)
        split = attn_split + max(moe_ffn, 3 * self.hidden * self.dense_ffn)
        replicated = 2 * self.hidden + attn_rep
        replicated += self.experts * self.hidden + (self.hidden if self.shared_gate else 0)
        replicated += self.experts if self.router_bias else 0  # the router's score-correction bias
        return split, replicated

    def expert_params(self) -> int:
        """Routed-expert parameters of one decoder layer (split over EP × ETP); 0 when dense."""
        return 3 * self.hidden * self.moe_ffn * self.experts

    def total_params(self) -> int:
        """All parameters of the HF model (unpadded vocabulary, tied embeddings once)."""
        attn_split, attn_rep = self._attention_params()
        emb = self.vocab * self.hidden
        per_layer = attn_split + attn_rep + 2 * self.hidden
        moe = 3 * self.hidden * self.shared_ffn + self.experts * self.hidden + self.expert_params() \
            + (self.hidden if self.shared_gate else 0) + (self.experts if self.router_bias else 0)
        mlp = self.dense_layers * 3 * self.hidden * self.dense_ffn + (self.layers - self.dense_layers) * \
            (moe if self.experts else 3 * self.hidden * self.ffn)
        return self.layers * per_layer + mlp + emb * (1 if self.tied else 2) + self.hidden

    def kv_bytes_per_token(self, tp: int, dtype_bytes: int = 2) -> int:
        """SGLang's KV cell: K and V of every layer, ``max(1, n_kv // tp)`` heads per GPU. MLA
        caches one latent and one shared RoPE key per token and layer, ``kv_lora_rank +
        qk_rope_head_dim`` elements, the same on every TP rank (SGLang's ``MLATokenToKVPool``:
        ``kv_lora_rank + qk_rope_head_dim`` per layer, not split over TP): DeepSeek-V3's 576
        against GQA's 2 · heads · head_dim."""
        if self.mla is not None:
            return self.layers * (self.mla[1] + self.mla[3]) * dtype_bytes
        return 2 * self.layers * max(1, self.kv_heads // tp) * self.head_dim * dtype_bytes

    def activation_bytes_per_token(self, tp: int, etp: Optional[int] = None) -> int:
        """bf16 bytes kept for backward by one layer per token (module docstring). An MoE layer
        keeps, per token and routed expert (``topk`` of them, balanced over the EP ranks), the
        dispatched input and the combined output (``2 h``) and the expert's fc1 outputs and fc2
        input (``3 f / ETP``); the shared expert as a dense MLP."""
        if self.mla is None:
            q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
            attn = q + 2 * kv + q
        else:  # q, k (nope + rope), v and the attention output per head; the latents replicated
            q_lora, kv_lora, nope, rope, v = self.mla
            attn = self.heads * (2 * (nope + rope) + 2 * v) + tp * (q_lora + kv_lora + rope)
        ffn = max(self.ffn + self.shared_ffn, self.dense_ffn)
        dense = 2 * (4 * self.hidden + (attn + 3 * ffn) // tp)
        return dense + 2 * self.topk * (2 * self.hidden + 3 * self.moe_ffn // (etp or tp))


@dataclass
class MemoryEstimate:
    """The estimate of one rank's GPU (bytes); see the module docstring for each term.

    Attributes:
        gpu_bytes: memory of the GPU.
        parts: named terms (``actor_params``, ``actor_grads``, ``actor_main_params``,
            ``actor_adam``, ``actor_fp8_weights``, ``activations``, ``logits``,
            ``engine_weights``, ``kv_cache``, ``overhead``, ``engine_runtime``,
            ``cuda_graphs_resident``, ``allocator_cache``, ``sync_buffers``).
        phases: bytes in use in the ``rollout``, ``train`` and ``sync`` phases.
        kv_tokens: tokens the KV pool holds; ``max_sequence_tokens`` the longest sequence.
        problems: why it does not fit (each with the knobs to turn); empty when it fits.
    """

    gpu_bytes: int
    parts: dict[str, int]
    phases: dict[str, int]
    kv_tokens: int
    max_sequence_tokens: int
    problems: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems

    def report(self) -> str:
        """One line per term and phase, in GB (10^9 bytes)."""
        def gb(x):
            return f"{x / GB:7.2f} GB"

        lines = [f"per-GPU memory estimate (GPU {gb(self.gpu_bytes)}):"]
        lines += [f"  {k:<18} {gb(v)}" for k, v in self.parts.items()]
        lines.append(f"  KV pool {self.kv_tokens:,} tokens (longest sequence {self.max_sequence_tokens:,})")
        lines += [f"  phase {k:<12} {gb(v)} in use" for k, v in self.phases.items()]
        return "\n".join(lines)


def estimate_memory(
    hf_config,
    *,
    tp: int,
    pp: int,
    world_size: int,
    params_dtype: str = "bfloat16",
    fp8: bool = False,
    make_vocab_size_divisible_by: int = 128,
    recompute: Optional[dict[str, Any]] = None,
    micro_batch_tokens: int,
    gpu_memory_utilization: float,
    max_sequence_tokens: int,
    rollout_tp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    bucket_bytes: int = 512 * 2**20,
    gpu_bytes: int = H100_80GB,
    overhead_bytes: int = DEFAULT_OVERHEAD,
    engine_runtime_bytes: int = DEFAULT_ENGINE_RUNTIME,
    cuda_graph_bytes: int = DEFAULT_CUDA_GRAPH,
    cuda_graphs_released: bool = True,
    allocator_cache_bytes: int = 0,
) -> MemoryEstimate:
    """Estimate one rank's GPU memory (module docstring); never raises for a layout that
    does not fit: read :attr:`MemoryEstimate.problems` (or use :func:`check_memory`).

    Args:
        hf_config: HF config of the model.
        tp, pp, world_size: actor layout (DP = world / (TP × PP)).
        params_dtype: ``model.params_dtype``. fp8: ``model.fp8`` is set.
        make_vocab_size_divisible_by: vocabulary padding multiple (× TP).
        recompute: ``TransformerConfig`` recompute fields (``recompute_granularity``,
            ``recompute_method``, ``recompute_num_layers``), e.g. the run's
            ``model.extra_transformer_config``.
        micro_batch_tokens: ``actor.ppo_max_token_len_per_gpu``.
        gpu_memory_utilization: SGLang ``mem_fraction_static``.
        max_sequence_tokens: ``data.max_prompt_length + rollout.response_length``.
        rollout_tp: GPUs per SGLang engine (its tensor parallel size); 1 by default.
        ep, etp: expert model / tensor parallel sizes (MoE; ``etp`` None: TP). A rank holds
            ``1 / (EP × ETP)`` of each stage's routed experts, whose fp32 main parameters and
            Adam moments the distributed optimizer shards over the expert-DP ranks
            ``EDP = world / (ETP × EP × PP)`` (megatron-core's expert data-parallel group).
        bucket_bytes: ``rollout.update_weights_bucket_megabytes`` in bytes.
        gpu_bytes: memory of one GPU (default: an 80 GB H100).
        overhead_bytes, engine_runtime_bytes, cuda_graph_bytes: the assumptions of the module
            docstring (``cuda_graph_bytes`` is the part of ``engine_runtime_bytes`` that sleep
            releases only under ``SGLANG_MEMORY_SAVER_CUDA_GRAPH=1``).
        cuda_graphs_released: sleep frees the engine's CUDA graphs
            (:func:`dapo_megatron.platform.sglang_env.cuda_graphs_released`); False adds them to
            the train and sync phases.
        allocator_cache_bytes: the actor's cached-but-free CUDA blocks when the engine starts
            (0: the engine starts after ``empty_cache``).

    Raises:
        ValueError: a layout that cannot exist (world not divisible by TP × PP, layers not
            divisible by PP, an unknown dtype).
    """
    shape = ModelShape.from_hf(hf_config)
    etp = etp or tp
    if world_size % (tp * pp) or shape.layers % pp or world_size % (etp * ep * pp):
        raise ValueError(f"world {world_size} / TP {tp} × PP {pp} (ETP {etp} × EP {ep} × PP) / {shape.layers} "
                         "layers: not a valid layout")
    if params_dtype not in _BYTES:
        raise ValueError(f"model.params_dtype={params_dtype!r} is not one of {sorted(_BYTES)}")
    dp = world_size // (tp * pp)
    T = int(micro_batch_tokens)
    multiple = make_vocab_size_divisible_by * tp
    padded_vocab = -(-shape.vocab // multiple) * multiple
    split, rep = shape.layer_params()
    layers_per_stage = shape.layers // pp
    emb_rows = padded_vocab * shape.hidden // tp
    # stage 0 holds the embedding, the last stage the LM head (a tied copy with PP > 1)
    head = emb_rows if (pp > 1 or not shape.tied) else 0
    first = layers_per_stage * (split // tp + rep) + emb_rows + (head + shape.hidden if pp == 1 else 0)
    last = layers_per_stage * (split // tp + rep) + head + shape.hidden
    P_experts = layers_per_stage * shape.expert_params() // (ep * etp)  # every stage holds as many
    P_dense = max(first, last)
    P = P_dense + P_experts
    edp = world_size // (etp * ep * pp)
    pb = _BYTES[params_dtype]
    parts = {
        "actor_params": P * pb,
        "actor_grads": P * 4,
        "actor_main_params": (P_dense * 4 // dp + P_experts * 4 // edp) if pb < 4 else 0,
        "actor_adam": P_dense * 8 // dp + P_experts * 8 // edp,
        "actor_fp8_weights": 2 * P if fp8 else 0,
    }

    # activations of one micro-batch on the stage that holds the most
    rc = dict(recompute or {})
    per_token_layer = shape.activation_bytes_per_token(tp, etp)
    in_flight = pp  # 1F1B: stage 0 holds PP micro-batches
    if rc.get("recompute_granularity") == "full":
        k = int(rc.get("recompute_num_layers") or 1)
        if rc.get("recompute_method", "uniform") == "block":  # the first k layers recomputed, the rest kept
            kept = (layers_per_stage - min(k, layers_per_stage)) * per_token_layer * T
            stored = min(k, layers_per_stage) * 2 * shape.hidden * T + kept
            working = per_token_layer * T
        else:  # uniform: every block of k layers checkpointed at its input
            stored = -(-layers_per_stage // k) * 2 * shape.hidden * T
            working = k * per_token_layer * T
    else:
        stored, working = layers_per_stage * per_token_layer * T, 0
    parts["activations"] = in_flight * stored + working
    parts["logits"] = 16 * T * (padded_vocab // tp)

    engine_weights = 2 * shape.total_params() // rollout_tp
    resident_at_start = parts["actor_params"] + parts["actor_grads"] + parts["actor_main_params"] \
        + parts["actor_fp8_weights"]
    resident = resident_at_start + parts["actor_adam"]
    free_at_engine_start = gpu_bytes - resident_at_start - overhead_bytes - allocator_cache_bytes
    static_pool = int(gpu_memory_utilization * free_at_engine_start)
    kv = static_pool - engine_weights
    kv_cell = shape.kv_bytes_per_token(rollout_tp)
    kv_tokens = max(0, kv) // kv_cell
    def gb(x):
        return f"{x / GB:.1f} GB"

    graphs = 0 if cuda_graphs_released else min(cuda_graph_bytes, engine_runtime_bytes)
    parts.update(engine_weights=engine_weights, kv_cache=max(0, kv), overhead=overhead_bytes,
                 engine_runtime=engine_runtime_bytes, cuda_graphs_resident=graphs,
                 allocator_cache=allocator_cache_bytes,
                 sync_buffers=max(bucket_bytes, padded_vocab * shape.hidden * pb) + bucket_bytes
                 + 2 * max(2 * (shape.ffn + shape.shared_ffn) * shape.hidden * pb if tp > 1 else 0,
                           2 * shape.moe_ffn * shape.hidden * pb if etp > 1 else 0))
    phases = {
        "rollout": resident + overhead_bytes + static_pool + engine_runtime_bytes,
        "train": resident + parts["activations"] + parts["logits"] + overhead_bytes + graphs,
        "sync": resident + engine_weights + parts["sync_buffers"] + overhead_bytes + graphs,
    }
    graphs_note = (f"; SGLang's CUDA graphs ({gb(graphs)}) stay resident while it sleeps: launch it with "
                   "SGLANG_MEMORY_SAVER_CUDA_GRAPH=1" if graphs else "")

    problems = []
    if kv_tokens < max_sequence_tokens:
        problems.append(
            f"the SGLang KV cache holds {kv_tokens:,} tokens, fewer than one sequence of {max_sequence_tokens:,} "
            f"(data.max_prompt_length + rollout.response_length): its static pool rollout.gpu_memory_utilization="
            f"{gpu_memory_utilization} × {gb(free_at_engine_start)} free = {gb(static_pool)} minus its weights "
            f"{gb(engine_weights)} (rollout TP {rollout_tp}). Raise the rollout tensor parallel size (weights / TP), "
            f"rollout.gpu_memory_utilization, or the actor's TP/PP (a smaller resident actor)")
    if phases["rollout"] > gpu_bytes:
        problems.append(
            f"rollout: the memory left beside SGLang's static pool, (1 - {gpu_memory_utilization}) × "
            f"{gb(free_at_engine_start)} = {gb(free_at_engine_start - static_pool)}, does not hold Adam's moments "
            f"{gb(parts['actor_adam'])} (allocated at the first step) and SGLang's runtime "
            f"{gb(engine_runtime_bytes)}: lower rollout.gpu_memory_utilization, or add data-parallel ranks / "
            f"raise TP/PP (smaller optimizer shards)")
    if phases["train"] > gpu_bytes:
        problems.append(
            f"train: the actor needs {gb(phases['train'])} (resident {gb(resident)}, activations "
            f"{gb(parts['activations'])}, LM-head logits {gb(parts['logits'])}): lower "
            f"actor.ppo_max_token_len_per_gpu (now {T:,}), turn on full recompute "
            f"(model.extra_transformer_config.recompute_granularity=full), or raise TP/PP" + graphs_note)
    if phases["sync"] > gpu_bytes:
        problems.append(
            f"weight sync: the actor ({gb(resident)}) and the engine's weights ({gb(engine_weights)}, rollout TP "
            f"{rollout_tp}) are resident together: raise the rollout tensor parallel size or the actor's TP/PP, "
            f"or lower rollout.update_weights_bucket_megabytes" + graphs_note)
    return MemoryEstimate(gpu_bytes, parts, phases, kv_tokens, int(max_sequence_tokens), problems)


def estimate_from_config(cfg, hf_config, world_size: int, *, rollout_tp: Optional[int] = None,
                         gpu_bytes: int = H100_80GB, **kwargs) -> MemoryEstimate:
    """:func:`estimate_memory` for a :class:`~dapo_megatron.config.DAPOConfig`.

    ``rollout_tp`` None: ``cfg.rollout.tensor_model_parallel_size`` (the GPUs of one
    colocated engine; 1: one engine per GPU). ``cuda_graphs_released`` defaults to what this
    process's environment gives the engine (``SGLANG_MEMORY_SAVER_CUDA_GRAPH``, set to 1 by the
    engine unless the user set it).
    """
    if rollout_tp is None:
        rollout_tp = cfg.rollout.tensor_model_parallel_size
    if "cuda_graphs_released" not in kwargs:  # what the colocated engine's children will get
        kwargs["cuda_graphs_released"] = cuda_graphs_released()
    return estimate_memory(
        hf_config, tp=cfg.parallel.tensor_model_parallel_size, pp=cfg.parallel.pipeline_model_parallel_size,
        world_size=world_size, params_dtype=cfg.model.params_dtype, fp8=cfg.model.fp8 is not None,
        make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by,
        recompute=cfg.model.extra_transformer_config, micro_batch_tokens=cfg.actor.ppo_max_token_len_per_gpu,
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        max_sequence_tokens=cfg.data.max_prompt_length + cfg.rollout.response_length, rollout_tp=rollout_tp,
        ep=cfg.parallel.expert_model_parallel_size, etp=cfg.parallel.expert_tensor_parallel_size,
        bucket_bytes=cfg.rollout.update_weights_bucket_megabytes * 2**20, gpu_bytes=gpu_bytes, **kwargs)


def check_memory(cfg, hf_config, world_size: int, **kwargs) -> MemoryEstimate:
    """:func:`estimate_from_config`, raising when the run cannot fit.

    Raises:
        ConfigError: (a ``ValueError``) with, per problem, the numbers and the settings to
            change, then the estimate's report; ``dapo-train`` prints it from rank 0.
    """
    est = estimate_from_config(cfg, hf_config, world_size, **kwargs)
    if not est.fits:
        raise ConfigError("the colocated actor + SGLang engine do not fit one GPU:\n- "
                          + "\n- ".join(est.problems) + "\n" + est.report())
    return est
