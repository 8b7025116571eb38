#!/usr/bin/env bash
# The compose stack's Slurm side without Docker: the three containers (controller, compute node,
# trainer) become Linux namespaces on this machine, each with its own hostname and /run, sharing a
# private network and the mounts compose gives them (deploy/slurm/slurm.conf at /etc/slurm, one
# munge key at /etc/munge-key, the job volume at /var/lib/loopline/jobs). Each runs
# deploy/slurm/loopline-slurm as the images do, as the user the images use. Then the "trainer"
# submits a job as uid 10001 and checks it ran on the compute node and wrote the job directory.
# Then the compute node comes back with a new address, which the controller must learn.
#
#   slurm_containers.sh [GPUS]   GPUS > 0: the compute node gets that many stand-in /dev/nvidiaN
#                                devices (the entrypoint finds them and offers them as gres/gpu),
#                                and the job runs one task per GPU through srun
#
# Needs root, util-linux's unshare and the Slurm/munge packages (scripts/slurm/install.sh).
# Everything lives in a PID namespace: when this script ends, every daemon it started ends too.
# Prints "slurm containers: ok" on success. Licence: CC0-1.0.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
ENTRY="$REPO/deploy/slurm/loopline-slurm"
WORK=$(mktemp -d /tmp/loopline-slurm-containers.XXXXXX)
trap '[ -n "${KEEP:-}" ] || rm -rf "$WORK"' EXIT
chmod 0755 "$WORK"

GPUS=${1:-0}
export REPO ENTRY WORK GPUS
unshare --mount --net --pid --uts --fork --mount-proc bash -s <<'OUTER'
set -euo pipefail
mount --make-rprivate /
ip link set lo up
# A container has an interface besides lo, and slurmctld needs one: with only lo, the address
# lookup for its listening socket (IPv4, AI_ADDRCONFIG) finds nothing. Both ends stay in here.
ip link add eth0 type veth peer name eth1
ip addr add 127.0.0.2/32 dev eth0
ip link set eth0 up
ip link set eth1 up
# A private /etc: the hosts the containers resolve each other by, the loopline user of the images,
# the mounts of docker-compose.yml.
cp -a /etc "$WORK/etc"
mount --bind "$WORK/etc" /etc
echo "127.0.0.1 slurmctld slurm-compute-0 trainer" >> /etc/hosts
getent group loopline >/dev/null || groupadd --system --gid 10001 loopline
getent passwd loopline >/dev/null || useradd --system --uid 10001 --gid 10001 --no-create-home loopline
mkdir -p /etc/slurm /etc/munge-key
cp "$REPO/deploy/slurm/slurm.conf" /etc/slurm/slurm.conf
# The compose `munge-key` service; run again, as on every `up`, over a key an earlier version left
# readable by all.
"$ENTRY" genkey /etc/munge-key/munge.key
chmod 0444 /etc/munge-key/munge.key
"$ENTRY" genkey /etc/munge-key/munge.key
mount -t tmpfs tmpfs /var/spool
install -d -o slurm -g slurm /var/spool/slurmctld
mount -t tmpfs tmpfs /var/lib
# A fresh volume is root's; the compute node's entrypoint hands it to the loopline user.
install -d /var/lib/loopline/jobs

container() {  # NAME: a new hostname and /run, like a container of the compose stack
  local name=$1; shift
  unshare --mount --uts --fork bash -c "hostname $name; mount -t tmpfs tmpfs /run; $*" \
    > "$WORK/$name.log" 2>&1 &
}
# The controller image: slurm user, /run/munge and /run/slurm its own; compose's group_add gives
# it the munge key's group.
container slurmctld "install -d -o slurm -g slurm /run/munge /run/slurm;
  exec setpriv --reuid=slurm --regid=slurm --groups=10002 '$ENTRY' slurmctld"
# The compute image: root. With GPUS, a private /dev that also holds stand-ins for the GPU device
# files the NVIDIA runtime would put there (character devices, as the entrypoint requires).
cat > "$WORK/compute.sh" <<'COMPUTE'
set -euo pipefail
if [ "$GPUS" -gt 0 ]; then
  dev=$(mktemp -d)
  mount -t tmpfs tmpfs "$dev"
  mkdir "$dev/pts" "$dev/shm"
  for n in null zero random urandom full tty; do touch "$dev/$n"; mount --bind "/dev/$n" "$dev/$n"; done
  ln -s /proc/self/fd "$dev/fd"
  for i in $(seq 0 $((GPUS - 1))); do mknod "$dev/nvidia$i" c 1 3; done
  mount --rbind "$dev" /dev
fi
exec "$ENTRY" slurmd --conf "CPUs=2"
COMPUTE
container slurm-compute-0 "bash '$WORK/compute.sh'"

