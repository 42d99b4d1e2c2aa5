#!/usr/bin/env bash
# Run a spmdgt program with torchrun on this machine's GPUs (or N CPU ranks), or on many nodes.
#
#   launch/run.sh [NPROC] script.py [args...]        # one node; NPROC: the GPU count, else 2
#
# Multi-node, c10d rendezvous (torchrun's elastic one: start the same command on every node,
# in any order; node ranks are assigned at the rendezvous, the endpoint is any node's host:port):
#   NNODES=2 RDZV_ENDPOINT=host0:29400 launch/run.sh 8 train.py
#   (RDZV_ID names the job, default "spmdgt": jobs sharing an endpoint need different ids)
#
# Multi-node, static (every node says its rank; MASTER_ADDR runs the store):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=host0 launch/run.sh 8 train.py
#
# 2-D meshes: torchrun numbers ranks node by node and the trainer's (dp_replicate, dp_shard, tp)
# mesh is row-major, so --tp <= NPROC keeps each tensor-parallel group inside a node (FSDP
# across): NNODES=2 RDZV_ENDPOINT=host0:29400 launch/run.sh 2 examples/train_transformer.py --tp 2
# (rank 0's log names each tp group's ranks and node; see docs/launch.md).
#
# LOG_DIR=logs/ writes one log file per rank (torchrun --log-dir, stdout and stderr teed).
set -euo pipefail
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then nproc=$1; shift; else
  nproc=$(python -c 'import torch; print(torch.cuda.device_count() or 2)')
fi
logs=()
if [[ -n "${LOG_DIR:-}" ]]; then logs=(--log-dir="$LOG_DIR" --redirects=3 --tee=3); fi
if [[ -n "${NNODES:-}" && "${NNODES}" != 1 ]]; then
  if [[ -n "${RDZV_ENDPOINT:-}" ]]; then
    exec torchrun --nnodes="$NNODES" --nproc_per_node="$nproc" --rdzv-backend=c10d \
      --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="${RDZV_ID:-spmdgt}" "${logs[@]}" "$@"
  fi
  exec torchrun --nnodes="$NNODES" --node_rank="${NODE_RANK:?set NODE_RANK or RDZV_ENDPOINT}" \
    --master_addr="${MASTER_ADDR:?set MASTER_ADDR or RDZV_ENDPOINT}" \
    --master_port="${MASTER_PORT:-29500}" --nproc_per_node="$nproc" "${logs[@]}" "$@"
fi
exec torchrun --standalone --nproc_per_node="$nproc" "${logs[@]}" "$@"
