#!/usr/bin/env bash
# A Slurm cluster of N nodes on this machine, for tests: each node a network
# namespace on a private bridge, with its own host name, /etc/hosts, /dev/shm and
# slurmd; slurmctld and munged run outside the nodes. The nodes share the file
# system.
#
#   bash tools/cluster.sh install    # only install the packages (tools/setup.sh --all)
#   bash tools/cluster.sh up [N]     # N nodes (default 3: node1 ... nodeN)
#   bash tools/cluster.sh status     # what is up; exit 1 when the cluster is not
#   bash tools/cluster.sh down       # stop and remove all of it
#   bash tools/cluster.sh env        # the shell lines that point Slurm's commands
#                                    # at it: eval "$(bash tools/cluster.sh env)"
#   bash tools/cluster.sh on NODE COMMAND...  # run COMMAND as on NODE (its network,
#                                    # host name and /etc/hosts)
#
# Needs root. Installs Debian's slurmd, slurmctld, slurm-client, munge, libpmix-dev
# (for srun --mpi=pmix) and nftables where they are missing. Running `up` twice is
# safe (the second says it is up), and `up` over a half-made cluster removes that
# first; `down` with nothing up does nothing.
#
# The network: the bridge m4jd-br holds $NET.1 (slurmctld's address); node K has
# $NET.(10+K) on its eth0 and no default route, and the bridge forwards nothing to
# other interfaces, so that traffic stays between the namespaces made here. Each
# node's /etc/hosts is Debian's: its own name on 127.0.1.1 first (the trap that
# makes a host name a bad address for other nodes), then every node's bridge
# address. The machine's own /etc/hosts is not touched.
#
# Variables (optional): CLUSTER_STATE, where its files go (default
# /run/mpi4jax_dist-cluster); CLUSTER_NET, the first three numbers of its /24
# (default 10.77.0), which must be in use nowhere on this machine.
set -euo pipefail

STATE=${CLUSTER_STATE:-/run/mpi4jax_dist-cluster}
NET=${CLUSTER_NET:-10.77.0}
BRIDGE=m4jd-br
PREFIX=m4jd-          # of the namespaces (m4jd-node1) and host-side veths (m4jd-v1)
CONF=$STATE/slurm.conf
PORTS=(6817 6818)     # slurmctld's, each slurmd's (in its own namespace)

say() { echo "cluster.sh: $*"; }
die() { echo "cluster.sh: $*" >&2; exit 1; }

node_count() { cat "$STATE/nodes" 2>/dev/null || echo 0; }
# The namespaces this script made (also those an interrupted run left).
node_namespaces() { ip netns list 2>/dev/null | awk '{print $1}' | grep "^${PREFIX}node" || true; }
node_address() { echo "$NET.$((10 + $1))"; }

# --- installing ------------------------------------------------------------------------

