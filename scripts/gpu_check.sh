#!/usr/bin/env bash
# The GPU check: ONE prepared run on the lent GPU machine (nvidia-h200: one H200,
# Python 3.12 with CuPy, no network). docs/GPU.md says how to call it with the
# device tool and what to report afterwards. In short, from the repo root here:
#     scripts/fetch_gpu_wheels.sh          # once, where PyPI is reachable
#     device run: command "bash scripts/gpu_check.sh", carry [".whl"], timeout_s 540
#
# It installs the carried wheels (.whl/: MPICH, mpi4py, pytest-mpi) into
# /tmp/site, prints the GPU and versions, then, with SPMD_BACKEND=cupy and
# SPMD_DEVICE=0 (every rank on the one GPU), runs these stages, each under
# `timeout`, cheapest first:
#     info        nvidia-smi, versions, the MPI library and its CUDA-awareness
#     numerics    CuPy vs NumPy on every op case, float32 and float64: max abs diff
#     unit-gpu    the CuPy tests of tests/unit/test_gpu_paths.py and test_backend.py (-k cupy;
#                 the real-CuPy ones skip everywhere but here)
#     mpi-N       the MPI suite tests/mpi on N ranks (N = 1, 2, 4)
#     demo-N      scripts/demo_transformer.py on meshes 1,1 / 1,2 / 2,2
#     bench-N     scripts/bench_collectives.py --device --quick on 2 and 4 ranks
# Every stage runs even if an earlier one failed; all of them together get
# GPU_CHECK_BUDGET seconds, and a stage that would start with under 20 s left
# is skipped, so the script ends well inside the device's 10-minute command
# limit. The last lines are a summary table; the exit status is 0 only if
# every stage passed. Everything is tee'd into $OUT/gpu_check.log (with a copy
# of the summary in $OUT/gpu_check_summary.txt): the device tool returns both.
#
# Knobs (environment):
#   GPU_CHECK_STAGES   stages to run (default all, in the order above), e.g.
#                      "info mpi-4" for a rerun of what failed
#   GPU_CHECK_BUDGET   seconds for all stages together (default 420)
#   GPU_CHECK_BACKEND  cupy (default) | numpy: numpy rehearses the whole script
#                      on a machine without a GPU (bench then runs without --device)
#   GPU_CHECK_MPI      wheels (default: the carried MPICH) | image (the image's
#                      own MPI and mpi4py, e.g. if it turns out CUDA-aware;
#                      only pytest-mpi is installed from .whl/)
#   GPU_CHECK_PYTHON   interpreter (default python3: the image's, with CuPy)
#   OUT                where the log goes (set by the device tool; default out/gpu_check)
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 2
OUT="${OUT:-$REPO/out/gpu_check}"
WORK=/tmp/gpu_check  # rank logs, demo programs: not $OUT, which returns at most 8 files
SITE=/tmp/site       # the Python packages from .whl/
MPICH=/tmp/mpich     # MPICH's own prefix: bin/mpiexec, lib/libmpi.so.12
PY="${GPU_CHECK_PYTHON:-python3}"
BACKEND="${GPU_CHECK_BACKEND:-cupy}"
MPI_FROM="${GPU_CHECK_MPI:-wheels}"
BUDGET="${GPU_CHECK_BUDGET:-420}"
ALL_STAGES="info numerics unit-gpu mpi-1 mpi-2 demo-1 demo-2 demo-4 bench-2 bench-4 mpi-4"
STAGES="${GPU_CHECK_STAGES:-$ALL_STAGES}"
MIN_STAGE_SECONDS=20
# Per-stage caps (seconds); the budget left lowers them further.
declare -A CAP=([info]=60 [numerics]=90 [unit-gpu]=120 [mpi-1]=90 [mpi-2]=150 [mpi-4]=200
                [demo-1]=60 [demo-2]=60 [demo-4]=60 [bench-2]=60 [bench-4]=90)
