"""A config check is a torch-free process: ``dapo-train`` loads, validates and checks the config
(the keys and values, the launch layout, the model and data paths) before it imports torch, so a
bad config, ``--check-config`` and ``--print-config`` answer in ~0.5 s instead of ~2.6 s (the
example launchers and the CLI tests start ~40 such processes). Each config section lives in a
module that imports no torch (issue 35)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO

CPU_YAML = os.path.join(REPO, "examples", "configs", "dapo_smollm2_cpu.yaml")

# one fresh interpreter: dapo-train's config phase in process, then which heavy modules it loaded
_PROBE = """
import json, sys
from dapo_megatron.train import main
codes = [main(args) for args in json.loads(sys.argv[1])]
print(json.dumps({"codes": codes, "loaded": sorted(m for m in ("torch", "megatron", "transformers")
                                                   if m in sys.modules)}))
"""


def test_loading_and_checking_the_config_imports_no_torch(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # check_inputs: an HF directory holds config.json
    runs = [
        ["--check-config", "--nproc-per-node", "2", "--config", CPU_YAML, f"model.hf_path={model}",
         "model.gguf_file=null"],  # loads, validates, checks the layout for 2 ranks and the paths: ok
        ["--config", CPU_YAML, f"model.hf_path={model}", "buffer.n=1"],  # a bad value: status 2
        ["--print-config", "--config", CPU_YAML, "model.hf_path=/x"],
        ["--list-keys"],
    ]
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(runs)], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["codes"] == [0, 2, 0, 0], (result, out.stderr[-3000:])
    assert "dapo-train: config ok" in out.stdout and "buffer.n=1: dynamic sampling" in out.stderr
    assert result["loaded"] == [], f"the config phase of dapo-train imported {result['loaded']}"
