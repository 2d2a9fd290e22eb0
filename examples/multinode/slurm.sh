#!/usr/bin/env bash
# GRPO on several nodes under SLURM: Ray's head on the first node of the allocation, a Ray worker on each other
# node, then `python -m rltrain.main_grpo` on the head with trainer.nnodes / n_gpus_per_node from the allocation.
#
#   sbatch --nodes=2 --gpus-per-node=8 examples/multinode/slurm.sh [Hydra overrides: model.path=... ...]
#
# Every node runs the same environment (activate it below, or run inside the docker/Dockerfile image) and sees a
# shared filesystem for trainer.output_dir, model.path and the data (see README.md next to this file).
#SBATCH --job-name=rltrain-grpo
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --exclusive
#SBATCH --time=24:00:00
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
# source /path/to/venv/bin/activate

gpus=${SLURM_GPUS_ON_NODE:-8}
cpus=${SLURM_CPUS_PER_TASK:-32}
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
head=${nodes[0]}
head_ip=$(srun --nodes=1 --ntasks=1 -w "$head" hostname --ip-address | awk '{print $1}')
port=6379

srun --nodes=1 --ntasks=1 -w "$head" \
    ray start --head --node-ip-address="$head_ip" --port="$port" --num-cpus="$cpus" --num-gpus="$gpus" --block &
sleep 10
for node in "${nodes[@]:1}"; do
    srun --nodes=1 --ntasks=1 -w "$node" \
        ray start --address="$head_ip:$port" --num-cpus="$cpus" --num-gpus="$gpus" --block &
done

# wait (up to 5 minutes) until every node has joined
for _ in $(seq 60); do
    joined=$(python -c "import ray; ray.init(address='$head_ip:$port', logging_level='ERROR'); \
print(sum(n['Alive'] for n in ray.nodes()))" 2>/dev/null || echo 0)
    [ "$joined" -ge "${#nodes[@]}" ] && break
    sleep 5
done
[ "$joined" -ge "${#nodes[@]}" ] || { echo "only $joined of ${#nodes[@]} nodes joined the Ray cluster" >&2; exit 1; }

status=0
python -m rltrain.main_grpo ray.address="$head_ip:$port" trainer.nnodes="${#nodes[@]}" \
    trainer.n_gpus_per_node="$gpus" actor.strategy=fsdp2 rollout.engine=vllm "$@" || status=$?
ray stop --force || true
exit $status
