#!/usr/bin/env bash
# A multi-node cluster on one machine, for tests: K "hosts", each a network namespace with its own address,
# hostname and SysV IPC, joined by a bridge; MPICH's hydra launches across them through
# scripts/netns_exec.sh (which enters a host as ssh would). Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN),
# iproute2 and util-linux's unshare.
#
#   scripts/emulate_cluster.sh check                  # can this machine do it? (exit 0 / 1, says why)
#   scripts/emulate_cluster.sh up [--nodes K] [--ranks-per-node R]   # hosts node1..nodeK (default 2, R 2);
#        # writes the hostfile
#   scripts/emulate_cluster.sh run [--nodes K] [--ranks-per-node R] -- CMD...
#        # up if needed, then scripts/launch.sh --hostfile HOSTFILE --ranks-per-node R -- CMD (default R 2)
#   scripts/emulate_cluster.sh env                    # the exports that point hydra at the cluster
#   scripts/emulate_cluster.sh down                   # removes the namespaces and the bridge
#
# Addresses: 10.77.0.1 (this machine, on the bridge spmd-br), node i at 10.77.0.(10+i); nothing outside the
# namespaces is touched. SPMD_CLUSTER_DIR (default /tmp/spmd_cluster) holds the hostfile ("nodeI:R" lines);
# SPMD_CLUSTER_PREFIX (default spmd: namespaces spmd-nodeI, bridge spmd-br) and SPMD_CLUSTER_NET (default
# 10.77.0) let a second cluster (the tests') stand beside a user's.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PREFIX="${SPMD_CLUSTER_PREFIX:-spmd}"
BRIDGE="$PREFIX-br"
DIR="${SPMD_CLUSTER_DIR:-/tmp/spmd_cluster}"
NET="${SPMD_CLUSTER_NET:-10.77.0}"  # a /24: this machine .1, node i .(10+i)
die() { echo "emulate_cluster.sh: $*" >&2; exit 2; }

check() {
    local why=""
    command -v ip >/dev/null || why="no 'ip' (iproute2)"
    command -v unshare >/dev/null || why="${why:+$why; }no 'unshare' (util-linux)"
    if [[ -z "$why" ]]; then
        ip netns add "$PREFIX-probe" 2>/dev/null && ip netns del "$PREFIX-probe" || why="cannot create a network namespace (needs root or CAP_NET_ADMIN)"
    fi
    if [[ -z "$why" ]]; then
        unshare --uts --ipc true 2>/dev/null || why="cannot unshare the UTS and IPC namespaces (needs CAP_SYS_ADMIN)"
    fi
    if [[ -n "$why" ]]; then
        echo "emulate_cluster.sh: this machine cannot emulate a cluster: $why" >&2
        return 1
    fi
    echo "emulate_cluster.sh: this machine can emulate a cluster"
}

nodes_up() { ip netns list | grep -o "^$PREFIX-node[0-9]*" | sort -V; }

up() {
    local nodes="$1" ppn="$2"
    [[ "$nodes" =~ ^[1-9][0-9]?$ && "$nodes" -le 200 ]] || die "--nodes wants 1 to 200; got '$nodes'"
    check >/dev/null || check
    if [[ "$(nodes_up | wc -l)" -ne 0 && "$(nodes_up | wc -l)" -ne "$nodes" ]]; then
        die "a cluster of $(nodes_up | wc -l) nodes is up; run '$0 down' first"
    fi
    ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
    ip addr show dev "$BRIDGE" | grep -q "$NET.1/" || ip addr add "$NET.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    mkdir -p "$DIR"
    : > "$DIR/hostfile.tmp"
    for i in $(seq 1 "$nodes"); do
        local ns="$PREFIX-node$i"
        if ! ip netns list | grep -qw "$ns"; then
            ip netns add "$ns"
            ip link add "$PREFIX-veth$i" type veth peer name eth0 netns "$ns"
            ip link set "$PREFIX-veth$i" master "$BRIDGE" up
            ip -n "$ns" addr add "$NET.$((10 + i))/24" dev eth0
            ip -n "$ns" link set eth0 up
            ip -n "$ns" link set lo up
        fi
        echo "node$i:$ppn" >> "$DIR/hostfile.tmp"
    done
    mv "$DIR/hostfile.tmp" "$DIR/hostfile"
    echo "emulate_cluster.sh: $nodes hosts up (node1..node$nodes, bridge $BRIDGE); hostfile $DIR/hostfile"
}

down() {
    for ns in $(nodes_up); do ip netns del "$ns"; done  # deleting a namespace deletes its veth pair
    ip link show "$BRIDGE" >/dev/null 2>&1 && ip link del "$BRIDGE"
    rm -f "$DIR/hostfile"
    echo "emulate_cluster.sh: down"
}

env_lines() {
    echo "export HYDRA_LAUNCHER=ssh HYDRA_LAUNCHER_EXEC=$HERE/netns_exec.sh HYDRA_IFACE=$BRIDGE" \
         "SPMD_CLUSTER_PREFIX=$PREFIX HYDRA_HOST_FILE=$DIR/hostfile"
}

cmd="${1:-}"; [[ $# -gt 0 ]] && shift
nodes=2 ppn=2
while [[ $# -gt 0 && "$1" != -- ]]; do
    case "$1" in
        --nodes) nodes="${2:?--nodes needs a value}"; shift 2 ;;
        --ranks-per-node) ppn="${2:?--ranks-per-node needs a value}"; shift 2 ;;
        *) die "unknown option '$1' (see the top of $0)" ;;
    esac
done
[[ "${1:-}" == -- ]] && shift
case "$cmd" in
    check) check ;;
    up) up "$nodes" "$ppn" ;;
    down) down ;;
    env) env_lines ;;
    run)
        [[ $# -gt 0 ]] || die "run needs a command after --"
        up "$nodes" "$ppn" >/dev/null
        eval "$(env_lines)"
        exec "$HERE/launch.sh" --launcher mpiexec --hostfile "$DIR/hostfile" --ranks-per-node "$ppn" -- "$@" ;;
    *) die "usage: $0 check|up|run|env|down [--nodes K] [--ranks-per-node R] [-- CMD...]" ;;
esac
