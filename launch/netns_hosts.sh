#!/usr/bin/env bash
# Several "hosts" on this one machine, as Linux network namespaces, and one mpirun (or
# horovodrun) job across them over TCP: a multi-host test without a second machine. Needs root.
#
#   launch/netns_hosts.sh [--hosts N] [--slots S] [--prefix P] [--subnet A.B.C] [--relay LOSS,DELAY_MS] \
#                         [--horovodrun] [more mpirun (horovodrun) options] -- COMMAND...
#   launch/netns_hosts.sh --hosts 2 --slots 2 -x OMP_NUM_THREADS -- python examples/torch_segmentation.py
#   launch/netns_hosts.sh --cleanup [--prefix P]    # remove what a killed (-9) run left
#
# What it makes (defaults: N=2 hosts, S=2 slots each, P=hvdnh, A.B.C=10.201.0), and
# removes again on exit, on failure and on Ctrl-C / SIGTERM:
# - a bridge Pbr with address A.B.C.1/24 in this (the root) namespace;
# - per host i: a namespace Pi, joined to the bridge by a veth pair (Pv<i> here, eth0
#   there) with address A.B.C.(10+i)/24, hostname P-host<i>, a default route to A.B.C.1
#   and /etc/netns/Pi/hosts naming every host (`ip netns exec` puts it on /etc/hosts);
# - with --relay LOSS,DELAY_MS (e.g. 0.05,20: 5% of the packets dropped, the others
#   delayed 20 ms, each way) no bridge: launch/netns_relay.py, at real-time priority,
#   makes a TUN device per host (moved into the host as its eth0) and one here (Ptr,
#   A.B.C.1/24), and forwards the IP packets between them, dropping and delaying them;
#   it prints how many it dropped when the job ends; SIGUSR1 to it cuts every link (a
#   partition, 100% loss), SIGUSR2 mends them. (This kernel has no tc netem.)
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
# The job runs on host 0, as on a cluster, where the launcher runs on the first node of
# the job (a batch script's node) and starts that node's ranks itself: through
# launch/mpirun.sh (so with its -x list and HOROVOD_CYCLE_TIME) plus: -np N*S, the
# hostfile, the agent, --mca btl tcp,self,vader (TCP between hosts, shared memory within
# one) and btl_tcp_if_include / oob_tcp_if_include A.B.C.0/24. (An mpirun with no ranks
# of its own that loses every other host never ends: docs/failures.md.) With --horovodrun
# it runs through launch/horovodrun.sh instead (its driver address must be on an
# interface named as the hosts' one), with -np N*S -H P-host0:S,... --gloo
# --network-interface eth0, and a fake ssh first on PATH that runs the command in the
# host's namespace as the agent does; horovodrun's command carries the environment.
# Every process the script starts (mpirun or horovodrun, the relay, what runs on a host)
# has HVD_NETNS_HOSTS=P in its environment: --cleanup ends those a killed run left (mpirun
# would otherwise wait for its lost hosts until its keepalive). Its exit status is the job's.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

