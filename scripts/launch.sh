#!/usr/bin/env bash
# Launch an spmd_runtime program on a cluster with whatever MPI launcher is there.
#
#   scripts/launch.sh [-n RANKS] [--ranks-per-node K] [--hostfile F]
#                     [--launcher auto|mpiexec|mpirun|srun] [--dry-run]
#                     -- python -m spmd_runtime run PROGRAM --inputs in.npz --out out.npz
#
# --launcher auto (default):
#   srun     inside a Slurm allocation (SLURM_JOB_ID set) and srun on PATH:
#              srun [-n N] [--ntasks-per-node=K] [--mpi=$SPMD_SRUN_MPI] CMD
#   mpirun   when `mpirun --version` says Open MPI:
#              mpirun -n N [--hostfile F] [--map-by ppr:K:node] --bind-to none
#                     -x SPMD_... -x PATH ... CMD
#   mpiexec  otherwise (MPICH / Intel MPI hydra):
#              mpiexec -n N [-ppn K] [-f F] CMD
# An explicit --launcher mpiexec|mpirun still checks which MPI the binary
# belongs to and uses that MPI's flags. MPIEXEC / MPIRUN in the environment
# override the binaries (e.g. MPIEXEC=/opt/mpich/bin/mpiexec).
#
# GPUs: one per rank. SPMD_DEVICE is removed from the environment so that
# each rank picks GPU (node-local rank % visible GPUs) itself.
#
# -n may be left out under srun (the allocation decides), or when both
# --hostfile and --ranks-per-node are given (N = K x hosts in the file).
# The command is printed (to stderr) before it runs; --dry-run prints it to
# stdout and runs nothing.
set -euo pipefail

usage() {
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    exit "${1:-0}"
}
die() { echo "launch.sh: $*" >&2; exit 2; }

ranks="" ppn="" hostfile="" launcher=auto dry=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        -n|--ranks|-np) [[ $# -ge 2 ]] || die "$1 needs a value"; ranks="$2"; shift 2 ;;
        -n=*|--ranks=*) ranks="${1#*=}"; shift ;;
        --ranks-per-node|-ppn|--ppn) [[ $# -ge 2 ]] || die "$1 needs a value"; ppn="$2"; shift 2 ;;
        --ranks-per-node=*) ppn="${1#*=}"; shift ;;
        --hostfile|-f) [[ $# -ge 2 ]] || die "$1 needs a value"; hostfile="$2"; shift 2 ;;
        --hostfile=*) hostfile="${1#*=}"; shift ;;
        --launcher) [[ $# -ge 2 ]] || die "$1 needs a value"; launcher="$2"; shift 2 ;;
        --launcher=*) launcher="${1#*=}"; shift ;;
        --dry-run) dry=1; shift ;;
        -h|--help) usage 0 ;;
        --) shift; break ;;
        *) die "unknown option '$1' (the program goes after --; see --help)" ;;
    esac
done
[[ $# -gt 0 ]] || die "no program given: put it after --, e.g. -- python -m spmd_runtime run prog.py"
[[ -z "$ranks" || "$ranks" =~ ^[1-9][0-9]*$ ]] || die "-n wants a positive integer, got '$ranks'"
[[ -z "$ppn" || "$ppn" =~ ^[1-9][0-9]*$ ]] || die "--ranks-per-node wants a positive integer, got '$ppn'"
if [[ -n "$hostfile" && "$dry" -eq 0 && ! -r "$hostfile" ]]; then
    die "hostfile '$hostfile' is not readable"
fi

# Which MPI does a launcher binary belong to? openmpi | hydra | unknown
mpi_flavor() {
    local v
    v="$("$1" --version 2>&1 || true)"
    if grep -qiE 'open ?mpi|open ?rte|prrte' <<<"$v"; then
        echo openmpi
    elif grep -qiE 'hydra|mpich|intel' <<<"$v"; then
        echo hydra
    else
        echo unknown
    fi
}

have() { command -v "$1" >/dev/null 2>&1; }

mpirun_bin="${MPIRUN:-mpirun}"
mpiexec_bin="${MPIEXEC:-mpiexec}"
case "$launcher" in
    auto)
        if [[ -n "${SLURM_JOB_ID:-}" ]] && have srun; then
            launcher=srun
        elif have "$mpirun_bin" && [[ "$(mpi_flavor "$mpirun_bin")" == openmpi ]]; then
            launcher=mpirun
        elif have "$mpiexec_bin"; then
            launcher=mpiexec
        elif have "$mpirun_bin"; then
            launcher=mpirun
        else
            die "no launcher found: no srun in a Slurm job, no mpirun, no mpiexec on PATH"
        fi
        ;;
    mpiexec|mpirun|srun) ;;
    *) die "--launcher must be auto, mpiexec, mpirun or srun; got '$launcher'" ;;
