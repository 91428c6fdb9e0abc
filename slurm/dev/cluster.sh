#!/usr/bin/env bash
# A throw-away multi-node Slurm cluster on one machine, for tests and demos (root only).
#
#   cluster.sh up STATE_DIR [NODES]   start munged, slurmctld and NODES slurmd (default 2)
#   cluster.sh down STATE_DIR         stop everything and remove the network; safe to repeat
#   cluster.sh status STATE_DIR       exit 0 when every daemon runs, 1 otherwise
#   cluster.sh node-down STATE_DIR NODE   NODE loses power: SIGKILL to its slurmd and every
#                                     process in its namespace (its tasks); `up` restarts it
#   cluster.sh restart-ctld STATE_DIR  stop and start slurmctld (jobs live on)
# Exit codes: 0 ok, 1 error, 2 usage, 3 busy (every network slot is taken).
#
# Clusters in different STATE_DIRs run side by side (two test runs on one machine must not
# see each other): `up` takes the first free slot K (0..7) and records it in STATE/slot and
# GLOBAL_DIR/slot-K. Node nI is a slurmd in its own network namespace enn-sK-nI (address
# 10.214.K.(10+I)) on the bridge enn-brK (10.214.K.1, where slurmctld listens on port
# 6920+K), with its own hostname and its own /etc/hosts, and 8 fake GPUs; STATE/network
# names the slot's bridge, prefix and port. A slot is free only when nothing of it exists
# (record, bridge, addresses, namespaces): `up` never touches a network it did not make. The filesystem is the host's, so jobs can run any local path
# (a venv's python). Everything else (configs, munge key, state, logs, pid files) lives in
# STATE_DIR; `source STATE_DIR/env.sh` points the Slurm clients at it.
# Environment knobs: ENN_SLURM_CPUS (CPUs per node, default 4), ENN_SLURM_UP_TIMEOUT (s, 60),
# ENN_SLURM_PYXIS (unset: no containers; 0 or 1: load Pyxis with use_squashfuse=0 or 1; needs
# ../shared/tools/pyxis-enroot/install.sh run first), ENN_PYXIS_PREFIX (/opt/enn-pyxis).
# With Pyxis every node gets its own Enroot directories: enroot.conf.d points them at
# PYXIS_NODE_DIR, which each slurmd's private mount namespace binds to STATE/nodelocal/nI.
set -euo pipefail
shopt -s nullglob

readonly GLOBAL_DIR=/run/enn-slurm-dev   # lock and slot records, shared by all STATE_DIRs
readonly MAX_SLOTS=8
readonly GPUS_PER_NODE=8
readonly MEM_PER_NODE_MB=4000
readonly MAX_NODES=50
# Per slot (see use_slot): SLOT BRIDGE NET_PREFIX CTLD_ADDR NS_PREFIX CTLD_PORT.
SLOT="" BRIDGE="" NET_PREFIX="" CTLD_ADDR="" NS_PREFIX="" CTLD_PORT=""
readonly CPUS_PER_NODE="${ENN_SLURM_CPUS:-4}"
readonly UP_TIMEOUT_S="${ENN_SLURM_UP_TIMEOUT:-60}"
readonly PYXIS="${ENN_SLURM_PYXIS:-}"
readonly PYXIS_PREFIX="${ENN_PYXIS_PREFIX:-/opt/enn-pyxis}"
readonly PYXIS_NODE_DIR=/var/tmp/enn-pyxis-node   # empty on the host; bound per node

die() { echo "cluster.sh: error: $*" >&2; exit 1; }
log() { echo "cluster.sh: $*" >&2; }

usage() {
    echo "usage: $0 up STATE_DIR [NODES] | down STATE_DIR | status STATE_DIR" \
        "| node-down STATE_DIR NODE | restart-ctld STATE_DIR" >&2
    exit 2
}

# Tools for COMMAND: down needs only what it takes to stop processes and delete links.
require_tools() {
    [[ "$(id -u)" == 0 ]] || die "must run as root (network namespaces, mknod)"
    local tool tools=(ip flock)
    if [[ "$1" == up ]]; then
        tools+=(nsenter unshare mknod mountpoint runuser munged mungekey slurmctld slurmd)
        tools+=(sinfo sbatch scontrol)
    fi
    for tool in "${tools[@]}"; do
        command -v "$tool" >/dev/null 2>&1 \
            || die "$tool not found (run slurm/dev/install-deps.sh)"
    done
    if [[ "$1" == up ]]; then
        id munge >/dev/null 2>&1 || die "no munge user (install the munge package)"
    fi
}

