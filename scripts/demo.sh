#!/usr/bin/env bash
# Run the transformer demo on 8 ranks: scripts/demo.sh [demo args...]
# (SPMD_DEMO_RANKS overrides the rank count; see scripts/setup_env.sh for the
# environment knobs.) Relative paths in the arguments are taken from the
# directory you run it from.
set -euo pipefail
# shellcheck source=scripts/setup_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
read -r -a MPIEXEC_CMD <<<"$MPIEXEC"
read -r -a OVERSUB <<<"${SPMD_OVERSUBSCRIBE:-}"
exec "${MPIEXEC_CMD[@]}" ${OVERSUB[@]+"${OVERSUB[@]}"} -n "${SPMD_DEMO_RANKS:-8}" \
    python "$SPMD_ROOT/scripts/demo_transformer.py" "$@"
