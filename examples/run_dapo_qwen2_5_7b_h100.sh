#!/usr/bin/env bash
# DAPO on Qwen2.5-7B, 8 × H100 per node (TP=4, DP=2 on one node), the paper's recipe:
# examples/configs/dapo_qwen2_5_7b_h100.yaml (TE FP8, bf16 params, colocated SGLang).
#
#   bash examples/run_dapo_qwen2_5_7b_h100.sh [dotted.override=value ...]
#
# Run it inside the docker/ image (docker/README.md), on every node of the job.
# Environment (defaults in brackets):
#   MODEL_PATH      HF directory of Qwen2.5-7B (config.json, safetensors, tokenizer) [/models/Qwen2.5-7B]
#   TRAIN_FILE      DAPO-Math-17k in DAPO schema (parquet) [/data/dapo-math-17k.parquet]
#   VAL_FILE        AIME 2024 in DAPO schema (parquet) [/data/aime-2024.parquet]
#   RUN_DIR         run directory: checkpoints, metrics, MLflow; shared by all nodes [runs/dapo_qwen2_5_7b_h100]
#   NNODES [1]  NODE_RANK [0]  GPUS_PER_NODE [8]  MASTER_ADDR [127.0.0.1]  MASTER_PORT [29500]
# Extra arguments are config overrides, e.g. trainer.total_training_steps=10 rollout.val_n=4.
set -euo pipefail
cd "$(dirname "$0")/.."

CONFIG=examples/configs/dapo_qwen2_5_7b_h100.yaml
MODEL_PATH=${MODEL_PATH:-/models/Qwen2.5-7B}
TRAIN_FILE=${TRAIN_FILE:-/data/dapo-math-17k.parquet}
VAL_FILE=${VAL_FILE:-/data/aime-2024.parquet}
RUN_DIR=${RUN_DIR:-runs/dapo_qwen2_5_7b_h100}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}

for f in "$MODEL_PATH/config.json" "$TRAIN_FILE" "$VAL_FILE"; do
    if [[ ! -f "$f" ]]; then
        echo "error: $f not found; set MODEL_PATH / TRAIN_FILE / VAL_FILE (see the header of $0)" >&2
        exit 2
    fi
done

export CUDA_DEVICE_MAX_CONNECTIONS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$GPUS_PER_NODE" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    -m dapo_megatron.train --config "$CONFIG" \
    model.hf_path="$MODEL_PATH" \
    "data.train_files=[$TRAIN_FILE]" "data.val_files=[$VAL_FILE]" \
    trainer.default_local_dir="$RUN_DIR" \
    "$@"
