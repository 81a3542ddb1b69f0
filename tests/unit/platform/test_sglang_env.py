"""The process environment around SGLang (platform/sglang_env.py), checked against the fake
``sglang`` of tests/fake_sglang, whose ``_set_envs_and_config`` is sglang 0.5.23's."""

import os
import subprocess
import sys

from conftest import REPO

from dapo_megatron.platform import sglang_env

FAKE = os.path.join(REPO, "tests", "fake_sglang")


def _python(code, env_extra=None, drop=()):
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(PYTHONPATH=os.pathsep.join([FAKE, REPO]), **(env_extra or {}))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_engine_launch_env_is_scoped_to_the_engines_construction():
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "RANK": "1"}
    with sglang_env.engine_launch_env(env) as changes:
        inside = dict(env)
        env["NCCL_CUMEM_ENABLE"] = "0"  # what SGLang sets meanwhile stays
    assert inside == {"RANK": "1", "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1"}
    assert changes == {"TORCHELASTIC_USE_AGENT_STORE": None, "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1"}
    assert env == {"TORCHELASTIC_USE_AGENT_STORE": "True", "RANK": "1", "NCCL_CUMEM_ENABLE": "0"}
    user = {"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "0"}  # the user's own choice is kept (and counted)
    with sglang_env.engine_launch_env(user):
        assert user == {"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "0"}
    assert not sglang_env.cuda_graphs_released(user) and sglang_env.cuda_graphs_released({})


def test_server_mode_trainer_uses_the_servers_nccl_cumem_value(tmp_path):
    """Issue 18 item 5: sglang.launch_server runs _set_envs_and_config, which gives its workers
    NCCL_CUMEM_ENABLE=0 when it is unset; dapo-train in server mode must have the same value in
    its environment when it builds its first NCCL communicator (init_distributed)."""
    server = _python("import os\nfrom sglang.srt.entrypoints.engine import _set_envs_and_config, _server_args\n"
                     "_set_envs_and_config(_server_args({'model_path': 'm'}))\nprint(os.environ['NCCL_CUMEM_ENABLE'])",
                     drop=("NCCL_CUMEM_ENABLE",))
    trainer_code = (
        "import os, sys\nimport dapo_megatron.platform as p\nclass Stop(Exception): pass\n"
        "def init(*a, **k):\n    print(os.environ.get('NCCL_CUMEM_ENABLE'))\n    raise Stop\n"
        "p.init_distributed = init\nfrom dapo_megatron.train import main\n"
        "try:\n    main(sys.argv[1:])\nexcept Stop:\n    pass\n")
    (tmp_path / "config.json").write_text("{}")  # dapo-train checks model.hf_path before torch.distributed
    args = f"['model.hf_path={tmp_path}', " + "'rollout.name=sglang', '{mode}', 'rollout.server_urls=[http://127.0.0.1:1]']"
    code = trainer_code.replace("main(sys.argv[1:])", "main(" + args.format(mode="rollout.mode=server") + ")")
    assert _python(code, drop=("NCCL_CUMEM_ENABLE", "RANK", "WORLD_SIZE")) == server == "0"
    # a value the user set is kept (the server must then be launched with it)
    assert _python(code, env_extra={"NCCL_CUMEM_ENABLE": "1"}, drop=("RANK", "WORLD_SIZE")) == "1"
    # colocated: NCCL's default (no SGLang process shares an NCCL group with the trainer)
    colocated = code.replace("'rollout.mode=server', 'rollout.server_urls=[http://127.0.0.1:1]'", "")
    assert _python(colocated, drop=("NCCL_CUMEM_ENABLE", "RANK", "WORLD_SIZE")) == "None"
