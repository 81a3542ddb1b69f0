#!/usr/bin/env bash
# GPU checks of the Docker image (docker/README.md) on a node with >= 2 GPUs:
#
#   docker run --rm --gpus all --ipc=host dapo-megatron:latest bash tests/gpu/full_image_check.sh
#
# One line per check, then "N passed, N failed" (exit status 1 when a check failed); the
# log of a failed check is printed after its line. The checks (tests/gpu/full_image_check.py):
#   image_stack        docker/smoke_test.sh: imports and versions of the CUDA stack
#   h200_checks        tests/gpu/h200_check.sh: actor logprobs, train step, sync parity, NCCL collectives
#   sglang_contract    tests/gpu/test_sglang_contract.py: generate / update / sleep-wake against sglang.Engine
#   two_engines        two colocated SGLang engines on two GPUs: sleep -> sync -> wake -> generate
#   fp8_thd_step       FP8 forward / backward with THD packing on Transformer Engine
#   fp8_sp_tp2_step    the same at TP=2 with sequence parallelism (tensorwise, blockwise), odd lengths
#   sglang_torchrun    2 colocated engines built under torchrun start within a minute; a weight sync
#                      read back from the engine after every bucket; graders alive after shutdown
#   dapo_step_sglang   dapo-train, 2 ranks (DP=2), SGLang rollouts (load_format=dummy), 2 steps + validations
#   dapo_step_rollout_tp2  the same with rollout.tensor_model_parallel_size=2: one engine over both
#                      GPUs, each rank's flattened bucket read by the TP worker on its GPU (CUDA IPC)
#   dapo_step_server   dapo-train, 1 rank on GPU 0, rollout.mode=server into a sglang.launch_server
#                      on GPU 1 (weights over NCCL, flattened buckets; health check every step)
# In the last three, the rollout-vs-actor logprob gap (dapo-metrics) shows the engine generated
# with the synced weights (they start as load_format=dummy random weights).
# More checks are one run_check line each below and a subcommand of tests/gpu/full_image_check.py.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
WORK=$(mktemp -d /tmp/full_image_check.XXXXXX)
PASSED=0
FAILED=0

run_check() {  # run_check NAME COMMAND...: one PASS/FAIL line; the log after a failure
    local name=$1
    shift
    local log="$WORK/$name.log" start=$SECONDS
    if "$@" > "$log" 2>&1; then
        PASSED=$((PASSED + 1))
        echo "PASS $name: $(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-200) ($((SECONDS - start)) s)"
    else
        FAILED=$((FAILED + 1))
        echo "FAIL $name (exit $?, $((SECONDS - start)) s); last lines of $log:"
        tail -n 40 "$log" | sed 's/^/    /'
    fi
}

NGPU=$(python -c "import torch; print(torch.cuda.device_count())" 2> /dev/null || echo 0)
if [[ "$NGPU" -lt 2 ]]; then
    echo "FAIL setup: $NGPU GPU(s) visible, these checks need 2 (docker run --gpus all)"
    echo "0 passed, 1 failed"
    exit 1
fi
TORCHRUN="torchrun --standalone"

run_check image_stack bash docker/smoke_test.sh
run_check h200_checks bash tests/gpu/h200_check.sh
sglang_contract() {  # a skipped contract test (no SGLang / GPU seen) is a failure here
    python -m pytest -q -x -rs tests/gpu/test_sglang_contract.py > "$WORK/contract.out" 2>&1
    local status=$?
    cat "$WORK/contract.out"
    [[ $status -eq 0 ]] && ! grep -q "skipped" "$WORK/contract.out"
}
run_check sglang_contract sglang_contract
run_check two_engines $TORCHRUN --nproc_per_node 2 tests/gpu/full_image_check.py engines "$WORK"
run_check fp8_thd_step $TORCHRUN --nproc_per_node 1 tests/gpu/full_image_check.py fp8
run_check fp8_sp_tp2_step $TORCHRUN --nproc_per_node 2 tests/gpu/full_image_check.py fp8 sp
run_check sglang_torchrun python tests/gpu/full_image_check.py sglang-torchrun "$WORK/torchrun_engine"
run_check sleep_memory python tests/gpu/full_image_check.py sleep-memory "$WORK"

dapo_step() {  # dapo_step NPROC RUN_NAME [override ...]
    local nproc=$1 run=$2
    shift 2
    python tests/gpu/full_image_check.py make-model "$WORK/tiny" \
    && $TORCHRUN --nproc_per_node "$nproc" -m dapo_megatron.train \
        model.hf_path="$WORK/tiny" model.params_dtype=bfloat16 model.transformer_impl=transformer_engine \
        rollout.name=sglang rollout.gpu_memory_utilization=0.3 rollout.response_length=16 \
        rollout.val_n=2 rollout.val_max_prompts=4 \
        buffer.train_batch_size=2 buffer.n=4 buffer.gen_batch_size=4 buffer.max_num_gen_batches=2 \
        buffer.filter_groups=false buffer.overlong.max_response_length=16 buffer.overlong.overlong_buffer_len=4 \
        actor.ppo_mini_batch_size=1 actor.ppo_max_token_len_per_gpu=1024 actor.optim.lr_warmup_steps=0 \
        trainer.total_training_steps=2 trainer.test_freq=1 trainer.save_freq=2 trainer.val_before_train=true \
        trainer.default_local_dir="$WORK/$run" \
        data.arithmetic.num_train_problems=32 data.arithmetic.num_val_problems=8 "$@" \
    && python tests/gpu/full_image_check.py dapo-metrics "$WORK/$run"
}
COLOCATED=(rollout.engine_kwargs.load_format=dummy rollout.engine_kwargs.skip_tokenizer_init=true)
run_check dapo_step_sglang dapo_step 2 run "${COLOCATED[@]}"
run_check dapo_step_rollout_tp2 dapo_step 2 run_tp2 "${COLOCATED[@]}" rollout.tensor_model_parallel_size=2

server_step() {  # a server on GPU 1 (started here, stopped after), the trainer on GPU 0
    python tests/gpu/full_image_check.py make-model "$WORK/tiny" || return 1
    local port=31000 status=1 waited=0
    NCCL_CUMEM_ENABLE=0 SGLANG_MEMORY_SAVER_CUDA_GRAPH=1 python -m sglang.launch_server --model-path "$WORK/tiny" --tp-size 1 --base-gpu-id 1 --port $port \
        --host 127.0.0.1 --mem-fraction-static 0.3 --load-format dummy --skip-tokenizer-init \
        > "$WORK/server.log" 2>&1 &
    local pid=$!
    until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do  # SGLang answers 503 while starting
        sleep 2
        waited=$((waited + 2))
        if [[ $waited -ge 300 ]] || ! kill -0 $pid 2> /dev/null; then
            tail -n 40 "$WORK/server.log"
            kill $pid 2> /dev/null
            return 1
        fi
    done
    CUDA_VISIBLE_DEVICES=0 dapo_step 1 run_server rollout.mode=server "rollout.server_urls=[http://127.0.0.1:$port]" \
        && status=0
    kill $pid 2> /dev/null
    wait $pid 2> /dev/null
    return $status
}
run_check dapo_step_server server_step

echo "$PASSED passed, $FAILED failed"
[[ $FAILED -eq 0 ]]
