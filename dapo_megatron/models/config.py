"""HF config → megatron-core ``TransformerConfig`` and ``GPTModel`` arguments.

Supported families (``hf_config.model_type``):

- ``llama`` (Llama 2/3, SmolLM2): RMSNorm, SwiGLU, RoPE (default, ``linear`` or
  ``llama3`` scaling), GQA, tied or untied embeddings.
- ``qwen2`` (Qwen2 / Qwen2.5): as llama plus a bias on the q/k/v projections.
- ``qwen3``: as llama plus RMSNorm on queries and keys per head (q/k norm) and an
  explicit ``head_dim`` that may differ from ``hidden_size / num_attention_heads``.

Anything this module cannot map exactly (another activation, a RoPE scaling type
megatron-core 0.16 does not implement, sliding-window attention, ...) raises a
``ValueError`` naming the HF config field, so that a model never builds with silently
different numerics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
FP8_FORMATS = ("e4m3", "hybrid")
# Minimum Transformer Engine version for each FP8 recipe, as megatron-core 0.16.1 itself
# requires them in ``megatron.core.fp8_utils.get_fp8_recipe`` (delayed works on any TE).
FP8_RECIPE_MIN_TE = {"delayed": "1.0", "tensorwise": "2.2.0.dev0", "blockwise": "2.3.0.dev0", "mxfp8": "2.1.0"}
# Minimum CUDA compute capability: FP8 GEMMs need Ada/Hopper (8.9, TE's
# ``check_fp8_support``); MXFP8 needs Blackwell (SM 10.0, TE MXFP8 docs); FP8 block scaling
# has Hopper kernels (SM 9.0, TE ``check_fp8_block_scaling_support``).
FP8_RECIPE_MIN_CC = {"delayed": (8, 9), "tensorwise": (8, 9), "blockwise": (9, 0), "mxfp8": (10, 0)}
TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


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
        import difflib
        import os

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
            import dataclasses

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
            if not torch.cuda.is_available():
                raise ValueError(f"{needs}={value!r} needs a CUDA GPU, none is visible; on CPU set "
                                 + ("fp8: null" if needs == "fp8" else "transformer_impl: local"))
            if _te_version() is None:
                raise ValueError(f"{needs}={value!r} needs Transformer Engine, which is not installed (the docker/ "
                                 "image has it)")

    def torch_dtype(self) -> torch.dtype:
        """``params_dtype`` as a ``torch.dtype``; ValueError naming ``model.params_dtype``."""
        if self.params_dtype not in _DTYPES:
            raise ValueError(f"model.params_dtype={self.params_dtype!r} is not one of {sorted(_DTYPES)}")
        return _DTYPES[self.params_dtype]


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
    from packaging.version import Version

    return Version(v)


def _te_version() -> Optional[str]:
    """Installed Transformer Engine version, or None (monkeypatched in tests)."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return None
    for dist_name in ("transformer-engine", "transformer-engine-torch"):
        try:
            return version(dist_name)
        except PackageNotFoundError:
            continue
    if torch.cuda.is_available():  # source builds (some NGC images) may lack dist metadata
        try:
            import transformer_engine

            return transformer_engine.__version__
        except (ImportError, AttributeError):
            return None
    return None


def _cuda_capability() -> Optional[tuple[int, int]]:
    """(major, minor) of the current CUDA device, or None without CUDA (monkeypatched in tests)."""
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
        dict with ``rotary_base`` (θ), ``rotary_percent`` (1.0), ``rope_scaling`` (bool,
        llama3), ``rope_scaling_factor`` and ``seq_len_interpolation_factor`` (linear).

    Raises:
        ValueError: naming ``rope_parameters.<field>`` for a scaling type or parameter
            megatron-core cannot reproduce exactly (its llama3 scaling hard-codes
            low_freq_factor=1, high_freq_factor=4, original_max_position_embeddings=8192).
    """
    p = rope_parameters(hf_config)
    out = dict(rotary_base=float(p["rope_theta"]), rotary_percent=1.0, rope_scaling=False,
               rope_scaling_factor=8.0, seq_len_interpolation_factor=None)
    if _get(hf_config, "partial_rotary_factor", 1.0) not in (None, 1.0):
        raise ValueError("hf_config.partial_rotary_factor != 1 is not supported")
    kind = p["rope_type"]
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
    if _get(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hf_config.hidden_act={hf_config.hidden_act!r}: only 'silu' (SwiGLU) is supported")
    if _get(hf_config, "mlp_bias", False):
        raise ValueError("hf_config.mlp_bias=True is not supported")
    if model_type in ("llama", "qwen3") and _get(hf_config, "attention_bias", False):
        # HF then also puts a bias on o_proj, which megatron-core's linear_proj cannot hold alone
        raise ValueError(f"hf_config.attention_bias=True is not supported for {model_type}")
    if model_type in ("qwen2", "qwen3") and _get(hf_config, "use_sliding_window", False):
        raise ValueError(f"hf_config.use_sliding_window=True is not supported for {model_type}")
    heads, groups = hf_config.num_attention_heads, _kv_heads(hf_config)
    if heads % groups != 0:
        raise ValueError(
            f"hf_config.num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}"
        )
    return model_type


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


def head_dim(hf_config) -> int:
    """Per-head size: ``hf_config.head_dim`` if set, else hidden_size / num_attention_heads."""
    hd = _get(hf_config, "head_dim")
    return int(hd) if hd else hf_config.hidden_size // hf_config.num_attention_heads


def hf_to_transformer_config(hf_config, parallel, model_cfg: ModelConfig = None):
    """Build the megatron-core ``TransformerConfig`` equivalent to an HF decoder config.

    Args:
        hf_config: a ``transformers`` LlamaConfig / Qwen2Config / Qwen3Config.
        parallel: :class:`dapo_megatron.platform.ParallelConfig` (TP, PP sizes).
        model_cfg: :class:`ModelConfig` (dtype, FP8); defaults to ``ModelConfig()``.

    Returns:
        ``megatron.core.transformer.TransformerConfig`` with RMSNorm (eps =
        ``rms_norm_eps``), SwiGLU (gated_linear_unit, silu), no linear biases except the
        qkv bias (qwen2), q/k layernorm (qwen3), ``kv_channels`` = head_dim, GQA
        (``num_query_groups``; zero-padded to a multiple of TP when needed, see
        :func:`megatron_attention_heads`), dropout 0, and the FP8 fields.

    Raises:
        ValueError: unsupported HF fields (see :func:`check_hf_config`), TP that does not
            divide the FFN size (or the query groups with ``pad_query_groups=False``), PP that does not divide the layers,
            or FP8 settings that cannot run here (see :func:`validate_fp8`).
    """
    from megatron.core.transformer import TransformerConfig

    model_cfg = model_cfg or ModelConfig()
    model_type = check_hf_config(hf_config)
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    heads, groups = megatron_attention_heads(hf_config, tp, model_cfg)
    if hf_config.intermediate_size % tp != 0:
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
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim(hf_config),
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=model_type == "qwen2",
        qk_layernorm=model_type == "qwen3",
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
    if model_cfg.fp8 is not None:
        kwargs.update(
            fp8=model_cfg.fp8,
            fp8_recipe=model_cfg.fp8_recipe,
            first_last_layers_bf16=model_cfg.first_last_layers_bf16,
            num_layers_at_start_in_bf16=model_cfg.num_layers_at_start_in_bf16,
            num_layers_at_end_in_bf16=model_cfg.num_layers_at_end_in_bf16,
        )
    kwargs.update(model_cfg.extra_transformer_config)
    return TransformerConfig(**kwargs)
