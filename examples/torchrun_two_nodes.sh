#!/usr/bin/env bash
# Two "nodes" on one machine: two torchrun commands (node ranks 0 and 1, one process each) that meet through a static
# rendezvous on the loopback address, training with strategy="cannikin" on CPU (gloo). Node 1's device is emulated as
# 3x slower than node 0's, so Cannikin moves samples to node 0.
#
#   examples/torchrun_two_nodes.sh                      # free port, 2 epochs
#   MASTER_PORT=29500 examples/torchrun_two_nodes.sh --epochs 4
#   DRY_RUN=1 examples/torchrun_two_nodes.sh            # print the two commands (one per line) and exit
#
# On two real machines run the same command once on each, with --node_rank 0 / 1, --master_addr set to node 0's
# address (reachable from node 1) and, for GPUs, --nproc_per_node and --devices set to the GPUs per node plus
# --accelerator gpu and no --per-sample-ms. Extra arguments go to examples/train_multinode.py.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"

PYTHON="${PYTHON:-python}"
# `torchrun` is `python -m torch.distributed.run`; the module form uses the same interpreter as $PYTHON
read -ra TORCHRUN <<<"${TORCHRUN:-$PYTHON -m torch.distributed.run}"
PORT="${MASTER_PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"

node_command() {
    local node_rank="$1"
    shift
    NODE_COMMAND=(
        "${TORCHRUN[@]}" --nnodes 2 --node_rank "$node_rank" --nproc_per_node 1
        --master_addr 127.0.0.1 --master_port "$PORT"
        "$ROOT/examples/train_multinode.py" --num-nodes 2 --devices 1 --accelerator cpu --per-sample-ms 1 3 "$@"
    )
}

if [[ -n "${DRY_RUN:-}" ]]; then
    for node_rank in 0 1; do
        node_command "$node_rank" "$@"
        printf '%q ' "${NODE_COMMAND[@]}"
        printf '\n'
    done
    exit 0
fi

pids=()
# shellcheck disable=SC2317  # called by the trap
cleanup() {
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true  # torchrun stops its workers on SIGTERM
    done
}
trap cleanup EXIT INT TERM

for node_rank in 0 1; do
    node_command "$node_rank" "$@"
    "${NODE_COMMAND[@]}" &
    pids+=("$!")
done

# if one node fails, the other would wait for it at the next collective: stop at the first failure
status=0
for _ in "${pids[@]}"; do
    wait -n || { status=$?; break; }
done
exit "$status"