# Serialise up/down of all clusters on this machine; fd 9 must not leak into daemons.
take_global_lock() {
    mkdir -p "$GLOBAL_DIR"
    exec 9>"$GLOBAL_DIR/lock"
    flock -w 120 9 || die "timed out waiting for $GLOBAL_DIR/lock"
}

# ---------------------------------------------------------------- network slots

# Sets the names of slot K's network. Namespaces enn-sK-n1..; host-side veths enn-sK-n1-br..
use_slot() {
    SLOT="$1"
    BRIDGE="enn-br$1"
    NET_PREFIX="10.214.$1"
    CTLD_ADDR="$NET_PREFIX.1"
    NS_PREFIX="enn-s$1-n"
    CTLD_PORT=$((6920 + $1))
}

slot_owner() { cat "$GLOBAL_DIR/slot-$1" 2>/dev/null || true; }

# True when nothing of slot K exists: no record, no bridge, no address, no namespace.
slot_free() {
    use_slot "$1"
    [[ -z "$(slot_owner "$1")" ]] || return 1
    ! ip link show "$BRIDGE" >/dev/null 2>&1 || return 1
    [[ -z "$(ip -4 -o addr show to "$NET_PREFIX.0/24")" ]] || return 1
    [[ -z "$(our_namespaces)" ]]
}

# The slot STATE used before when it is still ours or free (a restart keeps its addresses
# and slurm.conf), else the first free one; exits 3 when none is.
choose_slot() {
    local k
    k="$(cat "$STATE/slot" 2>/dev/null || true)"
    if [[ "$k" =~ ^[0-9]+$ && "$k" -lt "$MAX_SLOTS" ]]; then
        if [[ "$(slot_owner "$k")" == "$STATE" ]] || slot_free "$k"; then
            use_slot "$k"
            return 0
        fi
    fi
    for ((k = 0; k < MAX_SLOTS; k++)); do
        if slot_free "$k"; then
            use_slot "$k"
            return 0
        fi
    done
    echo "cluster.sh: busy: all $MAX_SLOTS network slots are taken (see $GLOBAL_DIR/slot-*);" \
        "run \`$0 down STATE_DIR\` for a cluster you no longer need" >&2
    exit 3
}

# The slot STATE recorded, when that slot is still ours; else returns 1.
own_slot() {
    local k
    k="$(cat "$STATE/slot" 2>/dev/null || true)"
    [[ "$k" =~ ^[0-9]+$ && "$k" -lt "$MAX_SLOTS" && "$(slot_owner "$k")" == "$STATE" ]] \
        || return 1
    use_slot "$k"
}

claim_slot() {
    echo "$STATE" >"$GLOBAL_DIR/slot-$SLOT"
    echo "$SLOT" >"$STATE/slot"
    printf 'bridge=%s\nprefix=%s\nctld_port=%s\n' "$BRIDGE" "$NET_PREFIX" "$CTLD_PORT" \
        >"$STATE/network"
}

# ---------------------------------------------------------------- processes by pid file

# Prints the pid recorded in FILE when that process is alive and is the program NAME
# (guards against a recycled pid after a crash or reboot).
live_pid() {
    local file="$1" name="$2" pid comm
    pid="$(cat "$file" 2>/dev/null || true)"
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    comm="$(cat "/proc/$pid/comm" 2>/dev/null || true)"
    [[ "$comm" == "$name"* ]] || return 1
    echo "$pid"
}

# TERM, wait up to 10 s, then KILL; by pid only.
kill_pids() {
    local pids=("$@") pid i
    [[ "${#pids[@]}" -gt 0 ]] || return 0
    kill -TERM "${pids[@]}" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do
        local alive=()
        for pid in "${pids[@]}"; do
            if kill -0 "$pid" 2>/dev/null; then alive+=("$pid"); fi
        done
        [[ "${#alive[@]}" -gt 0 ]] || return 0
        pids=("${alive[@]}")
        sleep 0.1
    done
    log "killing stubborn pids ${pids[*]}"
    kill -KILL "${pids[@]}" 2>/dev/null || true
}

