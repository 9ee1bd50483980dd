#!/usr/bin/env bash
# mpirun with the flags Horovod recommends for OpenMPI, for one or several hosts.
#
#   launch/mpirun.sh -np N [--hostfile F] [more mpirun options] -- COMMAND...
#   launch/mpirun.sh -np 4 -- python examples/torch_segmentation.py
#   launch/mpirun.sh -np 8 --hostfile hosts.txt -x OMP_NUM_THREADS -- python train.py
#   launch/mpirun.sh --dry-run -np 2 -- python train.py     # print the mpirun line only
#
# Runs, after printing it:
#   mpirun [--allow-run-as-root] -np N [--hostfile F] -bind-to none -map-by slot
#          -mca pml ob1 -mca btl ^openib -mca mpi_yield_when_idle 1
#          -mca oob_tcp_keepalive_time 5 -mca oob_tcp_keepalive_intvl I -mca oob_tcp_keepalive_probes 6
#          -x PATH [-x LD_LIBRARY_PATH] -x HOROVOD_* -x NCCL_* -x HVD_SYNCBN_*
#          [more mpirun options] COMMAND...
# - -x: mpirun hands a remote rank only the variables named with -x, one name each, so
#   PATH, LD_LIBRARY_PATH (when set) and every HOROVOD_* and NCCL_* variable set here
#   are named one by one.
# - HOROVOD_*, NCCL_* and HVD_SYNCBN_* (e.g. HVD_SYNCBN_TIMEOUT, HVD_SYNCBN_COMM) reach
#   every rank. Under mpirun SyncBN's statistics go over MPI, off Horovod's cycle, so
#   HOROVOD_CYCLE_TIME keeps its default (launch/README.md says why).
# - mpi_yield_when_idle: each rank has two threads waiting in MPI (Horovod's background
#   loop and SyncBN's statistics); spinning, they take cores from the compute when ranks
#   fill the cores (2-rank allreduces measured 12-24 ms instead of 1 ms so).
# - oob_tcp_keepalive_*: mpirun ends the job when a node is lost or cut off by the network,
#   within 5 + 6 x I s of the cut, I = ceil((T + 2G)/6), T = $HVD_SYNCBN_TIMEOUT (default
#   600) and G = min(T/2, 30) (default: 665 s), i.e. about T + 2G + 5 s. 6 x I >= T + 2G,
#   so every rank that can still reach mpirun has printed its SyncBN error first (within
#   T + G; with a small T, 1.5 T and 2 T). Open MPI's own keepalive is 300 +
#   20 x 9 s, and mpirun never notices a lost node once a rank has aborted
#   (hvd_syncbn/stuck.py, _abort_at_exit, says why and how the ranks wait for it).
# - Your own `-mca pml X` / `-mca btl X` / `-mca mpi_yield_when_idle X` /
#   `-mca oob_tcp_keepalive_* X` (or --mca) replace the defaults above.
# - The repo's virtual environment ($HVD_SYNCBN_VENV, default .venv/) goes first on PATH.
set -euo pipefail
user_pml=0 user_btl=0 user_yield=0 user_keepalive=0
option() {  # one mpirun option at "$@"; sets take (launch/_common.sh)
  case $1 in
    -mca|--mca)
      [ $# -ge 3 ] || { echo "mpirun.sh: $1 needs a name and a value" >&2; exit 2; }
      [ "$2" = pml ] && user_pml=1
      [ "$2" = btl ] && user_btl=1
      [ "$2" = mpi_yield_when_idle ] && user_yield=1
      [[ $2 == oob_tcp_keepalive_* ]] && user_keepalive=1
      opts+=("$1" "$2" "$3"); take=3 ;;
    *) opts+=("$1"); take=1 ;;
  esac
}
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
parse_args "$@"

cmd=(mpirun)
[ "$(id -u)" = 0 ] && cmd+=(--allow-run-as-root)
cmd+=(-bind-to none -map-by slot)
[ "$user_pml" = 1 ] || cmd+=(-mca pml ob1)
[ "$user_btl" = 1 ] || cmd+=(-mca btl ^openib)
[ "$user_yield" = 1 ] || cmd+=(-mca mpi_yield_when_idle 1)
if [ "$user_keepalive" = 0 ]; then
  intvl=$(awk -v t="${HVD_SYNCBN_TIMEOUT:-600}" 'BEGIN { g = (t / 2 < 30 ? t / 2 : 30); i = int((t + 2 * g + 5.999) / 6); print (i < 1 ? 1 : i) }')
  cmd+=(-mca oob_tcp_keepalive_time 5 -mca oob_tcp_keepalive_intvl "$intvl" -mca oob_tcp_keepalive_probes 6)
fi
cmd+=(-x PATH)
[ -n "${LD_LIBRARY_PATH+set}" ] && cmd+=(-x LD_LIBRARY_PATH)
while IFS= read -r name; do
  cmd+=(-x "$name")
done < <(compgen -e | grep -E '^(HOROVOD|NCCL|HVD_SYNCBN)_' | sort)
cmd+=("${opts[@]}" "${command[@]}")

run_command "${cmd[@]}"