RESULTS=()
FAILED=0

# -- environment ------------------------------------------------------------------------------

PIP_OFFLINE=(-m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade)

install_wheels() {
    local packages=(.whl/pytest_mpi-*.whl) mpich=(.whl/mpich-*.whl)
    [[ "$MPI_FROM" == wheels ]] && packages+=(.whl/mpi4py-*.whl)
    if [[ ! -e "${packages[0]}" || ! -e "${packages[-1]}" || ("$MPI_FROM" == wheels && ! -e "${mpich[0]}") ]]; then
        echo "the device needs .whl/ to hold the pytest-mpi, mpi4py and mpich wheels: run" \
            "scripts/fetch_gpu_wheels.sh where PyPI is reachable and name .whl in the device call's carry;" \
            "got: $(ls .whl 2>&1 | tr '\n' ' ')"
        return 1
    fi
    echo "installing into $SITE: ${packages[*]##*/}"
    "$PY" "${PIP_OFFLINE[@]}" --target "$SITE" "${packages[@]}" || return 1
    if [[ "$MPI_FROM" == wheels ]]; then
        # Not --target: pip --target keeps a wheel's data bin/ but drops its data lib/, and MPICH's
        # libmpi is there. A prefix install keeps both.
        echo "installing into $MPICH: ${mpich[*]##*/}"
        "$PY" "${PIP_OFFLINE[@]}" --prefix "$MPICH" --no-warn-script-location "${mpich[@]}" || return 1
    fi
}

export_environment() {
    export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
    if [[ "$MPI_FROM" == wheels ]]; then
        # The carried MPICH: its mpiexec first on PATH, and mpi4py pointed at its libmpi rather than
        # whichever one the image may hold (mpi4py's wheel searches several places).
        export PATH="$MPICH/bin:$PATH" LD_LIBRARY_PATH="$MPICH/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        export MPI4PY_LIBMPI="$MPICH/lib/libmpi.so.12"
        PYTHONPATH+=":$(echo "$MPICH"/lib/python3*/site-packages)"  # mpich's dist-info: its version shows
    fi
    export SPMD_BACKEND="$BACKEND" PYTHONUNBUFFERED=1
    export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1  # 4 ranks share 16 cores
    if [[ "$BACKEND" == cupy ]]; then
        export SPMD_DEVICE=0  # one GPU: every rank on it
    fi
    mkdir -p "$WORK"
}

# -- stage runner -----------------------------------------------------------------------------

# run_stage NAME CMD...: runs CMD under `timeout` (its cap, lowered to the budget left); records
# "NAME verdict seconds [detail]". A stage's detail comes from $WORK/NAME.detail if CMD wrote one.
run_stage() {
    local name="$1" left rc verdict t0=$SECONDS
    shift
    [[ " $STAGES " == *" $name "* ]] || return 0
    left=$((BUDGET - (SECONDS - STAGES_START)))
    if ((left < MIN_STAGE_SECONDS)); then
        RESULTS+=("$(printf '%-10s %-34s %5s' "$name" "SKIPPED (budget spent)" -)")
        FAILED=$((FAILED + 1))
        return 0
    fi
    local cap="${CAP[$name]}"
    local limit=$((cap < left ? cap : left))
    printf '\n===== %s (limit %ss): %s\n' "$name" "$limit" "$*"
    rm -f "$WORK/$name.detail"
    # A child bash runs the stage function (exported below): `timeout` needs a process, and it
    # signals that process's whole group, mpiexec and the ranks included.
    timeout -k 15 "$limit" bash -c '"$@"' stage "$@"
    rc=$?
    case $rc in
        0) verdict=ok ;;
        124 | 137)
            verdict="FAILED (timed out after ${limit}s)"
            sleep 3  # mpiexec is still reaping its ranks: let its last words land before the next stage
            ;;
        *) verdict="FAILED (exit $rc)" ;;
    esac
    ((rc == 0)) || FAILED=$((FAILED + 1))
    RESULTS+=("$(printf '%-10s %-34s %5s  %s' "$name" "$verdict" "$((SECONDS - t0))s" \
        "$(cat "$WORK/$name.detail" 2>/dev/null)")")
    printf -- '\n----- %s: %s in %ss\n' "$name" "$verdict" "$((SECONDS - t0))"
}

