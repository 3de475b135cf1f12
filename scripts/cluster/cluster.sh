#!/usr/bin/env bash
# cluster.sh: bring up / tear down a real one-node SLURM cluster on localhost,
# for loorl's slow (SLURM) tests. Needs root; no systemd required (daemons are
# started by hand).
#
# Usage:
#   bash scripts/cluster/cluster.sh install            # apt-get install slurm-wlm munge (idempotent)
#   bash scripts/cluster/cluster.sh up     [STATE_DIR] # start munged + slurmctld + slurmd
#   bash scripts/cluster/cluster.sh down   [STATE_DIR] # stop them and remove STATE_DIR
#   bash scripts/cluster/cluster.sh status [STATE_DIR] # exit 0 iff the cluster is up
#
# STATE_DIR defaults to /tmp/loorl-slurm. It holds slurm.conf, pid files, the
# controller state, slurmd's spool, the daemon logs and jobcomp.log.
# `up` prints `export SLURM_CONF=STATE_DIR/slurm.conf` as the last line of
# stdout (everything else goes to stderr), so callers can do
#   eval "$(bash scripts/cluster/cluster.sh up | tail -n1)"
# Environment overrides:
#   LOORL_SLURM_TASK_PLUGIN   TaskPlugin to use (default task/affinity)
#   LOORL_SLURM_UP_TIMEOUT    seconds to wait for the node to be idle (default 60)
# Only one cluster can run at a time on a machine (fixed ports 6817/6818).
set -euo pipefail

DEFAULT_STATE_DIR=/tmp/loorl-slurm
MARKER=.loorl-slurm-cluster            # marks a directory this script created
UP_TIMEOUT=${LOORL_SLURM_UP_TIMEOUT:-60}
TASK_PLUGIN=${LOORL_SLURM_TASK_PLUGIN:-task/affinity}
CTLD_PORT=6817
SLURMD_PORT=6818
MUNGE_SOCKET=/run/munge/munge.socket.2
MUNGE_PIDFILE=/run/munge/munged.pid

log() { echo "cluster.sh: $*" >&2; }
die() { echo "cluster.sh: error: $*" >&2; exit 1; }

require_root() {
    [[ $(id -u) -eq 0 ]] || die "must be run as root (slurmd/munged need it)"
}

require_binaries() {
    local b
    for b in munged munge unmunge slurmctld slurmd sinfo scontrol; do
        command -v "$b" >/dev/null 2>&1 \
            || die "'$b' not found; run 'bash $0 install' first"
    done
}

