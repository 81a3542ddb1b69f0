#!/usr/bin/env bash
# DAPO on Qwen2.5-32B, 4 nodes × 8 H100 (TP=8 within a node, PP=2, DP=2), the paper's recipe:
# examples/configs/dapo_qwen2_5_32b_h100.yaml (TE FP8, bf16 params, colocated SGLang).
#
#   bash examples/run_dapo_qwen2_5_32b_h100.sh [dotted.override=value ...]
#
# Run it on each of the 4 nodes with its NODE_RANK (0..3) and the same MASTER_ADDR (node 0).
# Rollout: one colocated SGLang engine per node (rollout.tensor_model_parallel_size=8, see the config).
# Defaults: MODEL_PATH=/models/Qwen2.5-32B, RUN_DIR=runs/dapo_qwen2_5_32b_h100, NNODES=4.
# The environment variables (data files, node rank, master address) and the checks are
# those of examples/launch_torchrun.sh.
set -euo pipefail
exec bash "$(dirname "$0")/launch_torchrun.sh" examples/configs/dapo_qwen2_5_32b_h100.yaml \
    /models/Qwen2.5-32B runs/dapo_qwen2_5_32b_h100 4 "$@"