# -- stages -----------------------------------------------------------------------------------

stage_info() {
    command -v nvidia-smi >/dev/null && nvidia-smi || echo "(no nvidia-smi)"
    echo "mpiexec: $(command -v mpiexec || echo none)"
    mpiexec --version 2>&1 | head -3
    "$PY" - <<'PY'
import importlib.metadata as md
import os
import sys

import numpy

print("python", sys.version.split()[0], sys.executable)
print("numpy", numpy.__version__)
try:
    import cupy
    rt = cupy.cuda.runtime
    props = rt.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(f"cupy {cupy.__version__}, CUDA runtime {rt.runtimeGetVersion()}, driver {rt.driverGetVersion()}, "
          f"{rt.getDeviceCount()} GPU(s), GPU 0: {name}")
except Exception as e:  # reported, not fatal: the cupy stages say the rest
    print(f"cupy unavailable: {type(e).__name__}: {e}")
for name in ("mpi4py", "mpich", "pytest", "pytest-mpi", "pytest-timeout", "hypothesis"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "NOT INSTALLED")
import mpi4py
from mpi4py import MPI

from spmd_runtime.comm.gpu import cuda_aware_mpi
from spmd_runtime.exec.backend import backend_name, get_array_module

print("mpi4py from", os.path.dirname(mpi4py.__file__))
print("MPI library:", MPI.Get_library_version().splitlines()[0].strip())
print("CUDA-aware MPI (spmd_runtime.comm.gpu.cuda_aware_mpi):", cuda_aware_mpi())
print("array backend for SPMD_BACKEND=%r:" % os.environ.get("SPMD_BACKEND"), backend_name(get_array_module()))
PY
}

stage_numerics() {
    "$PY" tests/unit/test_gpu_paths.py | tee "$WORK/numerics.out"
    local rc=${PIPESTATUS[0]}
    grep '^# ' "$WORK/numerics.out" | tail -1 | cut -c3- >"$WORK/numerics.detail"
    return "$rc"
}

stage_unit_gpu() {
    "$PY" -m pytest tests/unit/test_gpu_paths.py tests/unit/test_backend.py -k cupy -q -p no:cacheprovider -rs \
        | tee "$WORK/unit-gpu.out"
    local rc=${PIPESTATUS[0]}
    pytest_counts "$WORK/unit-gpu.out" >"$WORK/unit-gpu.detail"
    return "$rc"
}

# Each rank runs this: rank 0 prints (and keeps a copy), the others only log; every rank leaves
# its exit status. $0 is the file prefix.
RANK_WRAPPER='
r="${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-0}}}"
if [[ "$r" == 0 ]]; then "$@" 2>&1 | tee "$0.rank$r.log"; rc=${PIPESTATUS[0]}
else "$@" >"$0.rank$r.log" 2>&1; rc=$?; fi
echo "$rc" >"$0.rank$r.rc"
exit "$rc"'

stage_mpi() {
    local n="$1" prefix="$WORK/mpi-$n" r shown=0
    rm -f "$prefix".rank*
    mpiexec -n "$n" bash -c "$RANK_WRAPPER" "$prefix" \
        "$PY" -m pytest --with-mpi tests/mpi -p no:cacheprovider -rfE --maxfail=10 \
        --timeout=120 --timeout-method=thread
    local rc=$?
    pytest_counts "$prefix.rank0.log" >"$WORK/mpi-$n.detail"
    for ((r = 1; r < n; r++)); do  # ranks > 0 that failed where rank 0 did not show why
        if [[ "$(cat "$prefix.rank$r.rc" 2>/dev/null)" != 0 ]] && ((shown < 2)); then
            shown=$((shown + 1))
            echo "--- rank $r (exit $(cat "$prefix.rank$r.rc" 2>/dev/null || echo none)), last lines:"
            tail -n 25 "$prefix.rank$r.log" 2>/dev/null
        fi
    done
    return "$rc"
}

