"""Convert a Megatron model checkpoint (from ``convert_hf_to_megatron.py`` or
``bridge.save_model_checkpoint``) into an HF directory that
``transformers.AutoModelForCausalLM.from_pretrained`` loads: safetensors + config.json +
tokenizer files.

Usage::

    python tools/convert_megatron_to_hf.py --ckpt DIR --out DIR           # one process
    torchrun --nproc_per_node=2 tools/convert_megatron_to_hf.py --ckpt DIR --out DIR --tp 2

The checkpoint loads at any TP/PP, and EP/ETP for a mixture of experts (``--tp``/``--pp``/``--ep``/``--etp``
choose the loading layout, default 1; ``pp × lcm(tp, ep × etp)`` processes); every expert is
written under its per-expert HF checkpoint name;
vocabulary padding rows are trimmed, tied embeddings are written once
(``model.embed_tokens.weight``). Rank 0 writes ``<out>.tmp`` and renames it when complete.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

SHARD_BYTES = 4 * 2**30
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="Megatron model checkpoint directory")
    p.add_argument("--out", required=True, help="output HF directory (replaced atomically)")
    p.add_argument("--tp", type=int, default=1, help="tensor_model_parallel_size to load with")
    p.add_argument("--pp", type=int, default=1, help="pipeline_model_parallel_size to load with")
    p.add_argument("--ep", type=int, default=1, help="expert_model_parallel_size to load with (MoE models)")
    p.add_argument("--etp", type=int, default=None,
                   help="expert_tensor_parallel_size to load with (MoE models; default: --tp)")
    return p.parse_args(argv)


def write_safetensors(state: dict, out_dir: str, shard_bytes: int = SHARD_BYTES) -> list[str]:
    """Write an HF state dict as ``model.safetensors`` (or numbered shards + index json).

    Returns the file names written, in order.
    """
    from safetensors.torch import save_file

    shards: list[dict] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for fname, shard in zip(names, shards):
        save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
            "weight_map": {k: fname for fname, shard in zip(names, shards) for k in shard},
        }
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    return names


def main(argv=None) -> None:
    args = parse_args(argv)
    from dapo_megatron.platform.distributed import require_launch_world

    require_launch_world(args.tp, args.pp, args.ep, args.etp)

    import torch
    import torch.distributed as dist

    from dapo_megatron.bridge import (
        export_hf_state_dict,
        load_checkpoint_hf_config,
        load_model_checkpoint,
        read_checkpoint_meta,
    )
    from dapo_megatron.models import ModelConfig, build_gpt_model
    from dapo_megatron.platform import ParallelConfig, destroy_distributed, init_distributed

    meta = read_checkpoint_meta(args.ckpt)
    hf_config = load_checkpoint_hf_config(args.ckpt)
    parallel = init_distributed(ParallelConfig(args.tp, args.pp, args.ep, args.etp))
    # the layer spec of the save when this machine can build it (TE needs CUDA), else the local
    # spec: both read the same checkpoint keys (bridge.dist_ckpt.write_model_meta)
    saved_impl = meta.get("transformer_impl", "local")
    impl = "local"
    if saved_impl == "transformer_engine":
        from dapo_megatron.models.config import resolve_transformer_impl

        if resolve_transformer_impl(ModelConfig(transformer_impl="auto")) == "transformer_engine":
            impl = saved_impl
        elif int(os.environ.get("RANK", "0")) == 0:
            print("[convert] the checkpoint was saved with the Transformer Engine spec; loading it with the local "
                  "spec (no CUDA / TE here): same keys, same weights", flush=True)
    model_cfg = ModelConfig(params_dtype=meta.get("params_dtype", "float32"),
                            make_vocab_size_divisible_by=meta.get("make_vocab_size_divisible_by", 128),
                            query_groups_multiple=meta.get("num_query_groups"), transformer_impl=impl)
    model = build_gpt_model(hf_config, model_cfg, parallel=parallel)
    load_model_checkpoint(model, args.ckpt, strict=True)
    state = export_hf_state_dict(model, parallel=parallel)
    if dist.get_rank() == 0:
        out = os.path.abspath(args.out)
        tmp = out + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        hf_config.dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16",
                           torch.float16: "float16"}[next(iter(state.values())).dtype]
        hf_config.save_pretrained(tmp)
        files = write_safetensors(state, tmp)
        if any(os.path.isfile(os.path.join(args.ckpt, f)) for f in TOKENIZER_FILES):
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(args.ckpt).save_pretrained(tmp)
        else:
            print("[convert] the checkpoint has no tokenizer files: none written", flush=True)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.rename(tmp, out)
        print(f"[convert] {args.ckpt} -> {out}: {len(state)} tensors in {files}", flush=True)
    dist.barrier()
    destroy_distributed()


if __name__ == "__main__":
    main()
