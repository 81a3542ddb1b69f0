"""HF config → megatron-core ``TransformerConfig`` and ``GPTModel`` arguments.

Supported families (``hf_config.model_type``):

- ``llama`` (Llama 2/3, SmolLM2): RMSNorm, SwiGLU, RoPE (default, ``linear`` or
  ``llama3`` scaling), GQA, tied or untied embeddings.
- ``qwen2`` (Qwen2 / Qwen2.5): as llama plus a bias on the q/k/v projections.
- ``qwen3``: as llama plus RMSNorm on queries and keys per head (q/k norm) and an
  explicit ``head_dim`` that may differ from ``hidden_size / num_attention_heads``.

Mixtures of experts (every decoder layer an MoE layer, megatron-core ``MoELayer``; see
:func:`moe_layout` and docs/design.md §2.1):

- ``qwen3_moe`` (Qwen3-30B-A3B, Qwen3-235B-A22B): qwen3 attention, ``num_experts`` routed
  experts of ``moe_intermediate_size``, softmax router, top ``num_experts_per_tok``,
  renormalised when ``norm_topk_prob``.
- ``qwen2_moe`` (Qwen1.5-MoE, Qwen2-57B-A14B): qwen2 attention (``qkv_bias``), routed experts as
  above plus one shared expert of ``shared_expert_intermediate_size`` scaled by
  ``sigmoid(shared_expert_gate(x))`` (megatron-core ``SharedExpertMLP`` with ``gate=True``).
- ``mixtral``: llama attention, ``num_local_experts`` experts of ``intermediate_size``, softmax
  router, top-k always renormalised.
- ``deepseek_v3`` (DeepSeek-V3 / R1, Kimi K2, Moonlight-16B-A3B): multi-head latent attention
  (megatron-core ``MLATransformerConfig``, :func:`mla_layout`), the first
  ``first_k_dense_replace`` layers dense, the others MoE with ``n_shared_experts`` shared experts
  and a sigmoid router whose top-k choice adds ``e_score_correction_bias`` (megatron-core's
  ``expert_bias``) and is limited to ``topk_group`` of ``n_group`` groups, weights renormalised
  and scaled by ``routed_scaling_factor``. The multi-token-prediction layers
  (``num_nextn_predict_layers``) are ignored: they feed no logprob of the main head, the bridge
  neither imports nor exports them (SGLang's loader skips layers >= num_hidden_layers when not
  loading a draft model), see docs/design.md §2.1.
- ``deepseek_v2`` (DeepSeek-V2-Lite; DeepSeek-V2 / V2.5 where their group limit maps, see
  :func:`_deepseek_v2_moe_layout`): DeepSeek-V3's attention (MLA) and layer plan (dense first
  layers, ungated shared experts), with V2's router: softmax over all experts, the top k kept as
  they are (never renormalised: ``norm_topk_prob`` must be false) and scaled by
  ``routed_scaling_factor``; ``topk_method`` ``greedy`` (plain top-k) or ``group_limited_greedy``
  (``topk_group`` of ``n_group`` groups, a group ranked by its best expert). No score-correction bias.
- ``glm4_moe`` (GLM-4.5, GLM-4.5-Air, GLM-4.6): GQA attention with a q/k/v bias when
  ``attention_bias`` (o_proj has none), per-head q/k RMSNorm when ``use_qk_norm``, RoPE on the
  first ``partial_rotary_factor`` of each head (megatron-core ``rotary_percent``, rotate-half as
  transformers' ``apply_rotary_pos_emb``); the MLP side is DeepSeek-V3's (first
  ``first_k_dense_replace`` layers dense, sigmoid router with ``e_score_correction_bias``, grouped
  top-k, ``routed_scaling_factor``, ``n_shared_experts`` ungated shared experts). Its MTP layers
  (``num_nextn_predict_layers``, checkpoint layers >= ``num_hidden_layers``) are ignored as
  DeepSeek-V3's (SGLang's glm4_moe ``load_weights`` skips them when not loading a draft model).

ModelConfig is a config section: this module loads without torch and megatron-core (a config check
never loads them, tests/unit/config/test_torch_free.py); the functions that need torch get it from
:func:`_torch`, megatron-core where they use it.

Anything this module cannot map exactly (another activation, a RoPE scaling type
megatron-core 0.19 does not implement, sliding-window attention, ...) raises a
``ValueError`` naming the HF config field, so that a model never builds with silently
different numerics.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any, Optional

from packaging.version import Version

if TYPE_CHECKING:
    import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3",
                         "glm4_moe")
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3", "glm4_moe")
# families whose router is DeepSeek-V3's: sigmoid scores, + e_score_correction_bias for the choice,
# grouped top-k, routed_scaling_factor; shared experts without a gate; first_k_dense_replace dense layers
DEEPSEEK_ROUTER_TYPES = ("deepseek_v3", "glm4_moe")
# the dense family whose attention block each MoE family shares (q/k norm, qkv bias); "glm": GQA whose
# qkv bias (attention_bias) and q/k norm (use_qk_norm) are per config, with partial rotary
ATTENTION_FAMILY = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3",
                    "qwen2_moe": "qwen2", "mixtral": "llama", "deepseek_v2": "mla", "deepseek_v3": "mla",
                    "glm4_moe": "glm"}
MOE_DISPATCHERS = ("alltoall", "allgather")
# The model class of each supported model_type, written to config.json's "architectures": serving
# engines pick the class from it and refuse a checkpoint without it (SGLang 0.5.23
# srt/model_loader/utils.py:201 get_model_architecture reads hf_config.architectures, and
# srt/models/registry.py:134-145 keys its registry by each models/*.py EntryClass.__name__; vLLM's
# ModelRegistry by the same names in vllm/model_executor/models/registry.py _TEXT_GENERATION_MODELS).
# A config read from a GGUF file or built here (the upcycled MixtralConfig) has none.
# tests/unit/models/test_architectures.py checks each name against transformers, SGLang and vLLM.
CAUSAL_LM_ARCHITECTURE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                          "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                          "mixtral": "MixtralForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                          "deepseek_v3": "DeepseekV3ForCausalLM",
                          "glm4_moe": "Glm4MoeForCausalLM"}
MOE_LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
FP8_FORMATS = ("e4m3", "hybrid")
# Minimum Transformer Engine version for each FP8 recipe, as megatron-core itself requires them
# in ``megatron.core.fp8_utils.get_fp8_recipe`` (delayed works on any TE): 0.19.2 :714, the gates
# at :732-748, unchanged from core_v0.16.1 :536, :554-570. The recipes are TE's
# ``common/recipe/__init__.py`` classes DelayedScaling, Float8CurrentScaling, Float8BlockScaling,
# MXFP8BlockScaling, the same names in TE 2.11 (:121, :224, :306, :265) and 2.20 (:173, :286, :392, :337).
FP8_RECIPE_MIN_TE = {"delayed": "1.0", "tensorwise": "2.2.0.dev0", "blockwise": "2.3.0.dev0", "mxfp8": "2.1.0"}
# Minimum CUDA compute capability: FP8 GEMMs need Ada/Hopper (8.9, TE's
# ``check_fp8_support``); MXFP8 needs Blackwell (SM 10.0, TE MXFP8 docs); FP8 block scaling
# has Hopper kernels (SM 9.0, TE ``check_fp8_block_scaling_support``).
FP8_RECIPE_MIN_CC = {"delayed": (8, 9), "tensorwise": (8, 9), "blockwise": (9, 0), "mxfp8": (10, 0)}
TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")
# params_dtype -> the name of its torch dtype
_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16",
           "fp16": "float16"}


def _torch():
    """The torch module, imported on first use."""
    import torch  # here, not at the top: ModelConfig is a config section, and the config loads without torch

    return torch


@dataclass
class ModelConfig:
    """What to build and how (megatron-core / Megatron-LM argument names where they exist)."""

    hf_path: Optional[str] = None
    """HF model directory (config.json + safetensors) or a directory holding a GGUF file; ``None``
    when the caller passes an HF config object directly."""
    gguf_file: Optional[str] = None
    """file name of the GGUF inside ``hf_path`` (e.g. SmolLM2's
    ``SmolLM2-135M-Instruct.Q4_1.gguf``); ``None`` for safetensors."""
    params_dtype: str = "float32"
    """dtype of the Megatron parameters: "float32", "bfloat16" or "float16"."""
    make_vocab_size_divisible_by: int = 128
    """the embedding/output rows are padded to a multiple of ``make_vocab_size_divisible_by × TP``
    (Megatron-LM convention)."""
    transformer_impl: str = "auto"
    """"local" (megatron-core modules, works on CPU), "transformer_engine" (TE spec, CUDA only) or
    "auto" (TE when CUDA and TE are available)."""
    fp8: Optional[str] = None
    """None, "e4m3" or "hybrid" (``TransformerConfig.fp8``); needs TE and CUDA compute capability ≥
    8.9."""
    fp8_recipe: str = "delayed"
    """"delayed", "tensorwise", "mxfp8" or "blockwise" (``TransformerConfig.fp8_recipe``), checked
    against the installed TE version."""
    first_last_layers_bf16: bool = False
    """keep the first/last layers out of FP8."""
    num_layers_at_start_in_bf16: int = 1
    """how many first layers stay out of FP8 when ``first_last_layers_bf16``."""
    num_layers_at_end_in_bf16: int = 1
    """how many last layers stay out of FP8 when ``first_last_layers_bf16``."""
    pad_query_groups: bool = True
    """when TP does not divide the KV heads (SmolLM2: 3 KV heads at TP=2), add all-zero query groups
    (q/k/v rows and o_proj columns) up to a multiple of TP. Exact: a zero group's output is
    multiplied by zero o_proj columns, and its gradients are exactly zero, so it stays zero under
    AdamW. The bridge adds the groups on import and drops them on export. False: raise instead."""
    query_groups_multiple: Optional[int] = None
    """pad query groups to a multiple of lcm(TP, this) (set it to the saving run's padded group
    count to reload a padded checkpoint at another TP)."""
    moe_token_dispatcher_type: str = "alltoall"
    """MoE models only: megatron-core's token dispatcher, "alltoall" (tokens to the expert-parallel
    rank that holds their experts; verl / slime's choice for EP > 1) or "allgather"."""
    moe_grouped_gemm: Optional[bool] = None
    """MoE models only: run each rank's experts as one grouped GEMM (``TEGroupedMLP``, needs the TE
    spec); None: on with ``transformer_impl`` resolving to "transformer_engine", off with "local"
    (per-expert ``SequentialMLP``, the CPU path)."""
    moe_aux_loss_coeff: Optional[float] = None
    """MoE models only: load-balancing loss coefficient (``TransformerConfig.moe_aux_loss_coeff``);
    None: the HF config's ``router_aux_loss_coef``; 0 turns the loss off."""
    moe_router_load_balancing_type: str = "aux_loss"
    """MoE models only: "aux_loss" (GShard / Switch loss per micro-batch, HF's
    ``load_balancing_loss_func``), "seq_aux_loss", "global_aux_loss" or "none"."""
    moe_router_bias_update_rate: float = 0.0
    """DeepSeek-V3-style routers only (``e_score_correction_bias``): megatron-core's aux-loss-free
    balancing step, ``bias += rate · sign(mean load − load)`` per expert after every optimizer step
    (``TransformerConfig.moe_router_bias_update_rate``, distributed/finalize_model_grads.py
    ``_update_router_expert_bias``). 0 (default) keeps the pretrained bias: RL fine-tunes a balanced
    router, and the bias is state the engine routes with (docs/design.md §2.1). > 0 updates it,
    and the weight sync and the checkpoint carry the new bias."""
    extra_transformer_config: dict[str, Any] = field(default_factory=dict)
    """further ``TransformerConfig`` fields, set last (expert use)."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad field: a value outside its domain, or FP8 settings
        that contradict each other. What needs the machine or the model (CUDA, TE version, layer
        count) is checked by :func:`resolve_transformer_impl` / :func:`validate_fp8`, and the
        paths by ``DAPOConfig.check_inputs``."""
        if self.gguf_file is not None and not self.gguf_file.strip():
            raise ValueError("gguf_file='' must name the GGUF file inside hf_path, or be null for safetensors")
        if self.params_dtype not in _DTYPES:
            raise ValueError(f"params_dtype={self.params_dtype!r} must be one of 'float32', 'bfloat16', 'float16' "
                             "(or fp32, bf16, fp16)")
        if self.make_vocab_size_divisible_by < 1:
            raise ValueError(f"make_vocab_size_divisible_by={self.make_vocab_size_divisible_by} must be >= 1")
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            raise ValueError(f"transformer_impl={self.transformer_impl!r} must be one of {TRANSFORMER_IMPLS} "
                             "('local' on CPU)")
        if self.fp8 is not None and self.fp8 not in FP8_FORMATS:
            raise ValueError(f"fp8={self.fp8!r} must be null, 'e4m3' or 'hybrid'")
        if self.fp8_recipe not in FP8_RECIPE_MIN_TE:
            raise ValueError(f"fp8_recipe={self.fp8_recipe!r} must be one of {sorted(FP8_RECIPE_MIN_TE)}")
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.query_groups_multiple is not None and self.query_groups_multiple < 1:
            raise ValueError(f"query_groups_multiple={self.query_groups_multiple} must be >= 1, or null")
        # MoE keys whose domain needs no HF config (EP against the experts is check_moe_layout's)
        if self.moe_token_dispatcher_type not in MOE_DISPATCHERS:
            raise ValueError(f"moe_token_dispatcher_type={self.moe_token_dispatcher_type!r} must be one of "
                             f"{MOE_DISPATCHERS}")
        if self.moe_router_load_balancing_type not in MOE_LOAD_BALANCING:
            raise ValueError(f"moe_router_load_balancing_type={self.moe_router_load_balancing_type!r} must be one "
                             f"of {MOE_LOAD_BALANCING}")
        if not self.moe_router_bias_update_rate >= 0:
            raise ValueError(f"moe_router_bias_update_rate={self.moe_router_bias_update_rate} must be >= 0")
        if self.moe_aux_loss_coeff is not None and not self.moe_aux_loss_coeff >= 0:
            raise ValueError(f"moe_aux_loss_coeff={self.moe_aux_loss_coeff} must be >= 0 (or null: the HF "
                             "config's router_aux_loss_coef)")
        if self.moe_grouped_gemm and self.transformer_impl == "local":
            raise ValueError("moe_grouped_gemm=true needs transformer_impl='transformer_engine' (TEGroupedMLP, "
                             "CUDA); the local spec runs one MLP per expert: set it to null or false")
        if self.fp8 is not None:  # the contradictions validate_fp8 would meet after the model config is read
            if self.transformer_impl == "local":
                raise ValueError(f"fp8={self.fp8!r} needs transformer_impl='transformer_engine' (or 'auto'), got "
                                 "'local'; set fp8: null for the local spec")
            if self.first_last_layers_bf16 and self.fp8_recipe == "delayed":
                raise ValueError("first_last_layers_bf16=True does not work with fp8_recipe='delayed' (megatron-core "
                                 "rejects it); use 'tensorwise', 'blockwise' or 'mxfp8'")

    def check_inputs(self) -> None:
        """Raise ``ValueError`` (``field=value ...``) unless the model's files are on this machine
        and its implementation can run here, checked in a second or less, before any process
        group or model exists:

        * ``hf_path`` is a directory holding ``config.json`` (safetensors) or ``gguf_file``
          (the ``.gguf`` files found there are listed);
        * ``extra_transformer_config`` names fields of megatron-core's ``TransformerConfig``
          (imported only when it is set);
        * ``transformer_impl='transformer_engine'`` or ``fp8`` has CUDA and Transformer Engine
          (``torch.cuda.is_available()``: no CUDA context is created; the compute capability
          and TE version per recipe are :func:`validate_fp8`'s, at model build).
        """
        path = self.hf_path
        if path is None:
            raise ValueError("hf_path is required: an HF model directory or a directory holding gguf_file")
        if not os.path.isdir(path):
            hint = " (a .gguf file: set hf_path to its directory and gguf_file to its name)" \
                if path.endswith(".gguf") and os.path.isfile(path) else ""
            raise ValueError(f"hf_path={path!r} is not a directory{hint}: give a local HF model directory "
                             "(config.json + safetensors) or a directory holding gguf_file")
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if self.gguf_file is not None:
            if not os.path.isfile(os.path.join(path, self.gguf_file)):
                close = difflib.get_close_matches(self.gguf_file, ggufs, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else (f"; it holds {ggufs}" if ggufs else "")
                raise ValueError(f"gguf_file={self.gguf_file!r} is not a file in model.hf_path={path!r}{hint}")
        elif not os.path.isfile(os.path.join(path, "config.json")):
            hint = f"; for a GGUF model set gguf_file to one of {ggufs}" if ggufs else ""
            raise ValueError(f"hf_path={path!r} has no config.json (an HF model directory has config.json and "
                             f"safetensors){hint}")
        if self.extra_transformer_config:
            # megatron-core here, not at the top: models/ and actor/ hold config sections, and the config loads without it
            from megatron.core.transformer import TransformerConfig

            names = {f.name for f in dataclasses.fields(TransformerConfig)}
            for key in self.extra_transformer_config:
                if key not in names:
                    close = difflib.get_close_matches(key, sorted(names), n=1)
                    raise ValueError(f"extra_transformer_config.{key} is not a field of megatron-core's "
                                     "TransformerConfig" + (f"; did you mean {close[0]!r}?" if close else ""))
        needs = "fp8" if self.fp8 is not None else \
            "transformer_impl" if self.transformer_impl == "transformer_engine" else None
        if needs is not None:
            value = getattr(self, needs)
            if not _torch().cuda.is_available():
                raise ValueError(f"{needs}={value!r} needs a CUDA GPU, none is visible; on CPU set "
                                 + ("fp8: null" if needs == "fp8" else "transformer_impl: local"))
            if _te_version() is None:
                raise ValueError(f"{needs}={value!r} needs Transformer Engine, which is not installed (the docker/ "
                                 "image has it)")

    def torch_dtype(self) -> torch.dtype:
        """``params_dtype`` as a ``torch.dtype``; ValueError naming ``model.params_dtype``."""
        if self.params_dtype not in _DTYPES:
            raise ValueError(f"model.params_dtype={self.params_dtype!r} is not one of {sorted(_DTYPES)}")
        return getattr(_torch(), _DTYPES[self.params_dtype])


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tp: int = 1) -> int:
    """Vocabulary size padded to a multiple of ``divisible_by × tp`` (Megatron-LM
    ``_vocab_size_with_padding``).

    Raises:
        ValueError: a non-positive argument.
    """
    if vocab_size <= 0 or divisible_by <= 0 or tp <= 0:
        raise ValueError(
            f"padded_vocab_size needs positive vocab_size, make_vocab_size_divisible_by and TP, "
            f"got {vocab_size}, {divisible_by}, {tp}"
        )
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def _version(v: str):
    return Version(v)