install_packages() {
    local missing=()
    command -v slurmd >/dev/null || missing+=(slurmd)
    command -v slurmctld >/dev/null || missing+=(slurmctld)
    command -v srun >/dev/null || missing+=(slurm-client)
    command -v munged >/dev/null || missing+=(munge)
    compgen -G "/usr/lib/*/libpmix.so" >/dev/null \
        || missing+=(libpmix-dev)
    command -v nft >/dev/null || missing+=(nftables)
    command -v nsenter >/dev/null || missing+=(util-linux)
    command -v ip >/dev/null || missing+=(iproute2)
    [ ${#missing[@]} -gt 0 ] || return 0
    say "installing ${missing[*]} from Debian's packages"
    command -v apt-get >/dev/null || die "no apt-get: install ${missing[*]} by hand"
    # The image's policy-rc.d keeps their services from starting: this script
    # starts its own daemons.
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null \
        || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >/dev/null || die "apt-get install ${missing[*]} failed"
}

# --- checks ------------------------------------------------------------------------------

check_free() {
    # The subnet must be ours alone: no address or route of it on this machine.
    if ip -4 addr show | grep -q " $NET\." || ip -4 route show | grep -q "^$NET\."; then
        die "$NET.0/24 is already in use on this machine ($(ip -4 -o addr show \
            | grep " $NET\." | awk '{print $2, $4}' | head -1)); set CLUSTER_NET to an \
unused private /24, e.g. CLUSTER_NET=10.78.0"
    fi
    local port
    for port in "${PORTS[@]}"; do
        if ss -Hltn "sport = :$port" | grep -q .; then
            die "port $port (Slurm's) is taken on this machine: $(ss -Hltnp \
                "sport = :$port" | head -1)"
        fi
    done
}

# --- up ---------------------------------------------------------------------------------

write_files() {
    local n=$1 k host
    host=$(hostname -s)
    mkdir -p "$STATE/ctld"
    chmod 755 "$STATE"
    echo "$n" >"$STATE/nodes"
    # One munge key for all: the nodes share this machine's munged.
    dd if=/dev/urandom of="$STATE/munge.key" bs=1024 count=1 status=none
    chmod 400 "$STATE/munge.key"
    for k in $(seq 1 "$n"); do
        mkdir -p "$STATE/node$k/spool" "$STATE/node$k/tmp"
        chmod 1777 "$STATE/node$k/tmp"
        {
            echo "127.0.0.1 localhost"
            echo "127.0.1.1 node$k"
            for j in $(seq 1 "$n"); do echo "$(node_address "$j") node$j"; done
            echo "$NET.1 $host"
        } >"$STATE/node$k/hosts"
    done
    cat >"$CONF" <<EOF
# Written by tools/cluster.sh; removed by its down.
ClusterName=m4jd
SlurmctldHost=$host($NET.1)
SlurmctldPort=${PORTS[0]}
SlurmdPort=${PORTS[1]}
AuthType=auth/munge
AuthInfo=socket=$STATE/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$STATE/ctld
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdSpoolDir=$STATE/%n/spool
SlurmdPidFile=$STATE/%n/slurmd.pid
SlurmdLogFile=$STATE/%n/slurmd.log
# Each node's own: srun --mpi=pmix keeps files there under names alike on all nodes.
TmpFS=$STATE/%n/tmp
# Every node claims this machine's cores.
SlurmdParameters=config_overrides
GresTypes=gpu
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# A job whose task fails ends, as at most sites; tasks that outlive a cancel get
# SIGKILL 5 s after SIGTERM (sites wait 30 s; the tests here cancel often).
KillOnBadExit=1
KillWait=5
MinJobAge=30
InactiveLimit=0
# A node that stops answering is down after 15 s (sites: 300 s), and its jobs end.
SlurmdTimeout=15
EOF
    for k in $(seq 1 "$n"); do
        echo "NodeName=node$k NodeAddr=$(node_address "$k") CPUs=2 Gres=gpu:4 \
State=UNKNOWN" >>"$CONF"
    done
    # Four GPUs per node, as counts only (no devices): job scripts written for GPU
    # nodes (--gpus-per-node) run here as they are, on the CPU.
    printf "Name=gpu File=%s\n" /dev/null /dev/zero /dev/full /dev/urandom >"$STATE/gres.conf"
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP \
OverSubscribe=YES" >>"$CONF"
}

make_network() {
    local n=$1 k ns veth
    ip link add "$BRIDGE" type bridge || die "could not make the bridge $BRIDGE"
    ip addr add "$NET.1/24" dev "$BRIDGE"
    # Nothing that arrives on the bridge goes anywhere else.
    sysctl -qw "net.ipv4.conf.$BRIDGE.forwarding=0"
    sysctl -qw "net.ipv6.conf.$BRIDGE.disable_ipv6=1"
    ip link set "$BRIDGE" up
    for k in $(seq 1 "$n"); do
        ns=${PREFIX}node$k veth=${PREFIX}v$k
        ip netns add "$ns" || die "could not make the namespace $ns"
        ip link add "$veth" type veth peer name eth0 netns "$ns" \
            || die "could not make the veth pair $veth"
        ip link set "$veth" master "$BRIDGE" up
        ip -n "$ns" addr add "$(node_address "$k")/24" dev eth0
        ip -n "$ns" link set lo up
        ip -n "$ns" link set eth0 up
    done
}

start_daemons() {
    local n=$1 k
    munged --force --socket="$STATE/munge.socket" --key-file="$STATE/munge.key" \
        --pid-file="$STATE/munged.pid" --log-file="$STATE/munged.log" \
        --seed-file="$STATE/munged.seed" \
        || die "munged did not start"
    slurmctld -f "$CONF" || die "slurmctld did not start"
    for k in $(seq 1 "$n"); do
        # Only the network namespace is entered (ip netns exec would remount /sys,
        # and slurmd then finds no cgroups); the node's own host name, /etc/hosts
        # and /dev/shm (MPI's shared memory: what a killed job leaves there stays
        # on its node, and goes with it) come from new UTS and mount namespaces,
        # which live as long as the processes in them. The file systems stay
        # shared, as a cluster's home and project ones are (a clone of the project
        # under /tmp too).
        nsenter --net="/run/netns/${PREFIX}node$k" \
            unshare --uts --mount --propagation private \
            sh -ec "hostname node$k
                    mount --bind '$STATE/node$k/hosts' /etc/hosts
                    mount -t tmpfs -o mode=1777 m4jd-shm /dev/shm
                    exec slurmd -f '$CONF' -N node$k" \
            || die "slurmd of node$k did not start"
    done
}

wait_ready() {
    local n=$1 deadline=$((SECONDS + 60)) idle
    while :; do
        idle=$(SLURM_CONF=$CONF sinfo -h -N -o "%N %T" 2>/dev/null | grep -c " idle$" || true)
        [ "$idle" -eq "$n" ] && return 0
        if [ $SECONDS -ge $deadline ]; then
            SLURM_CONF=$CONF sinfo -N >&2 || true
            die "only $idle of $n nodes idle after 60 s"
        fi
        sleep 0.5
    done
}

up() {
    local n=${1:-3}
    [[ $n =~ ^[1-9][0-9]?$ ]] || die "up $n: expected a node count from 1 to 99"
    [ "$(id -u)" -eq 0 ] || die "needs root (namespaces, a bridge, daemons)"
    if status >/dev/null 2>&1; then
        if [ "$(node_count)" -eq "$n" ]; then
            say "up already: $n nodes"
            return 0
        fi
        die "up already with $(node_count) nodes; run down first for $n"
    fi
    if [ -e "$STATE" ] || ip link show "$BRIDGE" >/dev/null 2>&1; then
        say "removing what an earlier run left"
        down
    fi
    install_packages
    check_free
    local start=$SECONDS
    # A failure from here on shows the daemons' logs and removes what was made.
    trap up_failed EXIT
    write_files "$n"
    make_network "$n"
    start_daemons "$n"
    wait_ready "$n"
    trap - EXIT
    say "up: $n nodes ($(node_address 1)...$(node_address "$n")) in $((SECONDS - start)) s;" \
        "eval \"\$(bash $0 env)\" for sbatch, srun, salloc"
}

up_failed() {
    local log
    for log in "$STATE"/*.log "$STATE"/node*/slurmd.log; do
        [ -f "$log" ] || continue
        echo "--- $log" >&2
        tail -n 5 "$log" >&2
    done
    say "up failed (logs above): removing what it made" >&2
    down >/dev/null 2>&1 || true
}

# --- down -------------------------------------------------------------------------------

stop_pidfile() {
    local file=$1 pid
    [ -f "$file" ] || return 0
    pid=$(cat "$file")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
}

down() {
    local ns pids
    # Jobs first, while slurmctld can still end them; then everything that runs in
    # a node (slurmd, slurmstepd, tasks that outlived them), then the daemons.
    if [ -f "$CONF" ] && [ -f "$STATE/slurmctld.pid" ]; then
        SLURM_CONF=$CONF timeout 10 scancel --quiet --full "--user=$(id -un)" 2>/dev/null || true
    fi
    for ns in $(node_namespaces); do
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
    done
    stop_pidfile "$STATE/slurmctld.pid"
    stop_pidfile "$STATE/munged.pid"
    for ns in $(node_namespaces); do
        ip netns del "$ns" || say "could not remove the namespace $ns"
    done
    if ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link del "$BRIDGE" || say "could not remove the bridge $BRIDGE"
    fi
    rm -rf "$STATE"
    say "down"
}

# --- status, env, on ----------------------------------------------------------------

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

status() {
    local n ok=0 k
    n=$(node_count)
    if [ "$n" -eq 0 ]; then
        say "down"
        return 1
    fi
    ip link show "$BRIDGE" >/dev/null 2>&1 || { say "no bridge $BRIDGE"; ok=1; }
    alive "$STATE/munged.pid" || { say "munged is not running"; ok=1; }
    alive "$STATE/slurmctld.pid" || { say "slurmctld is not running"; ok=1; }
    for k in $(seq 1 "$n"); do
        [ -e "/run/netns/${PREFIX}node$k" ] || { say "no namespace ${PREFIX}node$k"; ok=1; }
        alive "$STATE/node$k/slurmd.pid" || { say "slurmd of node$k is not running"; ok=1; }
    done
    if [ $ok -eq 0 ]; then
        say "up: $n nodes"
        SLURM_CONF=$CONF sinfo -N
    fi
    return $ok
}

on() {
    local node=${1:?on NODE COMMAND...} pid
    shift
    pid=$(cat "$STATE/$node/slurmd.pid" 2>/dev/null) || die "no node $node"
    nsenter --target "$pid" --net --uts --mount -- "$@"
}

case "${1:-}" in
    install) install_packages ;;
    up) shift; up "$@" ;;
    down) down ;;
    status) status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    on) shift; on "$@" ;;
    *) die "usage: bash tools/cluster.sh install | up [N] | status | down | env | on NODE COMMAND..." ;;
esac
