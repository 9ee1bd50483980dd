#!/usr/bin/env bash
# A two-node Slurm cluster on this one Linux machine, to try launch/slurm/train.sbatch
# before a real cluster (and for tests/test_slurm.py). Needs root and network namespaces.
#
#   sudo launch/slurm/local_cluster.sh up [--dir D]     # then, as it prints:
#   export SLURM_CONF=D/slurm.conf; sbatch --wait launch/slurm/train.sbatch --epochs 1
#   sudo launch/slurm/local_cluster.sh down [--dir D]   # stops everything, removes D
#                                  (without --dir: the cluster that is up, wherever its D)
#
# What `up` makes (D defaults to /tmp/hvd-syncbn-slurm; everything else is named hvdsl*):
# - munged and slurmctld in this (the root) network namespace, with keys, spool, logs
#   and slurm.conf in D; slurmctld listens on the bridge hvdslbr, 10.201.9.1 (the range
#   launch/netns_hosts.sh uses, 10.201.0-7, is left alone), on port 16817, so a real
#   Slurm on the machine is not disturbed;
# - nodes node1 and node2 (2 CPUs each): a network namespace hvdsl1/hvdsl2 on the bridge
#   (10.201.9.11, .12), a hostname of its own (UTS namespace) that every node resolves
#   (D/hosts bound over /etc/hosts) and a private /tmp (mount
#   namespace; Slurm's pmix plugin makes the same /tmp/spmix_appdir_* folder on every
#   node), where one slurmd runs. D and the checkout stay visible at their paths when
#   they are under /tmp; jobs should keep their files there or outside /tmp.
# The nodes share this machine's cores: the cluster checks that a job runs across
# nodes, not how fast. `up` exits 3, saying why, where it cannot run (not root, no
# network namespaces, Slurm or munge not installed: apt-get install slurmctld slurmd
# slurm-client munge slurm-wlm-basic-plugins libpmix-dev); other failures exit 1
# after taking down what they started.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PREFIX=hvdsl SUBNET=10.201.9 NODES=(node1 node2) PORT=16817
RECORD=/run/hvdsl-cluster  # the folder of the cluster that is up, for `down` without --dir

usage() {
  sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}
log() { echo "[local_cluster] $*" >&2; }
die() { echo "[local_cluster] ERROR: $*" >&2; exit 1; }
cannot() { echo "[local_cluster] cannot run here: $*" >&2; exit 3; }

[ $# -ge 1 ] || usage
action=$1; shift
dir=
while [ $# -gt 0 ]; do
  case $1 in
    --dir) dir=${2:?"--dir needs a folder"}; shift 2 ;;
    -h|--help) usage ;;
    *) echo "local_cluster.sh: unknown option '$1'" >&2; usage ;;
  esac
done
if [ -z "$dir" ]; then
  dir=/tmp/hvd-syncbn-slurm
  [ "$action" = down ] && [ -s "$RECORD" ] && dir=$(cat "$RECORD")
fi
case $dir in /*) ;; *) dir=$PWD/$dir ;; esac

# D holds only what `up` wrote (it is removed by `down`, and emptied by `up`).
ours() { [ ! -e "$dir" ] || [ -z "$(ls -A "$dir")" ] || grep -qs '^# Written by launch/slurm/local_cluster.sh' "$dir/slurm.conf"; }

# ------------------------------------------------------------------------------- down
stop_pid() {  # stop_pid FILE: TERM the process in FILE, then KILL it after 5 s
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 0
  [[ $pid =~ ^[0-9]+$ ]] || return 0
  kill -TERM "$pid" 2>/dev/null || return 0
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
}

# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/../_netns.sh"  # remove_namespace

leftovers() {  # what `down` removes, if it is there
  ip netns list 2>/dev/null | awk '{ print $1 }' | grep -E "^${PREFIX}[0-9]+$" || true
  ip -o link show 2>/dev/null | awk -F': ' '{ sub(/@.*/, "", $2); print $2 }' | grep -E "^${PREFIX}(br|v[0-9]+)$" || true
  for f in "$dir"/slurmctld.pid "$dir"/munged.pid; do
    [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null && echo "process $(cat "$f") ($f)"
  done
  return 0
}

