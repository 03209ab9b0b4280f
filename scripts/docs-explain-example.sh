#!/usr/bin/env bash
# Regenerates the `kvlab traces explain` example in docs/observability.md from a real run:
#   bash scripts/docs-explain-example.sh [RUN_DIR]     (run from the repository, .venv active)
# Prints the machine, the commands and their output; paste it over the example.
set -euo pipefail
run="${1:-runs/docs-explain-example}"
mkdir -p "$(dirname "$run")"
export COLUMNS=110
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(date -u +%Y-%m-%d)"
echo "\$ kvlab lab --quick --run-dir $run"
kvlab lab --quick --run-dir "$run" > "$run.log" 2>&1 || { cat "$run.log"; exit 1; }
grep -E "TTFT p50|speed-up|×" "$run.log" | head -5 || true
echo "\$ kvlab traces explain --run-dir $run"
kvlab traces explain --run-dir "$run"
