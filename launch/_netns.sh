# Sourced by launch/netns_hosts.sh and launch/slurm/local_cluster.sh (Linux, root).

remove_namespace() {  # remove_namespace NS: TERM every process in NS, KILL what is left after 5 s, delete NS
  local ns=$1 pids
  pids=$(ip netns pids "$ns" 2>/dev/null || true)
  if [ -n "$pids" ]; then
    # shellcheck disable=SC2086
    kill -TERM $pids 2>/dev/null || true
    for _ in $(seq 50); do
      pids=$(ip netns pids "$ns" 2>/dev/null || true)
      [ -z "$pids" ] && break
      sleep 0.1
    done
    # shellcheck disable=SC2086
    [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
  fi
  ip netns del "$ns" 2>/dev/null || true
}
