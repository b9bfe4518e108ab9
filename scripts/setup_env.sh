# shellcheck shell=bash
# Source this file (scripts/test.sh and scripts/demo.sh do):
#
#     source scripts/setup_env.sh
#
# It makes sure <repo>/.venv exists and holds spmd_runtime installed editable
# with the extras in SPMD_EXTRAS (default "mpich,test,bf16,digest,weights"), activates it, and
# exports:
#   MPIEXEC              launcher to use (default: the venv's mpiexec; an
#                        MPIEXEC already in the environment wins)
#   SPMD_OVERSUBSCRIBE   flags that let MPIEXEC start more ranks than cores
#                        (empty for MPICH; --oversubscribe for Open MPI)
#   OMP_NUM_THREADS, OPENBLAS_NUM_THREADS, MKL_NUM_THREADS = 1 unless set
#
# Knobs (environment):
#   SPMD_VENV      venv path (default <repo>/.venv)
#   SPMD_PYTHON    interpreter for creating the venv (default: the newest
#                  python3.X >= 3.10 on PATH that works)
#   SPMD_EXTRAS    extras to install (default "mpich,test,bf16,digest,weights"; use "test,bf16,digest,weights" with
#                  an mpi4py built against your own MPI, see README.md)
#   SPMD_REINSTALL=1  force the pip install step
#
# A second run is fast: the install is skipped while the stamp file in the
# venv matches a hash of setup.cfg, pyproject.toml, the python and the extras.
# It works under `set -euo pipefail` and returns non-zero on failure.

_spmd_setup_env() {
    local root venv py extras stamp want have c

    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    venv="${SPMD_VENV:-$root/.venv}"
    extras="${SPMD_EXTRAS-mpich,test,bf16,digest,weights}"
    stamp="$venv/.spmd_install_stamp"

    _spmd_log() { printf '[setup_env] %s\n' "$*" >&2; }

    # -- 1. the venv --------------------------------------------------------
    if [[ -x "$venv/bin/python" ]] && ! "$venv/bin/python" -c 'import sys' >/dev/null 2>&1; then
        _spmd_log "venv $venv is broken (its python does not run); recreating it"
        rm -rf "$venv"
    fi
    if [[ ! -x "$venv/bin/python" ]]; then
        py="${SPMD_PYTHON:-}"
        if [[ -n "$py" ]] && ! "$py" -c 'import sys, venv; sys.exit(sys.version_info < (3, 10))' >/dev/null 2>&1; then
            _spmd_log "SPMD_PYTHON=$py does not run, is older than 3.10, or lacks the venv module"
            return 1
        fi
        if [[ -z "$py" ]]; then
            # Newest first. A pyenv shim for a version that is not active
            # exits non-zero, so every candidate is actually run.
            for c in python3.14 python3.13 python3.12 python3.11 python3.10 python3 python; do
                command -v "$c" >/dev/null 2>&1 || continue
                if "$c" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 10))' >/dev/null 2>&1; then
                    py="$c"
                    break
                fi
            done
        fi
        if [[ -z "$py" ]]; then
            _spmd_log "no working python3 >= 3.10 with the venv module found on PATH (set SPMD_PYTHON)"
            return 1
        fi
        _spmd_log "creating $venv with $(command -v "$py") ($("$py" -c 'import platform; print(platform.python_version())'))"
        "$py" -m venv "$venv" || { _spmd_log "python -m venv failed"; return 1; }
    fi

    # -- 2. activate (what bin/activate does, but safe under set -u) ------
    export VIRTUAL_ENV="$venv"
    [[ "$PATH" == "$venv/bin:"* ]] || export PATH="$venv/bin:$PATH"
    unset PYTHONHOME

    # -- 3. install the package (skipped when the stamp matches) ----------
    want="$(
        {
            cat "$root/setup.cfg" "$root/pyproject.toml" 2>/dev/null
            "$venv/bin/python" -c 'import sys; print(sys.version)'
            printf 'extras=%s\n' "$extras"
        } | { sha256sum 2>/dev/null || cksum; } | cut -d' ' -f1
    )"
    have="$(cat "$stamp" 2>/dev/null || true)"
    # Cheap sanity check that the key modules are still there (find_spec does
    # not import them, so this costs a few ms, not a second).
    local mods="'numpy', 'mpi4py'"
    case ",$extras," in *,test,*) mods="$mods, 'pytest', 'pytest_mpi', 'pytest_timeout', 'xdist', 'hypothesis'" ;; esac
    case ",$extras," in *,bf16,*) mods="$mods, 'ml_dtypes'" ;; esac
    case ",$extras," in *,digest,*) mods="$mods, 'xxhash'" ;; esac
    case ",$extras," in *,weights,*) mods="$mods, 'safetensors'" ;; esac
    local check="import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ($mods)))"
    if [[ "${SPMD_REINSTALL:-0}" != 1 && "$want" == "$have" ]] \
        && "$venv/bin/python" -c "$check" >/dev/null 2>&1; then
        :  # up to date
    else
        local spec="$root"
        [[ -n "$extras" ]] && spec="$root[$extras]"
        _spmd_log "installing spmd_runtime (editable) with extras [${extras}] into $venv ..."
        local t0=$SECONDS log="$venv/.spmd_pip.log"
        # pip's output goes to a log (it is chatty, and a pip.conf with
        # missing local indexes adds warnings); shown only on failure.
        if ! "$venv/bin/python" -m pip install -e "$spec" >"$log" 2>&1; then
            tail -n 40 "$log" >&2
            _spmd_log "pip install -e '$spec' failed (full log: $log)"
            rm -f "$stamp"
            return 1
        fi
        printf '%s\n' "$want" >"$stamp"
        _spmd_log "installed in $((SECONDS - t0))s"
    fi

    # -- 4. MPI launcher ----------------------------------------------------
    if [[ -z "${MPIEXEC:-}" ]]; then
        if [[ -x "$venv/bin/mpiexec" ]]; then
            MPIEXEC="$venv/bin/mpiexec"
        elif command -v mpiexec >/dev/null 2>&1; then
            MPIEXEC="$(command -v mpiexec)"
        else
            MPIEXEC=mpiexec
            _spmd_log "warning: no mpiexec found (install the mpich extra or put your MPI's bin/ on PATH)"
        fi
    fi
    export MPIEXEC

    # Open MPI refuses more ranks than cores, and refuses root, unless told;
    # MPICH (hydra) needs neither.
    SPMD_OVERSUBSCRIBE="${SPMD_OVERSUBSCRIBE-}"
    local first
    read -r first _ <<<"$MPIEXEC"
    if "$first" --version 2>/dev/null | grep -qiE 'open ?mpi|open ?rte|prrte'; then
        [[ -z "$SPMD_OVERSUBSCRIBE" ]] && SPMD_OVERSUBSCRIBE="--oversubscribe"
        if [[ "$(id -u)" == 0 ]]; then
            export OMPI_ALLOW_RUN_AS_ROOT="${OMPI_ALLOW_RUN_AS_ROOT:-1}"
            export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-1}"
        fi
    fi
    export SPMD_OVERSUBSCRIBE

    # -- 5. one BLAS/OpenMP thread per rank unless the caller chose -------
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
    export MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}"

    SPMD_ROOT="$root"
    export SPMD_ROOT
    unset -f _spmd_log
    return 0
}

_spmd_setup_env
_spmd_rc=$?
unset -f _spmd_setup_env
if [[ $_spmd_rc -ne 0 ]]; then
    unset _spmd_rc
    return 1 2>/dev/null || exit 1
fi
unset _spmd_rc
