#!/usr/bin/env bash
# Cannikin on a SLURM cluster: 2 nodes x 4 GPUs, one task per GPU, every task started by srun.
#
#   sbatch examples/slurm_job.sh                  # from the repository root
#   sbatch examples/slurm_job.sh --epochs 50      # extra arguments go to examples/train_multinode.py
#
# Lightning detects SLURMEnvironment from the variables srun sets (SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID,
# SLURM_NODEID, ...) and takes ranks from them; it does not start processes itself. Trainer(num_nodes=..., devices=...)
# must equal --nodes and --ntasks-per-node, or Lightning stops with a ValueError naming both; this script passes
# SLURM's own values. Nodes may carry different GPU models (that is what Cannikin balances), but every node must run
# the same number of tasks. Do not name the job "bash" or "interactive": Lightning then ignores SLURM.
# CI (.ci/examples) runs it under a stand-in srun on CPU (2 tasks as 2 nodes, --accelerator cpu --smoke);
# tests/test_launchers.py emulates what srun gives each task.
#
#SBATCH --job-name=cannikin
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --mem=64G
#SBATCH --time=02:00:00
#SBATCH --signal=SIGUSR1@90
#SBATCH --output=%x-%j.out
# --signal: Lightning's SLURMEnvironment (auto_requeue=True) checkpoints and requeues the job on SIGUSR1, 90 s before
# the time limit. --gpus-per-node may be --gres=gpu:4 on older sites.
set -euo pipefail

cd "${SLURM_SUBMIT_DIR:-.}"
# activate the environment that has torch, lightning and lightning-cannikin installed, e.g.
#   source .venv/bin/activate

# MASTER_ADDR: left unset, Lightning takes the first host of SLURM_NODELIST. MASTER_PORT: Lightning derives it from the
# job id (15000 + its last four digits) unless set; set it to pick another.
export OMP_NUM_THREADS="${SLURM_CPUS_PER_TASK:-1}"

srun python examples/train_multinode.py \
    --accelerator gpu \
    --num-nodes "$SLURM_NNODES" \
    --devices "$SLURM_NTASKS_PER_NODE" \
    --epochs 20 \
    "$@"
