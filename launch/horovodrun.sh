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
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${HVD_SYNCBN_VENV:-$ROOT/.venv}

usage() {
  sed -n '2,7p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

[ -d "$VENV/bin" ] && export PATH="$VENV/bin:$PATH"

dry_run=0 np='' hostfile='' hosts='' seen_sep=0
opts=()
while [ $# -gt 0 ]; do
  case $1 in
    --) shift; seen_sep=1; break ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage ;;
    -np|--num-proc) np=${2:?"$1 needs a number"}; shift 2 ;;
    -hostfile|--hostfile) hostfile=${2:?"$1 needs a file"}; shift 2 ;;
    -H|--hosts) hosts=${2:?"$1 needs host:slots,..."}; opts+=("$1" "$2"); shift 2 ;;
    *) opts+=("$1"); shift ;;
  esac
done
if [ "$seen_sep" = 0 ] || [ $# -eq 0 ]; then
  echo "horovodrun.sh: expected '-- COMMAND...' after the options (got: ${opts[*]:-nothing})" >&2
  usage
fi
if [ -n "$hostfile" ]; then
  [ -r "$hostfile" ] || { echo "horovodrun.sh: hostfile $hostfile not readable" >&2; exit 2; }
  # Lines "host slots=N"; a host without slots= counts 1, as horovodrun reads it.
  [ -n "$np" ] || np=$(awk '!/^[[:space:]]*(#|$)/ { n = 1; if (match($0, /slots=[0-9]+/)) n = substr($0, RSTART + 6, RLENGTH - 6); s += n } END { print s + 0 }' "$hostfile")
  opts=(--hostfile "$hostfile" "${opts[@]}")
fi
np=${np:-1}
[ -n "$hostfile" ] || [ -n "$hosts" ] || opts=(-H "localhost:$np" "${opts[@]}")

cmd=(horovodrun -np "$np" "${opts[@]}" "$@")
printf '[horovodrun.sh]' >&2
printf ' %q' "${cmd[@]}" >&2
printf '\n' >&2
[ "$dry_run" = 1 ] && exit 0
exec "${cmd[@]}"