def _te_version() -> Optional[str]:
    """Installed Transformer Engine version, or None (monkeypatched in tests)."""
    for dist_name in ("transformer-engine", "transformer-engine-torch"):
        try:
            return version(dist_name)
        except PackageNotFoundError:
            continue
    if _torch().cuda.is_available():  # source builds (some NGC images) may lack dist metadata
        try:  # Transformer Engine: GPU only
            import transformer_engine

            return transformer_engine.__version__
        except (ImportError, AttributeError):
            return None
    return None


def _cuda_capability() -> Optional[tuple[int, int]]:
    """(major, minor) of the current CUDA device, or None without CUDA (monkeypatched in tests)."""
    torch = _torch()
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability())


def resolve_transformer_impl(model_cfg: ModelConfig) -> str:
    """"local" or "transformer_engine" for ``model_cfg.transformer_impl`` on this machine.

    Raises:
        ValueError: an unknown value, or "transformer_engine" without CUDA or TE.
    """
    impl = model_cfg.transformer_impl
    if impl not in TRANSFORMER_IMPLS:
        raise ValueError(
            f"model.transformer_impl={impl!r}: use 'local', 'transformer_engine' or 'auto'"
        )
    has_te = _te_version() is not None
    has_cuda = _cuda_capability() is not None
    if impl == "auto":
        return "transformer_engine" if (has_te and has_cuda) else "local"
    if impl == "transformer_engine" and not (has_te and has_cuda):
        raise ValueError(
            "model.transformer_impl='transformer_engine' needs CUDA and Transformer Engine "
            f"(CUDA available: {has_cuda}, TE installed: {has_te}); use 'local' on CPU"
        )
    return impl


