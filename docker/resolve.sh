#!/usr/bin/env bash
# Regenerate docker/constraints.txt from docker/requirements.in: one consistent set of
# wheels for the image's Python 3.12 on x86_64 manylinux_2_34 (Ubuntu 24.04, glibc 2.39),
# binary wheels only except transformer-engine-torch (an sdist the image compiles).
# Needs uv (pip install uv) and access to PyPI; no GPU, no Docker.
set -euo pipefail
cd "$(dirname "$0")/.."
uv pip compile docker/requirements.in --config-file docker/uv.toml \
    --python-version 3.12 --python-platform x86_64-manylinux_2_34 \
    --index-url https://pypi.org/simple \
    --only-binary :all: --no-binary transformer-engine-torch \
    --no-header --annotation-style line \
    -o docker/constraints.txt
{ printf '# Resolved by docker/resolve.sh (uv pip compile, Python 3.12, x86_64-manylinux_2_34) from\n'
  printf '# docker/requirements.in; the Dockerfile installs every package with -c this file.\n'
  cat docker/constraints.txt; } > docker/constraints.txt.tmp
mv docker/constraints.txt.tmp docker/constraints.txt
echo "docker/constraints.txt: $(grep -c '==' docker/constraints.txt) pinned distributions"
