#!/usr/bin/env bash
# Install a single-node Slurm (controller, compute daemon, client tools) and munge from Debian, so
# the trainer's tests run against real Slurm. Idempotent: a quick no-op when everything is there.
# The daemons are not started here: tests/support/slurm.py starts them with a throwaway slurm.conf.
set -euo pipefail

have_all() {
  for cmd in sbatch squeue scancel scontrol srun slurmctld slurmd munged; do
    command -v "$cmd" >/dev/null 2>&1 || [ -x "/usr/sbin/$cmd" ] || return 1
  done
}

if have_all; then
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  SUDO=
elif command -v sudo >/dev/null 2>&1; then
  SUDO="sudo -n"  # never stop to ask for a password (make test runs this)
else
  echo "Slurm is not installed and installing it needs root" >&2
  exit 1
fi

$SUDO apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive \
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
# The package's postinst creates a key on most images; make sure one exists either way (and never
# replace one: a running munge would stop trusting its peers).
if ! $SUDO test -s /etc/munge/munge.key; then
  $SUDO mungekey --create --keyfile /etc/munge/munge.key 2>/dev/null \
    || $SUDO dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  $SUDO chown munge:munge /etc/munge/munge.key
  $SUDO chmod 0400 /etc/munge/munge.key
fi
have_all
echo "slurm installed: $(dpkg-query -W -f='${Version}' slurmctld)"