def validate_fp8(model_cfg: ModelConfig, num_layers: int, pipeline_model_parallel_size: int = 1) -> None:
    """Check that the FP8 settings can run here; no-op when ``model_cfg.fp8`` is None.

    Raises:
        ValueError: naming ``model.fp8`` (no CUDA, compute capability < 8.9, TE missing,
            unknown format), ``model.fp8_recipe`` (unknown, TE too old, GPU too old) or
            ``model.num_layers_at_*_in_bf16`` (negative or covering all layers).
    """
    if model_cfg.fp8 is None:
        return
    if model_cfg.fp8 not in FP8_FORMATS:
        raise ValueError(f"model.fp8={model_cfg.fp8!r}: use None, 'e4m3' or 'hybrid'")
    recipe = model_cfg.fp8_recipe
    if recipe not in FP8_RECIPE_MIN_TE:
        raise ValueError(f"model.fp8_recipe={recipe!r}: use one of {sorted(FP8_RECIPE_MIN_TE)}")
    cc = _cuda_capability()
    if cc is None:
        raise ValueError("model.fp8 needs a CUDA GPU with compute capability >= 8.9; set model.fp8=null on CPU")
    te = _te_version()
    if te is None:
        raise ValueError("model.fp8 needs Transformer Engine (pip install -e .[gpu] or the NGC image); "
                         "set model.fp8=null")
    if model_cfg.transformer_impl == "local":
        raise ValueError("model.fp8 needs model.transformer_impl='transformer_engine' (or 'auto')")
    if cc < (8, 9):
        raise ValueError(f"model.fp8 needs compute capability >= 8.9, this GPU has {cc[0]}.{cc[1]}")
    need_cc = FP8_RECIPE_MIN_CC[recipe]
    if cc < need_cc:
        raise ValueError(
            f"model.fp8_recipe={recipe!r} needs compute capability >= {need_cc[0]}.{need_cc[1]}, "
            f"this GPU has {cc[0]}.{cc[1]}; use 'delayed' or 'tensorwise'"
        )
    need_te = FP8_RECIPE_MIN_TE[recipe]
    if _version(te) < _version(need_te):
        raise ValueError(
            f"model.fp8_recipe={recipe!r} needs Transformer Engine >= {need_te}, installed {te}"
        )
    if model_cfg.first_last_layers_bf16:
        if recipe == "delayed":
            raise ValueError("model.first_last_layers_bf16=True does not work with model.fp8_recipe='delayed' "
                             "(megatron-core rejects it); use 'tensorwise', 'blockwise' or 'mxfp8'")
        start, end = model_cfg.num_layers_at_start_in_bf16, model_cfg.num_layers_at_end_in_bf16
        per_stage = num_layers // pipeline_model_parallel_size
        for name, value in (("num_layers_at_start_in_bf16", start), ("num_layers_at_end_in_bf16", end)):
            if not 0 <= value <= per_stage:
                raise ValueError(f"model.{name}={value} must be between 0 and the layers per pipeline stage "
                                 f"({per_stage})")
        if start + end >= num_layers:
            raise ValueError(
                f"model.num_layers_at_start_in_bf16 + num_layers_at_end_in_bf16 = {start + end} leaves no FP8 "
                f"layer of {num_layers}; lower them or set model.fp8=null"
            )


def _get(hf_config, name: str, default=None):
    return getattr(hf_config, name, default)


