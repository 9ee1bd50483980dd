#!/usr/bin/env bash
# Several "hosts" on this one machine, as Linux network namespaces, and one mpirun job
# across them over TCP: a multi-host test without a second machine. Needs root.
#
#   launch/netns_hosts.sh [--hosts N] [--slots S] [--prefix P] [--subnet A.B.C] \
#                         [more mpirun options] -- COMMAND...
#   launch/netns_hosts.sh --hosts 2 --slots 2 -x OMP_NUM_THREADS -- python examples/torch_segmentation.py
#   launch/netns_hosts.sh --cleanup [--prefix P]    # remove what a killed (-9) run left
#
# What it makes (defaults: N=2 hosts, S=2 slots each, P=hvdnh, A.B.C=10.201.0), and
# removes again on exit, on failure and on Ctrl-C / SIGTERM:
# - a bridge Pbr with address A.B.C.1/24 in this (the root) namespace, where mpirun runs;
# - per host i: a namespace Pi, joined to the bridge by a veth pair (Pv<i> here, eth0
#   there) with address A.B.C.(10+i)/24 and hostname P-host<i>;
# - a hostfile listing A.B.C.(10+i) slots=S, and an rsh agent that mpirun calls as
#   `agent HOST COMMAND...` instead of ssh: it runs COMMAND (mpirun's orted) in HOST's
#   namespace, in a UTS namespace of its own with that hostname, with a login-like
#   environment (env -i), so the ranks see only what mpirun exports with -x, as on a
#   real second machine. The agent drops orted's --daemonize: a daemonized orted calls
#   setsid, and Linux's autogroup scheduler (kernel.sched_autogroup_enabled) then splits
#   the cores between the sessions, one per emulated host. Real hosts have cores of
#   their own; here the hosts' MPI and Horovod threads, which poll and sched_yield,
#   stalled each other for seconds to minutes, until jobs timed out. In mpirun's
#   session all ranks share the cores as one group, as in a one-host job.
# The job runs through launch/mpirun.sh (so with its -x list and HOROVOD_CYCLE_TIME)
# plus: -np N*S, the hostfile, the agent, --mca btl tcp,self,vader (TCP between hosts,
# shared memory within one) and btl_tcp_if_include / oob_tcp_if_include A.B.C.0/24.
# Its exit status is the job's.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

usage() {
  sed -n '2,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}
log() { echo "[netns_hosts] $*" >&2; }
die() { echo "[netns_hosts] ERROR: $*" >&2; exit 2; }

hosts=2 slots=2 prefix=hvdnh subnet=10.201.0 cleanup_only=0 seen_sep=0
opts=()
while [ $# -gt 0 ]; do
  case $1 in
    --) shift; seen_sep=1; break ;;
    --hosts) hosts=${2:?"--hosts needs a number"}; shift 2 ;;
    --slots) slots=${2:?"--slots needs a number"}; shift 2 ;;
    --prefix) prefix=${2:?"--prefix needs a name"}; shift 2 ;;
    --subnet) subnet=${2:?"--subnet needs A.B.C"}; shift 2 ;;
    --cleanup) cleanup_only=1; shift ;;
    -h|--help) usage ;;
    *) opts+=("$1"); shift ;;
  esac
done

[[ $hosts =~ ^[1-9][0-9]{0,2}$ ]] && [ "$hosts" -le 200 ] || die "--hosts: expected 1 to 200, got '$hosts'"
[[ $slots =~ ^[1-9][0-9]*$ ]] || die "--slots: expected a positive number, got '$slots'"
[[ $prefix =~ ^[a-z][a-z0-9]{0,8}$ ]] \
  || die "--prefix: expected a lowercase name of 1 to 9 letters/digits (interface names are at most 15 characters), got '$prefix'"
