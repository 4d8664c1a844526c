#!/usr/bin/env bash
# Check scripts/slurm/relayrl.sbatch under a real Slurm (Debian's slurm-wlm 22.05) on this
# one machine: install it if missing (root), start munged, slurmctld and slurmd for one
# node, submit the sbatch script with a tiny run, wait for it, report, clean up.
# Everything runs in a private network namespace (loopback plus a veth pair of its own), so
# Slurm and Ray traffic never leaves this machine, and cleanup ends exactly the processes in
# that namespace (by pid; never `ray stop` or pkill, which would hit other Ray/Slurm users of
# the machine). Not part of `make test` (root, Slurm).
#
#   scripts/check_slurm.sh [MODEL_DIR]      # last line: slurm_check=passed seconds=...
#   PYTHON=/path/to/venv/bin/python KEEP=1 scripts/check_slurm.sh   # keep the logs
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
if [ -z "${RELAYRL_IN_NETNS:-}" ]; then
    if ! command -v slurmctld >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
    fi
    exec env RELAYRL_IN_NETNS=1 unshare --net bash "$0" "$@"
fi
NETNS=$(readlink /proc/$$/ns/net)
ip link set lo up
# Slurm's address lookups fail while loopback is the only interface: give the namespace a
# veth pair of its own (both ends inside it; no route leaves the namespace)
ip link add rr0 type veth peer name rr1
ip addr add 10.254.254.1/30 dev rr0 && ip addr add 10.254.254.2/30 dev rr1
ip link set rr0 up && ip link set rr1 up
WORK=$(mktemp -d /tmp/rr-slurm-XXXX)
MUNGE_SOCKET=$WORK/munge/munge.socket  # this check's own munged, not the machine's

in_namespace() {  # pids of every process in this namespace but this shell
    for p in /proc/[0-9]*; do
        pid=${p#/proc/}
        [ "$pid" != $$ ] && [ "$(readlink "$p/ns/net" 2>/dev/null)" = "$NETNS" ] && echo "$pid"
    done
    return 0
}
cleanup() {
    status=$?
    set +e
    scancel --quiet --full "${JOB:-0}" 2>/dev/null || true
    for sig in TERM KILL; do
        pids=$(in_namespace)
        [ -n "$pids" ] && kill -s $sig $pids 2>/dev/null
        for _ in $(seq 50); do [ -z "$(in_namespace)" ] && break; sleep 0.1; done
    done
    if [ -n "${KEEP:-}" ]; then echo "logs kept in $WORK"; else rm -rf "$WORK"; fi
    exit "$status"
}
trap cleanup EXIT

# munge: a key of this check's own (readable by the munge user only, as munged insists) and
# a socket under $WORK that every Slurm process is pointed at (AuthInfo/CredType settings)
mkdir -p "$WORK"/{state,spool,log,munge} && chmod 755 "$WORK"
dd if=/dev/urandom bs=1 count=1024 of="$WORK/munge/munge.key" 2>/dev/null
chown -R munge:munge "$WORK/munge" && chmod 700 "$WORK/munge" && chmod 400 "$WORK/munge/munge.key"
chmod 711 "$WORK/munge"
setpriv --reuid=munge --regid=munge --init-groups munged --foreground --key-file="$WORK/munge/munge.key" \
    --socket="$MUNGE_SOCKET" --pid-file="$WORK/munge/munged.pid" \
    --seed-file="$WORK/munge/seed" --log-file="$WORK/munge/munged.log" &
for _ in $(seq 50); do [ -S "$MUNGE_SOCKET" ] && break; sleep 0.1; done
munge --socket="$MUNGE_SOCKET" -n | unmunge --socket="$MUNGE_SOCKET" >/dev/null

CPUS=$(nproc)
HOST=$(hostname)
cat > "$WORK/slurm.conf" <<CONF
ClusterName=relayrl-check
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
CredType=cred/munge
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd.pid
SlurmctldLogFile=$WORK/log/slurmctld.log
SlurmdLogFile=$WORK/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
ReturnToService=2
MpiDefault=none
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF="$WORK/slurm.conf"
slurmctld -D -f "$SLURM_CONF" &
slurmd -D -f "$SLURM_CONF" &
for _ in $(seq 60); do sinfo -h -o %T 2>/dev/null | grep -q idle && break; sleep 1; done
sinfo
MODEL=${1:-}
if [ -z "$MODEL" ]; then
    MODEL="$WORK/model"
    "$PYTHON" -c "
from relayrl.models.build import create_model_dir
from relayrl.tasks.registry import make_task
create_model_dir('$MODEL', make_task('arithmetic'), 'tiny', seed=0, corpus_size=500)" 2>/dev/null
fi
TINY="model.path=$MODEL model.max_context=128 rollout.prompts_per_step=2 rollout.n_samples=4 rollout.max_new_tokens=16 algo.dynamic_sampling=false train.total_steps=3 train.eval_every=0 train.progress=false eval.num_problems=4 eval.max_new_tokens=16 train.trainer_threads=1 runtime.threads=1 output_dir=$WORK/runs name=slurm"
start=$(date +%s)
JOB=$(CONFIG=configs/async.yaml OVERRIDES="$TINY" PYTHON="$PYTHON" RAY_HEAD_IP=127.0.0.1 \
    RAY_TMPDIR="$WORK/ray" sbatch --parsable --nodes=1 --cpus-per-task="$CPUS" \
    --output="$WORK/job.out" scripts/slurm/relayrl.sbatch)
echo "submitted job $JOB"
deadline=$(( $(date +%s) + ${TIMEOUT:-600} ))
while squeue -h -j "$JOB" 2>/dev/null | grep -q .; do
    [ "$(date +%s)" -gt "$deadline" ] && { echo "timed out after ${TIMEOUT:-600}s"; break; }
    sleep 2
done
state=$(scontrol -o show job "$JOB" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2 || true)
echo "--- job output ---"; tail -15 "$WORK/job.out"
if grep -q "final_pass@1=" "$WORK/job.out"; then
    echo "slurm_check=passed seconds=$(( $(date +%s) - start )) state=${state:-unknown}"
else
    tail -n 20 "$WORK/log/slurmctld.log" "$WORK/log/slurmd.log" "$WORK/munge/munged.log"
    echo "slurm_check=failed state=${state:-unknown}"; exit 1
fi
