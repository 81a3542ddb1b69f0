#!/usr/bin/env bash
# Run inside the image on a GPU node:  docker run --rm --gpus all dapo-megatron bash docker/smoke_test.sh
# Checks what the build cannot (no GPU there): the CUDA stack imports and agrees,
# SGLang's kernels load against the base's torch, and the pure-Python config tests pass.
set -euo pipefail
cd "$(dirname "$0")/.."
python - <<'PY'
import sys, torch
assert torch.cuda.is_available(), "no CUDA device visible: run with --gpus all"
import transformer_engine.pytorch as te
import apex, megatron.core, sglang  # noqa: F401
try:  # SGLang's compiled kernels, built against PyPI torch: an ABI mismatch fails here
    import sgl_kernel  # noqa: F401
except ModuleNotFoundError:
    print("note: no module sgl_kernel in this SGLang version; skipped")
import nvidia.dali, mlflow, math_verify  # noqa: F401
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "te", te.__version__ if hasattr(te, "__version__") else "?",
      "megatron-core", megatron.core.__version__, "sglang", sglang.__version__,
      "gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0))
PY
python -m pytest -q -x tests/unit/config/test_config.py