fail() {
  echo "slurm containers: FAILED: $*"
  for log in "$WORK"/*.log; do echo "--- $log"; tail -n 25 "$log"; done
  exit 1
}

# The trainer image: uid 10001 with its own munged, then Slurm's client commands; with the munge
# key's group, as compose's group_add gives it.
cat > "$WORK/trainer.sh" <<'TRAINER'
set -euo pipefail
for _ in $(seq 60); do
  "$ENTRY" health slurmctld 2>/dev/null && break
  sleep 0.5
done
"$ENTRY" health slurmctld
for _ in $(seq 150); do
  state=$(sinfo -h -N -o '%N %T' 2>/dev/null || true)
  case "$state" in *"slurm-compute-0 idle"*) break ;; esac
  sleep 0.2
done
echo "node: $state"
"$ENTRY" health slurmctld
mkdir -p /var/lib/loopline/jobs/job-1
cat > /var/lib/loopline/jobs/job-1/entrypoint.sh <<'JOB'
#!/bin/bash
echo "ran as $(id -u) on $(hostname) in $PWD" > result.txt
# Whoever reads the munge key can forge a credential for root: a job must not.
if cat /etc/munge-key/munge.key > /dev/null 2>&1; then echo "munge key: read"; else echo "munge key: refused"; fi >> result.txt
if [ -n "${SLURM_GPUS_PER_TASK:-}" ]; then
  srun bash -c 'echo "task $SLURM_PROCID gpu $CUDA_VISIBLE_DEVICES"' | sort >> result.txt
fi
JOB
chmod +x /var/lib/loopline/jobs/job-1/entrypoint.sh
gpu_args=()
if [ "$GPUS" -gt 0 ]; then
  echo "gres: $(sinfo -h -N -o %G)"
  # What the trainer's Slurm launcher asks for on a cluster with GPUs.
  gpu_args=(--ntasks="$GPUS" --gpus-per-task=1)
fi
id=$(sbatch --parsable "${gpu_args[@]}" --chdir=/var/lib/loopline/jobs/job-1 \
  --output=/var/lib/loopline/jobs/job-1/slurm-%j.out /var/lib/loopline/jobs/job-1/entrypoint.sh)
for _ in $(seq 150); do
  job=$(squeue -h -t all -j "$id" -o %T)
  [ "$job" = COMPLETED ] && break
  sleep 0.2
done
echo "job $id: $job"
cat /var/lib/loopline/jobs/job-1/result.txt
TRAINER
unshare --mount --uts --fork bash -c "hostname trainer; mount -t tmpfs tmpfs /run;
  install -d -o 10001 -g 10001 /run/munge;
  exec setpriv --reuid=10001 --regid=10001 --groups=10002 '$ENTRY' run bash '$WORK/trainer.sh'" \
  > "$WORK/trainer.log" 2>&1 || fail "the trainer's commands failed"
grep -q "node: slurm-compute-0 idle" "$WORK/trainer.log" || fail "the compute node did not register"
grep -q "COMPLETED" "$WORK/trainer.log" || fail "the job did not complete"
grep -q "ran as 10001 on slurm-compute-0 in /var/lib/loopline/jobs/job-1" "$WORK/trainer.log" \
  || fail "the job did not run as 10001 on the compute node"
[ "$(stat -c %u /var/lib/loopline/jobs)" = 10001 ] || fail "the jobs volume was not handed to 10001"
grep -q "munge key: refused" "$WORK/trainer.log" || fail "a job could read the munge key"
[ "$(stat -c '%a %u %g' /etc/munge-key/munge.key)" = "440 0 10002" ] \
  || fail "the munge key is $(stat -c '%a %u %g' /etc/munge-key/munge.key), not 440 root:10002"
# The compute image's HEALTHCHECK, run inside the compute "container".
nsenter --target "$(pgrep -x slurmd | head -n 1)" --mount --uts "$ENTRY" health slurmd \
  || fail "loopline-slurm health slurmd failed on a healthy node"
# The compute node comes back with a new address, as a container does after `docker compose down`
# and `up`: its entrypoint must tell the controller, which keeps a dynamic node's first address.
pkill -x slurmd
for _ in $(seq 50); do pgrep -x slurmd > /dev/null || break; sleep 0.1; done
sed -i 's/^127.0.0.1 slurmctld slurm-compute-0 trainer$/127.0.0.1 slurmctld trainer\n127.0.0.2 slurm-compute-0/' /etc/hosts
container slurm-compute-0 "bash '$WORK/compute.sh'"
addr=""
for _ in $(seq 100); do
  pid=$(pgrep -x slurmd | head -n 1 || true)
  if [ -n "$pid" ]; then
    addr=$(nsenter --target "$pid" --mount --uts scontrol show node slurm-compute-0 2>/dev/null \
      | grep -o 'NodeAddr=[^ ]*' || true)
    [ "$addr" = "NodeAddr=127.0.0.2" ] && break
  fi
  sleep 0.2
done
[ "$addr" = "NodeAddr=127.0.0.2" ] || fail "the controller still has $addr for the restarted node, not 127.0.0.2"
grep -q "node slurm-compute-0 is now at 127.0.0.2" "$WORK/slurm-compute-0.log" \
  || fail "the compute node's entrypoint did not give the controller its new address"
if [ "$GPUS" -gt 0 ]; then
  grep -q "gres: gpu:$GPUS" "$WORK/trainer.log" || fail "the node does not offer gpu:$GPUS"
  for i in $(seq 0 $((GPUS - 1))); do
    grep -q "task $i gpu $i" "$WORK/trainer.log" || fail "task $i did not get GPU $i"
  done
fi
cat "$WORK/trainer.log"
echo "slurm containers: ok"
OUTER