# Directory holding Slurm's plugins (Debian: /usr/lib/<triplet>/slurm-wlm).
plugin_dir() {
    local d
    for d in /usr/lib/*/slurm-wlm /usr/lib/slurm-wlm /usr/lib64/slurm /usr/lib/slurm; do
        [[ -d $d ]] && { echo "$d"; return 0; }
    done
    return 1
}

have_plugin() {  # have_plugin jobcomp_filetxt
    local d
    d=$(plugin_dir) || return 1
    [[ -e $d/$1.so ]]
}

# ---------------------------------------------------------------- install ---
cmd_install() {
    require_root
    command -v apt-get >/dev/null 2>&1 || die "apt-get not found (only Debian/Ubuntu are supported)"
    if dpkg-query -W -f='${Status}\n' slurm-wlm munge 2>/dev/null \
            | grep -c '^install ok installed$' | grep -qx 2; then
        log "slurm-wlm and munge already installed; nothing to do"
        return 0
    fi
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y slurm-wlm munge >&2; then
        log "apt-get install failed; refreshing package lists and retrying"
        apt-get update >&2
        apt-get install -y slurm-wlm munge >&2
    fi
}

# ------------------------------------------------------------------ munge ---
munge_works() {
    munge -n -S "$MUNGE_SOCKET" 2>/dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1
}

ensure_munge_key() {
    local key=/etc/munge/munge.key
    [[ -s $key ]] && return 0
    log "creating munge key $key"
    mkdir -p /etc/munge
    if command -v mungekey >/dev/null 2>&1; then
        mungekey --create --keyfile="$key"
    else
        dd if=/dev/urandom of="$key" bs=1 count=1024 status=none
    fi
    if id munge >/dev/null 2>&1; then chown munge:munge /etc/munge "$key"; fi
    chmod 700 /etc/munge
    chmod 400 "$key"
}

# Start munged unless one already answers; remember in STATE_DIR if we did.
ensure_munged() {
    local state_dir=$1 i
    if munge_works; then return 0; fi
    ensure_munge_key
    log "starting munged"
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock" "$MUNGE_PIDFILE"
    if id munge >/dev/null 2>&1; then
        # munged refuses keys/dirs not owned by the user it runs as.
        chown munge:munge /run/munge /var/log/munge /var/lib/munge
        chmod 755 /run/munge
        runuser -u munge -- munged
    else
        munged --force
    fi
    for i in $(seq 50); do
        munge_works && break
        sleep 0.2
    done
    munge_works || die "munged did not come up (see /var/log/munge/munged.log)"
    cat "$MUNGE_PIDFILE" > "$state_dir/munged.started-by-us"
}

stop_munged_if_ours() {
    local state_dir=$1 pid
    [[ -f $state_dir/munged.started-by-us ]] || return 0
    pid=$(cat "$state_dir/munged.started-by-us")
    if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; then
        log "stopping munged (pid $pid)"
        kill "$pid" 2>/dev/null || true
        wait_gone "$pid" 10 || kill -9 "$pid" 2>/dev/null || true
    fi
}

# ------------------------------------------------------------- slurm.conf ---
write_slurm_conf() {
    local state_dir=$1 conf=$1/slurm.conf node cpus mem_mb jobcomp
    node=$(hostname -s)
    cpus=$(nproc)
    # 95% of MemTotal: slurmd marks the node invalid if RealMemory exceeds
    # what it measures itself.
    mem_mb=$(awk '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.95}' /proc/meminfo)
    if have_plugin jobcomp_filetxt; then
        jobcomp="JobCompType=jobcomp/filetxt          # one line per finished job, readable after it ends
JobCompLoc=$state_dir/jobcomp.log"
    else
        jobcomp="JobCompType=jobcomp/none             # jobcomp/filetxt plugin not installed"
    fi
    cat > "$conf" <<EOF
# Generated by scripts/cluster/cluster.sh for loorl's slow tests: a one-node
# cluster on localhost. Do not edit; rerun 'cluster.sh up' instead.
ClusterName=loorl                      # any name; no slurmdbd, so only cosmetic
SlurmctldHost=$node(127.0.0.1)        # controller on this host, reached over loopback
SlurmctldPort=$CTLD_PORT                    # default port, spelled out for clarity
SlurmdPort=$SLURMD_PORT                       # default port, spelled out for clarity
AuthType=auth/munge                    # the only auth plugin that works without JWT setup
CredType=cred/munge                    # job credentials signed by munge too
AuthInfo=cred_expire=10                # a requeued job waits this long (default 120 s!) before it may restart
MailProg=/bin/true                     # no mail on this box; silences 'Configured MailProg is invalid'
SlurmUser=root                         # slurmctld runs as root: no dedicated slurm user needed
SlurmdUser=root                        # slurmd must be root to launch jobs as their owner
MpiDefault=none                        # tests use plain srun, no PMI
SwitchType=switch/none                 # no interconnect

# Everything the daemons write lives under STATE_DIR, so 'down' can just rm it.
SlurmctldPidFile=$state_dir/slurmctld.pid
SlurmdPidFile=$state_dir/slurmd.pid
StateSaveLocation=$state_dir/state     # controller's job/node state (enables requeue bookkeeping)
SlurmdSpoolDir=$state_dir/spool        # batch scripts and step sockets
SlurmctldLogFile=$state_dir/slurmctld.log
SlurmdLogFile=$state_dir/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info

# Resource selection: hand out individual cores, so two 1-CPU tasks/jobs
# can run side by side instead of one job taking the whole node.
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1  # re-test pending jobs every 1-2 s (defaults 60/30 s) so requeued/queued jobs start promptly

# No cgroups: they are not reliably usable in containers/VMs without systemd.
ProctrackType=proctrack/linuxproc      # track job processes via /proc parent links
TaskPlugin=$TASK_PLUGIN             # task/affinity pins each task to its allocated CPUs

# Requeue / lifecycle behaviour the tests rely on.
JobRequeue=1                           # batch jobs are requeueable by default
ReturnToService=2                      # a DOWN node returns as soon as slurmd registers
MinJobAge=300                          # keep finished jobs visible to 'scontrol show job' for 5 min
KillWait=10                            # SIGTERM -> SIGKILL grace period on cancel/timeout
PreemptType=preempt/none               # no preemption...
PreemptMode=OFF                        # ...spelled out so tests never see jobs preempted
InactiveLimit=0                        # never kill srun/salloc that look idle
SlurmdTimeout=300                      # don't mark the node DOWN on a slow test machine
Waittime=0                             # don't kill steps when one task exits early

# Accounting: no slurmdbd; only a flat text record per finished job.
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none  # no per-step usage polling (needs no cgroups)
$jobcomp

# The single node: CPUs from nproc, memory a bit below MemTotal.
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
}

# --------------------------------------------------------------- helpers ---
pid_alive() {  # pid_alive PIDFILE
    local pid
    [[ -f $1 ]] || return 1
    pid=$(cat "$1" 2>/dev/null) || return 1
    [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null
}

wait_gone() {  # wait_gone PID SECONDS
    local pid=$1 secs=$2 i
    for i in $(seq $((secs * 5))); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.2
    done
    return 1
}

stop_pidfile() {  # stop_pidfile PIDFILE NAME
    local pid
    [[ -f $1 ]] || return 0
    pid=$(cat "$1" 2>/dev/null || true)
    [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null || return 0
    log "stopping $2 (pid $pid)"
    kill "$pid" 2>/dev/null || true
    wait_gone "$pid" 15 || { log "$2 ignored SIGTERM; killing"; kill -9 "$pid" 2>/dev/null || true; }
}

node_state() {
    sinfo -h -N -n "$(hostname -s)" -o '%t' 2>/dev/null | head -n1
}

is_up() {  # is_up STATE_DIR (SLURM_CONF must be exported)
    local s=$1
    pid_alive "$s/slurmctld.pid" && pid_alive "$s/slurmd.pid" \
        && scontrol ping >/dev/null 2>&1 \
        && [[ $(node_state) =~ ^(idle|mix|alloc|comp) ]]
}

port_busy() {
    ss -Hltn "sport = :$1" 2>/dev/null | grep -q .
}

# ------------------------------------------------------------------- up ---
cmd_up() {
    local s=$1 i st
    require_root
    require_binaries
    export SLURM_CONF=$s/slurm.conf
    if [[ -f $s/$MARKER ]] && is_up "$s"; then
        log "already up"
        echo "export SLURM_CONF=$SLURM_CONF"
        return 0
    fi
    # Half-started leftovers from an earlier run: stop them before starting fresh.
    if [[ -f $s/$MARKER ]]; then
        stop_pidfile "$s/slurmd.pid" slurmd
        stop_pidfile "$s/slurmctld.pid" slurmctld
    fi
    for i in $CTLD_PORT $SLURMD_PORT; do
        port_busy "$i" && die "port $i already in use (another slurm cluster running?)"
    done
    mkdir -p "$s/state" "$s/spool"
    touch "$s/$MARKER"
    ensure_munged "$s"
    write_slurm_conf "$s"

    log "starting slurmctld"
    # -c: start from a clean state (no jobs recovered from an earlier run).
    slurmctld -c -f "$SLURM_CONF" \
        || die "slurmctld failed to start; see $s/slurmctld.log"
    log "starting slurmd"
    slurmd -N "$(hostname -s)" -f "$SLURM_CONF" \
        || die "slurmd failed to start; see $s/slurmd.log"

    for i in $(seq "$UP_TIMEOUT"); do
        st=$(node_state || true)
        [[ $st == idle ]] && break
        sleep 1
    done
    if [[ ${st:-} != idle ]]; then
        log "node not idle after ${UP_TIMEOUT}s (state: '${st:-unknown}'); last log lines:"
        tail -n 5 "$s/slurmctld.log" "$s/slurmd.log" >&2 2>/dev/null || true
        die "cluster did not come up"
    fi
    log "up: node $(hostname -s) idle, partition debug, config $SLURM_CONF"
    echo "export SLURM_CONF=$SLURM_CONF"
}

# ----------------------------------------------------------------- down ---
cmd_down() {
    local s=$1 i
    require_root
    if [[ ! -d $s ]]; then log "$s does not exist; nothing to do"; return 0; fi
    [[ -f $s/$MARKER ]] || die "$s was not created by cluster.sh; refusing to remove it"
    export SLURM_CONF=$s/slurm.conf
    # Cancel jobs first so slurmd reaps their processes before it stops.
    if pid_alive "$s/slurmctld.pid" && command -v squeue >/dev/null 2>&1; then
        if [[ -n $(squeue -h -o %i 2>/dev/null) ]]; then
            log "cancelling remaining jobs"
            squeue -h -o %i | xargs -r scancel 2>/dev/null || true
            for i in $(seq 30); do
                [[ -z $(squeue -h -o %i 2>/dev/null) ]] && break
                sleep 1
            done
        fi
    fi
    stop_pidfile "$s/slurmd.pid" slurmd
    stop_pidfile "$s/slurmctld.pid" slurmctld
    stop_munged_if_ours "$s"
    rm -rf -- "$s"
    log "down"
}

# --------------------------------------------------------------- status ---
cmd_status() {
    local s=$1
    export SLURM_CONF=$s/slurm.conf
    if [[ -f $s/$MARKER ]] && is_up "$s"; then
        log "up ($SLURM_CONF)"
        return 0
    fi
    log "down"
    return 1
}

main() {
    local cmd=${1:-}
    local s=${2:-$DEFAULT_STATE_DIR}
    [[ $s == /* ]] || s=$PWD/$s            # slurm.conf needs absolute paths
    s=${s%/}
    [[ -n $s ]] || die "refusing to use / as STATE_DIR"
    case $cmd in
        install) cmd_install ;;
        up) cmd_up "$s" ;;
        down) cmd_down "$s" ;;
        status) cmd_status "$s" ;;
        *) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
    esac
}

main "$@"
