#!/usr/bin/env bash
# GPU checks for one bare H200 machine, under 8 minutes: see tests/gpu/h200_check.py for the
# list. The machine has torch + CUDA, transformers, safetensors, sympy, pyyaml and pytest (its
# own versions: the checks need none of the image's pins but megatron-core's). What else the
# checks import is brought as wheels in .whl/ at the repository root (ignored by git; carry it
# to the machine), fetched beforehand on any machine with PyPI: megatron-core (requires
# torch>=2.6.0, numpy, packaging>=24.2, all there; cp312, the machine's Python 3.12), and
# math-verify with its two pure-Python requirements (the reward graders that sglang_torchrun's
# engine keeps alive import it when they start):
#
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.19.2 math-verify==0.9.0 \
#       latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2      # 2.8 MB
#
# The first check, cuda_ipc, shares a CUDA tensor with a spawned child within
# H200_IPC_TIMEOUT_S (60 s): a sandboxed runtime may not allow CUDA IPC. Where it does not, the
# line says so and the checks that need it print SKIP; the others run.
#
# Usage:  bash tests/gpu/h200_check.sh [--only NAME ...]      (--cpu: the same checks on CPU)
# Prints one line per check (PASS / FAIL / SKIP) and "N passed, N failed" (", N skipped" when a
# check was skipped); exit status 1 when a check failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 2
    export PYTHONPATH="/tmp/site:$PWD"
fi
if ! python3 -c "import megatron.core, math_verify" 2> /dev/null; then
    echo "FAIL setup: megatron-core or math-verify is not importable; put their wheels in .whl/ (see this script's header)"
    echo "0 passed, 1 failed"
    exit 1
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
timeout 470 python3 tests/gpu/h200_check.py "$@"
status=$?
if [[ $status -eq 124 ]]; then
    echo "FAIL timeout: tests/gpu/h200_check.py ran past 470 s"
fi
exit $status
