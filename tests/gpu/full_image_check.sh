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
#   dapo_step_sglang   dapo-train, 2 ranks (DP=2), SGLang rollouts (load_format=dummy), 2 steps + validations
# More checks (a TP=2 engine's sync, a server-mode sync) are one run_check line each below
# and a subcommand of tests/gpu/full_image_check.py.
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

dapo_step() {
    python tests/gpu/full_image_check.py make-model "$WORK/tiny" \
    && $TORCHRUN --nproc_per_node 2 -m dapo_megatron.train \
        model.hf_path="$WORK/tiny" model.params_dtype=bfloat16 model.transformer_impl=transformer_engine \
        rollout.name=sglang rollout.gpu_memory_utilization=0.3 rollout.response_length=16 \
        rollout.engine_kwargs.load_format=dummy rollout.engine_kwargs.skip_tokenizer_init=true \
        rollout.val_n=2 rollout.val_max_prompts=4 \
        buffer.train_batch_size=2 buffer.n=4 buffer.gen_batch_size=4 buffer.max_num_gen_batches=2 \
        buffer.filter_groups=false buffer.overlong.max_response_length=16 buffer.overlong.overlong_buffer_len=4 \
        actor.ppo_mini_batch_size=1 actor.ppo_max_token_len_per_gpu=1024 actor.optim.lr_warmup_steps=0 \
        trainer.total_training_steps=2 trainer.test_freq=1 trainer.save_freq=2 trainer.val_before_train=true \
        trainer.default_local_dir="$WORK/run" \
        data.arithmetic.num_train_problems=32 data.arithmetic.num_val_problems=8 \
    && python tests/gpu/full_image_check.py dapo-metrics "$WORK/run"
}
run_check dapo_step_sglang dapo_step

echo "$PASSED passed, $FAILED failed"
[[ $FAILED -eq 0 ]]