# Stops the daemons recorded in PIDFILE:NAME pairs, all at once.
stop_by_pidfiles() {
    local pair pid pids=()
    for pair in "$@"; do
        if pid="$(live_pid "${pair%:*}" "${pair##*:}")"; then pids+=("$pid"); fi
    done
    kill_pids "${pids[@]}"
    for pair in "$@"; do rm -f "${pair%:*}"; done
}

# ---------------------------------------------------------------- network

node_addr() { echo "$NET_PREFIX.$((10 + $1))"; }

# The bridge and its address must exist before anything talks to the slot's addresses:
# without it those addresses would be routed off this machine.
setup_bridge() {
    local foreign
    foreign="$(ip -4 -o addr show to "$NET_PREFIX.0/24" | awk -v br="$BRIDGE" '$2 != br')"
    [[ -z "$foreign" ]] || die "$NET_PREFIX.0/24 is already used by another interface: $foreign"
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link add "$BRIDGE" type bridge
    fi
    if ! ip -4 -o addr show dev "$BRIDGE" | grep -F " $CTLD_ADDR/24 " >/dev/null; then
        ip addr add "$CTLD_ADDR/24" dev "$BRIDGE"
    fi
    ip link set "$BRIDGE" up
    ip -4 -o addr show dev "$BRIDGE" | grep -F " $CTLD_ADDR/24 " >/dev/null \
        || die "$CTLD_ADDR/24 is not on $BRIDGE; refusing to continue"
}

# Fails unless the kernel would send traffic for ADDR over our bridge.
check_routed_to_bridge() {
    local route
    route="$(ip -4 route get "$1")"
    [[ "$route" == *" dev $BRIDGE "* ]] || die "$1 does not route via $BRIDGE: $route"
}

setup_node_netns() {
    local i="$1" ns="$NS_PREFIX$1" veth="$NS_PREFIX$1-br"
    if [[ ! -e "/run/netns/$ns" ]]; then
        # The first `ip netns add` on a machine bind-mounts /run/netns; down undoes that.
        if ! mountpoint -q /run/netns; then touch "$GLOBAL_DIR/netns-mount-is-ours"; fi
        ip netns add "$ns"
    fi
    if ! ip -n "$ns" link show eth0 >/dev/null 2>&1; then
        ip link del "$veth" 2>/dev/null || true
        ip link add "$veth" type veth peer name eth0 netns "$ns"
    fi
    ip link set "$veth" master "$BRIDGE" up
    if ! ip -n "$ns" -4 -o addr show dev eth0 | grep -F " $(node_addr "$i")/24 " >/dev/null; then
        ip -n "$ns" addr add "$(node_addr "$i")/24" dev eth0
    fi
    ip -n "$ns" link set lo up
    ip -n "$ns" link set eth0 up
    check_routed_to_bridge "$(node_addr "$i")"
}

our_namespaces() {
    ip netns list | awk '{ print $1 }' | grep -E "^${NS_PREFIX}[0-9]+\$" || true
}

teardown_network() {
    local ns pids veth namespaces veths
    mapfile -t namespaces < <(our_namespaces)
    for ns in "${namespaces[@]}"; do
        # Job processes that setsid'ed away from slurmstepd still live here.
        mapfile -t pids < <(ip netns pids "$ns" 2>/dev/null || true)
        kill_pids "${pids[@]}"
        ip netns del "$ns"   # unmounts /run/netns/NAME; its veth pair goes with it
    done
    mapfile -t veths < <(ip -o link show type veth | awk -F': ' '{ print $2 }' | cut -d@ -f1 \
        | grep -E "^${NS_PREFIX}[0-9]+-br\$" || true)
    for veth in "${veths[@]}"; do
        ip link del "$veth" 2>/dev/null || true
    done
    if ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link del "$BRIDGE"
    fi
    # Only when we made that mount and no one else's namespace still lives there.
    if [[ -e "$GLOBAL_DIR/netns-mount-is-ours" && -z "$(ip netns list)" ]]; then
        if mountpoint -q /run/netns; then umount /run/netns; fi
        rm -f "$GLOBAL_DIR/netns-mount-is-ours"
    fi
}

# ---------------------------------------------------------------- configuration

write_hosts_file() {
    local nodes="$1" i
    {
        echo "127.0.0.1 localhost"
        echo "::1 localhost ip6-localhost ip6-loopback"
        echo "$CTLD_ADDR $(hostname -s) enn-ctld"
        for ((i = 1; i <= nodes; i++)); do
            echo "$(node_addr "$i") n$i"
        done
    } >"$STATE/etc/hosts"
}

# Character devices (like /dev/null) so gres sets CUDA_VISIBLE_DEVICES; plain files would not.
make_fake_gpus() {
    local k
    for ((k = 0; k < GPUS_PER_NODE; k++)); do
        [[ -c "$STATE/dev/nvidia$k" ]] || mknod -m 666 "$STATE/dev/nvidia$k" c 1 3
    done
}

# Prints slurm.conf then gres.conf, separated by a line "---".
render_configs() {
    local nodes="$1" i
    cat <<EOF
# Generated by slurm/dev/cluster.sh for $STATE; rewritten on every \`up\`.
ClusterName=enndev
SlurmctldHost=$(hostname -s)($CTLD_ADDR)
# Not the stock 6817, so a system Slurm on this host cannot clash; slurmd ports are per netns.
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$STATE/munge/munge.socket
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
# No cgroups here; linuxproc misses processes that setsid away (down kills them by netns).
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
# Without DefMemPerCPU every job would take a whole node's memory and jobs would serialise.
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=500
# Nodes may declare more CPUs than this machine has.
SlurmdParameters=config_overrides
SchedulerParameters=batch_sched_delay=0
GresTypes=gpu
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
KillOnBadExit=0
# Keep finished jobs visible to \`scontrol show job\` for 10 minutes.
MinJobAge=600
# Seconds between SIGTERM and SIGKILL when a job ends or is cancelled (Slurm's default: 30).
KillWait=10
InactiveLimit=0
$(pyxis_conf_line)
NodeName=DEFAULT CPUs=$CPUS_PER_NODE RealMemory=$MEM_PER_NODE_MB Gres=gpu:$GPUS_PER_NODE
EOF
    for ((i = 1; i <= nodes; i++)); do
        echo "NodeName=n$i NodeHostname=n$i NodeAddr=$(node_addr "$i")"
    done
    echo "PartitionName=debug Nodes=n[1-$nodes] Default=YES MaxTime=INFINITE State=UP"
    # A job asking for more time than MaxTime stays PENDING forever (Reason=PartitionConfig).
    echo "PartitionName=short Nodes=n[1-$nodes] MaxTime=5 State=UP"
    echo "---"
    echo "AutoDetect=off"
    echo "NodeName=n[1-$nodes] Name=gpu File=$STATE/dev/nvidia[0-$((GPUS_PER_NODE - 1))]"
}

# The slurm.conf line that loads Pyxis (the plugstack file names use_squashfuse), or a comment.
pyxis_conf_line() {
    if [[ -z "$PYXIS" ]]; then
        echo "# No Pyxis (ENN_SLURM_PYXIS unset)."
    else
        echo "# Pyxis use_squashfuse=$PYXIS"
        echo "PlugStackConfig=$STATE/plugstack.conf"
    fi
}

# Pyxis's plugstack line and Enroot's per-node paths (Pyxis clears the environment, so they
# go in enroot.conf.d; PYXIS_NODE_DIR is each node's own directory, see start_slurmd).
write_pyxis_configs() {
    [[ "$PYXIS" == 0 || "$PYXIS" == 1 ]] || die "ENN_SLURM_PYXIS must be 0 or 1 (use_squashfuse), got '$PYXIS'"
    local plugin="$PYXIS_PREFIX/lib/slurm/spank_pyxis.so" conf_d="$PYXIS_PREFIX/etc/enroot/enroot.conf.d"
    [[ -f "$plugin" && -x "$PYXIS_PREFIX/bin/enroot" ]] \
        || die "Pyxis/Enroot not installed in $PYXIS_PREFIX (run ../shared/tools/pyxis-enroot/install.sh)"
    command -v enroot >/dev/null 2>&1 || die "enroot is not on PATH (the Pyxis epilog needs /usr/local/bin/enroot)"
    echo "required $plugin runtime_path=$PYXIS_NODE_DIR/pyxis container_scope=job" \
        "execute_entrypoint=0 use_squashfuse=$PYXIS" >"$STATE/plugstack.conf"
    mkdir -p "$conf_d" "$PYXIS_NODE_DIR"
    # shellcheck disable=SC2016  # $(id -u) is for enroot to expand
    printf '%s\n' "# Written by enn_cluster's slurm/dev/cluster.sh: one Enroot tree per dev node." \
        "ENROOT_RUNTIME_PATH $PYXIS_NODE_DIR/enroot/run/user-\$(id -u)" \
        "ENROOT_CACHE_PATH   $PYXIS_NODE_DIR/enroot/cache/user-\$(id -u)" \
        "ENROOT_DATA_PATH    $PYXIS_NODE_DIR/enroot/data/user-\$(id -u)" \
        >"$conf_d/50-enn-dev-nodes.conf"
}

# Running daemons would not see a changed config, so a change needs down + up.
write_configs() {
    local rendered current
    rendered="$(render_configs "$1")"
    current="$({ cat "$STATE/slurm.conf" && echo --- && cat "$STATE/gres.conf"; } 2>/dev/null)" \
        || current=""
    if [[ "$rendered" != "$current" ]] \
            && live_pid "$STATE/run/slurmctld.pid" slurmctld >/dev/null; then
        die "cluster in $STATE is up with another configuration; run \`$0 down $STATE\` first"
    fi
    sed '/^---$/,$d' <<<"$rendered" >"$STATE/slurm.conf"
    sed '1,/^---$/d' <<<"$rendered" >"$STATE/gres.conf"
    printf 'export SLURM_CONF=%q\n' "$STATE/slurm.conf" >"$STATE/env.sh"
    if [[ -n "$PYXIS" ]]; then write_pyxis_configs; fi
}

# ---------------------------------------------------------------- daemons

# A private munged for this STATE_DIR (own key and socket), run as the munge user.
start_munged() {
    local dir="$STATE/munge"
    live_pid "$dir/munged.pid" munged >/dev/null && return 0
    runuser -u munge -- test -x "$dir" \
        || die "munged needs every parent of $STATE to be searchable by all users (chmod o+x)"
    if [[ ! -s "$dir/munge.key" ]]; then
        mungekey --create --keyfile="$dir/munge.key"
    fi
    chown -R munge:munge "$dir"
    chmod 600 "$dir/munge.key"
    runuser -u munge -- munged --socket="$dir/munge.socket" --key-file="$dir/munge.key" \
        --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" \
        --seed-file="$dir/munged.seed" </dev/null >>"$STATE/log/daemons.out" 2>&1 9>&- \
        || die "munged failed: $(tail -n 3 "$dir/munged.log" 2>/dev/null)"
}

# Returns 1 when slurmctld was already running.
start_slurmctld() {
    live_pid "$STATE/run/slurmctld.pid" slurmctld >/dev/null && return 1
    slurmctld </dev/null >>"$STATE/log/daemons.out" 2>&1 9>&- \
        || die "slurmctld failed: $(tail -n 5 "$STATE/log/slurmctld.log" 2>/dev/null)"
}

# Not `ip netns exec`: it remounts /sys and slurmd 22.05 then dies on /sys/fs/cgroup.
# The private mount namespace (slave: host mounts still propagate in) carries the hosts file
# and, with Pyxis, binds the node's own Enroot directory onto PYXIS_NODE_DIR.
start_slurmd() {
    local node="$1" ns="$NS_PREFIX${1#n}" node_dir=""
    live_pid "$STATE/run/slurmd-$node.pid" slurmd >/dev/null && return 0
    mkdir -p "$STATE/spool/$node"
    if [[ -n "$PYXIS" ]]; then
        node_dir="$STATE/nodelocal/$node"
        mkdir -p "$node_dir"
    fi
    # shellcheck disable=SC2016  # $1.. expand in the inner sh, not here
    nsenter --net="/run/netns/$ns" -- unshare --mount --uts --propagation slave -- \
        sh -c 'hostname "$1" && mount --bind "$2" /etc/hosts &&
               { [ -z "$3" ] || mount --bind "$3" "$4"; } && exec slurmd -N "$1"' \
        sh "$node" "$STATE/etc/hosts" "$node_dir" "$PYXIS_NODE_DIR" \
        </dev/null >>"$STATE/log/daemons.out" 2>&1 9>&- \
        || die "slurmd $node failed: $(tail -n 5 "$STATE/log/slurmd-$node.log" 2>/dev/null)"
}

# A node whose slurmd is gone (node-down: power lost) is declared DOWN before it starts
# again, as Slurm itself does once SlurmdTimeout (300 s here) passes: a job still COMPLETING
# on it then ends at once, not when the controller next re-sends its kill (about a minute
# after the node answers again). ReturnToService=2 puts it back in service on registration.
declare_lost_nodes_down() {
    local nodes="$1" i lost=()
    for ((i = 1; i <= nodes; i++)); do
        live_pid "$STATE/run/slurmd-n$i.pid" slurmd >/dev/null || lost+=("n$i")
    done
    [[ "${#lost[@]}" -gt 0 ]] || return 0
    scontrol update NodeName="$(IFS=,; echo "${lost[*]}")" State=DOWN \
        Reason="cluster.sh: powered off, starting again" >/dev/null 2>&1 \
        || log "could not declare ${lost[*]} DOWN (the controller may not know them yet)"
}

# Bounded wait until every node answers and is usable (idle on a fresh cluster).
wait_nodes_ready() {
    local nodes="$1" deadline=$((SECONDS + UP_TIMEOUT_S)) states ready
    while true; do
        live_pid "$STATE/run/slurmctld.pid" slurmctld >/dev/null \
            || die "slurmctld exited: $(tail -n 5 "$STATE/log/slurmctld.log" 2>/dev/null)"
        states="$(sinfo -h -N -p debug -o '%N %T' 2>/dev/null || true)"
        ready="$(awk '$2 == "idle" || $2 == "mixed" || $2 == "allocated"' <<<"$states" | wc -l)"
        [[ "$ready" -ge "$nodes" ]] && return 0
        if [[ "$SECONDS" -ge "$deadline" ]]; then
            log "nodes not ready after ${UP_TIMEOUT_S}s; sinfo says:"
            echo "${states:-<no answer from slurmctld>}" >&2
            tail -n 5 "$STATE/log/slurmctld.log" "$STATE"/log/slurmd-*.log >&2 2>/dev/null || true
            die "cluster did not come up; see $STATE/log (run \`$0 down $STATE\` to clean up)"
        fi
        sleep 0.5
    done
}

# A fresh slurmctld first schedules batch jobs about 3 s after it starts; run one tiny batch
# job now, so that `up` returns a cluster where batch jobs start at once (and is proven to).
run_probe_job() {
    local job state deadline=$((SECONDS + UP_TIMEOUT_S))
    job="$(sbatch --parsable --job-name=enn-dev-probe --output=/dev/null --chdir="$STATE" \
        --wrap true)" || die "could not submit the probe batch job"
    job="${job%%;*}"
    while true; do
        state="$(scontrol -o show job "$job" 2>/dev/null | grep -o 'JobState=[A-Z_]*' || true)"
        case "${state#JobState=}" in
            COMPLETED) return 0 ;;
            PENDING | CONFIGURING | RUNNING | COMPLETING | "") ;;
            *) die "probe batch job $job ended ${state#JobState=}; see $STATE/log" ;;
        esac
        [[ "$SECONDS" -lt "$deadline" ]] \
            || die "probe batch job $job still ${state#JobState=} after ${UP_TIMEOUT_S}s"
        sleep 0.25
    done
}

