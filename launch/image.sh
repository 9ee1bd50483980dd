#!/usr/bin/env bash
# Builds the image from the project's Dockerfile with no registry but Debian's and PyPI,
# as root: a Debian bookworm base made by debootstrap (once, kept as a local image), then
# `buildah bud --isolation chroot` with this host's Horovod wheel cache mounted, so the
# build reuses the wheel launch/install.sh built here instead of building Horovod again.
# Extra arguments go to buildah bud (e.g. --build-arg ...). TAG (default hvd-syncbn:cpu)
# names the image. Where Docker runs, `docker build -t hvd-syncbn:cpu .` builds the same.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TAG=${TAG:-hvd-syncbn:cpu}
BASE=${BASE:-localhost/hvd-syncbn-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CACHE=${HVD_SYNCBN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd_syncbn}
CACHE_IN_BUILD=/tmp/hvd_syncbn-cache   # the Dockerfile's HVD_SYNCBN_CACHE
# pip inside the build resolves as install.sh does on this host: the host's effective pip
# settings (indexes, find-links: torch 2.13.0+cpu is a local wheel here) in a user-level
# pip.conf, the local folders they name read-only at the same paths (for a file:// index,
# the folder around it, where its links point), and the host's CA bundle (PyPI may be
# reached through a TLS proxy).
HOST_PY=${HVD_SYNCBN_VENV:-$ROOT/.venv}/bin/python
[ -x "$HOST_PY" ] || HOST_PY=python3
HOST_CA=${HVD_SYNCBN_HOST_CA:-/etc/ssl/certs/ca-certificates.crt}
CA_IN_BUILD=/tmp/hvd_syncbn-host-ca.crt
PIP_CONF_IN_BUILD=/root/.config/pip/pip.conf

log() { echo "[image] $*" >&2; }
die() { echo "[image] ERROR: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "expected root (debootstrap and buildah build here as root), got uid $(id -u); run: sudo bash launch/image.sh"
[ -f "$ROOT/Dockerfile" ] || die "no Dockerfile in $ROOT"
missing=()
command -v buildah >/dev/null || missing+=(buildah)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
  log "apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# 1. The base: Debian bookworm minbase, no Python (install.sh installs python3), with the
#    security and point-release updates Debian's own images have.
if ! buildah inspect --type image "$BASE" >/dev/null 2>&1; then
  log "debootstrap bookworm from $MIRROR into $BASE (about a minute, once)"
  debroot=$(mktemp -d)
  debootstrap --variant=minbase bookworm "$debroot" "$MIRROR" >"$debroot.log" 2>&1 \
    || { tail -20 "$debroot.log" >&2; die "debootstrap bookworm from $MIRROR failed (log above)"; }
  printf 'deb %s bookworm main\ndeb %s bookworm-updates main\ndeb %s-security bookworm-security main\n' \
    "$MIRROR" "$MIRROR" "$MIRROR" > "$debroot/etc/apt/sources.list"
  rm -rf "$debroot"/var/cache/apt/archives/*.deb "$debroot"/var/lib/apt/lists/*
  ctr=$(buildah from scratch)
  cp -a "$debroot/." "$(buildah mount "$ctr")/"
  rm -rf "$debroot" "$debroot.log"
  buildah umount "$ctr" >/dev/null
  # An imported root has no PATH in its config.
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd /bin/bash "$ctr"
  buildah commit -q --rm "$ctr" "$BASE" >/dev/null
fi

# 2. The image, unless one built from the same files is there. Its label holds a digest of
#    every file `COPY .` copies (the paths .dockerignore leaves out are left out here too),
#    the base image and the arguments: with nothing changed, a rebuild costs seconds
#    instead of minutes. HVD_SYNCBN_REBUILD=1 builds anyway (e.g. to take newer packages).
LABEL=org.hvd_syncbn.context
excluded=()
while read -r pattern; do
  case $pattern in
    ''|'#'*) ;;
    '**/'*) excluded+=(-o -name "${pattern#'**/'}") ;;
    *) excluded+=(-o -path "./$pattern") ;;
  esac
done < <(cat "$ROOT/.dockerignore" 2>/dev/null)
context=$(cd "$ROOT" && find . \( -false "${excluded[@]}" \) -prune -o -type f -print0 | LC_ALL=C sort -z \
  | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)
key=$(printf '%s\n' "$context" "$(buildah inspect --type image --format '{{.FromImageID}}' "$BASE")" "$@" \
  | sha256sum | cut -d' ' -f1)
built=$(buildah inspect --type image --format "{{index .OCIv1.Config.Labels \"$LABEL\"}}" "$TAG" 2>/dev/null || true)
if [ "${HVD_SYNCBN_REBUILD:-0}" != 1 ] && [ "$built" = "$key" ]; then
  log "$TAG is up to date: built from these same files (HVD_SYNCBN_REBUILD=1 to build it anyway)"
  exit 0
fi

# The image this build replaces, removed at the end once it has lost its tag (else each
# rebuild would leave its ~3 GB behind).
previous=$(buildah inspect --type image --format '{{.FromImageID}}' "$TAG" 2>/dev/null || true)

# The wheel cache is this host's own, read-write: install.sh in the build finds the
# Horovod wheel built here (or builds it here, once), and the Dockerfile deletes its cache
# folder only when it is not a mount.
mkdir -p "$CACHE"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
targets=("$CACHE_IN_BUILD")
mounts=(-v "$CACHE:$CACHE_IN_BUILD")
# `pip config list` prints key='value', the environment's first; keep the first of each key.
"$HOST_PY" -m pip config list 2>/dev/null \
  | sed -n "s/^[^.]*\.\(index-url\|extra-index-url\|find-links\|default-timeout\)='\(.*\)'$/\1 = \2/p" \
  | awk -F' = ' '!seen[$1]++' > "$work/settings"
[ -f "$HOST_CA" ] && echo "cert = $CA_IN_BUILD" >> "$work/settings"
{ echo "[global]"; cat "$work/settings"; } > "$work/pip.conf"
mounts+=(-v "$work/pip.conf:$PIP_CONF_IN_BUILD:ro")
targets+=("$PIP_CONF_IN_BUILD" "${PIP_CONF_IN_BUILD%/*}" "${PIP_CONF_IN_BUILD%/*/*}")
if [ -f "$HOST_CA" ]; then targets+=("$CA_IN_BUILD"); mounts+=(-v "$HOST_CA:$CA_IN_BUILD:ro"); fi
for word in $(sed -n 's/^\(index-url\|extra-index-url\|find-links\) = //p' "$work/settings"); do
  case $word in
    file://*) path=$(dirname "${word#file://}") ;;
    /*) path=$word ;;
    *) continue ;;
  esac
  if [ -d "$path" ] && [[ " ${targets[*]} " != *" $path "* ]]; then targets+=("$path"); mounts+=(-v "$path:$path:ro"); fi
done
log "buildah bud -t $TAG from $BASE, wheel cache $CACHE"
start=$SECONDS
buildah bud --isolation chroot -t "$TAG" --build-arg BASE_IMAGE="$BASE" "${mounts[@]}" "$@" "$ROOT" >&2 \
  || die "buildah bud failed (output above)"

# 3. buildah leaves an empty file or folder where each mount was: remove them in one more
#    layer.
built_by_bud=$(buildah inspect --type image --format '{{.FromImageID}}' "$TAG")
ctr=$(buildah from --pull-never "$TAG")
rootfs=$(buildah mount "$ctr")
for path in "${targets[@]}"; do
  if [ -f "$rootfs$path" ] && [ ! -s "$rootfs$path" ]; then rm "$rootfs$path"
  elif [ -d "$rootfs$path" ]; then rmdir --ignore-fail-on-non-empty "$rootfs$path"; fi
done
buildah umount "$ctr" >/dev/null
buildah config --label "$LABEL=$key" "$ctr"
buildah commit -q --rm "$ctr" "$TAG" >/dev/null
# The untagged images left: buildah bud's (the one above holds its layers) and the previous.
final=$(buildah inspect --type image --format '{{.FromImageID}}' "$TAG")
for id in "$built_by_bud" "$previous"; do
  if [ -n "$id" ] && [ "$id" != "$final" ]; then
    buildah rmi "$id" >/dev/null 2>&1 || log "kept image $id (a container uses it)"
  fi
done
log "built $TAG in $((SECONDS - start)) s, $(buildah images --format '{{.Size}}' "$TAG")"
