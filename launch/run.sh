#!/usr/bin/env bash
# Run a spmdgt program on this machine's GPUs (or N CPU ranks) with torchrun.
#   launch/run.sh [NPROC] script.py [args...]          # NPROC defaults to the GPU count, else 2
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=host0 launch/run.sh 8 train.py   # multi-node
set -euo pipefail
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then nproc=$1; shift; else
  nproc=$(python -c 'import torch; print(torch.cuda.device_count() or 2)')
fi
if [[ -n "${NNODES:-}" && "${NNODES}" != 1 ]]; then
  exec torchrun --nnodes="$NNODES" --node_rank="${NODE_RANK:?set NODE_RANK}" \
    --master_addr="${MASTER_ADDR:?set MASTER_ADDR}" --master_port="${MASTER_PORT:-29500}" \
    --nproc_per_node="$nproc" "$@"
fi
exec torchrun --standalone --nproc_per_node="$nproc" "$@"