# ---------------------------------------------------------------- commands

cmd_up() {
    local nodes="$1" i current
    [[ "$nodes" =~ ^[0-9]+$ && "$nodes" -ge 1 && "$nodes" -le "$MAX_NODES" ]] \
        || die "NODES must be 1..$MAX_NODES, got '$nodes'"
    [[ "$CPUS_PER_NODE" =~ ^[0-9]+$ && "$CPUS_PER_NODE" -ge 1 ]] \
        || die "ENN_SLURM_CPUS must be a positive integer"
    take_global_lock
    choose_slot
    mkdir -p "$STATE"/{ctld,dev,etc,log,run,spool,munge}
    # munged refuses a socket whose directories are not searchable by every user.
    chmod 755 "$STATE" "$STATE/munge"
    write_configs "$nodes"
    echo "$nodes" >"$STATE/nodes"

    claim_slot   # from here on, down STATE_DIR cleans up the network
    setup_bridge
    for ((i = 1; i <= nodes; i++)); do setup_node_netns "$i"; done

    write_hosts_file "$nodes"
    make_fake_gpus
    export SLURM_CONF="$STATE/slurm.conf"
    start_munged
    local fresh_ctld=0
    if start_slurmctld; then fresh_ctld=1; else declare_lost_nodes_down "$nodes"; fi
    for ((i = 1; i <= nodes; i++)); do start_slurmd "n$i"; done
    wait_nodes_ready "$nodes"
    if [[ "$fresh_ctld" == 1 ]]; then run_probe_job; fi
    log "up: $nodes nodes; source $STATE/env.sh"
}

