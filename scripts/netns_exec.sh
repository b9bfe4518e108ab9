#!/usr/bin/env bash
# The "ssh" of the emulated cluster (scripts/emulate_cluster.sh): MPICH's hydra launches its proxy on a
# host with `LAUNCHER_EXEC [options] HOST COMMAND`; this enters HOST's network namespace and gives the
# command a host of its own (its own hostname and SysV IPC, as another machine would have), then runs it.
#   HYDRA_LAUNCHER=ssh HYDRA_LAUNCHER_EXEC=scripts/netns_exec.sh mpiexec -f HOSTFILE ...
set -euo pipefail
while [[ $# -gt 0 && "$1" == -* ]]; do shift; done  # ssh's options (hydra passes -x)
[[ $# -ge 2 ]] || { echo "netns_exec.sh: usage: netns_exec.sh [ssh options] HOST COMMAND..." >&2; exit 2; }
host="$1"; shift
ns="${SPMD_CLUSTER_PREFIX:-spmd}-$host"
if ! ip netns list | grep -qw -- "$ns"; then
    echo "netns_exec.sh: host '$host' is not a node of the emulated cluster (no network namespace '$ns'; start it" \
         "with scripts/emulate_cluster.sh up)" >&2
    exit 255  # what ssh exits with when it cannot reach the host
fi
exec ip netns exec "$ns" unshare --uts --ipc bash -c 'hostname "$0" && exec bash -c "$1"' "$host" "$*"
