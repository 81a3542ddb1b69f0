"""docker/: the Dockerfile's base and pins, no PyPI apex or Transformer Engine, and the SGLang
requirement filter (static checks of the committed files; nothing is built)."""

import importlib.util
import os
import re
import shlex
import zipfile

from conftest import REPO

DOCKER_DIR = os.path.join(REPO, "docker")


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
            if cmd[:2] == ["pip", "install"] or cmd[:4] == ["python", "-m", "pip", "install"]:
                commands.append(cmd)
                start = 2 if cmd[0] == "pip" else 4
                specs += [t for t in cmd[start:] if not t.startswith("-")]
            cmd = []
    return specs, commands


def _load_dockerfile():
    path = os.path.join(DOCKER_DIR, "Dockerfile")
    instructions = _dockerfile_instructions(open(path, encoding="utf-8").read())
    args = {}
    for word, rest in instructions:
        if word == "ARG" and "=" in rest:
            name, value = rest.split("=", 1)
            args[name] = value
    return instructions, args


def test_dockerfile_uses_ngc_base_and_pins_the_stack():
    instructions, args = _load_dockerfile()
    froms = [rest.replace("${BASE_IMAGE}", args.get("BASE_IMAGE", "")) for w, rest in instructions if w == "FROM"]
    assert len(froms) == 1 and re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", froms[0]), froms
    specs, commands = _pip_installs(instructions, args)
    pinned = {}
    for spec in specs:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)==([0-9][0-9A-Za-z.+-]*)", spec)
        if m:
            pinned[m.group(1).lower()] = m.group(2)
    mcore = tuple(int(x) for x in pinned["megatron-core"].split(".")[:2])
    assert mcore >= (0, 17), "the image has Python 3.12: pin megatron-core 0.17 or newer"
    assert "math-verify" in pinned and "mlflow" in pinned
    assert any(re.fullmatch(r"nvidia-dali-cuda1[23]0", name) for name in pinned), pinned
    # SGLang: downloaded at a pinned version, installed from that wheel without its torch pin
    runs = " ".join(rest for w, rest in instructions if w == "RUN")
    for name, value in args.items():
        runs = runs.replace("${%s}" % name, value)
    assert re.search(r"pip download --no-deps \"?sglang==\d+\.\d+\.\d+", runs)
    assert any("--no-deps" in c and any("sglang" in t for t in c) for c in commands)
    # this package: editable, with the GPU extra, without dependency resolution
    assert any("--no-deps" in c and "-e" in c and any(t.startswith(".[gpu]") for t in c) for c in commands)


def test_dockerfile_never_installs_pypi_apex_or_transformer_engine():
    instructions, args = _load_dockerfile()
    specs, _ = _pip_installs(instructions, args)
    names = {re.split(r"[=<>!~\[;@ ]", s.strip("\"'"), maxsplit=1)[0].lower() for s in specs}
    assert "apex" not in names
    assert not {n for n in names if n.replace("_", "-").startswith("transformer-engine")}
    assert "torch" not in names  # NVIDIA's torch from the base stays


def _sglang_requirements_module():
    spec = importlib.util.spec_from_file_location("sglang_requirements", os.path.join(DOCKER_DIR, "sglang_requirements.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sglang_requirement_filter_drops_base_packages_and_unrequested_extras(tmp_path):
    mod = _sglang_requirements_module()
    metadata = "\n".join([
        "Metadata-Version: 2.1",
        "Name: sglang",
        "Requires-Dist: torch==2.11.0",
        "Requires-Dist: Torch_Audio==2.11.0",
        "Requires-Dist: torchaudio==2.11.0",
        "Requires-Dist: transformer_engine[pytorch]>=2.4",
        "Requires-Dist: transformers==5.6.0",
        "Requires-Dist: orjson",
        'Requires-Dist: torchcodec==0.11.1; sys_platform != "darwin"',
        'Requires-Dist: pytest; extra == "test"',
        'Requires-Dist: sentencepiece; python_version >= "3.10" and extra == "srt"',
    ])
    wheel = tmp_path / "sglang-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("sglang-0.0.0.dist-info/METADATA", metadata)
    assert mod.read_metadata(str(wheel)) == metadata
    assert mod.filtered_requirements(metadata) == [
        "Torch_Audio==2.11.0",  # not the torchaudio distribution: kept
        "transformers==5.6.0",
        "orjson",
        'torchcodec==0.11.1; sys_platform != "darwin"',
    ]
    assert mod.filtered_requirements(metadata, frozenset({"srt"}))[-1] == 'sentencepiece; python_version >= "3.10"'
    bad = tmp_path / "not-a-wheel.whl"
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr("x.txt", "")
    assert mod.main([str(bad)]) == 2
