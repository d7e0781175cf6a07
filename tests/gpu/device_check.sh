#!/usr/bin/env bash
# The GPU check, in one go, on a machine with a GPU, CuPy, PyTorch, NumPy (and maybe mpi4py)
# and NO network.  Run from the repository root:
#
#   bash tests/gpu/device_check.sh
#
# What it needs offline comes from .gpu-wheels/ (filled beforehand, with network, by
# tests/gpu/fetch_wheels.sh).  Stages, each under `timeout`, the whole under BUDGET_S
# (default 330 s):
#   1. setup: a venv over the system's packages (CuPy, torch, NumPy stay the image's); into
#      it mpich + mpi4py (always ours: their mpiexec and MPI library belong together),
#      and ml_dtypes, click, pytest, pytest-mpi, setuptools when missing; gpurt itself
#      editable from this tree (so the tests run this tree's code);
#   2. env: nvidia-smi -L, Python/NumPy/CuPy/torch/mpi4py versions, `gpurt info`, the CUDA
#      backend's info (GPUs, P2P matrix), /dev/shm;
#   3. pytest: python -m pytest -m gpu tests/gpu -q (unit tests of the CUDA backend, then
#      tests/gpu/gpu_cases.py under mpiexec -n 1..4 on the GPU);
#   4. sweep: tests/mpi_sweep.py --device cupy (every collective x algorithm, exact) on 3
#      ranks sharing the GPU;
#   5. bench: `gpurt bench allreduce --memory cupy -c` on 2 and 4 ranks, 1 MiB .. 256 MiB,
#      with the device-to-device copy ceiling (%ceil: the issue's >= 60 % at >= 64 MiB).
# Everything (each stage's log, JUnit XML, benchmark JSON, summary.txt) goes under $OUT if
# set, else ./gpu-out.  Exit status: 0 when every stage passed, else 1.
set -uo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd "$REPO"
OUT=${OUT:-$REPO/gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
BUDGET_S=${BUDGET_S:-330}
exec > >(tee "$OUT/device_check.log") 2>&1
T0=$SECONDS
WHEELS=$REPO/.gpu-wheels
VENV=${GPURT_CHECK_VENV:-/tmp/gpurt-gpu-venv}
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
FAILED=0
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/gpurt-cupy-cache}
export GPURT_TIMEOUT=${GPURT_TIMEOUT:-60}

left() { echo $((BUDGET_S - (SECONDS - T0))); }

# stage NAME MAX_SECONDS CMD...: run CMD under timeout (MAX, or what is left of the budget
# less RESERVE seconds kept for later stages), output to $OUT/NAME.log; print its tail.
RESERVE=0
stage() {
    local name=$1 max=$2 t rc start
    shift 2
    t=$(( $(left) - RESERVE ))
    [ "$t" -gt "$max" ] && t=$max
    if [ "$t" -lt 10 ]; then
        echo "== $name: SKIPPED (no time left in the ${BUDGET_S} s budget)" | tee -a "$SUMMARY"
        FAILED=1
        return 1
    fi
    start=$SECONDS
    echo "== $name (timeout ${t} s): $*"
    # SIGINT first: pytest then still prints the failures so far and writes its JUnit
    # XML (on SIGTERM it died without either), gpurt bench stops its job
    timeout -s INT -k 15 "$t" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    tail -n "${TAIL_LINES:-40}" "$OUT/$name.log"
    local verdict="ok"
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then verdict="TIMED OUT"; elif [ $rc -ne 0 ]; then verdict="FAILED rc=$rc"; fi
    echo "== $name: $verdict ($((SECONDS - start)) s)" | tee -a "$SUMMARY"
    [ $rc -eq 0 ] || FAILED=1
    return $rc
}

# -- 1. setup ------------------------------------------------------------------------------------
PY=${GPURT_CHECK_PYTHON:-}      # forces the interpreter (dry runs without CuPy)
for c in ${PY:+__forced__} ${PYTHON:-} python3 python; do
    [ "$c" = __forced__ ] && break
    if command -v "$c" > /dev/null 2>&1 && "$c" -c "import cupy" > /dev/null 2>&1; then
        PY=$(command -v "$c")
        break
    fi
done
if [ -z "$PY" ]; then
    echo "no Python here imports cupy (tried: ${PYTHON:-} python3 python)" | tee -a "$SUMMARY"
    PY=$(command -v python3 || command -v python)
fi
echo "base Python: $PY ($("$PY" -V 2>&1))"
[ -d "$WHEELS" ] || echo "WARNING: $WHEELS missing: nothing can be installed offline" | tee -a "$SUMMARY"