down() {
  local i
  for ((i = 1; i <= ${#NODES[@]}; i++)); do remove_namespace "$PREFIX$i"; done
  stop_pid "$dir/slurmctld.pid"
  stop_pid "$dir/munged.pid"
  for ((i = 1; i <= ${#NODES[@]}; i++)); do ip link del "${PREFIX}v$i" 2>/dev/null || true; done
  ip link del "${PREFIX}br" 2>/dev/null || true
  local left
  left=$(leftovers)
  [ -z "$left" ] || die "could not remove: $(tr '\n' ' ' <<<"$left")"
  if ours; then rm -rf "$dir"; else log "left $dir as it is: it holds files local_cluster.sh did not write"; fi
  [ "$(cat "$RECORD" 2>/dev/null)" != "$dir" ] || rm -f "$RECORD"
}

# --------------------------------------------------------------------------------- up
check_can_run() {
  [ "$(id -u)" = 0 ] || cannot "needs root (network namespaces, mount namespaces, Slurm's daemons); got uid $(id -u)"
  local tool missing=()
  for tool in ip nsenter unshare mount; do command -v "$tool" >/dev/null || missing+=("$tool"); done
  [ ${#missing[@]} -eq 0 ] || cannot "${missing[*]} not found (apt-get install iproute2 util-linux mount)"
  for tool in slurmctld slurmd sbatch srun sinfo munged; do command -v "$tool" >/dev/null || missing+=("$tool"); done
  [ ${#missing[@]} -eq 0 ] || cannot "${missing[*]} not found; install Slurm and munge with:
  apt-get install slurmctld slurmd slurm-client munge slurm-wlm-basic-plugins libpmix-dev"
  local plugins
  plugins=$(dirname "$(find /usr/lib -path '*slurm*' -name mpi_pmix.so -print -quit 2>/dev/null)")
  [ "$plugins" != . ] || cannot "Slurm's pmix MPI plugin (mpi_pmix.so) not found (apt-get install slurm-wlm-basic-plugins libpmix-dev)"
  local probe=${PREFIX}probe err
  if ! err=$(ip netns add "$probe" 2>&1); then cannot "network namespaces are not permitted here (ip netns add: $err)"; fi
  ip netns del "$probe"
  if ! err=$(unshare --mount --uts true 2>&1); then cannot "mount/UTS namespaces are not permitted here (unshare: $err)"; fi
  [ ! -s "$RECORD" ] && [ -z "$(leftovers)" ] || die "a cluster is already up (or one was killed): \
$(cat "$RECORD" 2>/dev/null) $(leftovers | tr '\n' ' ')
take it down first: $0 down"
  if grep -q " inet ${SUBNET//./\\.}\." <<<"$(ip -o -4 addr show)"; then
    die "$SUBNET.0/24 is already in use here (ip -4 addr)"
  fi
}

write_config() {
  local i cpus=2
  mkdir -p "$dir/ctld"
  cat > "$dir/slurm.conf" <<EOF
# Written by launch/slurm/local_cluster.sh: 2 nodes in network namespaces on this machine.
ClusterName=hvdlocal
SlurmctldHost=$(hostname -s)($SUBNET.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge.socket
CredType=cred/munge
StateSaveLocation=$dir/ctld
SlurmctldPidFile=$dir/slurmctld.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdSpoolDir=$dir/%n/spool
SlurmdPidFile=$dir/%n/slurmd.pid
SlurmdLogFile=$dir/%n/slurmd.log
# No cgroups here (each node's /sys is the machine's): track processes by parentage.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
# The nodes have as many CPUs as said here, whatever the machine has (they share it).
SlurmdParameters=config_overrides
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
EOF
  for ((i = 1; i <= ${#NODES[@]}; i++)); do
    echo "NodeName=${NODES[i - 1]} NodeAddr=$SUBNET.$((10 + i)) CPUs=$cpus State=UNKNOWN" >> "$dir/slurm.conf"
    mkdir -p "$dir/${NODES[i - 1]}/spool" "$dir/${NODES[i - 1]}/tmp"
  done
  echo "PartitionName=local Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP" >> "$dir/slurm.conf"
}

start_munge() {
  (umask 077 && head -c 1024 /dev/urandom > "$dir/munge.key")
  munged --force --key-file="$dir/munge.key" --socket="$dir/munge.socket" --pid-file="$dir/munged.pid" \
    --log-file="$dir/munged.log" --seed-file="$dir/munged.seed" </dev/null >/dev/null 2>&1 \
    || die "munged did not start: $(tail -5 "$dir/munged.log" 2>/dev/null)"
}

start_network() {
  local i ns
  ip link add "${PREFIX}br" type bridge forward_delay 0
  ip addr add "$SUBNET.1/24" dev "${PREFIX}br"
  ip link set "${PREFIX}br" up
  for ((i = 1; i <= ${#NODES[@]}; i++)); do
    ns=$PREFIX$i
    ip netns add "$ns"
    ip link add "${PREFIX}v$i" type veth peer name eth0 netns "$ns"
    ip link set "${PREFIX}v$i" master "${PREFIX}br" up
    ip -n "$ns" addr add "$SUBNET.$((10 + i))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
  done
}

# Run inside a node's new mount and UTS namespaces: name the node, make the nodes' names
# resolve (D/hosts over /etc/hosts, as a cluster's DNS would: torchrun's rendezvous looks
# its own host name up), give it a private /tmp with the folders that must stay shared
# bound back in, then exec slurmd.
# (`ip netns exec` would remount /sys, and slurmd then looks for cgroups there.)
NODE_INIT='
node=$1 private=$2; shift 2
hostname "$node"
mount --bind "$HVDSL_HOSTS" /etc/hosts
mount -t tmpfs -o mode=1777 "hvdsl-$node-tmp" "$private"
for keep in "$@"; do
  case $keep in /tmp/*) mkdir -p "$private/${keep#/tmp/}" && mount --bind "$keep" "$private/${keep#/tmp/}" ;; esac
done
mount --rbind "$private" /tmp
exec slurmd -D -N "$node" -f "$SLURM_CONF"
'

start_nodes() {
  local i node
  { cat /etc/hosts; for ((i = 1; i <= ${#NODES[@]}; i++)); do echo "$SUBNET.$((10 + i)) ${NODES[i - 1]}"; done; } \
    > "$dir/hosts"
  for ((i = 1; i <= ${#NODES[@]}; i++)); do
    node=${NODES[i - 1]}
    HVDSL_HOSTS=$dir/hosts SLURM_CONF=$dir/slurm.conf nsenter --net="/run/netns/$PREFIX$i" unshare --uts --mount --propagation private \
      sh -c "$NODE_INIT" sh "$node" "$dir/$node/tmp" "$dir" "$ROOT" </dev/null >"$dir/$node/stdout.log" 2>&1 &
  done
}

wait_idle() {  # until sinfo shows every node idle, or 40 s
  local state
  for _ in $(seq 400); do
    state=$(SLURM_CONF=$dir/slurm.conf sinfo -h -N -o '%N %t' 2>/dev/null || true)
    [ "$(grep -c ' idle$' <<<"$state")" = "${#NODES[@]}" ] && return 0
    sleep 0.1
  done
  die "the nodes did not come up within 40 s (sinfo: ${state:-nothing}); logs in $dir:
$(tail -n 5 "$dir"/slurmctld.log "$dir"/node*/slurmd.log "$dir"/node*/stdout.log 2>/dev/null)"
}

up() {
  check_can_run
  ours || die "--dir $dir holds files local_cluster.sh did not write: give it an empty or new folder"
  rm -rf "$dir"
  mkdir -p "$dir"
  chmod 755 "$dir"
  trap 'rc=$?; trap - EXIT; if [ $rc != 0 ]; then log "up failed: taking down what it started"; logs=$(mktemp -d); cp "$dir"/*.log "$logs" 2>/dev/null || true; down || true; log "logs kept in $logs"; fi; exit $rc' EXIT
  start=$SECONDS
  echo "$dir" > "$RECORD"
  write_config
  start_munge
  start_network
  SLURM_CONF=$dir/slurm.conf slurmctld -f "$dir/slurm.conf" -i </dev/null >"$dir/slurmctld.stdout.log" 2>&1 \
    || die "slurmctld did not start: $(tail -5 "$dir/slurmctld.log" "$dir/slurmctld.stdout.log" 2>/dev/null)"
  start_nodes
  wait_idle
  trap - EXIT
  log "up in $((SECONDS - start)) s: ${NODES[*]} ($SUBNET.11-$((10 + ${#NODES[@]}))), 2 CPUs each; state in $dir"
  echo "export SLURM_CONF=$dir/slurm.conf"
}

case $action in
  up) up ;;
  down)
    [ "$(id -u)" = 0 ] || cannot "needs root; got uid $(id -u)"
    down
    log "down: nothing left" ;;
  *) echo "local_cluster.sh: expected up or down, got '$action'" >&2; usage ;;
esac
