#!/usr/bin/env bash
# On the GPU machine, from the repo root: nano-bench (Qwen3-0.6B architecture, random bf16 weights).
# Usage: bash benchmarks/gpu/run_nano.sh [extra bench flags...]
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUTDIR=${OUT:-benchmarks/results}
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
python3 -m pagedllm.entrypoints.cli bench throughput --workload nano \
    --model benchmarks/configs/qwen3-0.6b --load-format dummy --skip-tokenizer-init \
    --max-model-len 4096 --temperature 0.6 --results-dir "$OUTDIR" "$@"
