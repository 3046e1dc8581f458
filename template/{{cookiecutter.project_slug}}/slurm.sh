#!/bin/bash
# Train on a SLURM cluster: srun starts one task per device on every node, and Lightning
# Fabric reads its ranks from the SLURM environment. Every task is a learner; a replay
# recipe's replay shards (replay.ranks) run in CPU processes that rank 0's task starts on
# the first node, so that task's cores and the node's memory must hold them too (about
# 7 GB per million Atari transitions). Edit the #SBATCH lines for your cluster.
#
#   sbatch slurm.sh                                   # the defaults of config.yaml
#   sbatch slurm.sh replay.ranks=2 total_frames=2000000
#   NET_IF=ib0 sbatch slurm.sh                        # the nodes talk over interface ib0
#
# Preemption and time limits: 90 s before the limit SLURM sends SIGUSR1 to every rank; they
# stop at the same step, write a checkpoint, and rank 0 requeues the job (scontrol requeue).
# The requeued job runs this same script: resume=auto goes on from the newest checkpoint in
# run_dir (and starts afresh when there is none). Give each job its own run_dir.
#
#SBATCH --job-name={{ cookiecutter.project_slug }}
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --time=04:00:00
#SBATCH --signal=USR1@90
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%j.out

set -euo pipefail

# The main address: this script runs on the job's first node, so take that node's address
# on the interface named by NET_IF, or its first address that is not loopback. Not its
# hostname: many hosts files map the own hostname to 127.0.1.1, which the other nodes
# cannot reach. gloo, NCCL and RPC then listen on that network instead of loopback; RPC
# runs pickled calls, so keep the job inside a network you trust (docs/clusters.md, "Security").
if [ "$SLURM_NNODES" = 1 ]; then
    MASTER_ADDR=127.0.0.1  # one node: everything stays on loopback
elif [ -n "${NET_IF:-}" ]; then
    MASTER_ADDR=$(ip -4 -o addr show dev "$NET_IF" | awk '{split($4, a, "/"); print a[1]; exit}')
    export GLOO_SOCKET_IFNAME="$NET_IF" NCCL_SOCKET_IFNAME="$NET_IF" TP_SOCKET_IFNAME="$NET_IF"
else
    MASTER_ADDR=$(hostname -I | awk '{print $1}')
fi
if [ -z "$MASTER_ADDR" ]; then
    echo "error: no network address for the main node${NET_IF:+ on interface $NET_IF}" >&2
    exit 2
fi
# Each job takes a block of three ports (c10d, RPC, watchdog) from its id, so jobs that
# share a node do not collide.
MASTER_PORT=$((15000 + SLURM_JOB_ID % 15000 * 3))
export MASTER_ADDR MASTER_PORT

srun python train.py \
    fabric.accelerator=gpu fabric.strategy=ddp \
    fabric.devices="$SLURM_NTASKS_PER_NODE" fabric.num_nodes="$SLURM_NNODES" \
    checkpoint.every=100000 resume=auto \
    "$@"