esac

case "$launcher" in
    srun) bin=srun; flavor=slurm ;;
    mpirun) bin="$mpirun_bin"; flavor="$(mpi_flavor "$bin")" ;;
    mpiexec) bin="$mpiexec_bin"; flavor="$(mpi_flavor "$bin")" ;;
esac
if [[ "$dry" -eq 0 ]] && ! have "$bin"; then
    die "launcher '$bin' not found on PATH"
fi

# Ranks from hostfile x ranks-per-node when -n is not given.
if [[ -z "$ranks" && "$flavor" != slurm ]]; then
    if [[ -n "$hostfile" && -n "$ppn" && -r "$hostfile" ]]; then
        nhosts="$(sed -e 's/#.*//' -e 's/[[:space:]:].*//' "$hostfile" | grep -v '^$' | sort -u | wc -l)"
        ranks=$((nhosts * ppn))
    else
        die "give -n RANKS (or --hostfile with --ranks-per-node)"
    fi
fi

# One GPU per rank: the runtime picks it from the node-local rank.
if [[ -n "${SPMD_DEVICE:-}" ]]; then
    echo "launch.sh: note: unsetting SPMD_DEVICE=$SPMD_DEVICE so each rank picks its own GPU" >&2
fi
unset SPMD_DEVICE

cmd=("$bin")
case "$flavor" in
    slurm)
        [[ -n "$ranks" ]] && cmd+=(-n "$ranks")
        [[ -n "$ppn" ]] && cmd+=("--ntasks-per-node=$ppn")
        [[ -n "${SPMD_SRUN_MPI:-}" ]] && cmd+=("--mpi=$SPMD_SRUN_MPI")
        if [[ -n "$hostfile" ]]; then
            echo "launch.sh: warning: --hostfile is ignored under srun (the Slurm allocation decides the nodes)" >&2
        fi
        ;;
    openmpi)
        cmd+=(-n "$ranks")
        [[ -n "$hostfile" ]] && cmd+=(--hostfile "$hostfile")
        [[ -n "$ppn" ]] && cmd+=(--map-by "ppr:$ppn:node")
        cmd+=(--bind-to none)
        [[ "$(id -u)" == 0 ]] && cmd+=(--allow-run-as-root)
        # Open MPI only forwards OMPI_* to remote nodes: export the rest by name.
        while IFS= read -r var; do
            cmd+=(-x "$var")
        done < <(compgen -e | grep -E '^(SPMD_|OMP_NUM_THREADS$|OPENBLAS_NUM_THREADS$|MKL_NUM_THREADS$|PYTHONPATH$|VIRTUAL_ENV$|PATH$|LD_LIBRARY_PATH$|UCX_)' | sort)
        ;;
    hydra)
        cmd+=(-n "$ranks")
        [[ -n "$ppn" ]] && cmd+=(-ppn "$ppn")
        [[ -n "$hostfile" ]] && cmd+=(-f "$hostfile")
        ;;
    *)
        echo "launch.sh: warning: could not tell which MPI '$bin' belongs to; passing only -n" >&2
        cmd+=(-n "$ranks")
        [[ -n "$ppn" || -n "$hostfile" ]] && echo "launch.sh: warning: --ranks-per-node/--hostfile not passed to '$bin'" >&2
        ;;
esac
cmd+=("$@")

if [[ "$dry" -eq 1 ]]; then
    printf '%q ' "${cmd[@]}" | sed 's/ $//'
    echo
    exit 0
fi
{ printf '+ '; printf '%q ' "${cmd[@]}" | sed 's/ $//'; echo; } >&2
exec "${cmd[@]}"
