#!/usr/bin/env bash
# Download, where pip reaches PyPI, the wheels tests/gpu/run.sh installs on a GPU machine without
# network: tests/gpu/requirements.txt and its dependencies, never torch, for CPython
# $PYTHON_VERSIONS (default 3.12, the GPU image's; e.g. "3.11 3.12") on manylinux x86_64, into
# .cache/gpu-wheels (git-ignored; carry it to the machine). Prints the folder's size.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
WHEELS=.cache/gpu-wheels
mkdir -p "$WHEELS"
platforms=()
for p in manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux_2_34_x86_64; do
    platforms+=(--platform "$p")
done
# peft / accelerate would pull torch in: they come without dependencies (requirements.txt names theirs).
with_deps=$(grep -v -E '^\s*(#|$)|^(peft|accelerate)\b' tests/gpu/requirements.txt)
without_deps=$(grep -E '^(peft|accelerate)\b' tests/gpu/requirements.txt)
for version in ${PYTHON_VERSIONS:-3.12}; do
    common=(download -q --disable-pip-version-check --only-binary=:all: --implementation cp
            --python-version "$version" "${platforms[@]}" -d "$WHEELS")
    "$PYTHON" -m pip "${common[@]}" $with_deps
    "$PYTHON" -m pip "${common[@]}" --no-deps $without_deps
done
if ls "$WHEELS" | grep -q '^torch-'; then
    echo "torch was pulled in by a dependency: $(ls "$WHEELS" | grep '^torch-')" >&2
    exit 1
fi
echo "$(ls "$WHEELS" | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1) in $WHEELS"
