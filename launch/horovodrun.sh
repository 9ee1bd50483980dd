#!/usr/bin/env bash
# horovodrun from the repo's virtual environment, with the same defaults as mpirun.sh.
#
#   launch/horovodrun.sh [-np N] [--hostfile F] [--gloo|--mpi] [more horovodrun options] -- COMMAND...
#   launch/horovodrun.sh -np 2 -- python examples/torch_segmentation.py
#   launch/horovodrun.sh -np 8 --hostfile hosts.txt --gloo -- python train.py
#   launch/horovodrun.sh --dry-run -np 2 -- python train.py    # print the horovodrun line only
#
# Runs, after printing it: horovodrun -np N [--hostfile F] [--gloo|--mpi] [options] COMMAND...
# - -np defaults to the slots in --hostfile, else to 1; without --hostfile (or -H) the
#   ranks run on this machine (-H localhost:N).
# - Neither --gloo nor --mpi: horovodrun picks MPI when Horovod was built with it and
#   mpirun works, else Gloo.
# - HOROVOD_CYCLE_TIME, when set, reaches every rank (launch/README.md: when 0.1 ms pays);
#   horovodrun hands the ranks this whole environment, on every host.
# - The repo's virtual environment ($HVD_SYNCBN_VENV, default .venv/) goes first on PATH.
set -euo pipefail
np='' hostfile='' hosts=''
option() {  # one horovodrun option at "$@"; sets take (launch/_common.sh)
  case $1 in
    -np|--num-proc) np=${2:?"$1 needs a number"}; take=2 ;;
    -hostfile|--hostfile) hostfile=${2:?"$1 needs a file"}; take=2 ;;
    -H|--hosts) hosts=${2:?"$1 needs host:slots,..."}; opts+=("$1" "$2"); take=2 ;;
    *) opts+=("$1"); take=1 ;;
  esac
}
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
parse_args "$@"

if [ -n "$hostfile" ]; then
  [ -r "$hostfile" ] || { echo "horovodrun.sh: hostfile $hostfile not readable" >&2; exit 2; }
  # Lines "host slots=N"; a host without slots= counts 1, as horovodrun reads it.
  [ -n "$np" ] || np=$(awk '!/^[[:space:]]*(#|$)/ { n = 1; if (match($0, /slots=[0-9]+/)) n = substr($0, RSTART + 6, RLENGTH - 6); s += n } END { print s + 0 }' "$hostfile")
  opts=(--hostfile "$hostfile" "${opts[@]}")
fi
np=${np:-1}
[ -n "$hostfile" ] || [ -n "$hosts" ] || opts=(-H "localhost:$np" "${opts[@]}")

run_command horovodrun -np "$np" "${opts[@]}" "${command[@]}"