def rope_parameters(hf_config) -> dict:
    """RoPE settings of an HF config as one dict with ``rope_theta`` and ``rope_type``.

    Accepts transformers v5 (``rope_parameters``) and v4 (``rope_theta`` + ``rope_scaling``).
    """
    params = dict(_get(hf_config, "rope_parameters") or {})
    scaling = _get(hf_config, "rope_scaling")
    if scaling and not params.get("rope_type"):
        params.update(scaling)
    if "rope_theta" not in params:
        params["rope_theta"] = _get(hf_config, "rope_theta", 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def gpt_rope_kwargs(hf_config) -> dict:
    """RoPE arguments of ``megatron.core.models.gpt.GPTModel`` for an HF config.

    Returns:
        dict with ``rotary_base`` (θ), ``rotary_percent`` (1.0; GLM's ``partial_rotary_factor``,
        see :func:`partial_rotary_factor`), ``rope_scaling`` (bool, llama3),
        ``rope_scaling_factor`` and ``seq_len_interpolation_factor`` (linear).

    Raises:
        ValueError: naming ``rope_parameters.<field>`` for a scaling type or parameter
            megatron-core cannot reproduce exactly (its llama3 scaling hard-codes
            low_freq_factor=1, high_freq_factor=4, original_max_position_embeddings=8192);
            ``partial_rotary_factor`` != 1 outside GLM, or with a scaled RoPE.
    """
    p = rope_parameters(hf_config)
    out = dict(rotary_base=float(p["rope_theta"]), rotary_percent=1.0, rope_scaling=False,
               rope_scaling_factor=8.0, seq_len_interpolation_factor=None)
    kind = p["rope_type"]
    partial = partial_rotary_factor(hf_config)
    if partial != 1.0:
        if ATTENTION_FAMILY.get(_get(hf_config, "model_type")) != "glm":
            raise ValueError("hf_config.partial_rotary_factor != 1 is not supported")
        if kind != "default":
            raise ValueError(f"hf_config.rope_parameters.rope_type={kind!r} with partial_rotary_factor={partial} is "
                             "not supported (GLM: default RoPE only)")
        out["rotary_percent"] = partial
    if kind == "default":
        return out
    if kind == "linear":
        out["seq_len_interpolation_factor"] = float(p["factor"])
        return out
    if kind == "llama3":
        fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for key, want in fixed.items():
            if float(p.get(key, want)) != want:
                raise ValueError(
                    f"hf_config.rope_parameters.{key}={p.get(key)} : megatron-core's llama3 RoPE scaling "
                    f"is fixed at {key}={want}; this model cannot be built exactly"
                )
        out["rope_scaling"] = True
        out["rope_scaling_factor"] = float(p["factor"])
        return out
    raise ValueError(
        f"hf_config.rope_parameters.rope_type={kind!r} is not supported (supported: default, linear, llama3)"
    )


def partial_rotary_factor(hf_config) -> float:
    """The fraction of each head that RoPE rotates (transformers 5 keeps it in ``rope_parameters``,
    v4 as a config attribute; 1.0 when absent).

    For GLM (transformers ``Glm4MoeRotaryEmbedding``: ``dim = int(head_dim · factor)``, the first
    ``dim`` channels of each head rotated half against half, the rest passed through) this is
    megatron-core's ``rotary_percent`` (``RotaryEmbedding``: ``dim = int(kv_channels ·
    rotary_percent)``, rotary_pos_embedding.py:73-74; ``_apply_rotary_pos_emb_bshd`` rotates
    ``t[..., :rot_dim]`` and passes the rest, rope_utils.py:121-124).

    Raises:
        ValueError: a factor outside (0, 1], or one whose rotated size ``head_dim · factor`` is not
            an even integer (transformers truncates it, megatron-core too, but odd sizes pair channels
            differently)."""
    factor = (rope_parameters(hf_config).get("partial_rotary_factor") or
              _get(hf_config, "partial_rotary_factor", None) or 1.0)
    factor = float(factor)
    if not 0.0 < factor <= 1.0:
        raise ValueError(f"hf_config.partial_rotary_factor={factor} must be in (0, 1]")
    if factor != 1.0 and ATTENTION_FAMILY.get(_get(hf_config, "model_type")) not in ("mla",):
        rotated = head_dim(hf_config) * factor
        if rotated != int(rotated) or int(rotated) % 2:
            raise ValueError(f"hf_config.partial_rotary_factor={factor} rotates {rotated} of head_dim="
                             f"{head_dim(hf_config)} channels: it must be an even whole number")
    return factor


def mla_rope_kwargs(hf_config) -> dict:
    """The RoPE fields of megatron-core's ``MLATransformerConfig`` for an MLA HF config (the MLA
    layer builds its own rotary embedding from them, multi_latent_attention.py:180-204).

    ``default`` RoPE is ``rope_type='rope'``; ``yarn`` (DeepSeek-V3, Kimi K2) is megatron-core's
    ``YarnRotaryEmbedding`` with the HF ``factor``, ``original_max_position_embeddings``,
    ``beta_fast`` / ``beta_slow`` (HF defaults 32 / 1), ``mscale`` / ``mscale_all_dim``: the cos/sin
    scale ``m(f, mscale) / m(f, mscale_all_dim)`` (transformers modeling_rope_utils.py
    ``_compute_yarn_parameters``; megatron-core yarn_rotary_pos_embedding.py
    ``_yarn_get_concentration_factor``) and the softmax scale ``m(f, mscale_all_dim)² / √d``
    (HF DeepseekV3Attention ``yarn_apply_mscale``; megatron-core multi_latent_attention.py:177-178).

    Raises:
        ValueError: naming the ``rope_parameters`` field: another scaling type, an explicit
            ``attention_factor``, ``truncate=False`` (megatron-core rounds the correction range,
            ``correction_range_round_to_int``), or ``mscale`` without ``mscale_all_dim`` (HF then
            ignores ``mscale``).
    """
    p = rope_parameters(hf_config)
    if partial_rotary_factor(hf_config) != 1.0:
        raise ValueError("hf_config.partial_rotary_factor != 1 is not supported for MLA")
    out = dict(rope_type="rope", rotary_base=float(p["rope_theta"]), rotary_percent=1.0)
    kind = p["rope_type"]
    if kind == "default":
        return out
    if kind != "yarn":
        raise ValueError(f"hf_config.rope_parameters.rope_type={kind!r} is not supported for MLA (default, yarn)")
    if p.get("attention_factor") is not None:
        raise ValueError("hf_config.rope_parameters.attention_factor is not supported: megatron-core derives the "
                         "YaRN scale from factor, mscale and mscale_all_dim")
    if not p.get("truncate", True):
        raise ValueError("hf_config.rope_parameters.truncate=False is not supported (megatron-core rounds the YaRN "
                         "correction range)")
    mscale, mscale_all = float(p.get("mscale") or 1.0), float(p.get("mscale_all_dim") or 0.0)
    if not mscale_all and mscale != 1.0:
        raise ValueError(f"hf_config.rope_parameters.mscale={mscale} without mscale_all_dim: transformers ignores "
                         "mscale then, megatron-core does not")
    factor = p.get("factor")
    if factor is None:  # transformers' DeepSeek fallback (_compute_yarn_parameters)
        factor = hf_config.max_position_embeddings / p["original_max_position_embeddings"]
    out.update(rope_type="yarn", rotary_scaling_factor=float(factor),
               original_max_position_embeddings=int(p["original_max_position_embeddings"]),
               beta_fast=float(p.get("beta_fast") or 32), beta_slow=float(p.get("beta_slow") or 1),
               mscale=mscale, mscale_all_dim=mscale_all)
    return out


def check_hf_config(hf_config) -> str:
    """Validate that an HF config is one this package builds; returns its model_type.

    Raises:
        ValueError: naming the HF config field that does not fit.
    """
    model_type = _get(hf_config, "model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"hf_config.model_type={model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
        )
    attention = ATTENTION_FAMILY[model_type]
    if _get(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hf_config.hidden_act={hf_config.hidden_act!r}: only 'silu' (SwiGLU) is supported")
    if _get(hf_config, "mlp_bias", False):
        raise ValueError("hf_config.mlp_bias=True is not supported")
    if attention in ("llama", "qwen3") and _get(hf_config, "attention_bias", False):
        # HF then also puts a bias on o_proj, which megatron-core's linear_proj cannot hold alone
        raise ValueError(f"hf_config.attention_bias=True is not supported for {model_type}")
    if model_type == "qwen2_moe" and not _get(hf_config, "qkv_bias", True):
        raise ValueError("hf_config.qkv_bias=False is not supported for qwen2_moe (the rule table maps its q/k/v bias)")
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and _get(hf_config, "use_sliding_window", False):
        raise ValueError(f"hf_config.use_sliding_window=True is not supported for {model_type}")
    if model_type == "mixtral" and _get(hf_config, "sliding_window") is not None:
        raise ValueError(f"hf_config.sliding_window={hf_config.sliding_window} is not supported for mixtral "
                         "(megatron-core's local attention has no sliding window); set it to null")
    if attention == "mla":
        mla_layout(hf_config)  # raises on what megatron-core's MLA cannot reproduce
        mla_rope_kwargs(hf_config)
    else:
        gpt_rope_kwargs(hf_config)  # raises on a RoPE megatron-core cannot reproduce (partial rotary: GLM only)
    heads, groups = hf_config.num_attention_heads, _kv_heads(hf_config)
    if heads % groups != 0:
        raise ValueError(
            f"hf_config.num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}"
        )
    if model_type in MOE_MODEL_TYPES:
        moe_layout(hf_config)  # raises on what the MoE mapping cannot build
    return model_type


@dataclass(frozen=True)
class MoELayout:
    """The mixture-of-experts facts of an HF config (every decoder layer is an MoE layer).

    Attributes:
        num_experts: routed experts per layer (``num_experts`` / Mixtral ``num_local_experts``).
        topk: experts per token (``num_experts_per_tok``).
        ffn_hidden_size: one routed expert's FFN size (``moe_intermediate_size``; Mixtral
            ``intermediate_size``).
        shared_ffn_hidden_size: the shared expert's FFN size (qwen2_moe
            ``shared_expert_intermediate_size``), 0 without one.
        shared_expert_gate: the shared expert's output is scaled by
            ``sigmoid(x · shared_expert_gate)`` (qwen2_moe).
        norm_topk_prob: the top-k probabilities are renormalised to sum to 1 (Mixtral always;
            Qwen ``norm_topk_prob``).
        aux_loss_coef: HF ``router_aux_loss_coef``.
        score_function: "softmax" or "sigmoid" (DeepSeek-V3: ``sigmoid(logits)``).
        expert_bias: the router adds a per-expert bias (HF ``e_score_correction_bias``) to the
            scores it chooses the top k by (not to the weights): megatron-core ``expert_bias``.
        num_groups, group_topk: grouped top-k (HF ``n_group`` / ``topk_group``), None when every
            group is kept (``topk_group == n_group``: the group mask selects all experts).
        scaling_factor: the top-k weights are multiplied by it (HF ``routed_scaling_factor``), None for 1.
        dense_layers: 0-based indices of the dense (non-MoE) layers (HF ``first_k_dense_replace``).
        dense_ffn_hidden_size: their FFN size (HF ``intermediate_size``), 0 without dense layers.
    """

    num_experts: int
    topk: int
    ffn_hidden_size: int
    shared_ffn_hidden_size: int
    shared_expert_gate: bool
    norm_topk_prob: bool
    aux_loss_coef: float
    score_function: str = "softmax"
    expert_bias: bool = False
    num_groups: Optional[int] = None
    group_topk: Optional[int] = None
    scaling_factor: Optional[float] = None
    dense_layers: tuple[int, ...] = ()
    dense_ffn_hidden_size: int = 0

    def moe_layer_pattern(self, num_layers: int) -> list[int]:
        """megatron-core's ``moe_layer_freq`` list: 1 for an MoE layer, 0 for a dense one."""
        return [0 if i in self.dense_layers else 1 for i in range(num_layers)]


def _check_topk(topk: int, experts: int) -> None:
    """Raises ValueError unless ``1 <= num_experts_per_tok <= experts`` (every MoE family's router)."""
    if not 1 <= topk <= experts:
        raise ValueError(f"hf_config.num_experts_per_tok={topk} must be between 1 and the {experts} experts")


def _router_groups(hf_config: Any, experts: int) -> tuple[int, int]:
    """``(n_group, topk_group)`` of a DeepSeek router (1 each when unset). Raises ValueError unless
    ``n_group`` divides ``experts`` and ``1 <= topk_group <= n_group``."""
    n_group, topk_group = int(_get(hf_config, "n_group", 1) or 1), int(_get(hf_config, "topk_group", 1) or 1)
    if experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"hf_config.n_group={n_group}, topk_group={topk_group}: n_group must divide the {experts} "
                         "experts and 1 <= topk_group <= n_group")
    return n_group, topk_group


def _deepseek_moe_layout(hf_config) -> MoELayout:
    """:class:`MoELayout` of a DeepSeek-V3-router config (transformers 5 ``DeepseekV3TopkRouter`` /
    ``DeepseekV3MoE``): ``sigmoid(x·Wᵀ)`` in fp32; the choice ranks ``scores + e_score_correction_bias``,
    first by group (the sum of each group's top-2), keeping ``topk_group`` groups, then the top k
    experts of those; the weights are the chosen *unbiased* scores, divided by their sum
    (``norm_topk_prob``) and multiplied by ``routed_scaling_factor``; a shared expert of
    ``n_shared_experts × moe_intermediate_size`` is added ungated. megatron-core 0.19.2 does the same
    in ``moe_utils.topk_routing_with_score_function`` (sigmoid branch, ``expert_bias``: :853-861)
    with ``group_limited_topk`` (:617-668) ranking a group by its top ``topk / group_topk`` scores,
    where HF hard-codes the top 2: the two agree when ``topk / topk_group == 2`` (DeepSeek-V3: 8 / 4),
    or when every group is kept (Moonlight, Kimi K2, GLM-4.5: ``n_group == topk_group``), which is
    plain top-k. megatron-core always renormalises a sigmoid top-k (k > 1, :863), so
    ``norm_topk_prob=False`` is refused."""
    experts = int(_get(hf_config, "n_routed_experts", None) or _get(hf_config, "num_local_experts"))
    topk = int(hf_config.num_experts_per_tok)
    _check_topk(topk, experts)
    if not bool(_get(hf_config, "norm_topk_prob", True)) and topk > 1:
        raise ValueError("hf_config.norm_topk_prob=False is not supported with the sigmoid router: megatron-core "
                         "renormalises the top-k sigmoid weights always (moe_utils.py topk_routing_with_score_function)")
    method = _get(hf_config, "topk_method", "noaux_tc")
    if method not in (None, "noaux_tc"):
        raise ValueError(f"hf_config.topk_method={method!r}: only 'noaux_tc' (sigmoid + score-correction bias, "
                         "grouped top-k) is supported for this family")
    scoring = _get(hf_config, "scoring_func", "sigmoid")
    if scoring not in (None, "sigmoid"):
        raise ValueError(f"hf_config.scoring_func={scoring!r}: this family's router is sigmoid")
    n_group, topk_group = _router_groups(hf_config, experts)
    groups = group_topk = None
    if topk_group < n_group:
        if topk % topk_group or topk // topk_group != 2:
            raise ValueError(f"hf_config.num_experts_per_tok={topk} / topk_group={topk_group} must be 2: transformers "
                             "ranks a group by its top-2 scores, megatron-core by its top (topk / topk_group)")
        groups, group_topk = n_group, topk_group
    return MoELayout(num_experts=experts, topk=topk, norm_topk_prob=True, score_function="sigmoid", expert_bias=True,
                     num_groups=groups, group_topk=group_topk, **_deepseek_layer_plan(hf_config))


def _deepseek_layer_plan(hf_config) -> dict:
    """The layer plan DeepSeek-V2 and V3 share: ``n_shared_experts × moe_intermediate_size`` of
    ungated shared expert, the first ``first_k_dense_replace`` layers dense (FFN
    ``intermediate_size``), every later layer MoE (``moe_layer_freq`` 1). :class:`MoELayout` fields."""
    shared = int(_get(hf_config, "n_shared_experts", 0) or 0) * int(hf_config.moe_intermediate_size)
    first_dense = int(_get(hf_config, "first_k_dense_replace", 0) or 0)
    if not 0 <= first_dense < hf_config.num_hidden_layers:
        raise ValueError(f"hf_config.first_k_dense_replace={first_dense} must leave at least one MoE layer of "
                         f"{hf_config.num_hidden_layers}")
    if int(_get(hf_config, "moe_layer_freq", 1) or 1) != 1:
        raise ValueError(f"hf_config.moe_layer_freq={hf_config.moe_layer_freq}: only 1 (every layer after "
                         "first_k_dense_replace an MoE layer) is supported")
    scale = float(_get(hf_config, "routed_scaling_factor", 1.0) or 1.0)
    return dict(ffn_hidden_size=int(hf_config.moe_intermediate_size), shared_ffn_hidden_size=shared,
                shared_expert_gate=False, aux_loss_coef=float(_get(hf_config, "router_aux_loss_coef", 0.0) or 0.0),
                scaling_factor=None if scale == 1.0 else scale, dense_layers=tuple(range(first_dense)),
                dense_ffn_hidden_size=int(hf_config.intermediate_size) if first_dense else 0)


def _deepseek_v2_moe_layout(hf_config) -> MoELayout:
    """:class:`MoELayout` of a DeepSeek-V2 config (DeepSeek-V2-Lite: ``scoring_func: softmax``,
    ``topk_method: greedy``, ``norm_topk_prob: false``, ``n_group`` = ``topk_group`` = 1).

    What transformers 5.19.0 computes (models/deepseek_v2/modeling_deepseek_v2.py:97-116,
    ``DeepseekV2TopkRouter.forward``): ``softmax(x·Wᵀ)`` in fp32 over all experts; ``greedy``: the
    top k of those; ``group_limited_greedy``: each of ``n_group`` groups ranked by its BEST score
    (``.max(dim=-1)``), the ``topk_group`` best groups kept, the others' scores set to 0, then the top
    k; the weights are the chosen softmax probabilities times ``routed_scaling_factor``, never
    renormalised (the router has no ``norm_topk_prob``: modular_deepseek_v2.py:166 deletes it).
    SGLang's deepseek_v2 computes the same when ``norm_topk_prob`` is false (``grouped_topk``: group
    max, masked to 0; ``renormalize=config.norm_topk_prob``), always through its grouped top-k.

    megatron-core 0.19.2 (transformer/moe/moe_utils.py ``topk_routing_with_score_function``):
    ``moe_router_pre_softmax=True`` is the softmax over all experts before the top k, the weights
    the chosen probabilities (:840-846), times ``moe_router_topk_scaling_factor`` (:872-873, any
    score function); with ``moe_router_num_groups`` / ``moe_router_group_topk`` the choice is
    ``group_limited_topk`` (:617-672), which ranks a group by the SUM of its top
    ``topk // group_topk`` scores (:654-657) and masks the other groups with -inf. The two agree
    exactly when ``num_experts_per_tok // topk_group == 1`` (the sum of one score is the max).

    Raises:
        ValueError, naming the field: ``norm_topk_prob`` true (transformers never renormalises,
        SGLang would: the engines disagree), ``scoring_func`` other than softmax, ``topk_method``
        other than greedy / group_limited_greedy, ``greedy`` with a real group limit (transformers
        ignores the groups, SGLang applies them), a group limit megatron-core ranks differently
        (``num_experts_per_tok // topk_group`` != 1, DeepSeek-V2's 6 // 3) or whose kept groups hold
        fewer than k experts, and the layer-plan fields of :func:`_deepseek_layer_plan`.
    """
    experts = int(hf_config.n_routed_experts)
    topk = int(_get(hf_config, "num_experts_per_tok", 0) or 0)
    _check_topk(topk, experts)
    if bool(_get(hf_config, "norm_topk_prob", False)) and topk > 1:
        raise ValueError("hf_config.norm_topk_prob=True is not supported for deepseek_v2: transformers' "
                         "DeepseekV2TopkRouter never renormalises the top-k weights while SGLang's deepseek_v2 "
                         "would; set it to false (DeepSeek-V2 / V2-Lite's value)")
    scoring = _get(hf_config, "scoring_func", "softmax")
    if scoring not in (None, "softmax"):
        raise ValueError(f"hf_config.scoring_func={scoring!r}: DeepSeek-V2's router is softmax (a sigmoid router "
                         "with a score-correction bias is model_type 'deepseek_v3')")
    method = _get(hf_config, "topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"hf_config.topk_method={method!r}: deepseek_v2 supports 'greedy' and 'group_limited_greedy' "
                         "('noaux_tc', sigmoid with a score-correction bias, is model_type 'deepseek_v3')")
    n_group, topk_group = _router_groups(hf_config, experts)
    groups = group_topk = None
    if topk_group < n_group:
        if method == "greedy":
            raise ValueError(f"hf_config.topk_method='greedy' with n_group={n_group}, topk_group={topk_group}: "
                             "transformers ignores the groups for 'greedy', SGLang's deepseek_v2 limits them "
                             "(grouped top-k always); set topk_group = n_group, or topk_method='group_limited_greedy'")
        if topk // topk_group != 1:
            raise ValueError(f"hf_config.num_experts_per_tok={topk} // topk_group={topk_group} must be 1 for "
                             "topk_method='group_limited_greedy': transformers and SGLang rank a group by its best "
                             "expert, megatron-core by the sum of its top (num_experts_per_tok // topk_group) "
                             "(moe_utils.group_limited_topk)")
        if topk > topk_group * (experts // n_group):
            raise ValueError(f"hf_config.num_experts_per_tok={topk} exceeds the {topk_group * (experts // n_group)} "
                             f"experts of the topk_group={topk_group} kept groups")
        groups, group_topk = n_group, topk_group
    return MoELayout(num_experts=experts, topk=topk, norm_topk_prob=False, score_function="softmax",
                     expert_bias=False, num_groups=groups, group_topk=group_topk, **_deepseek_layer_plan(hf_config))


@dataclass(frozen=True)
class MLALayout:
    """The multi-head latent attention sizes of an HF config (DeepSeek-V2/V3; megatron-core
    ``MLATransformerConfig`` names in brackets).

    Attributes:
        q_lora_rank: rank of the query down-projection ``q_a_proj`` (``q_lora_rank``), None when the
            queries are one projection ``q_proj`` (DeepSeek-V2-Lite, Moonlight).
        kv_lora_rank: rank of the compressed KV latent (``kv_lora_rank``).
        qk_nope_head_dim: per-head query/key size without RoPE (``qk_head_dim``).
        qk_rope_head_dim: per-head RoPE part, its key shared by all heads (``qk_pos_emb_head_dim``).
        v_head_dim: per-head value size (``v_head_dim``).
    """

    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def kv_cache_elements_per_token_layer(self) -> int:
        """What an MLA serving engine caches per token and layer: the latent and the shared RoPE key
        (``kv_lora_rank + qk_rope_head_dim``, SGLang's MLA token pool), not 2 · heads · head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def mla_layout(hf_config) -> Optional[MLALayout]:
    """:class:`MLALayout` of an MLA config, None for other attention.

    Raises:
        ValueError: naming the HF field megatron-core's MLA cannot reproduce: biases on the
            projections (``attention_bias``), non-interleaved RoPE (``rope_interleave=False``:
            megatron-core's MLA always applies DeepSeek's interleaved RoPE,
            multi_latent_attention.py:942, :952 ``mla_rotary_interleaved=True``).
    """
    if ATTENTION_FAMILY.get(_get(hf_config, "model_type")) != "mla":
        return None
    if _get(hf_config, "attention_bias", False):
        raise ValueError("hf_config.attention_bias=True is not supported for MLA (megatron-core's MLA projections "
                         "have no bias)")
    if not _get(hf_config, "rope_interleave", True):
        raise ValueError("hf_config.rope_interleave=False is not supported: megatron-core's MLA applies "
                         "DeepSeek's interleaved RoPE only")
    q_lora = _get(hf_config, "q_lora_rank")
    return MLALayout(q_lora_rank=int(q_lora) if q_lora else None, kv_lora_rank=int(hf_config.kv_lora_rank),
                     qk_nope_head_dim=int(hf_config.qk_nope_head_dim), qk_rope_head_dim=int(hf_config.qk_rope_head_dim),
                     v_head_dim=int(hf_config.v_head_dim))


def moe_layout(hf_config) -> Optional[MoELayout]:
    """:class:`MoELayout` of an MoE HF config, None for a dense one.

    Sources: transformers 5 ``Qwen3MoeSparseMoeBlock`` / ``Qwen2MoeSparseMoeBlock`` /
    ``MixtralSparseMoeBlock`` and their ``TopKRouter`` (softmax over all experts in fp32, top-k,
    divided by the top-k sum when ``norm_topk_prob``; Mixtral divides always).

    Raises:
        ValueError: naming the HF field: dense layers among MoE ones (``mlp_only_layers``,
            ``decoder_sparse_step`` != 1), top-k outside 1..num_experts, or router jitter.
    """
    model_type = _get(hf_config, "model_type")
    if model_type not in MOE_MODEL_TYPES:
        return None
    if model_type in DEEPSEEK_ROUTER_TYPES:
        return _deepseek_moe_layout(hf_config)
    if model_type == "deepseek_v2":
        return _deepseek_v2_moe_layout(hf_config)
    if model_type == "mixtral":
        experts, ffn, shared, norm = hf_config.num_local_experts, hf_config.intermediate_size, 0, True
        if float(_get(hf_config, "router_jitter_noise", 0.0) or 0.0) != 0.0:
            # HF multiplies the router input by uniform noise while training; megatron-core's
            # moe_input_jitter_eps is the same idea but the actor never trains the HF module
            raise ValueError(f"hf_config.router_jitter_noise={hf_config.router_jitter_noise} is not supported; set 0")
    else:
        experts, ffn = hf_config.num_experts, hf_config.moe_intermediate_size
        shared = int(_get(hf_config, "shared_expert_intermediate_size", 0) or 0) if model_type == "qwen2_moe" else 0
        norm = bool(_get(hf_config, "norm_topk_prob", False))
        if _get(hf_config, "mlp_only_layers"):
            raise ValueError(f"hf_config.mlp_only_layers={list(hf_config.mlp_only_layers)}: dense layers among MoE "
                             "layers are not supported (every layer must be an MoE layer); set it to []")
        if int(_get(hf_config, "decoder_sparse_step", 1)) != 1:
            raise ValueError(f"hf_config.decoder_sparse_step={hf_config.decoder_sparse_step}: only 1 (every layer an "
                             "MoE layer) is supported")
    topk = hf_config.num_experts_per_tok
    _check_topk(topk, experts)
    return MoELayout(num_experts=int(experts), topk=int(topk), ffn_hidden_size=int(ffn),
                     shared_ffn_hidden_size=shared, shared_expert_gate=model_type == "qwen2_moe" and shared > 0,
                     norm_topk_prob=norm, aux_loss_coef=float(_get(hf_config, "router_aux_loss_coef", 0.0) or 0.0))


def check_moe_parallel(hf_config, parallel, model_cfg: Optional["ModelConfig"] = None) -> Optional[MoELayout]:
    """Check the expert-parallel layout and the MoE keys against the model; returns its
    :class:`MoELayout` (None for a dense model).

    Args:
        hf_config: the HF config.
        parallel: anything with ``tensor_model_parallel_size``, ``expert_model_parallel_size``
            and ``expert_tensor_parallel_size`` (:class:`dapo_megatron.platform.ParallelConfig`).
        model_cfg: the model section (its ``moe_*`` keys).

    Raises:
        ValueError, one line naming the dotted key: EP or ETP on a dense model, ``model.moe_*``
            set on a dense model, experts not divisible by EP, an expert (or shared expert) FFN
            size not divisible by ETP (TP), an unknown dispatcher or load-balancing type.
    """
    model_cfg = model_cfg or ModelConfig()
    moe = moe_layout(hf_config)
    tp = parallel.tensor_model_parallel_size
    ep = getattr(parallel, "expert_model_parallel_size", 1)
    etp = getattr(parallel, "expert_tensor_parallel_size", None)
    model_type = _get(hf_config, "model_type")
    if moe is None:
        if ep != 1:
            raise ValueError(f"parallel.expert_model_parallel_size={ep} needs a mixture-of-experts model; "
                             f"hf_config.model_type={model_type!r} is dense: set it to 1")
        if etp not in (None, tp):
            raise ValueError(f"parallel.expert_tensor_parallel_size={etp} needs a mixture-of-experts model; "
                             f"hf_config.model_type={model_type!r} is dense: remove it")
        defaults = ModelConfig()
        for key in ("moe_grouped_gemm", "moe_aux_loss_coeff", "moe_router_load_balancing_type",
                    "moe_token_dispatcher_type"):
            if getattr(model_cfg, key) != getattr(defaults, key):
                raise ValueError(f"model.{key}={getattr(model_cfg, key)!r} applies to mixture-of-experts models only; "
                                 f"hf_config.model_type={model_type!r} is dense: remove it")
        return None
    etp = tp if etp is None else etp
    if moe.num_experts % ep:
        raise ValueError(f"parallel.expert_model_parallel_size={ep} does not divide the {moe.num_experts} experts "
                         f"(hf_config num_experts): choose a divisor of {moe.num_experts}")
    if moe.ffn_hidden_size % etp:
        raise ValueError(f"parallel.expert_tensor_parallel_size={etp} does not divide the expert FFN size "
                         f"{moe.ffn_hidden_size} (hf_config moe_intermediate_size): choose a divisor, e.g. 1")
    if moe.shared_ffn_hidden_size % tp:
        raise ValueError(f"parallel.tensor_model_parallel_size={tp} does not divide the shared expert FFN size "
                         f"{moe.shared_ffn_hidden_size} (hf_config.shared_expert_intermediate_size, or "
                         "n_shared_experts × moe_intermediate_size)")
    if moe.dense_ffn_hidden_size % tp:
        raise ValueError(f"parallel.tensor_model_parallel_size={tp} does not divide the dense layers' FFN size "
                         f"{moe.dense_ffn_hidden_size} (hf_config.intermediate_size)")
    try:  # the key domains load_config checks (ModelConfig.validate), for callers that built the config by hand
        model_cfg.validate()
    except ValueError as err:
        raise ValueError(f"model.{err}") from None
    return moe


def moe_grouped_gemm(model_cfg: "ModelConfig") -> bool:
    """Whether the experts run as one grouped GEMM: ``model.moe_grouped_gemm``, None resolving
    to the TE spec. Raises ValueError for grouped GEMM with the local spec (megatron-core's
    local ``GroupedMLP`` needs the ``grouped_gemm`` CUDA package)."""
    impl = resolve_transformer_impl(model_cfg)
    if model_cfg.moe_grouped_gemm is None:
        return impl == "transformer_engine"
    if model_cfg.moe_grouped_gemm and impl != "transformer_engine":
        raise ValueError("model.moe_grouped_gemm=true needs model.transformer_impl='transformer_engine' (TEGroupedMLP, "
                         "CUDA); the local spec runs one MLP per expert: set it to null or false")
    return bool(model_cfg.moe_grouped_gemm)


def _kv_heads(hf_config) -> int:
    return _get(hf_config, "num_key_value_heads") or hf_config.num_attention_heads


def megatron_attention_heads(hf_config, tp: int, model_cfg: Optional[ModelConfig] = None) -> tuple[int, int]:
    """(num_attention_heads, num_query_groups) of the Megatron model: the HF values, or with
    the query groups zero-padded to a multiple of lcm(TP, ``model.query_groups_multiple``)
    (see ``ModelConfig.pad_query_groups``).

    Raises:
        ValueError: padding is needed but ``model.pad_query_groups`` is False.
    """
    model_cfg = model_cfg or ModelConfig()
    heads, groups = hf_config.num_attention_heads, _kv_heads(hf_config)
    if ATTENTION_FAMILY.get(_get(hf_config, "model_type")) == "mla":
        # MLA has no query groups: every head has its own key and value from the shared latent
        if heads % tp:
            raise ValueError(f"hf_config.num_attention_heads={heads} is not divisible by tensor_model_parallel_size={tp}")
        return heads, heads
    multiple = math.lcm(tp, model_cfg.query_groups_multiple or 1)
    if groups % multiple == 0:
        return heads, groups
    if not model_cfg.pad_query_groups:
        raise ValueError(
            f"hf_config.num_key_value_heads={groups} is not divisible by tensor_model_parallel_size={tp}"
            f"{f' × query_groups_multiple' if model_cfg.query_groups_multiple else ''}: choose a TP that divides "
            "it or set model.pad_query_groups=true"
        )
    padded = -(-groups // multiple) * multiple
    return padded * (heads // groups), padded


def has_qkv_bias(hf_config) -> bool:
    """Whether the q/k/v projections carry a bias: always for the qwen2 attention family, per
    ``attention_bias`` for GLM (whose o_proj never has one, transformers ``Glm4MoeAttention``)."""
    attention = ATTENTION_FAMILY.get(_get(hf_config, "model_type"))
    return attention == "qwen2" or (attention == "glm" and bool(_get(hf_config, "attention_bias", False)))


def has_qk_norm(hf_config) -> bool:
    """Whether queries and keys get a per-head RMSNorm before RoPE (megatron-core ``qk_layernorm``
    on GQA attention): always for qwen3, per ``use_qk_norm`` for GLM (GLM-4.5 on, GLM-4.5-Air off)."""
    attention = ATTENTION_FAMILY.get(_get(hf_config, "model_type"))
    return attention == "qwen3" or (attention == "glm" and bool(_get(hf_config, "use_qk_norm", False)))


def head_dim(hf_config) -> int:
    """Per-head size: ``hf_config.head_dim`` if set, else hidden_size / num_attention_heads."""
    hd = _get(hf_config, "head_dim")
    return int(hd) if hd else hf_config.hidden_size // hf_config.num_attention_heads


def hf_to_transformer_config(hf_config, parallel, model_cfg: ModelConfig = None, *, routing_replay: bool = False):
    """Build the megatron-core ``TransformerConfig`` equivalent to an HF decoder config.

    Args:
        hf_config: a ``transformers`` LlamaConfig / Qwen2Config / Qwen3Config.
        parallel: :class:`dapo_megatron.platform.ParallelConfig` (TP, PP sizes).
        model_cfg: :class:`ModelConfig` (dtype, FP8); defaults to ``ModelConfig()``.
        routing_replay: set ``moe_enable_routing_replay`` (MoE only; ``actor.routing_replay``).

    Returns:
        ``megatron.core.transformer.TransformerConfig`` with RMSNorm (eps =
        ``rms_norm_eps``), SwiGLU (gated_linear_unit, silu), no linear biases except the
        qkv bias (qwen2; GLM with ``attention_bias``), q/k layernorm (qwen3; GLM with
        ``use_qk_norm``), ``kv_channels`` = head_dim, GQA
        (``num_query_groups``; zero-padded to a multiple of TP when needed, see
        :func:`megatron_attention_heads`), dropout 0, and the FP8 fields.

    Raises:
        ValueError: unsupported HF fields (see :func:`check_hf_config`), TP that does not
            divide the FFN size (or the query groups with ``pad_query_groups=False``), PP that does not divide the layers,
            or FP8 settings that cannot run here (see :func:`validate_fp8`).
    """
    # megatron-core here, not at the top: models/ and actor/ hold config sections, and the config loads without it
    from megatron.core.transformer import TransformerConfig

    torch = _torch()
    model_cfg = model_cfg or ModelConfig()
    model_type = check_hf_config(hf_config)
    attention = ATTENTION_FAMILY[model_type]
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    heads, groups = megatron_attention_heads(hf_config, tp, model_cfg)
    moe = check_moe_parallel(hf_config, parallel, model_cfg)
    mla = mla_layout(hf_config)
    if mla is not None:
        # the local spec's MLA down-projections are ColumnParallelLinear (gpt_layer_specs.py:413-425,
        # multi_latent_attention.py:536-601): their output rows are split over TP, then gathered
        for what, rows in (("q_lora_rank", mla.q_lora_rank), ("kv_lora_rank + qk_rope_head_dim",
                                                              mla.kv_lora_rank + mla.qk_rope_head_dim)):
            if rows is not None and rows % tp:
                raise ValueError(f"hf_config {what}={rows} is not divisible by tensor_model_parallel_size={tp} (the "
                                 "local spec splits the MLA down-projections over TP)")
    if routing_replay and moe is None:
        raise ValueError(f"actor.routing_replay=rollout needs a mixture-of-experts model; hf_config.model_type="
                         f"{model_type!r} is dense (no router to replay): set actor.routing_replay=off")
    if model_cfg.moe_router_bias_update_rate and (moe is None or not moe.expert_bias):
        raise ValueError(f"model.moe_router_bias_update_rate={model_cfg.moe_router_bias_update_rate} needs a router "
                         f"with a score-correction bias (DeepSeek-V3 family); hf_config.model_type={model_type!r} has "
                         "none: set it to 0")
    if moe is None and hf_config.intermediate_size % tp != 0:
        raise ValueError(
            f"hf_config.intermediate_size={hf_config.intermediate_size} is not divisible by "
            f"tensor_model_parallel_size={tp}; choose a TP that divides it"
        )
    if hf_config.num_hidden_layers % pp != 0:
        raise ValueError(
            f"hf_config.num_hidden_layers={hf_config.num_hidden_layers} is not divisible by "
            f"pipeline_model_parallel_size={pp}"
        )
    impl = resolve_transformer_impl(model_cfg)
    validate_fp8(model_cfg, hf_config.num_hidden_layers, pp)
    dtype = model_cfg.torch_dtype()
    on_cpu = not torch.cuda.is_available()
    kwargs: dict[str, Any] = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        # dense layers' FFN; an all-MoE model has none (Qwen's intermediate_size then sizes
        # layers it does not have), so the expert size stands in for it
        ffn_hidden_size=hf_config.intermediate_size if moe is None else (moe.dense_ffn_hidden_size or
                                                                         moe.ffn_hidden_size),
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim(hf_config) if mla is None else mla.v_head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=has_qkv_bias(hf_config),
        # MLA: the latent norms q_a_layernorm / kv_a_layernorm are megatron-core's q_layernorm / kv_layernorm
        qk_layernorm=has_qk_norm(hf_config) or attention == "mla",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=float(_get(hf_config, "initializer_range", 0.02)),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        use_cpu_initialization=on_cpu,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        transformer_impl=impl,
    )
    if moe is not None:
        kwargs.update(moe_transformer_config_kwargs(moe, parallel, model_cfg, impl, hf_config.num_hidden_layers))
        # megatron-core router.py (0.19.2 :256, core_v0.16.1 :206): every TopKRouter gets a
        # RouterReplay (moe/router_replay.py)
        kwargs["moe_enable_routing_replay"] = bool(routing_replay)
    # Set before the model is built: megatron-core 0.19.2 TopKRouter copies it at construction
    # (transformer/moe/router.py:72) and only then attaches the balancing / z loss as
    # aux · num_local_tokens · |TP·CP| (router.py:604-618, 656-665), the per-token form that the
    # actor's moe_grad_scale_func (actor/actor.py, docs/design.md §3.4) divides by the global
    # router token count. The actor needs the flag anyway (its loss is summed, not averaged).
    kwargs["calculate_per_token_loss"] = True
    if model_cfg.fp8 is not None:
        kwargs.update(
            fp8=model_cfg.fp8,
            fp8_recipe=model_cfg.fp8_recipe,
            first_last_layers_bf16=model_cfg.first_last_layers_bf16,
            num_layers_at_start_in_bf16=model_cfg.num_layers_at_start_in_bf16,
            num_layers_at_end_in_bf16=model_cfg.num_layers_at_end_in_bf16,
        )
    kwargs.update(model_cfg.extra_transformer_config)
    if mla is not None:
        # megatron-core here, not at the top: the config loads without it (as TransformerConfig above)
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        kwargs.update(mla_rope_kwargs(hf_config))
        kwargs.update(multi_latent_attention=True, q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank,
                      qk_head_dim=mla.qk_nope_head_dim, qk_pos_emb_head_dim=mla.qk_rope_head_dim,
                      v_head_dim=mla.v_head_dim)
        return MLATransformerConfig(**kwargs)
    return TransformerConfig(**kwargs)


def moe_transformer_config_kwargs(moe: MoELayout, parallel, model_cfg: ModelConfig, impl: str,
                                  num_layers: int = 0) -> dict[str, Any]:
    """The ``TransformerConfig`` MoE fields (megatron-core names, the same in 0.16.1 and 0.19.2:
    megatron/core/transformer/transformer_config.py "MoE related") of an MoE model.

    Routing equivalence with transformers (megatron/core/transformer/moe/moe_utils.py,
    ``topk_routing_with_score_function``, softmax branch): HF takes softmax over all experts,
    then the top k, then (``norm_topk_prob``) divides by their sum, which equals megatron's
    default top-k of the logits followed by a softmax over those k (``moe_router_pre_softmax``
    False). Without renormalisation HF keeps the top k of the full softmax, which is megatron's
    ``moe_router_pre_softmax=True`` (moe_utils.py:840-846), times ``moe_router_topk_scaling_factor``
    where the model scales (DeepSeek-V2's ``routed_scaling_factor``, :872-873; its group limit as
    ``moe_router_num_groups`` / ``moe_router_group_topk`` on the softmax probabilities, see
    :func:`_deepseek_v2_moe_layout`). The router runs in fp32 (``moe_router_dtype``), as HF's softmax does.
    """
    ep = getattr(parallel, "expert_model_parallel_size", 1)
    etp = getattr(parallel, "expert_tensor_parallel_size", None)
    tp = parallel.tensor_model_parallel_size
    out: dict[str, Any] = dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.topk,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_score_function=moe.score_function,
        moe_router_pre_softmax=not moe.norm_topk_prob if moe.score_function == "softmax" else False,
        moe_router_topk_scaling_factor=moe.scaling_factor,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type=model_cfg.moe_router_load_balancing_type,
        moe_aux_loss_coeff=moe.aux_loss_coef if model_cfg.moe_aux_loss_coeff is None else model_cfg.moe_aux_loss_coeff,
        moe_token_dispatcher_type=model_cfg.moe_token_dispatcher_type,
        moe_grouped_gemm=moe_grouped_gemm(model_cfg),
        # fused permute / router kernels are TE CUDA kernels (moe_utils.permute(fused=True))
        moe_permute_fusion=False,
        moe_router_fusion=False,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=tp if etp is None else etp,
    )
    if moe.expert_bias:
        # megatron-core router.py:177-195 registers expert_bias (fp32, persistent: in the checkpoint);
        # finalize_model_grads updates it by the rate after each step (0: kept as loaded)
        out.update(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=model_cfg.moe_router_bias_update_rate)
    if moe.num_groups:
        out.update(moe_router_num_groups=moe.num_groups, moe_router_group_topk=moe.group_topk)
    if moe.dense_layers:
        out["moe_layer_freq"] = moe.moe_layer_pattern(num_layers)
    if moe.shared_ffn_hidden_size:
        out.update(moe_shared_expert_intermediate_size=moe.shared_ffn_hidden_size,
                   moe_shared_expert_gate=moe.shared_expert_gate, moe_shared_expert_overlap=False)
    if tp > 1 and impl == "transformer_engine":
        # megatron-core's MoELayer.forward refuses to train at TP > 1 without sequence
        # parallelism (moe_layer.py); the local spec's torch norm cannot run it (torch_norm.py
        # asserts not sequence_parallel), so CPU MoE runs at TP > 1 are forward-only
        out["sequence_parallel"] = True
    return out


def with_architectures(hf_config):
    """``hf_config`` with ``architectures`` naming its causal-LM class (:data:`CAUSAL_LM_ARCHITECTURE`)
    when it names none, as a config read from a GGUF file or built in this package does; a config
    that names its class keeps it. Returns the same object. Raises ValueError for a model_type
    this package does not build."""
    if getattr(hf_config, "architectures", None):
        return hf_config
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in CAUSAL_LM_ARCHITECTURE:
        raise ValueError(f"hf_config.model_type={model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
    hf_config.architectures = [CAUSAL_LM_ARCHITECTURE[model_type]]
    return hf_config
