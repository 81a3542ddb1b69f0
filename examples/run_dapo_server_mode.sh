#!/usr/bin/env bash
# DAPO with separate SGLang servers (rollout.mode=server): the servers on one node, the
# trainer (Megatron actor) on the others. Run the same script on every node of the job:
#
#   ROLE=servers bash examples/run_dapo_server_mode.sh          # on the server node
#   ROLE=trainer NODE_RANK=<0..NNODES-1> SERVER_ADDR=<server node> \
#       bash examples/run_dapo_server_mode.sh [dotted.override=value ...]   # on each trainer node
#
# ROLE=servers starts NUM_SERVERS `python -m sglang.launch_server` processes on this node,
# server i on GPUs i*SERVER_TP .. i*SERVER_TP+SERVER_TP-1 and port BASE_PORT+i, and waits
# for them (Ctrl-C stops all). ROLE=trainer runs examples/launch_torchrun.sh with CONFIG and
# rollout.mode=server, rollout.server_urls=[http://SERVER_ADDR:BASE_PORT, ...]: every step
# starts with a health check of every server, and the weights go to them over one NCCL group
# per pipeline stage, from one trainer rank per stage (SERVER_ADDR's workers connect back to
# the trainer nodes: the trainer nodes must accept TCP connections from the server node).
#
# Environment (defaults in brackets), besides those of examples/launch_torchrun.sh:
#   ROLE          servers | trainer (required)
#   CONFIG        [examples/configs/dapo_qwen2_5_32b_h100.yaml]
#   NUM_SERVERS [2]  SERVER_TP [4]  BASE_PORT [30000]  SERVER_ADDR [127.0.0.1]
#   SERVER_MEM_FRACTION  SGLang --mem-fraction-static [0.85]: the servers' GPUs hold no actor
#   NNODES        trainer nodes [4]
# Extra arguments go to the trainer as config overrides (ROLE=trainer) or to every
# sglang.launch_server (ROLE=servers, e.g. --enable-deterministic-inference).
set -euo pipefail
cd "$(dirname "$0")/.."

ROLE=${ROLE:-}
CONFIG=${CONFIG:-examples/configs/dapo_qwen2_5_32b_h100.yaml}
MODEL_PATH=${MODEL_PATH:-/models/Qwen2.5-32B}
NUM_SERVERS=${NUM_SERVERS:-2}
SERVER_TP=${SERVER_TP:-4}
BASE_PORT=${BASE_PORT:-30000}
SERVER_ADDR=${SERVER_ADDR:-127.0.0.1}
SERVER_MEM_FRACTION=${SERVER_MEM_FRACTION:-0.85}

case "$ROLE" in
servers)
    if [[ ! -f "$MODEL_PATH/config.json" ]]; then
        echo "error: $MODEL_PATH/config.json not found; set MODEL_PATH" >&2
        exit 2
    fi
    pids=()
    trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT INT TERM
    # one NCCL_CUMEM_ENABLE on both ends of the weight-update group (sglang.launch_server's own
    # default is 0; dapo-train uses the same unless set), CUDA graphs released by sleep (docs/design.md §6)
    export NCCL_CUMEM_ENABLE=${NCCL_CUMEM_ENABLE:-0} SGLANG_MEMORY_SAVER_CUDA_GRAPH=${SGLANG_MEMORY_SAVER_CUDA_GRAPH:-1}
    # --incremental-streaming-output: each event of the trainer's streamed /generate carries a row's new
    # tokens only, not all so far (docs/design.md §3.8, streamed generation)
    for ((i = 0; i < NUM_SERVERS; i++)); do
        python -m sglang.launch_server --model-path "$MODEL_PATH" --dtype bfloat16 \
            --tp-size "$SERVER_TP" --base-gpu-id $((i * SERVER_TP)) \
            --host 0.0.0.0 --port $((BASE_PORT + i)) --mem-fraction-static "$SERVER_MEM_FRACTION" \
            --incremental-streaming-output "$@" &
        pids+=($!)
    done
    wait -n "${pids[@]}"  # one server exiting ends the node's role (the trap stops the others)
    ;;
trainer)
    urls=()
    for ((i = 0; i < NUM_SERVERS; i++)); do
        urls+=("http://$SERVER_ADDR:$((BASE_PORT + i))")
    done
    joined=$(IFS=,; echo "${urls[*]}")
    export NCCL_CUMEM_ENABLE=${NCCL_CUMEM_ENABLE:-0}  # the servers' value (docs/design.md §6)
    exec bash examples/launch_torchrun.sh "$CONFIG" "$MODEL_PATH" runs/dapo_server_mode "${NNODES:-4}" \
        rollout.mode=server "rollout.server_urls=[$joined]" rollout.tensor_model_parallel_size=1 "$@"
    ;;
*)
    echo "error: set ROLE=servers (on the server node) or ROLE=trainer (on each trainer node)" >&2
    exit 2
    ;;
esac
