#!/bin/bash
# Train on a SLURM cluster: srun starts one torchrun agent on every node, and each agent
# starts that node's learners (one per GPU), restarts them when one dies, and re-forms the
# job without a node that dies (torchelastic). Every learner is a rank; a replay recipe's
# replay shards (replay.processes) run in CPU processes that rank 0 starts on its node, so that
# node's cores and memory must hold them too (about 7 GB per million Atari transitions).
# Edit the #SBATCH lines for your cluster.
#
#   sbatch slurm.sh                                   # the defaults of config.yaml
#   sbatch slurm.sh replay.processes=2 total_frames=2000000
#   NET_IF=ib0 sbatch slurm.sh                        # the nodes talk over interface ib0
#   LEARNERS_PER_NODE=8 sbatch slurm.sh fabric.accelerator=cpu   # a CPU cluster
#
# A dead process: torchrun stops the node's learners and starts them again (at most
# MAX_RESTARTS times, default 3); resume=auto takes them on from the newest checkpoint, so a
# failure costs at most checkpoint.every frames. A node that dies and does not come back:
# the others go on without it (at least MIN_NODES, default 1), from the same checkpoint,
# with fewer learners. The first node hosts the job's rendezvous: the job cannot outlive it.
#
# Preemption and time limits: 90 s before the limit SLURM sends SIGUSR1 to this script,
# which passes it on to the job's processes; the learners stop at the same step and write
# a checkpoint, and once they have all ended this script requeues the job (scontrol
# requeue). The requeued job runs this same script: resume=auto goes on from the newest
# checkpoint in run_dir (and starts afresh when there is none).
#
# Each job has its own run_dir, named by its job id, which a requeued job keeps:
# runs/<recipe>-<env>-seed<seed>-job<id>. Two jobs of the same recipe, env and seed never
# share one. To go on from an earlier job's run, name its folder: run_dir=<it> (a run
# there with another recipe, env, seed or algo is refused in one line).
#
#SBATCH --job-name={{ cookiecutter.project_slug }}
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1   # one torchrun agent per node
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32    # the node's cores for its learners
#SBATCH --time=04:00:00
#SBATCH --signal=B:USR1@90    # to this script, which passes it on to the learners
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%j.out

set -euo pipefail

# Where this node is reached: its address on the interface named by NET_IF, or its first
# address that is not loopback; with one node, loopback. Not its hostname: many hosts files
# map the own hostname to 127.0.1.1, which the other nodes cannot reach. gloo, NCCL and RPC
# then listen on that network instead of loopback; RPC runs pickled calls, so keep the job
# inside a network you trust (docs/clusters.md, "Security").
node_address() {
    if [ "$SLURM_NNODES" = 1 ]; then
        echo 127.0.0.1
    elif [ -n "${NET_IF:-}" ]; then
        ip -4 -o addr show dev "$NET_IF" | awk '{split($4, a, "/"); print a[1]; exit}'
    else
        hostname -I | awk '{print $1}'
    fi
}
export -f node_address
if [ -n "${NET_IF:-}" ]; then
    export GLOO_SOCKET_IFNAME="$NET_IF" NCCL_SOCKET_IFNAME="$NET_IF" TP_SOCKET_IFNAME="$NET_IF"
fi
MAIN_ADDR=$(node_address)  # this script runs on the job's first node
if [ -z "$MAIN_ADDR" ]; then
    echo "error: no network address for the main node${NET_IF:+ on interface $NET_IF}" >&2
    exit 2
fi
# The rendezvous port comes from the job's id, so jobs that share a node do not collide.
RDZV_PORT=$((15000 + SLURM_JOB_ID % 15000))
LEARNERS_PER_NODE=${LEARNERS_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}

# SLURM's warning, from here on (before srun, so that none is lost).
trap 'echo "SIGUSR1: the time limit is near; stopping at a checkpoint" >&2; STOPPED=1' USR1

# One torchrun agent per node, named by its own address. srun passes SIGUSR1 on to every
# process of the job step; it is for the learners, so the agent ignores it (`trap ""`, kept
# across exec), where it would die of it and take them down before their checkpoint.
srun bash -c 'trap "" USR1; exec torchrun --local-addr="$(node_address)" "$@"' torchrun \
    --nnodes="${MIN_NODES:-1}:$SLURM_NNODES" --nproc-per-node="$LEARNERS_PER_NODE" \
    --max-restarts="${MAX_RESTARTS:-3}" \
    --rdzv-backend=c10d --rdzv-endpoint="$MAIN_ADDR:$RDZV_PORT" --rdzv-id="$SLURM_JOB_ID" \
    train.py fabric.accelerator=gpu fabric.strategy=ddp \
    checkpoint.every=100000 resume=auto \
    "run_dir=runs/\${recipe}-\${one_folder:\${env.id}}-seed\${seed}-job$SLURM_JOB_ID" \
    "$@" &
STEP=$!
# Once SLURM's warning has come, pass it on to the job step, and again every 10 s until the
# learners have all ended: those that a restart was starting when it came ignore it until
# they are up (torchrun's agent passes its ignoring on).
since=0
while kill -0 "$STEP" 2>/dev/null; do
    if [ -n "${STOPPED:-}" ]; then
        if ((since % 10 == 0)); then kill -USR1 "$STEP" 2>/dev/null || true; fi
        since=$((since + 1))
    fi
    sleep 1
done
status=0
wait "$STEP" || status=$?
if [ -n "${STOPPED:-}" ] && [ "$status" = 0 ]; then
    echo "requeueing job $SLURM_JOB_ID: it goes on from its last checkpoint" >&2
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