stage_demo() {
    local n="$1" mesh="$2" backend_flag=()
    # SPMD_BACKEND selects the backend in any case; pass the flag too once the demo has one.
    grep -q -- '"--backend"' scripts/demo_transformer.py && backend_flag=(--backend "$BACKEND")
    mpiexec -n "$n" "$PY" scripts/demo_transformer.py --mesh "$mesh" --steps 10 --out "$WORK/demo-$n" \
        "${backend_flag[@]}" | tee "$WORK/demo-$n.out"
    local rc=${PIPESTATUS[0]}
    grep -oE 'max abs error[^(]*|time per step on [0-9]+ ranks: [0-9.]+ ms' "$WORK/demo-$n.out" \
        | sed 's/ *$//' | paste -sd ';' | sed 's/;/; /g' >"$WORK/demo-$n.detail"
    return "$rc"
}

stage_bench() {
    local n="$1" device_flag=()
    [[ "$BACKEND" == cupy ]] && device_flag=(--device)
    mpiexec -n "$n" "$PY" scripts/bench_collectives.py --quick "${device_flag[@]}" | tee "$WORK/bench-$n.out"
    local rc=${PIPESTATUS[0]}
    grep -E '^# results identical' "$WORK/bench-$n.out" | cut -c3- >"$WORK/bench-$n.detail"
    return "$rc"
}

pytest_counts() {  # the closing "N passed, M failed ..." of a pytest log, without its "=" decoration
    grep -E '[0-9]+ (passed|failed|error)' "$1" 2>/dev/null | tail -1 | tr -d '=' | sed 's/^ *//; s/ *$//'
}

export -f stage_info stage_numerics stage_unit_gpu stage_mpi stage_demo stage_bench pytest_counts
export WORK PY BACKEND RANK_WRAPPER

# -- main -------------------------------------------------------------------------------------

main() {
    local rev
    if rev="$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null)"; then
        rev+=" ($(git -C "$REPO" status --porcelain | wc -l) changed files)"
    else
        rev="(no .git in this copy: note the commit you ran from)"
    fi
    echo "GPU check of $rev on $(hostname), $(date -u)"
    echo "backend=$BACKEND mpi=$MPI_FROM budget=${BUDGET}s stages: $STAGES"
    if ! install_wheels; then
        echo "GPU check: the wheels did not install; nothing ran"
        return 2
    fi
    export_environment
    STAGES_START=$SECONDS  # the budget is for the stages: the install above is not counted

    run_stage info stage_info
    run_stage numerics stage_numerics
    run_stage unit-gpu stage_unit_gpu
    run_stage mpi-1 stage_mpi 1
    run_stage mpi-2 stage_mpi 2
    run_stage demo-1 stage_demo 1 1,1
    run_stage demo-2 stage_demo 2 1,2
    run_stage demo-4 stage_demo 4 2,2
    run_stage bench-2 stage_bench 2
    run_stage bench-4 stage_bench 4
    run_stage mpi-4 stage_mpi 4

    {
        printf '\n===== summary (backend %s, %ss in all)\n' "$BACKEND" "$SECONDS"
        printf '%s\n' "${RESULTS[@]}"
        echo "GPU check: $((${#RESULTS[@]} - FAILED)) of ${#RESULTS[@]} stages passed"
    } | tee "$OUT/gpu_check_summary.txt"
    ((FAILED == 0))
}

mkdir -p "$OUT"
main "$@" 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
