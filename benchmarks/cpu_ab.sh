#!/usr/bin/env bash
# On the CPU, from the repo root: the README's CPU throughput command and a batch-1 decode, for two
# trees, alternating, on the embedded SmolLM2 model (float32).
# Usage: bash benchmarks/cpu_ab.sh BASE_DIR [ROUNDS]
#   BASE_DIR holds the other tree's pagedllm/ (e.g. `git archive OLD pagedllm | tar -x -C BASE_DIR`).
# Prints one line per run; compare within one run only (the machine must be otherwise idle).
set -uo pipefail
BASE=$1
ROUNDS=${2:-2}
NEW=$(pwd)
OUTDIR=${OUTDIR:-/tmp/cpu_ab}
mkdir -p "$OUTDIR"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PAGEDLLM_LOG_LEVEL=WARNING
throughput() {  # tree label round
    (cd "$1" && PYTHONPATH=. python3 -m pagedllm.entrypoints.cli bench throughput --num-requests 64 \
        --input-len 32 256 --output-len 32 256 --output-json "$OUTDIR/tp-$2-$3.json" > "$OUTDIR/tp-$2-$3.log" 2>&1) \
        || tail -5 "$OUTDIR/tp-$2-$3.log"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], 'throughput', round(d['output_tokens_per_s'], 1), 'tok/s', round(d['seconds'], 2), 's')" \
        "$OUTDIR/tp-$2-$3.json" "$2"
}
decode() {  # tree label round
    (cd "$1" && PYTHONPATH=. python3 -m pagedllm.entrypoints.cli bench latency --batch-size 1 --input-len 128 \
        --output-len 128 --extra-batch-sizes --repeats 2 --output-json "$OUTDIR/b1-$2-$3.json" > "$OUTDIR/b1-$2-$3.log" 2>&1) \
        || tail -5 "$OUTDIR/b1-$2-$3.log"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], 'batch-1 decode', round(d['runs'][0]['decode_step_ms'], 2), 'ms')" \
        "$OUTDIR/b1-$2-$3.json" "$2"
}
for r in $(seq 1 "$ROUNDS"); do
    if [ $((r % 2)) -eq 1 ]; then order="base new"; else order="new base"; fi
    for label in $order; do
        if [ "$label" = base ]; then tree=$BASE; else tree=$NEW; fi
        throughput "$tree" "$label" "$r"
        decode "$tree" "$label" "$r"
    done
done
