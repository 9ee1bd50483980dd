# Sourced by launch/horovodrun.sh and launch/mpirun.sh: what the two wrappers share.
#
# Before sourcing, the wrapper defines option(), which handles one of its own options
# at "$@" (appending what it passes on to opts) and sets take to how many arguments it
# used. Sourcing sets ROOT, VENV, NAME (the wrapper's file name) and usage, and puts
# $VENV/bin first on PATH; parse_args "$@" then sets dry_run, opts and command (the
# words after --), and run_command prints the final line and runs it unless --dry-run.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${HVD_SYNCBN_VENV:-$ROOT/.venv}
LAUNCHER=${BASH_SOURCE[1]}
NAME=$(basename "$LAUNCHER")

usage() {  # lines 2-7 of the wrapper's header
  sed -n '2,7p' "$LAUNCHER" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

[ -d "$VENV/bin" ] && export PATH="$VENV/bin:$PATH"

parse_args() {
  local seen_sep=0
  dry_run=0 opts=() command=()
  while [ $# -gt 0 ]; do
    case $1 in
      --) shift; seen_sep=1; break ;;
      --dry-run) dry_run=1; shift ;;
      -h|--help) usage ;;
      *) option "$@"; shift "$take" ;;
    esac
  done
  if [ "$seen_sep" = 0 ] || [ $# -eq 0 ]; then
    echo "$NAME: expected '-- COMMAND...' after the options (got: ${opts[*]:-nothing})" >&2
    usage
  fi
  command=("$@")
}

run_command() {  # run_command WORDS...: print them, then exec them unless --dry-run
  printf '[%s]' "$NAME" >&2
  printf ' %q' "$@" >&2
  printf '\n' >&2
  [ "$dry_run" = 1 ] && exit 0
  exec "$@"
}
