#!/usr/bin/env bash
# On the GPU machine, from the repo root: Llama-8B decode-step latency with programmatic dependent
# launch on and off (PAGEDLLM_PDL), alternating twice to see drift.
#   bash benchmarks/gpu/run_pdl_ab.sh OUTDIR
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=.
OUTDIR=${1:-benchmarks/results}
common="--load-format dummy --skip-tokenizer-init --max-model-len 4096"
for run in 1 2; do
  for pdl in 1 0; do
    echo "PAGEDLLM_PDL=$pdl (run $run)"
    PAGEDLLM_PDL=$pdl python3 -m pagedllm.entrypoints.cli bench latency --model benchmarks/configs/llama-3.1-8b $common \
      --batch-size 64 --input-len 1024 --output-len 256 --extra-batch-sizes 1 \
      --output-json "$OUTDIR/pdl$pdl-run$run-8b.json" 2>&1 | tail -2
  done
done
