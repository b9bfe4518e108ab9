#!/usr/bin/env bash
# Download into .whl/ the wheels the lent GPU machine (nvidia-h200: Python 3.12,
# x86-64, no network) needs and its image lacks: MPICH (libmpi + mpiexec),
# mpi4py built for it, and pytest-mpi. Run it HERE, where PyPI is reachable;
# scripts/gpu_check.sh installs them there. See docs/GPU.md.
#
#   scripts/fetch_gpu_wheels.sh            # default pins below
#   MPI4PY_VERSION=4.1.1 scripts/fetch_gpu_wheels.sh
#
# The pins are the versions this project's venv is tested with (setup.cfg's
# mpich and test extras). Exactly one version of each is kept: the device's
# `pip install .whl/*.whl` refuses two versions of one package. .whl/ is
# git-ignored; it travels only when a device call names it in `carry`, and it
# counts towards that call's 64 MiB working-tree limit.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-python3}"
DEST=.whl
PINS=(
    "mpich==${MPICH_VERSION:-5.0.2}"
    "mpi4py==${MPI4PY_VERSION:-4.1.2}"
    "pytest-mpi==${PYTEST_MPI_VERSION:-0.6}"
)
# The device's Python and platform, not this machine's (recipe from the device
# tool's README). pip matches manylinux_2_N exactly, hence the list of N.
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
LIMIT_MIB=48  # of the 64 MiB a device call may carry, leave room for the repo itself

mkdir -p "$DEST"
for pin in "${PINS[@]}"; do
    name="${pin%%==*}" version="${pin#*==}"
    # Any other version already here would break the install there: drop it.
    for old in "$DEST/${name//-/_}"-*.whl; do
        if [[ -e "$old" && "$(basename "$old")" != "${name//-/_}-$version-"* ]]; then
            rm -v "$old"
        fi
    done
    "$PYTHON" -m pip download -q --no-deps "${TARGET[@]}" -d "$DEST" "$pin"
done

echo "wheels in $DEST:"
for whl in "$DEST"/*.whl; do
    printf '  %7.2f MiB  %s\n' "$(stat -c %s "$whl" | awk '{ print $1 / 1048576 }')" "$(basename "$whl")"
    # --no-deps above: show what each wheel asks for, so a need the image lacks shows up here.
    deps="$(unzip -p "$whl" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' || true)"
    if [[ -n "$deps" ]]; then
        sed 's/^/               /' <<<"$deps"
    fi
done
total_bytes="$(cat "$DEST"/*.whl | wc -c)"
printf 'total: %.2f MiB (this script allows %s MiB)\n' "$(awk -v b="$total_bytes" 'BEGIN { print b / 1048576 }')" "$LIMIT_MIB"
if ((total_bytes > LIMIT_MIB * 1048576)); then
    echo "the wheels must stay under ${LIMIT_MIB} MiB so the repo still fits a device call's 64 MiB; got $total_bytes bytes" >&2
    exit 1
fi