[[ $subnet =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] || die "--subnet: expected the first three octets, like 10.201.0, got '$subnet'"
[ "$(id -u)" = 0 ] || die "needs root (ip netns add, unshare --uts)"
for tool in ip unshare mpirun; do
  command -v "$tool" >/dev/null || die "$tool not found (ip: iproute2, unshare: util-linux, mpirun: launch/install.sh)"
done

# Namespaces and links named with $prefix: ours, or left by a run that was killed with -9.
leftovers() {
  ip netns list | awk '{ print "netns " $1 }' | grep -E "^netns ${prefix}[0-9]+$" || true
  ip -o link show | awk -F': ' '{ sub(/@.*/, "", $2); print "link " $2 }' | grep -E "^link ${prefix}(br|v[0-9]+)$" || true
}

# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/_netns.sh"  # remove_namespace

if [ "$cleanup_only" = 1 ]; then
  while read -r kind name; do
    log "removing $kind $name"
    if [ "$kind" = netns ]; then remove_namespace "$name"; else ip link del "$name" 2>/dev/null || true; fi
  done < <(leftovers)
  exit 0
fi
if [ "$seen_sep" = 0 ] || [ $# -eq 0 ]; then
  echo "netns_hosts.sh: expected '-- COMMAND...' after the options" >&2
  usage
fi
found=$(leftovers)
[ -z "$found" ] || die "already there (another run, or one killed with -9):
$found
Remove them with: $0 --cleanup --prefix $prefix"
if grep -q " inet ${subnet//./\\.}\." <<<"$(ip -o -4 addr show)"; then  # no pipe: grep -q may end it early
  die "$subnet.0/24 is already in use here (ip -4 addr): choose another --subnet"
fi

# --- set up, recording each thing made so that cleanup removes exactly those ---------
made_ns=() made_links=() job=
tmp=$(mktemp -d "${TMPDIR:-/tmp}/netns_hosts.XXXXXX")
# shellcheck disable=SC2329  # called by the EXIT trap
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ -n "$job" ] && kill -0 "$job" 2>/dev/null; then
    kill -TERM "$job" 2>/dev/null || true
    for _ in $(seq 20); do kill -0 "$job" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$job" 2>/dev/null || true
  fi
  local ns link
  for ns in "${made_ns[@]}"; do remove_namespace "$ns"; done
  for link in "${made_links[@]}"; do ip link del "$link" 2>/dev/null || true; done
  rm -rf "$tmp"
  [ -z "$(leftovers)" ] || { log "could not remove: $(leftovers | tr '\n' ' ')"; rc=1; }
  exit "$rc"
}
trap cleanup EXIT
trap 'log "interrupted: stopping the job"; exit 130' INT
trap 'log "SIGTERM: stopping the job"; exit 143' TERM

bridge=${prefix}br
ip link add "$bridge" type bridge forward_delay 0
made_links+=("$bridge")
ip addr add "$subnet.1/24" dev "$bridge"
ip link set "$bridge" up

agent=$tmp/rsh_agent
hostfile=$tmp/hostfile
cat > "$agent" <<'EOF'
#!/bin/sh
# mpirun's rsh agent: "agent [options] HOST COMMAND..." runs COMMAND in HOST's namespace.
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
host=$1; shift
case $host in
EOF
: > "$hostfile"
for ((i = 0; i < hosts; i++)); do
  ns=$prefix$i ip_addr=$subnet.$((10 + i)) name=$prefix-host$i
  ip netns add "$ns"
  made_ns+=("$ns")
  ip link add "${prefix}v$i" type veth peer name eth0 netns "$ns"
  made_links+=("${prefix}v$i")
  ip link set "${prefix}v$i" master "$bridge" up
  ip -n "$ns" addr add "$ip_addr/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  echo "  $ip_addr|$name) ns=$ns name=$name ;;" >> "$agent"
  echo "$ip_addr slots=$slots" >> "$hostfile"
done
cat >> "$agent" <<EOF
  *) echo "netns_hosts rsh agent: unknown host '\$host'" >&2; exit 255 ;;
esac
# orted in the foreground, in mpirun's session: see --daemonize at the top of netns_hosts.sh.
cmd=\$(printf '%s' "\$*" | sed 's/ --daemonize\( \|\$\)/\1/')
exec ip netns exec "\$ns" unshare --uts env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
  HOME="$HOME" USER="$(id -un)" LOGNAME="$(id -un)" SHELL=/bin/sh \\
  sh -c 'hostname "\$0" && exec sh -c "\$1"' "\$name" "\$cmd"
EOF
chmod +x "$agent"
log "$hosts hosts x $slots slots: $(tr '\n' ' ' < "$hostfile")(namespaces ${prefix}0..$((hosts - 1)), bridge $bridge)"

# --- the job: in the background, so that a signal reaches the trap at once -----------
net=$subnet.0/24
bash "$ROOT/launch/mpirun.sh" -np $((hosts * slots)) --hostfile "$hostfile" \
  --mca plm_rsh_agent "$agent" --mca plm_rsh_no_tree_spawn 1 \
  --mca btl tcp,self,vader --mca btl_tcp_if_include "$net" --mca oob_tcp_if_include "$net" \
  "${opts[@]}" -- "$@" &
job=$!
set +e
wait "$job"
rc=$?
set -e
job=
exit "$rc"
