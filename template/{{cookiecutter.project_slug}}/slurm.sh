#!/bin/bash
# Train on a SLURM cluster: srun starts one task per device on every node, and Lightning
# Fabric reads its ranks from the SLURM environment. Edit the #SBATCH lines for your cluster.
#
#   sbatch slurm.sh                                   # the defaults of config.yaml
#   sbatch slurm.sh replay.ranks=2 total_frames=2000000
#
#SBATCH --job-name={{ cookiecutter.project_slug }}
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --time=04:00:00
#SBATCH --output=slurm-%j.out

set -euo pipefail

# Name the first node as the main address: gloo, NCCL and RPC then listen on the cluster
# network instead of loopback. RPC runs pickled calls, so keep the job inside a network
# you trust (README.md, Security). RPC takes MASTER_PORT + 1, the watchdog MASTER_PORT + 2.
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
export MASTER_ADDR MASTER_PORT

srun python train.py \
    fabric.accelerator=gpu fabric.strategy=ddp \
    fabric.devices="$SLURM_NTASKS_PER_NODE" fabric.num_nodes="$SLURM_NNODES" \
    "$@"