usage() {
  sed -n '2,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}
log() { echo "[netns_hosts] $*" >&2; }
die() { echo "[netns_hosts] ERROR: $*" >&2; exit 2; }

hosts=2 slots=2 prefix=hvdnh subnet=10.201.0 relay='' launcher=mpirun cleanup_only=0 seen_sep=0
opts=()
while [ $# -gt 0 ]; do
  case $1 in
    --) shift; seen_sep=1; break ;;
    --hosts) hosts=${2:?"--hosts needs a number"}; shift 2 ;;
    --slots) slots=${2:?"--slots needs a number"}; shift 2 ;;
    --prefix) prefix=${2:?"--prefix needs a name"}; shift 2 ;;
    --subnet) subnet=${2:?"--subnet needs A.B.C"}; shift 2 ;;
    --relay) relay=${2:?"--relay needs LOSS,DELAY_MS"}; shift 2 ;;
    --horovodrun) launcher=horovodrun; shift ;;
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
if [ -n "$relay" ]; then
  [[ $relay =~ ^(0|0?\.[0-9]+),[0-9]+(\.[0-9]+)?$ ]] \
    || die "--relay: expected LOSS,DELAY_MS with 0 <= LOSS < 1, like 0.05,20, got '$relay'"
  loss=${relay%,*} delay_ms=${relay#*,}
fi
[ "$(id -u)" = 0 ] || die "needs root (ip netns add, unshare --uts)"
tools=(ip unshare)
[ "$launcher" = mpirun ] && tools+=(mpirun)
[ -n "$relay" ] && tools+=(chrt python3)
for tool in "${tools[@]}"; do
  command -v "$tool" >/dev/null \
    || die "$tool not found (ip: iproute2, unshare and chrt: util-linux, mpirun: launch/install.sh, python3: for launch/netns_relay.py)"
done

# What is named with $prefix: ours, or left by a run that was killed with -9.
marked() {  # pids of the processes with HVD_NETNS_HOSTS=$prefix in their environment
  grep -lzx "HVD_NETNS_HOSTS=$prefix" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3 || true
}
leftovers() {
  ip netns list | awk '{ print "netns " $1 }' | grep -E "^netns ${prefix}[0-9]+$" || true
  ip -o link show | awk -F': ' '{ sub(/@.*/, "", $2); print "link " $2 }' | grep -E "^link ${prefix}(br|v[0-9]+|t[0-9]+|tr)$" || true
  find /etc/netns -maxdepth 1 -regextype egrep -regex "/etc/netns/${prefix}[0-9]+" -printf 'dir %p\n' 2>/dev/null || true
  marked | sed 's/^/process /'
}

# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/_netns.sh"  # remove_namespace

if [ "$cleanup_only" = 1 ]; then
  while read -r kind name; do
    log "removing $kind $name"
    case $kind in
      netns) remove_namespace "$name" ;;
      link) ip link del "$name" 2>/dev/null || true ;;
      dir) rm -rf "$name" ;;
      process) kill -KILL "$name" 2>/dev/null || true ;;
    esac
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
made_ns=() made_links=() made_dirs=() job='' relay_pid=''
tmp=$(mktemp -d "${TMPDIR:-/tmp}/netns_hosts.XXXXXX")
stop() {  # stop PID: TERM, then KILL after 10 s
  kill -TERM "$1" 2>/dev/null || return 0
  for _ in $(seq 20); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.5; done
  kill -KILL "$1" 2>/dev/null || true
}
# shellcheck disable=SC2329  # called by the EXIT trap
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  [ -z "$job" ] || stop "$job"
  local ns link
  if [ -n "$relay_pid" ]; then stop "$relay_pid"; wait "$relay_pid" 2>/dev/null || true; fi  # it prints its counts
  for ns in "${made_ns[@]}"; do remove_namespace "$ns"; done
  for link in "${made_links[@]}"; do ip link del "$link" 2>/dev/null || true; done
  rm -rf "$tmp" "${made_dirs[@]}"
  for _ in $(seq 20); do  # what outlived its namespace's TERM was sent KILL: let it go
    [ -n "$(marked)" ] || break
    # shellcheck disable=SC2046
    kill -KILL $(marked) 2>/dev/null || true
    sleep 0.1
  done
  [ -z "$(leftovers)" ] || { log "could not remove: $(leftovers | tr '\n' ' ')"; rc=1; }
  exit "$rc"
}
trap cleanup EXIT
trap 'log "interrupted: stopping the job"; exit 130' INT
trap 'log "SIGTERM: stopping the job"; exit 143' TERM

if [ -z "$relay" ]; then
  bridge=${prefix}br
  ip link add "$bridge" type bridge forward_delay 0
  made_links+=("$bridge")
  ip addr add "$subnet.1/24" dev "$bridge"
  ip link set "$bridge" up
  net_desc="bridge $bridge"
else
  devices=("${prefix}tr=$subnet.1")
  for ((i = 0; i < hosts; i++)); do devices+=("${prefix}t$i=$subnet.$((10 + i))"); done
  HVD_NETNS_HOSTS=$prefix chrt -f 50 python3 "$ROOT/launch/netns_relay.py" --loss "$loss" --delay-ms "$delay_ms" \
    "${devices[@]}" > "$tmp/relay.out" &
  relay_pid=$!
  for _ in $(seq 100); do
    grep -qx ready "$tmp/relay.out" && break
    kill -0 "$relay_pid" 2>/dev/null || die "launch/netns_relay.py did not start"
    sleep 0.1
  done
  grep -qx ready "$tmp/relay.out" || die "launch/netns_relay.py not ready after 10 s"
  ip addr add "$subnet.1/24" dev "${prefix}tr"
  ip link set "${prefix}tr" up
  net_desc="relay pid $relay_pid: loss $loss, delay $delay_ms ms each way"
fi

# Which host a name or address means: the case arms shared by the rsh agent and the fake ssh.
host_cases=''
{ echo "127.0.0.1 localhost"; echo "$subnet.1 $prefix-root"; } > "$tmp/hosts"
for ((i = 0; i < hosts; i++)); do
  host_cases+="  $subnet.$((10 + i))|$prefix-host$i) ns=$prefix$i name=$prefix-host$i ;;"$'\n'
  echo "$subnet.$((10 + i)) $prefix-host$i" >> "$tmp/hosts"
