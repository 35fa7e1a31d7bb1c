#!/usr/bin/env bash
# On the GPU machine, from the repo root: the same benchmarks for two trees, alternating, in one run.
# Usage: bash benchmarks/gpu/ab_compare.sh BASE_DIR [ROUNDS]
#   BASE_DIR holds the other tree's pagedllm/ and benchmarks/ (e.g. `git archive OLD pagedllm benchmarks`);
#   the repo root is the new tree. Each round runs the nano-bench on both trees (the order alternates
#   between rounds), each from an empty Triton cache so that its start-up is a cold start; then the
#   latency workloads (Llama-3.1-8B b64 + b1, Qwen3-0.6B b1) run once per tree.
# Runs go to /tmp/ab; $OUT gets ab-summary.json and the table is printed (benchmarks/gpu/ab_table.py).
set -uo pipefail
BASE=$1
ROUNDS=${2:-2}
NEW=$(pwd)
OUTDIR=/tmp/ab
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
nano() {  # tree label round
    (cd "$1" && TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=".:${EXTRA_PYTHONPATH:-}" PAGEDLLM_COMMIT="$2" \
        python3 -m pagedllm.entrypoints.cli bench throughput \
        --workload nano --model "$NEW/benchmarks/configs/qwen3-0.6b" --load-format dummy --skip-tokenizer-init \
        --max-model-len 4096 --temperature 0.6 --results-dir "$OUTDIR/nano-$2-$3" > "$OUTDIR/nano-$2-$3.log" 2>&1) \
        || tail -20 "$OUTDIR/nano-$2-$3.log"
}
latency() {  # tree label
    local common="--load-format dummy --skip-tokenizer-init --max-model-len 4096"
    (cd "$1" && PYTHONPATH=".:${EXTRA_PYTHONPATH:-}" PAGEDLLM_COMMIT="$2" python3 -m pagedllm.entrypoints.cli bench latency \
        --model "$NEW/benchmarks/configs/llama-3.1-8b" $common --batch-size 64 --input-len 1024 --output-len 256 \
        --extra-batch-sizes 1 --output-json "$OUTDIR/latency-8b-$2.json" > "$OUTDIR/latency-8b-$2.log" 2>&1) \
        || tail -20 "$OUTDIR/latency-8b-$2.log"
    (cd "$1" && PYTHONPATH=".:${EXTRA_PYTHONPATH:-}" PAGEDLLM_COMMIT="$2" python3 -m pagedllm.entrypoints.cli bench latency \
        --model "$NEW/benchmarks/configs/qwen3-0.6b" $common --batch-size 1 --input-len 512 --output-len 512 \
        --extra-batch-sizes --output-json "$OUTDIR/latency-0.6b-$2.json" > "$OUTDIR/latency-0.6b-$2.log" 2>&1) \
        || tail -20 "$OUTDIR/latency-0.6b-$2.log"
}
for r in $(seq 1 "$ROUNDS"); do
    if [ $((r % 2)) -eq 1 ]; then nano "$BASE" base "$r"; nano "$NEW" new "$r"
    else nano "$NEW" new "$r"; nano "$BASE" base "$r"; fi
done
latency "$BASE" base
latency "$NEW" new
python3 "$NEW/benchmarks/gpu/ab_table.py" "$OUTDIR"
[ -n "${OUT:-}" ] && cp "$OUTDIR/ab-summary.json" "$OUT/"
