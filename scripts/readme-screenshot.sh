#!/usr/bin/env bash
# Regenerates docs/img/report.png, the README's opening picture, from a real run's report:
#   bash scripts/readme-screenshot.sh [RUN_DIR]     (run from the repository, .venv active)
# Without RUN_DIR (or if it has no report.html yet) it runs `kvlab lab --quick --run-dir RUN_DIR`
# first. Needs headless Chromium (apt-get install chromium). Prints the machine and the commands.
set -euo pipefail
run="${1:-runs/readme-screenshot}"
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(date -u +%Y-%m-%d)"
if [ ! -f "$run/report.html" ]; then
  mkdir -p "$(dirname "$run")"
  echo "\$ kvlab lab --quick --run-dir $run"
  kvlab lab --quick --run-dir "$run" > "$run.log" 2>&1 || { cat "$run.log"; exit 1; }
  grep -E "lower\)|× lower" "$run.log" | head -3 || true
fi
echo "\$ python -m kvlab.traces.screenshot $run/report.html docs/img/report.png --width 1300 --height 1400"
python -m kvlab.traces.screenshot "$run/report.html" docs/img/report.png --width 1300 --height 1400