done
hostfile=$tmp/hostfile
: > "$hostfile"
for ((i = 0; i < hosts; i++)); do
  ns=$prefix$i ip_addr=$subnet.$((10 + i))
  ip netns add "$ns"
  made_ns+=("$ns")
  mkdir -p "/etc/netns/$ns"
  made_dirs+=("/etc/netns/$ns")
  cp "$tmp/hosts" "/etc/netns/$ns/hosts"
  if [ -z "$relay" ]; then
    ip link add "${prefix}v$i" type veth peer name eth0 netns "$ns"
    made_links+=("${prefix}v$i")
    ip link set "${prefix}v$i" master "$bridge" up
  else
    ip link set "${prefix}t$i" netns "$ns" name eth0  # the relay keeps its descriptor
  fi
  ip -n "$ns" addr add "$ip_addr/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  if [ -z "$relay" ]; then ip -n "$ns" route add default via "$subnet.1"; else ip -n "$ns" route add default dev eth0; fi
  echo "$ip_addr slots=$slots" >> "$hostfile"
done

# How a command reaches a host: "[options] HOST COMMAND..." runs COMMAND in HOST's namespace
# and a UTS namespace with its hostname, in a login-like environment; used as mpirun's rsh
# agent and as horovodrun's ssh. The command's words are joined with spaces, as ssh does.
run_on_host() {  # run_on_host FILE OPTION_PARSING: writes the script FILE
  cat > "$1" <<EOF
#!/bin/sh
host=
$2
case \$host in
$host_cases  *) echo "netns_hosts: unknown host '\$host'" >&2; exit 255 ;;
esac
exec ip netns exec "\$ns" unshare --uts env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
  HOME="$HOME" USER="$(id -un)" LOGNAME="$(id -un)" SHELL=/bin/sh HVD_NETNS_HOSTS=$prefix \\
  sh -c 'hostname "\$0" && exec sh -c "\$1"' "\$name" "\$cmd"
EOF
  chmod +x "$1"
}
# mpirun's agent: options first. orted in the foreground, in mpirun's session: see
# --daemonize at the top.
agent=$tmp/rsh_agent
run_on_host "$agent" "$(cat <<'EOF'
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
host=$1; shift
cmd=$(printf '%s' "$*" | sed 's/ --daemonize\( \|$\)/\1/')
EOF
)"
# horovodrun's ssh: `ssh -o A -o B HOST -p PORT -o ConnectTimeout=S COMMAND`, options on
# either side of the host, as OpenSSH takes them.
mkdir "$tmp/bin"
run_on_host "$tmp/bin/ssh" "$(cat <<'EOF'
while [ $# -gt 0 ]; do
  case $1 in
    -[BbcDEeFIiJLlmOoPpQRSWw]) shift 2 ;;
    -*) shift ;;
    *) [ -z "$host" ] || break; host=$1; shift ;;
  esac
done
cmd=$*
EOF
)"
log "$hosts hosts x $slots slots: $(tr '\n' ' ' < "$hostfile")(namespaces ${prefix}0..$((hosts - 1)), $net_desc)"

# --- the job: in the background, so that a signal reaches the trap at once -----------
# The launcher runs on host 0: in its namespace, with its hostname.
on_host0=(ip netns exec "${prefix}0" unshare --uts sh -c 'hostname "$0" && exec "$@"' "$prefix-host0")
if [ "$launcher" = mpirun ]; then
  net=$subnet.0/24
  HVD_NETNS_HOSTS=$prefix "${on_host0[@]}" bash "$ROOT/launch/mpirun.sh" -np $((hosts * slots)) --hostfile "$hostfile" \
    --mca plm_rsh_agent "$agent" --mca plm_rsh_no_tree_spawn 1 \
    --mca btl tcp,self,vader --mca btl_tcp_if_include "$net" --mca oob_tcp_if_include "$net" \
    "${opts[@]}" -- "$@" &
else
  host_list=$prefix-host0:$slots
  for ((i = 1; i < hosts; i++)); do host_list+=",$prefix-host$i:$slots"; done
  HVD_NETNS_HOSTS=$prefix PATH="$tmp/bin:$PATH" "${on_host0[@]}" \
    bash "$ROOT/launch/horovodrun.sh" -np $((hosts * slots)) -H "$host_list" --gloo --network-interface eth0 \
    "${opts[@]}" -- "$@" &
fi
job=$!
set +e
wait "$job"
rc=$?
set -e
job=
exit "$rc"
