#!/usr/bin/env bash
# The checks a lent GPU machine runs in one call (one GPU, torch preinstalled there):
#   bash benchmarks/gpu_check.sh OUTDIR
# 1. tests/gpu (a world of one on CUDA, AMP, CUDA memory, resume);
# 2. examples/train_hf.py on the GPU: the trainer's fp32 losses against the plain HF loop;
# 3. the same at a size that keeps an H100 busy, bf16 AMP: trainer vs plain loop step time,
#    and the trainer's tokens/s, TFLOP/s and MFU (peak from the datasheet table), eager and
#    compiled per layer.
set -uo pipefail
out=${1:-/tmp/gpu_check}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
py=python3
$py -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
timeout 120 $py -m pytest tests/gpu -o addopts="" -q -x -p no:cacheprovider -W ignore 2>&1 | tail -5 | tee "$out/gpu_tests.log"
small=(--steps 6 --log-every 3)
timeout 45 $py examples/train_hf.py "${small[@]}" --reference 2>&1 | grep -E "losses|avg_step" | tee "$out/hf_small.log"
timeout 45 $py examples/train_hf.py "${small[@]}" 2>&1 | grep -E "^losses" | tee -a "$out/hf_small.log"
big=(--dim 2048 --layers 8 --heads 16 --kv-heads 8 --vocab 32000 --seq-len 2048 --global-batch 8
     --steps 20 --log-every 10 --amp)
timeout 60 $py examples/train_hf.py "${big[@]}" --reference 2>&1 | grep -E "avg_step" | sed 's/^/plain HF loop /' | tee "$out/hf_big.log"
timeout 75 $py examples/train_hf.py "${big[@]}" 2>&1 | grep -E "^step|avg_step_time|tokens_per_sec_per_device|tflops|mfu|peak_|flops_estimate|data_wait" | sed 's/^/trainer /' | tee -a "$out/hf_big.log"
timeout 100 $py examples/train_hf.py "${big[@]}" --compile 2>&1 | grep -E "^step|avg_step_time|tflops|mfu|compile_time|compiled_blocks" | sed 's/^/trainer+compile /' | tee -a "$out/hf_big.log"
