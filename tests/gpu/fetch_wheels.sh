#!/usr/bin/env bash
# Fill .gpu-wheels/ (repository root) with what tests/gpu/device_check.sh installs offline on
# a GPU machine that has CuPy, PyTorch, NumPy and mpi4py but no network: run HERE, with pip's
# network access.
#
#   bash tests/gpu/fetch_wheels.sh                 # CPython 3.10 to 3.13
#   PYVERS="311 312" bash tests/gpu/fetch_wheels.sh
#
# Binary wheels (manylinux x86_64) for every Python version in PYVERS, without their
# dependencies (NumPy comes with the GPU image: downloading it for three Pythons would
# triple the size): mpich (its mpiexec is what the tests launch with), mpi4py, ml_dtypes,
# click, pytest and pytest-mpi with pytest's own dependencies, setuptools and wheel (to
# install the project from the tree without build isolation), and the project's wheel.
# Prints every wheel's size and the total; fails above LIMIT_MIB (default 60).
set -euo pipefail
export PIP_DISABLE_PIP_VERSION_CHECK=1

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DEST=${DEST:-$ROOT/.gpu-wheels}
PYVERS=${PYVERS:-"310 311 312 313"}
LIMIT_MIB=${LIMIT_MIB:-60}
PY=${PYTHON:-python3}
PIP=("$PY" -m pip)

# ml_dtypes < 0.6 still installs beside NumPy 1.x (GPU images often pin NumPy 1.26)
BINARY=("mpich" "mpi4py>=4.0" "ml_dtypes>=0.3,<0.6")
PURE=("click>=8.1" "pytest>=7" "pytest-mpi>=0.6" "pluggy" "iniconfig" "packaging"
      "pygments" "typing_extensions" "setuptools>=64" "wheel")
# pytest's dependencies on CPython 3.10 only
OLD=("exceptiongroup>=1" "tomli>=2")

mkdir -p "$DEST"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform linux_x86_64)
for v in $PYVERS; do
    echo "== cp$v: ${BINARY[*]}"
    "${PIP[@]}" download --quiet --no-deps --only-binary=:all: -d "$DEST" \
        --python-version "$v" --implementation cp --abi "cp$v" --abi abi3 --abi none \
        "${PLATFORMS[@]}" "${BINARY[@]}"
    if [ "$v" = 310 ]; then
        "${PIP[@]}" download --quiet --no-deps --only-binary=:all: -d "$DEST" \
            --python-version "$v" --implementation cp --abi "cp$v" --abi abi3 --abi none \
            "${PLATFORMS[@]}" --platform any "${OLD[@]}"
    fi
done
echo "== pure Python: ${PURE[*]}"
"${PIP[@]}" download --quiet --no-deps --only-binary=:all: -d "$DEST" "${PURE[@]}"

echo "== the project wheel"
rm -f "$DEST"/gpurt-*.whl
# pure Python (no compiled board round): it must install on whatever CPython the GPU machine has
# (pip builds in the tree: a build/ left from an earlier run could put deleted files into
# the wheel, and one left by this run would linger in the checkout)
rm -rf "$ROOT/build"
GPURT_NO_EXTENSION=1 "${PIP[@]}" wheel --quiet --no-deps "$ROOT" -w "$DEST"
rm -rf "$ROOT/build"

echo "== sizes"
( cd "$DEST" && ls -l --block-size=K ./*.whl | awk '{printf "%8s  %s\n", $5, $9}' )
total_kib=$(du -sk "$DEST" | cut -f1)
echo "total: $((total_kib / 1024)) MiB ($total_kib KiB) in $DEST"
if [ "$total_kib" -gt $((LIMIT_MIB * 1024)) ]; then
    echo "over the ${LIMIT_MIB} MiB limit" >&2
    exit 1
fi