setup() {
    set -e
    local pip_args=(--no-index --find-links "$WHEELS")
    VPY=$PY
    if [ "$("$PY" -c 'import sys; print(int(sys.prefix != sys.base_prefix))')" = 1 ]; then
        echo "$PY is a virtual environment already: installing into it"
    elif "$PY" -m venv --system-site-packages --without-pip "$VENV" \
            && "$VENV/bin/python" -c "import cupy, pip" > /dev/null 2>&1; then
        VPY=$VENV/bin/python
        echo "venv $VENV over $PY's packages"
    else
        echo "no usable venv over $PY: installing into $PY's environment"
        export PIP_BREAK_SYSTEM_PACKAGES=1
    fi
    echo "$VPY" > "$OUT/.python"
    "$VPY" -m pip --version
    # ours always: the mpiexec (hydra) and the MPI library mpi4py loads must match
    "$VPY" -m pip install "${pip_args[@]}" --ignore-installed --no-deps mpich "mpi4py>=4.0"
    # each on its own, and not fatal: one wheel missing for this Python (say ml_dtypes)
    # must not keep gpurt from being installed; what fails is listed
    local pkg
    for pkg in "ml_dtypes>=0.3" "click>=8.1" "pytest>=7" "pytest-mpi>=0.6" "setuptools>=64" \
            wheel; do
        "$VPY" -m pip install "${pip_args[@]}" "$pkg" || echo "WARNING: could not install $pkg"
    done
    if ! "$VPY" -m pip install "${pip_args[@]}" --no-deps --no-build-isolation -e "$REPO"; then
        echo "editable install failed; installing the wheel from .gpu-wheels (may be older" \
             "than this tree)"
        "$VPY" -m pip install "${pip_args[@]}" --no-deps --force-reinstall "$WHEELS"/gpurt-*.whl
    fi
    "$VPY" -c "import gpurt, mpi4py, ml_dtypes; print('gpurt', gpurt.__version__, 'from', gpurt.__file__)"
    # (a size of 1 twice would be an mpiexec and an MPI library that do not belong together)
    "$(dirname "$VPY")/mpiexec" -n 2 "$VPY" -c \
        "from mpi4py import MPI; print('mpi4py rank', MPI.COMM_WORLD.rank, 'of', MPI.COMM_WORLD.size, MPI.Get_library_version().splitlines()[0]); assert MPI.COMM_WORLD.size == 2, 'mpiexec -n 2 gave size 1: the wrong MPI library?'"
    "$VPY" -c "import cupy; print('cupy', cupy.__version__)"
}
if ! stage setup 120 bash -c "$(declare -f setup); PY='$PY' VENV='$VENV' WHEELS='$WHEELS' REPO='$REPO' OUT='$OUT'; setup"; then
    echo "setup failed: going on with what there is" | tee -a "$SUMMARY"
fi
VPY=$(cat "$OUT/.python" 2>/dev/null || echo "$PY")
MPIEXEC=$(dirname "$VPY")/mpiexec
[ -x "$MPIEXEC" ] || MPIEXEC=$(command -v mpiexec || echo mpiexec)
export GPURT_MPIEXEC=$MPIEXEC

# -- 2. environment --------------------------------------------------------------------------------
envinfo() {
    nvidia-smi -L || echo "nvidia-smi failed"
    nvidia-smi --query-gpu=name,memory.total,driver_version,compute_mode --format=csv || true
    "$VPY" - <<'EOF'
import platform, sys
print("python", platform.python_version(), sys.executable)
for m in ("numpy", "cupy", "torch", "mpi4py", "ml_dtypes", "pytest"):
    try:
        mod = __import__(m)
        print(m, getattr(mod, "__version__", "?"), getattr(mod, "__file__", ""))
    except Exception as e:
        print(m, "MISSING:", e)
try:
    import torch
    print("torch.cuda", torch.version.cuda, "available", torch.cuda.is_available(),
          torch.cuda.device_count())
except Exception as e:
    print("torch.cuda:", e)
import json
import gpurt.device_cuda as d
print("CudaBackend.probe():", d.CudaBackend.probe())
print(json.dumps(d.info(), indent=2))
EOF
    "$VPY" -c "import sys; from gpurt.launch.cli import main; sys.exit(main())" info
    echo "mpiexec: $MPIEXEC"; "$MPIEXEC" --version | head -3
    df -h /dev/shm
    nproc
}
stage env 45 bash -c "$(declare -f envinfo); VPY='$VPY' MPIEXEC='$MPIEXEC'; envinfo"

# -- 3. the GPU tests ----------------------------------------------------------------------------------
RESERVE=130     # keep time for the sweep and the benchmark
# (no -x: a first GPU run should report every failure it can within its time)
GPURT_GPU_REQUIRED=1 TAIL_LINES=60 stage pytest 170 "$VPY" -m pytest -m gpu tests/gpu -q -rs -p no:cacheprovider \
    --durations=15 --junitxml "$OUT/pytest-gpu.xml"

# -- 4. every collective x algorithm on CuPy arrays ------------------------------------------------------
RESERVE=90
stage sweep-3 45 "$MPIEXEC" -n 3 "$VPY" tests/mpi_sweep.py --device cupy algorithms

# -- 5. the benchmark (gpurt bench, device buffers, device-copy ceiling) -------------------------------------
GBENCH=("$VPY" -c "import sys; from gpurt.launch.cli import main; sys.exit(main())" bench)
RESERVE=45
stage bench-2 45 "${GBENCH[@]}" allreduce -n 2 -b 1M -e 256M -f 4 -w 3 -i 10 -c \
    --memory cupy --json "$OUT/bench-2.json"
RESERVE=0
stage bench-4 45 "${GBENCH[@]}" allreduce -n 4 -b 1M -e 256M -f 4 -w 3 -i 10 -c \
    --memory cupy --json "$OUT/bench-4.json"

echo
echo "== summary ($((SECONDS - T0)) s of ${BUDGET_S} s; logs in $OUT)"
cat "$SUMMARY"
sleep 0.5     # let tee write the log
exit $FAILED
