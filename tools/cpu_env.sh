# Sourced (not run) by tools/setup_cpu.sh and the CPU examples: the one place that says where the
# CPU development environment lives. A Python 3.12 virtual environment outside the clone, so that
# every clone on a machine (CI's fresh clone included) reuses one install of torch and
# megatron-core (~6 GB). Override with DAPO_VENV=/path/to/venv.
DAPO_VENV=${DAPO_VENV:-$HOME/.cache/dapo-megatron/venv-py3.12}
# The environment's interpreter and console scripts (python3, torchrun, dapo-train) come first.
if [ -x "$DAPO_VENV/bin/python" ]; then
    PATH="$DAPO_VENV/bin:$PATH"
    export PATH
fi
export DAPO_VENV