cmd_down() {
    local file daemons=()
    take_global_lock
    for file in "$STATE"/run/slurmd-*.pid; do daemons+=("$file:slurmd"); done
    # All at once (each takes ~2 s to exit); none of them needs munge to shut down.
    stop_by_pidfiles "${daemons[@]}" "$STATE/run/slurmctld.pid:slurmctld" \
        "$STATE/munge/munged.pid:munged"
    if own_slot; then
        teardown_network
        rm -f "$GLOBAL_DIR/slot-$SLOT"
    fi
    log "down: $STATE"
}

cmd_node_down() {
    local node="$1" pids
    [[ "$node" =~ ^n[1-9][0-9]*$ ]] || die "NODE must be n1, n2, ..., got '$node'"
    take_global_lock
    own_slot || die "no cluster of $STATE is up"
    [[ -e "/run/netns/$NS_PREFIX${node#n}" ]] || die "$node is not a node of $STATE"
    # Everything whose network is the node's: slurmd, slurmstepd, the job's tasks.
    mapfile -t pids < <(ip netns pids "$NS_PREFIX${node#n}" 2>/dev/null || true)
    if [[ "${#pids[@]}" -gt 0 ]]; then kill -KILL "${pids[@]}" 2>/dev/null || true; fi
    rm -f "$STATE/run/slurmd-$node.pid"
    log "node-down: $node (${#pids[@]} processes killed); \`$0 up $STATE\` restarts it"
}

