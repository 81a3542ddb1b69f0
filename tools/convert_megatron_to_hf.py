"""Convert a Megatron model checkpoint (from ``convert_hf_to_megatron.py`` or
``bridge.save_model_checkpoint``) into an HF directory that
``transformers.AutoModelForCausalLM.from_pretrained`` loads: safetensors + config.json +
tokenizer files.

Usage::

    python tools/convert_megatron_to_hf.py --ckpt DIR --out DIR           # one process
    torchrun --nproc_per_node=2 tools/convert_megatron_to_hf.py --ckpt DIR --out DIR --tp 2

``--ckpt`` is a model checkpoint (``convert_hf_to_megatron.py``), a trainer checkpoint
``<run dir>/checkpoints/step_<k>``, or a run directory: its ``checkpoints/latest`` is followed
(the checkpoint a resume would load; the step is printed). The checkpoint loads at any TP/PP, and EP/ETP for a mixture of experts
(``--tp``/``--pp``/``--ep``/``--etp`` choose the loading layout, default 1; ``pp × lcm(tp, ep × etp)``
processes; every expert is written under its per-expert HF checkpoint name); vocabulary padding rows are trimmed,
tied embeddings are written once (``model.embed_tokens.weight``). Rank 0 writes ``<out>.tmp``
and renames it when complete; the files get the mode a plain ``open`` gives (0666 less the
umask: safetensors' writer creates 0600 files).

Bad input (a missing or truncated checkpoint file, a bad flag, a world that does not fit
``--tp`` x ``--pp``) is one line, ``convert_megatron_to_hf: error: ...``, exit status 2; the
checkpoint is checked from its index and file sizes before any model is built
(:func:`dapo_megatron.checkpointing.check_model_checkpoint`).
"""

from __future__ import annotations

import json
import os
from argparse import Namespace
import shutil
import sys

from dapo_megatron.cli import ArgumentParser, positive_int, run_tool

PROG = "convert_megatron_to_hf"

SHARD_BYTES = 4 * 2**30
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def parse_args(argv=None) -> Namespace:
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True,
                   help="Megatron model checkpoint, trainer checkpoint step_<k>, or run directory (its latest)")
    p.add_argument("--out", required=True, help="output HF directory (replaced atomically)")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor_model_parallel_size to load with")
    p.add_argument("--pp", type=positive_int, default=1, help="pipeline_model_parallel_size to load with")
    p.add_argument("--ep", type=positive_int, default=1, help="expert_model_parallel_size to load with (MoE models)")
    p.add_argument("--etp", type=positive_int, default=None,
                   help="expert_tensor_parallel_size to load with (MoE models; default: --tp)")
    return p.parse_args(argv)


def resolve_checkpoint(path: str) -> str:
    """The checkpoint directory to convert for ``--ckpt``: ``path`` itself, or the latest
    checkpoint of a run directory; checked cheaply (index and file sizes, no tensor read).

    Raises:
        InputError: ``path`` is not a directory. FileNotFoundError: not a dapo-megatron model
        checkpoint. CheckpointError: a run directory without a checkpoint, a missing or
        truncated checkpoint file.
    """
    from dapo_megatron.bridge import read_checkpoint_meta
    from dapo_megatron.checkpointing import check_model_checkpoint, is_run_dir, latest_checkpoint_dir
    from dapo_megatron.cli import InputError

    if not os.path.isdir(path):
        raise InputError(f"--ckpt {path!r} is not a directory (a Megatron checkpoint or a run directory)")
    if is_run_dir(path):
        path = latest_checkpoint_dir(path)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"[convert] run directory: converting its latest checkpoint, {path}", flush=True)
    read_checkpoint_meta(path)
    check_model_checkpoint(path)
    return path


def file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: 0666 less this process's umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


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


def convert(argv=None) -> None:
    """Parse ``argv`` and convert (every rank); see the module docstring."""
    args = parse_args(argv)
    from dapo_megatron.cli import require_launch_world

    require_launch_world(args.tp, args.pp, args.ep, args.etp)
    args.ckpt = resolve_checkpoint(args.ckpt)  # before torch.distributed and any model: file checks only

    import torch
    import torch.distributed as dist

    from dapo_megatron.bridge import (
        export_hf_state_dict,
        load_checkpoint_hf_config,
        load_model_checkpoint,
        read_checkpoint_meta,
    )
    from dapo_megatron.models import ModelConfig, build_gpt_model
    from dapo_megatron.models.config import with_architectures
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
        # a checkpoint written before config.json named the class (a GGUF source): name it now
        with_architectures(hf_config).save_pretrained(tmp)
        files = write_safetensors(state, tmp)
        for fname in files:  # safetensors' writer creates 0600 files: give them a plain file's mode
            os.chmod(os.path.join(tmp, fname), file_mode())
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


def main(argv=None) -> int:
    """:func:`convert`; bad input is one line and exit status 2 (:mod:`dapo_megatron.cli`)."""
    def input_errors():  # imported only when convert() raised: a bad flag never loads torch (~1.2 s)
        from dapo_megatron.checkpointing import CheckpointError

        return (CheckpointError,)

    return run_tool(PROG, convert, argv, input_errors)


if __name__ == "__main__":
    sys.exit(main())
