#!/usr/bin/env bash
# Shared multi-node torchrun launcher of the H100 examples (run_dapo_qwen2_5_*_h100.sh).
#
#   bash examples/launch_torchrun.sh CONFIG DEFAULT_MODEL_PATH DEFAULT_RUN_DIR DEFAULT_NNODES \
#       [dotted.override=value ...]
#
# Starts `torchrun -m dapo_megatron.train --config CONFIG` on this node. Run it (through an
# example script) inside the docker/ image (docker/README.md), on every node of the job.
# Environment (defaults in brackets):
#   MODEL_PATH      HF model directory (config.json, safetensors, tokenizer) [DEFAULT_MODEL_PATH]
#   TRAIN_FILE      DAPO-Math-17k in DAPO schema (parquet) [/data/dapo-math-17k.parquet]
#   VAL_FILE        AIME 2024 in DAPO schema (parquet) [/data/aime-2024.parquet]
#   RUN_DIR         run directory: checkpoints, metrics, MLflow; shared by all nodes [DEFAULT_RUN_DIR]
#   NNODES [DEFAULT_NNODES]  NODE_RANK [0]  GPUS_PER_NODE [8]  MASTER_ADDR [127.0.0.1]  MASTER_PORT [29500]
# Extra arguments are config overrides (after the config file), e.g.
# trainer.total_training_steps=10 rollout.val_n=4. A missing model config.json or data file
# stops it with exit status 2, naming the variable to set; so does a bad config key or value, a
# layout that does not fit NNODES × GPUS_PER_NODE, or an FP8 / TE config on a node without CUDA
# (`dapo-train --check-config`, one line, before torchrun starts any worker).
set -euo pipefail
if [[ $# -lt 4 ]]; then
    echo "usage: $0 CONFIG DEFAULT_MODEL_PATH DEFAULT_RUN_DIR DEFAULT_NNODES [dotted.override=value ...]" >&2
    exit 2
fi
CONFIG=$1 DEFAULT_MODEL_PATH=$2 DEFAULT_RUN_DIR=$3 DEFAULT_NNODES=$4
shift 4
cd "$(dirname "$0")/.."

MODEL_PATH=${MODEL_PATH:-$DEFAULT_MODEL_PATH}
TRAIN_FILE=${TRAIN_FILE:-/data/dapo-math-17k.parquet}
VAL_FILE=${VAL_FILE:-/data/aime-2024.parquet}
RUN_DIR=${RUN_DIR:-$DEFAULT_RUN_DIR}
NNODES=${NNODES:-$DEFAULT_NNODES}
NODE_RANK=${NODE_RANK:-0}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}

if [[ ! -f "$CONFIG" ]]; then
    echo "error: config $CONFIG not found" >&2
    exit 2
fi
for f in "$MODEL_PATH/config.json" "$TRAIN_FILE" "$VAL_FILE"; do
    if [[ ! -f "$f" ]]; then
        echo "error: $f not found; set MODEL_PATH / TRAIN_FILE / VAL_FILE (see examples/launch_torchrun.sh)" >&2
        exit 2
    fi
done

export CUDA_DEVICE_MAX_CONNECTIONS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
TRAIN_ARGS=(--config "$CONFIG" model.hf_path="$MODEL_PATH"
    "data.train_files=[$TRAIN_FILE]" "data.val_files=[$VAL_FILE]"
    trainer.default_local_dir="$RUN_DIR" "$@")
# the config, the layout and the inputs, in one process: a bad value is one line and exit status 2
# here, not torchrun's ChildFailedError report (exit status 1) after every worker started
python3 -m dapo_megatron.train --check-config --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" "${TRAIN_ARGS[@]}"
exec torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$GPUS_PER_NODE" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    -m dapo_megatron.train "${TRAIN_ARGS[@]}"
