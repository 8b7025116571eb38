#!/usr/bin/env bash
# Podman and what `make compose-test` needs beside it, from Debian's packages (root or sudo), and
# the settings these machines need (measured 2026-11-27, ENVIRONMENT.md):
#   - runc, not crun: crun refuses the kernel's mixed cgroup mode;
#   - containers' open-file and process limits at 20000: higher ones are refused.
# Idempotent. Licence: CC0-1.0.
set -euo pipefail
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"

need=()
for cmd in podman runc conmon mmdebstrap; do
  command -v "$cmd" >/dev/null || need+=("$cmd")
done
if [ ${#need[@]} -gt 0 ]; then
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends podman runc \
    conmon fuse-overlayfs slirp4netns uidmap containernetworking-plugins netavark aardvark-dns \
    iptables catatonit mmdebstrap
fi

# A drop-in of its own (podman reads containers.conf.d after containers.conf), so an existing
# containers.conf is left as it is; rewritten each time.
$SUDO mkdir -p /etc/containers/containers.conf.d
$SUDO tee /etc/containers/containers.conf.d/loopline.conf >/dev/null <<'CONF'
# deploy/podman/install.sh (Loopline's make compose-test)
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=20000:20000"]

[engine]
runtime = "runc"
CONF
podman --version
