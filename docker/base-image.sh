#!/bin/sh
# Makes a Debian bookworm base image from Debian's packages with debootstrap and
# `docker import`, for a Docker host that reaches a Debian mirror but no image registry.
# It already holds what docker/Dockerfile and docker/Dockerfile.etcd install, so their
# builds need no apt index. Run as root:
#
#   docker/base-image.sh ftrain-base:bookworm http://YOUR-DEBIAN-MIRROR/debian
#   docker build --build-arg BASE_IMAGE=ftrain-base:bookworm ...
set -eu
tag=${1:?usage: base-image.sh TAG MIRROR}
mirror=${2:?usage: base-image.sh TAG MIRROR (a Debian mirror URL, e.g. the one apt uses)}
packages=ca-certificates,python3,python3-venv,tini,etcd-server,etcd-client

root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include="$packages" bookworm "$root" "$mirror"
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb
tar -C "$root" --numeric-owner -c . | docker import - "$tag"
