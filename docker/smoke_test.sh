#!/usr/bin/env bash
# Run inside the image on a GPU node:  docker run --rm --gpus all dapo-megatron bash docker/smoke_test.sh
# Checks what the build cannot (no GPU there): the CUDA stack imports and agrees with
# docker/constraints.txt, Transformer Engine's extension and SGLang's compiled kernels load
# against the image's torch, and the pure-Python config tests pass. The GPU behaviour
# checks are tests/gpu/full_image_check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
python - <<'PY'
import re, sys, torch
assert torch.cuda.is_available(), "no CUDA device visible: run with --gpus all"
pins = dict(re.match(r"([A-Za-z0-9_.-]+)==(\S+)", l).groups() for l in open("docker/constraints.txt")
            if re.match(r"[A-Za-z0-9]", l))
assert torch.__version__.split("+")[0] == pins["torch"], (torch.__version__, pins["torch"])
# torch 2.14.1's Linux wheel is the CUDA 13.0 build; the base image's nvcc is 13.0 too
assert torch.version.cuda.split(".")[:2] == ["13", "0"], torch.version.cuda
import transformer_engine.pytorch as te  # the extension compiled in the image: an ABI mismatch fails here
import sgl_kernel  # noqa: F401  SGLang's kernels (sglang-kernel), built for the same torch
import megatron.core, sglang  # noqa: F401
import nvidia.dali, mlflow, math_verify  # noqa: F401
import transformer_engine
import importlib.metadata as md
for dist in ("sglang", "sglang-kernel", "transformer-engine", "transformer-engine-torch", "megatron-core",
             "transformers", "nvidia-dali-cuda130"):
    assert md.version(dist) == pins[dist], (dist, md.version(dist), pins[dist])
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "te", transformer_engine.__version__, "megatron-core", megatron.core.__version__,
      "sglang", sglang.__version__, "gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0))
PY
python -m pytest -q -x tests/unit/config/test_config.py
