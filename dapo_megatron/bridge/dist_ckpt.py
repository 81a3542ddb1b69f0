"""Model-only Megatron distributed checkpoints (torch_dist) that reload at any TP/PP (EP/ETP).

Layout of a checkpoint directory::

    ckpt_dir/
      metadata.json, __*.distcp (+ common.pt before 0.19)   megatron.core.dist_checkpointing (torch_dist)
      config.json                            the HF config (the model's architecture)
      tokenizer files                        when a tokenizer was given (export needs only the dir)
      dapo_megatron.json                     padded vocab, TP/PP, params dtype and layer spec
                                             (transformer_impl) of the save, format version

The save is atomic: everything is written to ``<ckpt_dir>.tmp`` and renamed at the end,
so a crashed save never leaves a directory that looks complete.

Trainer checkpoints (optimizer, RNG, data position) are ``dapo_megatron.checkpointing``'s
job; these helpers cover the model weights for the conversion tools.

Design: docs/design.md §5.3 (resharded loads are verified) and §7 (the run directory).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.validation import StrictHandling
from transformers import AutoConfig

from dapo_megatron.models.config import rope_parameters, with_architectures
from dapo_megatron.platform.parallel_dims import ParallelDims, dims_or_single
from .weights import _as_list, unwrap_model

META_FILE = "dapo_megatron.json"
FORMAT_VERSION = 1
# HF config fields that must agree between a checkpoint and the model it loads into.
ARCH_FIELDS = (
    "model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "rms_norm_eps",
    "hidden_act", "attention_bias",
    # mixtures of experts (None on both sides for a dense model)
    "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size", "norm_topk_prob",
    # DeepSeek-V3: MLA sizes, routed / shared experts, routing, dense layers
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
    "n_shared_experts", "first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor",
)


def model_sharded_state_dict(model_chunks) -> dict:
    """``{"model": sd}`` for one chunk, ``{"model0": sd0, "model1": ...}`` for virtual PP."""
    chunks = [unwrap_model(c) for c in _as_list(model_chunks)]
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def write_model_meta(ckpt_dir: str, model_chunks, hf_config, tokenizer=None) -> None:
    """Write what makes a torch_dist directory a convertible model checkpoint: the HF config
    (config.json), the tokenizer files (if given) and ``dapo_megatron.json`` (padded vocab,
    padded query groups, TP/PP, dtype and ``transformer_impl`` of the save). Rank 0 only; no
    collective.

    Local and Transformer Engine specs write the same checkpoint keys: megatron-core 0.16.1's
    local layer spec maps its separate norms to TE's fused names
    (``gpt_layer_specs.get_gpt_layer_local_spec``: ``sharded_state_dict_keys_map``
    ``input_layernorm.`` → ``self_attention.linear_qkv.layer_norm_``), TE's
    ``TEDotProductAttention`` adds no key, and the ``_extra_state`` objects (TE's FP8 scaling
    metadata; ``None`` for local layers, whose ``set_extra_state`` ignores it) hold no
    weights. So a checkpoint of either spec loads into a model of either spec.

    :func:`save_model_checkpoint` calls it, and so does the trainer for its own checkpoints
    (``dapo_megatron.checkpointing``), which then convert with the same tools.
    """
    with_architectures(hf_config).save_pretrained(ckpt_dir)  # a GGUF-built config names no class
    if tokenizer is not None:
        tokenizer.save_pretrained(ckpt_dir)
    model = unwrap_model(_as_list(model_chunks)[0])
    meta = {
        "format_version": FORMAT_VERSION,
        "padded_vocab_size": model.vocab_size,
        # the layout the model was built for (build_gpt_model writes it into its TransformerConfig)
        "tensor_model_parallel_size": model.config.tensor_model_parallel_size,
        "pipeline_model_parallel_size": model.config.pipeline_model_parallel_size,
        # MoE: the expert layout of the save (torch_dist reloads the experts at any EP / ETP)
        "expert_model_parallel_size": model.config.expert_model_parallel_size,
        "expert_tensor_parallel_size": model.config.expert_tensor_parallel_size,
        "num_model_chunks": len(_as_list(model_chunks)),
        "num_query_groups": model.config.num_query_groups,
        # the layer spec of the save ("local" / "transformer_engine"): the converter builds the
        # same one where it can (TE needs CUDA); both write the same checkpoint keys
        "transformer_impl": getattr(model, "transformer_impl", "local"),
    }
    model_cfg = getattr(model, "model_cfg", None)
    if model_cfg is not None:
        meta["params_dtype"] = model_cfg.params_dtype
        meta["make_vocab_size_divisible_by"] = model_cfg.make_vocab_size_divisible_by
    with open(os.path.join(ckpt_dir, META_FILE), "w") as f:
        json.dump(meta, f, indent=2)


def save_model_checkpoint(model_chunks, ckpt_dir: str, hf_config, tokenizer=None, *,
                          parallel: Optional[ParallelDims] = None) -> None:
    """Save the model as a torch_dist distributed checkpoint plus its HF config (collective).

    Every rank calls it. The launching script must have an ``if __name__ == "__main__":``
    guard (torch_dist's writer may start worker processes; docs/design.md §5.2).

    Args:
        model_chunks: model (chunks) from ``build_gpt_model``.
        ckpt_dir: target directory; replaced atomically if it exists.
        hf_config: the HF config the model was built from (written as config.json).
        tokenizer: optional HF tokenizer, saved next to the weights.
        parallel: the layout the model was built with (the world group of the barriers);
            None: a world of one.

    Raises:
        ValueError: ``parallel`` is None in a world of more than one rank.
    """
    parallel = dims_or_single(parallel, "save_model_checkpoint")
    ckpt_dir = os.path.abspath(ckpt_dir)
    tmp = ckpt_dir + ".tmp"
    if parallel.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    parallel.barrier("world")
    dist_checkpointing.save(model_sharded_state_dict(model_chunks), tmp, sharded_strategy=("torch_dist", 1))
    parallel.barrier("world")
    if parallel.rank == 0:
        write_model_meta(tmp, model_chunks, hf_config, tokenizer)
        if os.path.exists(ckpt_dir):
            old = ckpt_dir + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(ckpt_dir, old)
            os.rename(tmp, ckpt_dir)
            shutil.rmtree(old)
        else:
            os.rename(tmp, ckpt_dir)
    parallel.barrier("world")


def read_checkpoint_meta(ckpt_dir: str) -> dict:
    """The ``dapo_megatron.json`` of a checkpoint.

    Raises:
        FileNotFoundError: not a checkpoint written by :func:`save_model_checkpoint`.
    """
    path = os.path.join(ckpt_dir, META_FILE)
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(ckpt_dir, "metadata.json")):
        raise FileNotFoundError(
            f"{ckpt_dir!r} is not a dapo-megatron model checkpoint (no {META_FILE} / metadata.json); "
            "write one with tools/convert_hf_to_megatron.py"
        )
    with open(path) as f:
        return json.load(f)


def load_checkpoint_hf_config(ckpt_dir: str):
    """The HF config stored in a checkpoint directory (config.json)."""
    read_checkpoint_meta(ckpt_dir)
    return AutoConfig.from_pretrained(ckpt_dir)


def check_config_fits(model_hf_config, ckpt_hf_config, where: str = "checkpoint") -> None:
    """Raise ValueError naming the first architecture field that differs."""
    for name in ARCH_FIELDS:
        a, b = getattr(model_hf_config, name, None), getattr(ckpt_hf_config, name, None)
        if name == "head_dim":
            a = a or model_hf_config.hidden_size // model_hf_config.num_attention_heads
            b = b or ckpt_hf_config.hidden_size // ckpt_hf_config.num_attention_heads
        if name == "num_key_value_heads":
            a = a or model_hf_config.num_attention_heads
            b = b or ckpt_hf_config.num_attention_heads
        if a != b:
            raise ValueError(f"hf_config.{name}={a!r} does not fit the {where} ({name}={b!r})")
    ra, rb = rope_parameters(model_hf_config), rope_parameters(ckpt_hf_config)
    if ra != rb:
        raise ValueError(f"hf_config.rope_parameters={ra} does not fit the {where} ({rb})")


def load_model_checkpoint(model_chunks, ckpt_dir: str, strict: bool = True) -> None:
    """Load a :func:`save_model_checkpoint` directory into the model, at any TP/PP (collective).

    Args:
        model_chunks: model (chunks) from ``build_gpt_model``.
        ckpt_dir: checkpoint directory.
        strict: every tensor of the model must be in the checkpoint and vice versa
            (``StrictHandling.RAISE_ALL``), and ``load_state_dict(strict=True)``.

    Raises:
        FileNotFoundError: not a checkpoint. ValueError: the model's HF config or padded
        vocab does not fit the checkpoint (naming the field). Errors of
        ``dist_checkpointing.load`` (naming the missing / unexpected / mis-shaped key).
    """
    meta = read_checkpoint_meta(ckpt_dir)
    chunks = _as_list(model_chunks)
    model = unwrap_model(chunks[0])
    check_config_fits(model.hf_config, load_checkpoint_hf_config(ckpt_dir), where=f"checkpoint {ckpt_dir}")
    if meta["padded_vocab_size"] != model.vocab_size:
        raise ValueError(
            f"padded vocab size {model.vocab_size} does not fit the checkpoint ({meta['padded_vocab_size']}): "
            "set model.make_vocab_size_divisible_by so that make_vocab_size_divisible_by × TP pads "
            "to the same size, or re-import from HF"
        )
    saved_groups = meta.get("num_query_groups", model.config.num_query_groups)
    if saved_groups != model.config.num_query_groups:
        raise ValueError(
            f"the model has {model.config.num_query_groups} (padded) query groups, the checkpoint {saved_groups}: "
            f"build it with ModelConfig(query_groups_multiple={saved_groups})"
        )
    sharded = model_sharded_state_dict(chunks)
    if strict:
        # megatron-core's terms: "unexpected" = requested by the model but absent from the
        # checkpoint; "missing" = in the checkpoint but not requested. A trainer checkpoint also
        # holds the optimizer ("optimizer.*"): only those may stay unread.
        state, missing, unexpected = dist_checkpointing.load(sharded, ckpt_dir, strict=StrictHandling.RETURN_ALL)
        not_loaded = sorted(k for k in missing if not k.startswith("optimizer."))
        if unexpected or not_loaded:
            raise KeyError(f"checkpoint {ckpt_dir} does not fit the model: tensors absent from the checkpoint "
                           f"{sorted(unexpected)[:10]}, checkpoint tensors the model has no place for "
                           f"{not_loaded[:10]}")
    else:
        state = dist_checkpointing.load(sharded, ckpt_dir, strict=StrictHandling.LOG_ALL)
    for i, chunk in enumerate(chunks):
        key = "model" if len(chunks) == 1 else f"model{i}"
        unwrap_model(chunk).load_state_dict(state[key], strict=strict)
