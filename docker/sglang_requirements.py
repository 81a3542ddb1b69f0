"""Print a wheel's runtime requirements minus what the NGC PyTorch base image provides.

SGLang pins an exact PyPI ``torch`` (e.g. ``torch==2.11.0``). Installing that over the
NGC container would replace NVIDIA's CUDA build of torch, against which the base's
Transformer Engine and NVIDIA Apex are compiled. The Dockerfile therefore installs the
SGLang wheel with ``--no-deps`` and its other requirements from this list.

Usage (inside the image build)::

    pip download --no-deps sglang==X -d /tmp/sglang
    python sglang_requirements.py /tmp/sglang/sglang-X-py3-none-any.whl > reqs.txt
    pip install -r reqs.txt && pip install --no-deps /tmp/sglang/sglang-X-*.whl

Requirements carrying an ``extra == ...`` marker are dropped unless the extra is named
with ``--extra NAME`` (repeatable). Other environment markers are kept verbatim, so pip
evaluates them. Exit status 2 with a message when the wheel has no METADATA.
"""

from __future__ import annotations

import argparse
import re
import sys
import zipfile

# Distributions the NGC PyTorch image ships and that must not be replaced from PyPI.
PROVIDED_BY_BASE = frozenset(
    {
        "torch",
        "torchvision",
        "torchaudio",
        "triton",
        "pytorch-triton",
        "transformer-engine",
        "transformer-engine-torch",
        "transformer-engine-cu12",
        "transformer-engine-cu13",
        "apex",
    }
)

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def normalize(name: str) -> str:
    """PEP 503 normalised distribution name (``Transformer_Engine`` → ``transformer-engine``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_metadata(wheel_path: str) -> str:
    """The ``*.dist-info/METADATA`` text of a wheel.

    Raises:
        ValueError: the archive has no ``.dist-info/METADATA``.
    """
    with zipfile.ZipFile(wheel_path) as z:
        names = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        if not names:
            raise ValueError(f"{wheel_path} has no .dist-info/METADATA: is it a wheel?")
        return z.read(names[0]).decode("utf-8")


def filtered_requirements(metadata: str, extras: frozenset[str] = frozenset()) -> list[str]:
    """``Requires-Dist`` lines of ``metadata`` that pip should install on the NGC base.

    Drops distributions in :data:`PROVIDED_BY_BASE` and requirements that only apply
    to extras not in ``extras``.
    """
    out = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        spec, _, marker = req.partition(";")
        m = _NAME.match(spec)
        if not m or normalize(m.group(1)) in PROVIDED_BY_BASE:
            continue
        extra = _EXTRA.search(marker)
        if extra and normalize(extra.group(1)) not in {normalize(e) for e in extras}:
            continue
        if extra:  # the extra was requested: keep only the rest of the marker
            rest = _EXTRA.sub("", marker)
            rest = re.sub(r"^\s*(and|or)\s+|\s+(and|or)\s*$", "", rest.strip()).strip()
            rest = re.sub(r"^\(\s*\)$", "", rest)
            req = f"{spec.strip()}; {rest}" if rest else spec.strip()
        out.append(req)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel")
    parser.add_argument("--extra", action="append", default=[])
    args = parser.parse_args(argv)
    try:
        reqs = filtered_requirements(read_metadata(args.wheel), frozenset(args.extra))
    except (ValueError, zipfile.BadZipFile) as e:
        print(f"sglang_requirements: {e}", file=sys.stderr)
        return 2
    print("\n".join(reqs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
