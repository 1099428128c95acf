#!/usr/bin/env bash
# A Debian base image built from Debian's own packages, for machines that reach a Debian mirror but no image
# registry: debootstrap a minimal bookworm (Python 3.11 with venv, CA certificates, redis-server) and
# `docker import` it. The CPU kvserve image and the Redis image are built FROM it.
#
#   docker/base.sh [TAG]     (default kvserve-base:bookworm; root, debootstrap, a reachable mirror)
#
# DEBIAN_MIRROR overrides the mirror (default http://deb.debian.org/debian); DOCKER_HOST picks the daemon.
set -euo pipefail

tag="${1:-kvserve-base:bookworm}"
suite="${DEBIAN_SUITE:-bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
# python3-venv: the images install into a venv (Debian's Python is externally managed); passwd: useradd;
# redis-server (with redis-cli): the Redis image, a few MB in the kvserve image too, one base for both.
packages="python3,python3-venv,ca-certificates,passwd,redis-server"

if docker image inspect "$tag" >/dev/null 2>&1; then
    echo "base image $tag: present"
    exit 0
fi
command -v debootstrap >/dev/null || { echo "error: debootstrap not found (apt-get install debootstrap)" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "error: debootstrap needs root" >&2; exit 1; }

rootfs="$(mktemp -d "${TMPDIR:-/tmp}/kvserve-base.XXXXXX")"
trap 'rm -rf "$rootfs"' EXIT
echo "base image $tag: debootstrap $suite ($packages) from $mirror"
debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" "$mirror" >"$rootfs.log" 2>&1 || {
    tail -n 30 "$rootfs.log" >&2
    echo "error: debootstrap failed (log above; is $mirror reachable?)" >&2
    rm -f "$rootfs.log"
    exit 1
}
rm -f "$rootfs.log"
# What the container does not need: apt's package lists and caches, documentation.
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
    "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/*
# debootstrap copies the host's resolv.conf and hostname; docker supplies its own at run time.
: >"$rootfs/etc/resolv.conf"
rm -f "$rootfs/etc/hostname"
tar -C "$rootfs" --numeric-owner -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    - "$tag" >/dev/null
echo "base image $tag: built ($(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}'))"
