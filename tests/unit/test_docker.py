"""docker/: the image's Python set is one resolved set (docker/constraints.txt), it agrees
with setup.py, its base carries the CUDA of that set's torch, and every install uses it.

The resolution itself (``docker/resolve.sh``: uv pip compile for Python 3.12 on x86_64
manylinux_2_34) needs PyPI and is not run here; these tests read its committed output.
"""

from __future__ import annotations

import ast
import os
import re
import shlex

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest import REPO

DOCKER_DIR = os.path.join(REPO, "docker")
CONSTRAINTS = "/opt/dapo/constraints.txt"  # where the Dockerfile copies docker/constraints.txt


def _dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined, comments and heredoc bodies dropped."""
    out, buf, heredoc_end = [], "", None
    for line in text.splitlines():
        if heredoc_end is not None:
            if line.strip() == heredoc_end:
                heredoc_end = None
            continue
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        full = (buf + line).strip()
        buf = ""
        m = re.search(r"<<-?'?([A-Z]+)'?", full)
        if m:
            heredoc_end = m.group(1)
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _pip_installs(instructions, args):
    """Every requirement spec given to `pip install`, with ${ARG} expanded, and the flags."""
    specs, commands = [], []
    for word, rest in instructions:
        if word != "RUN":
            continue
        for name, value in args.items():
            rest = rest.replace("${%s}" % name, value)
        lexer = shlex.shlex(rest, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        cmd: list[str] = []
        for token in list(lexer) + ["&&"]:
            if token not in ("&&", "||", ";", "|"):
                cmd.append(token)
                continue
            while cmd and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", cmd[0]):  # VAR=value prefixes
                cmd = cmd[1:]
            if cmd[:2] == ["pip", "install"] or cmd[:4] == ["python", "-m", "pip", "install"]:
                commands.append(cmd)
                start = 2 if cmd[0] == "pip" else 4
                args_ = cmd[start:]
                specs += [t for i, t in enumerate(args_) if not t.startswith("-")
                          and (i == 0 or args_[i - 1] not in ("-c", "-r", "--constraint", "--requirement"))]
            cmd = []
    return specs, commands



def _load_dockerfile():
    instructions = _dockerfile_instructions(open(os.path.join(DOCKER_DIR, "Dockerfile"), encoding="utf-8").read())
    args = {}
    for word, rest in instructions:
        if word == "ARG" and "=" in rest:
            name, value = rest.split("=", 1)
            args[name] = value
    return instructions, args


def _pins(path) -> dict[str, str]:
    """``name -> version`` of the ``name==version`` lines of a requirements file (names canonical)."""
    out = {}
    for line in open(path, encoding="utf-8"):
        m = re.match(r"([A-Za-z0-9][A-Za-z0-9_.-]*)(\[[^\]]*\])?==([^\s#;]+)", line)
        if m:
            out[canonicalize_name(m.group(1))] = m.group(3)
    return out


def _setup_requirements() -> tuple[list[str], dict[str, list[str]]]:
    tree = ast.parse(open(os.path.join(REPO, "setup.py"), encoding="utf-8").read())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}
    return kw["install_requires"], kw["extras_require"]


def test_base_image_carries_the_cuda_of_the_resolved_torch():
    instructions, args = _load_dockerfile()
    pins = _pins(os.path.join(DOCKER_DIR, "constraints.txt"))
    froms = [rest.replace("${BASE_IMAGE}", args.get("BASE_IMAGE", "")) for w, rest in instructions if w == "FROM"]
    assert len(froms) == 1
    m = re.fullmatch(r"nvidia/cuda:(\d+\.\d+\.\d+)-cudnn-devel-ubuntu24\.04", froms[0])
    assert m, froms  # devel: nvcc compiles Transformer Engine's torch extension; Ubuntu 24.04: Python 3.12
    assert m.group(1) == pins["cuda-toolkit"], "the base's CUDA is the one torch's wheels were built with"
    # SGLang's pin of torch (and of the kernels built for it) is the torch of the set
    assert pins["torch"] == "2.11.0" and pins["sglang"] == "0.5.11" and pins["sglang-kernel"] == "0.4.2"
    assert pins["transformer-engine"] == pins["transformer-engine-torch"] == pins["transformer-engine-cu13"]


def test_every_install_uses_the_constraints_and_nothing_from_pypi_apex():
    instructions, args = _load_dockerfile()
    specs, commands = _pip_installs(instructions, args)
    copies = [rest for w, rest in instructions if w == "COPY"]
    assert any("docker/constraints.txt" in c and "/opt/dapo/" in c for c in copies)
    for cmd in commands:
        if "-e" in cmd:  # this package: editable, without dependency resolution
            assert "--no-deps" in cmd and any(t.startswith(".[gpu]") for t in cmd), cmd
        else:
            assert "-c" in cmd and cmd[cmd.index("-c") + 1] == CONSTRAINTS, cmd
    assert any("transformer-engine[pytorch,core_cu13]" in c and "--no-build-isolation" in c for c in commands)
    names = {canonicalize_name(re.split(r"[=<>!~\[;@ ]", s, maxsplit=1)[0]) for s in specs if not s.startswith(".")}
    pins = _pins(os.path.join(DOCKER_DIR, "constraints.txt"))
    assert "apex" not in names and "apex" not in pins  # the PyPI "apex" is an unrelated web toolkit
    assert not [n for n in pins if n.endswith("-cu12")], "one CUDA major (13) in the image"
    assert names <= set(pins) | {"pip"}, names - set(pins)


def test_setup_py_and_the_image_agree():
    pins = _pins(os.path.join(DOCKER_DIR, "constraints.txt"))
    install, extras = _setup_requirements()
    for spec in install + extras["gpu"] + extras["dev"]:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        if name == "nvidia-dali-cuda120":  # the DALI build for CUDA 12; the CUDA 13 image has its twin
            name = "nvidia-dali-cuda130"
        assert name in pins, f"setup.py requires {spec} but the image does not install it"
        assert req.specifier.contains(pins[name], prereleases=True), f"setup.py {spec} vs the image's {pins[name]}"
    assert pins["megatron-core"] == "0.16.1"  # the version the CPU suite runs


def test_constraints_honour_the_pins_of_requirements_in():
    want = _pins(os.path.join(DOCKER_DIR, "requirements.in"))
    pins = _pins(os.path.join(DOCKER_DIR, "constraints.txt"))
    assert want and all(pins[n] == v for n, v in want.items()), {n: (v, pins.get(n)) for n, v in want.items()}
    text = open(os.path.join(DOCKER_DIR, "uv.toml"), encoding="utf-8").read()
    assert f'version = "{pins["transformer-engine-torch"]}"' in text
    assert f'transformer_engine_cu13=={pins["transformer-engine"]}' in text
