#!/usr/bin/env bash
# On the GPU machine, from the repo root: decode-step latency vs floor.
#   8B-class (Llama-3.1-8B architecture): batch 64 and 1, 1024 in / 256 out.
#   0.6B (Qwen3): batch 1, 512 in / 512 out (time per output token).
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=.
OUTDIR=${OUT:-benchmarks/results}
common="--load-format dummy --skip-tokenizer-init --max-model-len 4096"
python3 -m pagedllm.entrypoints.cli bench latency --model benchmarks/configs/llama-3.1-8b $common \
    --batch-size 64 --input-len 1024 --output-len 256 --extra-batch-sizes 1 --output-json "$OUTDIR/latency-8b.json" "$@"
python3 -m pagedllm.entrypoints.cli bench latency --model benchmarks/configs/qwen3-0.6b $common \
    --batch-size 1 --input-len 512 --output-len 512 --extra-batch-sizes --output-json "$OUTDIR/latency-0.6b.json" "$@"
