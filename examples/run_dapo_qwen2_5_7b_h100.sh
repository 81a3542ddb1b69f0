#!/usr/bin/env bash
# DAPO on Qwen2.5-7B, 8 × H100 per node (TP=4, DP=2 on one node), the paper's recipe:
# examples/configs/dapo_qwen2_5_7b_h100.yaml (TE FP8, bf16 params, colocated SGLang).
#
#   bash examples/run_dapo_qwen2_5_7b_h100.sh [dotted.override=value ...]
#
# Defaults: MODEL_PATH=/models/Qwen2.5-7B, RUN_DIR=runs/dapo_qwen2_5_7b_h100, NNODES=1.
# The environment variables (data files, node rank, master address) and the checks are
# those of examples/launch_torchrun.sh.
set -euo pipefail
exec bash "$(dirname "$0")/launch_torchrun.sh" examples/configs/dapo_qwen2_5_7b_h100.yaml \
    /models/Qwen2.5-7B runs/dapo_qwen2_5_7b_h100 1 "$@"
