#!/usr/bin/env bash
# Build the shoal node image with no container registry: a Debian bookworm base made by debootstrap and a
# wheelhouse made by this host's pip, then `docker build` installs from the wheelhouse with --no-index.
#
#   compose/build-offline.sh                  # -> image shoal:latest (and shoal-base:bookworm)
#   SHOAL_IMAGE=shoal:dev compose/build-offline.sh
#
# Needs: root (debootstrap), debootstrap, a Docker engine (DOCKER_HOST is honoured), and a CPython 3.11 with pip
# ($PYTHON, default python3) whose indexes serve the project's dependencies (Debian bookworm's Python is 3.11, so
# the host's cp311 wheels fit the image). Reuses what it can between runs from $SHOAL_BUILD_CACHE (default
# ~/.cache/shoal/compose): the base's root file system as a tarball, the Debian packages and the wheelhouse.
# Prints one line per phase with its time.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
IMAGE=${SHOAL_IMAGE:-shoal:latest}
BASE_IMAGE=${SHOAL_BASE_IMAGE:-shoal-base:bookworm}
CACHE=${SHOAL_BUILD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/shoal/compose}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PYTHON=${PYTHON:-python3}
TORCH=${SHOAL_TORCH:-torch==2.13.0}
INCLUDE=python3,python3-venv,python3-pip
WHEELHOUSE="$ROOT/compose/wheelhouse"

say() { printf 'build-offline: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }
phase_start() { PHASE_T0=$(date +%s); say "$1 ..."; }
phase_end() { say "$1 done in $(( $(date +%s) - PHASE_T0 )) s"; }

command -v docker >/dev/null || die "no docker client on PATH"
docker version --format '{{.Server.Version}}' >/dev/null 2>&1 \
    || die "cannot reach a Docker engine (DOCKER_HOST=${DOCKER_HOST:-unset}): $(docker version 2>&1 | tail -1)"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
    || die "$PYTHON is not CPython 3.11: the wheelhouse must match the image's Python 3.11 (set PYTHON=...)"
mkdir -p "$CACHE"

# -- 1. the base image: Debian bookworm minbase with Python 3.11 ------------------------------------------------
if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    say "base image $BASE_IMAGE already present"
else
    tarball="$CACHE/bookworm-minbase-$(echo "$INCLUDE" | tr , -).tar"
    if [ ! -s "$tarball" ]; then
        command -v debootstrap >/dev/null || die "debootstrap not installed (apt-get install debootstrap)"
        [ "$(id -u)" = 0 ] || die "debootstrap needs root"
        phase_start "debootstrap bookworm ($INCLUDE) from $MIRROR"
        rootfs=$(mktemp -d "${TMPDIR:-/tmp}/shoal-rootfs.XXXXXX")
        cleanup_rootfs() {
            for m in proc sys dev/pts dev; do umount -l "$rootfs/$m" 2>/dev/null || true; done
            rm -rf --one-file-system "$rootfs"
        }
        trap cleanup_rootfs EXIT
        mkdir -p "$CACHE/debs"
        debootstrap --variant=minbase --include="$INCLUDE" --cache-dir="$CACHE/debs" \
            bookworm "$rootfs" "$MIRROR" > "$CACHE/debootstrap.log" 2>&1 \
            || die "debootstrap failed, see $CACHE/debootstrap.log: $(tail -3 "$CACHE/debootstrap.log")"
        rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb
        tar --numeric-owner -C "$rootfs" -cf "$tarball.tmp" .
        mv "$tarball.tmp" "$tarball"
        cleanup_rootfs
        trap - EXIT
        phase_end "debootstrap"
    fi
    phase_start "docker import $BASE_IMAGE"
    docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' "$tarball" "$BASE_IMAGE" >/dev/null
    phase_end "import"
fi

# -- 2. the wheelhouse: every wheel the image installs, built or fetched by this host's pip ---------------------
# torch, the project's dependencies (from pyproject.toml) and the build tools; remade only when that list changes
requirements=$("$PYTHON" -c 'import sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
print(*[sys.argv[2], *deps, "setuptools>=68", "wheel"], sep="\n")' "$ROOT/pyproject.toml" "$TORCH")
stamp=$(printf '%s\n' "$requirements" "$("$PYTHON" -V)" | sha256sum | cut -c1-16)
if [ "$(cat "$CACHE/wheelhouse/.stamp" 2>/dev/null)" = "$stamp" ]; then
    say "wheelhouse in $CACHE/wheelhouse is up to date"
else
    phase_start "wheelhouse ($TORCH and the project's dependencies)"
    rm -rf "$CACHE/wheelhouse"
    mkdir -p "$CACHE/wheelhouse"
    printf '%s\n' "$requirements" > "$CACHE/requirements.txt"
    "$PYTHON" -m pip wheel -q --wheel-dir "$CACHE/wheelhouse" -r "$CACHE/requirements.txt" > "$CACHE/wheelhouse.log" 2>&1 \
        || die "pip wheel failed, see $CACHE/wheelhouse.log: $(tail -3 "$CACHE/wheelhouse.log")"
    echo "$stamp" > "$CACHE/wheelhouse/.stamp"
    phase_end "wheelhouse ($(ls "$CACHE"/wheelhouse/*.whl | wc -l) wheels, $(du -sh "$CACHE/wheelhouse" | cut -f1))"
fi
# the build context's copy; hard links when the cache is on the same file system
find "$WHEELHOUSE" -name '*.whl' -delete 2>/dev/null || true
mkdir -p "$WHEELHOUSE"
cp -l "$CACHE"/wheelhouse/*.whl "$WHEELHOUSE"/ 2>/dev/null || cp "$CACHE"/wheelhouse/*.whl "$WHEELHOUSE"/

# -- 3. the image -----------------------------------------------------------------------------------------------
phase_start "docker build $IMAGE"
docker build -q -f "$ROOT/compose/Dockerfile" --build-arg BASE="$BASE_IMAGE" --build-arg TORCH="$TORCH" \
    -t "$IMAGE" "$ROOT" >/dev/null
phase_end "build"
say "image $IMAGE: $(docker image inspect "$IMAGE" --format '{{.Size}}' | awk '{printf "%.0f MB", $1/1e6}')"
