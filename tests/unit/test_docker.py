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


# The set the image, setup.py and the CPU suite share (issue 34). Each exact pin below was read
# from the wheel's METADATA on PyPI: sglang 0.5.23 "Requires-Dist: torch==2.14.1" and
# "transformers==5.19.0"; sglang-kernel 0.4.10 "Requires-Dist: torch==2.14.1" (its description:
# "Requires torch == 2.14.1"); torch 2.14.1 (the 2.14.1+cu130 Linux wheel)
# "Requires-Dist: cuda-toolkit[...]==13.0.3".
THE_SET = {
    "torch": "2.14.1",
    "sglang": "0.5.23",
    "sglang-kernel": "0.4.10",
    "transformer-engine": "2.20.2",
    "megatron-core": "0.19.2",
    "transformers": "5.19.0",
    "nvidia-dali-cuda130": "2.4.0",
    "mlflow": "3.17.2",
}
# The one CUDA 12 package of the resolved set: nvidia-cutlass-dsl 4.8.0 (required by sglang
# 0.5.23 as nvidia-cutlass-dsl[cu13]) lists "Requires-Dist: nvidia-cutlass-dsl-libs-cu12==4.8.0"
# without a marker; its cu13 extra adds nvidia-cutlass-dsl-libs-cu13 beside it.
CU12_ALLOWED = {"nvidia-cutlass-dsl-libs-cu12"}


def test_base_image_carries_the_cuda_of_the_resolved_torch():
    from packaging.version import Version

    instructions, args = _load_dockerfile()
    pins = _pins(os.path.join(DOCKER_DIR, "constraints.txt"))
    froms = [rest.replace("${BASE_IMAGE}", args.get("BASE_IMAGE", "")) for w, rest in instructions if w == "FROM"]
    assert len(froms) == 1
    m = re.fullmatch(r"nvidia/cuda:(\d+\.\d+\.\d+)-cudnn-devel-ubuntu24\.04", froms[0])
    assert m, froms  # devel: nvcc compiles Transformer Engine's torch extension; Ubuntu 24.04: Python 3.12
    # cuda-toolkit is pinned as 13.0.3.0 (torch asks ==13.0.3); PEP 440 equality ignores the trailing .0
    assert Version(m.group(1)) == Version(pins["cuda-toolkit"]), "the base's CUDA is the one torch's wheels were built with"
    # torch's CUDA 13 libraries and the Transformer Engine core are of the base's CUDA major
    major = Version(m.group(1)).major
    assert canonicalize_name(f"transformer-engine-cu{major}") in pins
    assert canonicalize_name(f"nvidia-nccl-cu{major}") in pins and canonicalize_name(f"nvidia-cudnn-cu{major}") in pins


def test_the_image_installs_the_set():
    pins = _pins(os.path.join(DOCKER_DIR, "constraints.txt"))
    assert {n: pins.get(n) for n in THE_SET} == THE_SET
    # SGLang's pin of torch (and of the kernels built for it) is the torch of the set
    assert pins["transformer-engine"] == pins["transformer-engine-torch"] == pins["transformer-engine-cu13"]


def _versions_named(text: str) -> dict[str, set[str]]:
    """Every full version (X.Y.Z) a text gives to a package of the set, by the set's name."""
    names = {
        "torch": r"torch", "sglang": r"sglang|SGLang", "sglang-kernel": r"sglang-kernel",
        "transformer-engine": r"transformer-engine(?:\[[^\]]*\])?|Transformer Engine",
        "megatron-core": r"megatron-core|megatron_core", "transformers": r"transformers",
    }
    out: dict[str, set[str]] = {}
    for name, alts in names.items():
        for m in re.finditer(rf"(?<![\w-])(?:{alts})(?:==| |, )v?(\d+\.\d+\.\d+)(?![\d])", text):
            out.setdefault(name, set()).add(m.group(1))
    return out


