#!/usr/bin/env bash
# Build pflower's Docker images with no container registry, as an air-gapped site does:
#   1. pflower-debian:bookworm  a minimal Debian rootfs from Debian's own packages
#                               (debootstrap from a Debian mirror, then `docker import`);
#   2. pflower-base:bookworm    + Python 3.11 in a venv + CPU torch/torchvision
#                               (docker/Dockerfile.base);
#   3. pflower-superlink, pflower-supernode  + pflower (docker/Dockerfile.*, BASE_IMAGE=2.).
# The Debian and base images already present are kept (REBUILD=1 builds them again); pflower's
# own two images are always built (layer-cached), so they carry this checkout's code. Run from anywhere:
#   bash docker/build-images.sh
# Settings (environment):
#   DEBIAN_MIRROR  the mirror debootstrap and apt use (default: this machine's apt source,
#                  else http://deb.debian.org/debian)
#   TORCH_WHEEL    a local CPU torch wheel for the base (default: the first
#                  torch-*+cpu-cp311-*.whl in PIP_FIND_LINKS or /opt/wheels; none: torch comes
#                  from TORCH_INDEX_URL, PyTorch's CPU index)
#   FLWR_SPEC      the Flower release in pflower's images (default: empty, the newest that
#                  pyproject.toml allows, 1.42; FLWR_SPEC='flwr[simulation]==1.39.0' for 1.39,
#                  whose Fleet API is gRPC: then start compose with PFLOWER_FLEET_PORT=9092)
#   CA_BUNDLE      the certificate authorities pip trusts in the images (default: the host's
#                  /etc/ssl/certs/ca-certificates.crt: a TLS proxy's authority comes with it)
# Needs root (debootstrap) and a Docker daemon. Needs no Docker Hub.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
REBUILD=${REBUILD:-0}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}

say() { printf 'build-images: %s\n' "$*"; }
have_image() { [ "$REBUILD" != 1 ] && docker image inspect "$1" >/dev/null 2>&1; }
fail() { printf 'build-images: %s\n' "$*" >&2; exit 1; }

docker info >/dev/null 2>&1 || fail "no Docker daemon answers; start one (as root: dockerd &) and retry"
[ -r "$CA_BUNDLE" ] || fail "CA_BUNDLE=$CA_BUNDLE is not a readable file; point it at your certificate bundle"

default_mirror() {
    local uri
    uri=$(grep -rhoE '^(URIs: |deb )https?://[^ ]+/debian/?' /etc/apt/sources.list /etc/apt/sources.list.d 2>/dev/null \
          | head -1 | sed -E 's/^(URIs: |deb )//') || true
    echo "${uri:-http://deb.debian.org/debian}"
}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-$(default_mirror)}

find_torch_wheel() {
    local dir
    for dir in ${PIP_FIND_LINKS:-} /opt/wheels; do
        [ -d "$dir" ] || continue
        ls "$dir"/torch-*+cpu-cp311-*.whl 2>/dev/null | sort | tail -1 && return 0
    done
    return 0
}
TORCH_WHEEL=${TORCH_WHEEL:-$(find_torch_wheel)}

# ---- 1. Debian rootfs -> image
if have_image pflower-debian:bookworm; then
    say "pflower-debian:bookworm is there"
else
    command -v debootstrap >/dev/null || fail "debootstrap is missing (apt-get install -y debootstrap)"
    rootfs=$(mktemp -d /tmp/pflower-rootfs.XXXXXX)
    trap 'rm -rf "$rootfs"' EXIT
    say "debootstrap bookworm from $DEBIAN_MIRROR (a few minutes)"
    debootstrap --variant=minbase bookworm "$rootfs" "$DEBIAN_MIRROR" >/tmp/pflower-debootstrap.log 2>&1 \
        || fail "debootstrap failed; its log is /tmp/pflower-debootstrap.log"
    echo "deb $DEBIAN_MIRROR bookworm main" >"$rootfs/etc/apt/sources.list"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | docker import - pflower-debian:bookworm >/dev/null
    rm -rf "$rootfs"
    trap - EXIT
fi

# ---- 2. base: Python + CPU torch
if have_image pflower-base:bookworm; then
    say "pflower-base:bookworm is there"
else
    ctx=$(mktemp -d /tmp/pflower-base.XXXXXX)
    trap 'rm -rf "$ctx"' EXIT
    mkdir "$ctx/wheels"
    cp "$CA_BUNDLE" "$ctx/ca-bundle.crt"
    cp "$REPO/docker/Dockerfile.base" "$ctx/Dockerfile"
    args=()
    if [ -n "$TORCH_WHEEL" ]; then
        [ -r "$TORCH_WHEEL" ] || fail "TORCH_WHEEL=$TORCH_WHEEL is not a readable file"
        cp "$TORCH_WHEEL" "$ctx/wheels/"
        # torchvision 0.(minor+15) is the release made for torch 2.minor
        minor=$(basename "$TORCH_WHEEL" | sed -E 's/^torch-2\.([0-9]+)\..*/\1/')
        args+=(--build-arg "TORCHVISION_VERSION=0.$((minor + 15)).0")
        say "base with torch from $TORCH_WHEEL"
    else
        say "base with torch from PyTorch's CPU index (no local wheel found)"
    fi
    docker build -q -t pflower-base:bookworm "${args[@]}" "$ctx" >/dev/null
    rm -rf "$ctx"
    trap - EXIT
fi

# ---- 3. pflower's images
# always built: they carry this checkout's code, and Docker's layer cache makes a build with
# unchanged code take seconds (an image left from another checkout would run old code)
for role in superlink supernode; do
    say "building pflower-$role"
    docker build -q -f "$REPO/docker/Dockerfile.$role" -t "pflower-$role" \
        --build-arg BASE_IMAGE=pflower-base:bookworm --build-arg TORCH_INDEX_URL= \
        --build-arg "FLWR_SPEC=${FLWR_SPEC:-}" "$REPO" >/dev/null
done
docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep '^pflower-' | sed 's/^/build-images: /'