cmd_restart_ctld() {
    take_global_lock
    own_slot || die "no cluster of $STATE is up"
    export SLURM_CONF="$STATE/slurm.conf"
    stop_by_pidfiles "$STATE/run/slurmctld.pid:slurmctld"
    start_slurmctld || die "slurmctld is still running"
    local deadline=$((SECONDS + UP_TIMEOUT_S))
    until live_pid "$STATE/run/slurmctld.pid" slurmctld >/dev/null; do  # it daemonizes
        [[ "$SECONDS" -lt "$deadline" ]] || die "slurmctld wrote no pid file; see $STATE/log"
        sleep 0.1
    done
    wait_nodes_ready "$(cat "$STATE/nodes")"
    log "restart-ctld: slurmctld restarted"
}

cmd_status() {
    local ok=0 file name pid
    if own_slot; then echo "network: $BRIDGE $NET_PREFIX.0/24"; else echo "network: none"; fi
    for file in "$STATE/munge/munged.pid" "$STATE/run/slurmctld.pid" "$STATE"/run/slurmd-*.pid; do
        name="$(basename "$file" .pid)"
        if pid="$(live_pid "$file" "${name%%-*}")"; then
            echo "$name: running (pid $pid)"
        else
            echo "$name: not running"
            ok=1
        fi
    done
    if [[ "$ok" == 0 ]]; then
        SLURM_CONF="$STATE/slurm.conf" sinfo -N || ok=1
    fi
    return "$ok"
}

main() {
    [[ $# -ge 2 ]] || usage
    local cmd="$1"
    STATE="$(realpath -m -- "$2")"
    [[ "$STATE" != / ]] || die "STATE_DIR must not be /"
    readonly STATE
    case "$cmd" in
        up) [[ $# -le 3 ]] || usage; require_tools up; cmd_up "${3:-2}" ;;
        down) [[ $# -eq 2 ]] || usage; require_tools down; cmd_down ;;
        status) [[ $# -eq 2 ]] || usage; cmd_status ;;
        node-down) [[ $# -eq 3 ]] || usage; require_tools down; cmd_node_down "$3" ;;
        restart-ctld) [[ $# -eq 2 ]] || usage; require_tools up; cmd_restart_ctld ;;
        *) usage ;;
    esac
}

main "$@"