def test_docs_and_comments_name_the_pinned_versions():
    """The Dockerfile's comments, requirements.in's reasons, setup.py's docstring, docker/README.md
    and the GPU check scripts name the versions the image installs (they named the previous set)."""
    files = ["docker/Dockerfile", "docker/requirements.in", "docker/README.md", "docker/uv.toml", "setup.py",
             "tests/gpu/h200_check.sh", "tests/gpu/h200_check.py", "tests/gpu/full_image_check.sh",
             "tests/gpu/full_image_check.py"]
    wrong = {}
    for rel in files:
        named = _versions_named(open(os.path.join(REPO, rel), encoding="utf-8").read())
        for name, versions in named.items():
            if versions != {THE_SET[name]}:
                wrong[rel, name] = sorted(versions)
    assert not wrong, wrong
    readme = open(os.path.join(DOCKER_DIR, "README.md"), encoding="utf-8").read()
    assert all(v in readme for v in THE_SET.values()), [n for n, v in THE_SET.items() if v not in readme]


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
    assert {n for n in pins if n.endswith("-cu12")} == CU12_ALLOWED, "one CUDA major (13) in the image"
    assert names <= set(pins) | {"pip"}, names - set(pins)


def test_setup_py_and_the_image_agree():
    pins = _pins(os.path.join(DOCKER_DIR, "constraints.txt"))
    install, extras = _setup_requirements()
    for spec in install + extras["gpu"] + extras["dev"]:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        assert name in pins, f"setup.py requires {spec} but the image does not install it"
        assert req.specifier.contains(pins[name], prereleases=True), f"setup.py {spec} vs the image's {pins[name]}"
    assert pins["megatron-core"] == THE_SET["megatron-core"]  # the version the CPU suite runs
    assert Requirement(next(s for s in install if s.startswith("torch"))).specifier == \
        Requirement(f"torch=={THE_SET['torch']}").specifier  # SGLang's exact pin, on CPU too
    assert "python_requires=\">=3.12\"" in open(os.path.join(REPO, "setup.py"), encoding="utf-8").read()


def test_constraints_honour_the_pins_of_requirements_in():
    want = _pins(os.path.join(DOCKER_DIR, "requirements.in"))
    pins = _pins(os.path.join(DOCKER_DIR, "constraints.txt"))
    assert want and all(pins[n] == v for n, v in want.items()), {n: (v, pins.get(n)) for n, v in want.items()}



def test_uv_override_of_the_te_torch_sdist_is_pinned_and_cuda13():
    """docker/uv.toml declares transformer-engine-torch's requirements (its sdist's are Dynamic): the
    override is for the pinned version, names the CUDA 13 core of the same version, and every
    requirement it declares is in the resolved set at a version that satisfies it."""
    import tomllib

    pins = _pins(os.path.join(DOCKER_DIR, "constraints.txt"))
    with open(os.path.join(DOCKER_DIR, "uv.toml"), "rb") as f:
        (meta,) = tomllib.load(f)["dependency-metadata"]
    assert canonicalize_name(meta["name"]) == "transformer-engine-torch"
    assert meta["version"] == pins["transformer-engine-torch"] == THE_SET["transformer-engine"]
    reqs = [Requirement(r) for r in meta["requires-dist"]]
    cores = [r for r in reqs if canonicalize_name(r.name).startswith("transformer-engine-cu")]
    assert [canonicalize_name(r.name) for r in cores] == ["transformer-engine-cu13"]
    assert str(cores[0].specifier) == f"=={THE_SET['transformer-engine']}"
    for r in reqs:
        name = canonicalize_name(r.name)
        assert name in pins and r.specifier.contains(pins[name], prereleases=True), (str(r), pins.get(name))
    # TE 2.20.2's build_tools/pytorch.py:24-35 install_requirements() (read in the PyPI sdist)
    assert {canonicalize_name(r.name) for r in reqs} >= {"nvdlfw-inspect", "nvidia-cudnn-frontend", "torch"}
