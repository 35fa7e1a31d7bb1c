#!/usr/bin/env bash
# Install everything (in ./.venv) and run the linters and the whole test suite on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ]; then
    [ -d .venv ] || python3 -m venv .venv
    # shellcheck disable=SC1091
    . .venv/bin/activate
fi
python3 -m pip install -q --upgrade pip
bash scripts/install.sh "[test]"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
ruff check pagedllm tests benchmarks
lint-imports
python3 -m pytest -q --durations=15 "$@"
