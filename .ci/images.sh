#!/usr/bin/env bash
# Build the container images the deployment tests run, without any image registry:
#
#   localhost/skred-base:bookworm   Debian bookworm (debootstrap, minbase) with Python 3.11;
#                                   the Dockerfile's BASE_IMAGE in CI
#   localhost/skred-etcd:bookworm   Debian's etcd-server and etcd-client (deploy/images/etcd)
#   localhost/skred-prometheus:bookworm  Debian's prometheus (deploy/images/prometheus)
#
# The base trusts the CA certificates this machine adds locally (/usr/local/share/ca-certificates),
# so builds on it reach the package registries exactly as the host does. A base image that already
# exists is kept (delete it with `podman rmi` to rebuild); etcd and Prometheus are rebuilt when
# their Containerfile changed. Needs root, podman and debootstrap.
# Prints `export NAME=image` lines for the tests (SKRED_BASE_IMAGE, ETCD_IMAGE, PROMETHEUS_IMAGE).
set -euo pipefail
cd "$(dirname "$0")/.."

BASE=localhost/skred-base:bookworm
ETCD=localhost/skred-etcd:bookworm
PROMETHEUS=localhost/skred-prometheus:bookworm
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

if ! podman image exists "$BASE"; then
    rootfs="$(mktemp -d)"
    trap 'rm -rf "$rootfs"' EXIT
    debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
        bookworm "$rootfs" "$MIRROR" >&2
    if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
        cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
        chroot "$rootfs" update-ca-certificates >&2
    fi
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE" >&2
    rm -rf "$rootfs"
    trap - EXIT
fi
# etcd and Prometheus are rebuilt when their Containerfile changed since the image was built
# (a label holds its checksum): a kept image must not miss what the tests rely on, such as the
# wget of the Prometheus healthcheck.
build_current() {  # IMAGE DIR
    local sum
    sum="$(sha256sum "$2/Containerfile" | cut -d' ' -f1)"
    [ "$(podman image inspect --format '{{index .Labels "skred.containerfile"}}' "$1" 2>/dev/null)" = "$sum" ] ||
        podman build --build-arg BASE_IMAGE="$BASE" --label "skred.containerfile=$sum" -t "$1" "$2" >&2
}
build_current "$ETCD" deploy/images/etcd
build_current "$PROMETHEUS" deploy/images/prometheus

echo "export SKRED_BASE_IMAGE=$BASE ETCD_IMAGE=$ETCD PROMETHEUS_IMAGE=$PROMETHEUS"
