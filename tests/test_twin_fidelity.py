"""The twin against the live simulator stack (reduced fidelity check, docs/twin.md has the full
table): quickstart, 4 replicas, the same workload, seed, users and duration through `kvlab compare`
and through the twin; delivered hit rate (the twin sending as many requests as the live phase
did) and TTFT (the same run time) within tolerance. The phases are 12 s (about 40-60
requests a policy), where one request moves a hit rate by ~0.02: the test allows four requests'
worth and the 30-s table in docs/twin.md holds ±0.03."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvlab.twin.runner import plans, run
from kvlab.twin.settings import TwinSettings

POLICIES = ["round-robin", "kv-aware"]
DURATION_S = 12
# Which prompts meet their group on a replica follows the order concurrent users' requests arrive in:
# the live order is timing's, the twin's fixed. The tolerance is this many requests' worth of the
# live phase (±0.03 at 30 s in docs/twin.md; at 12 s CI measured 0.048 and 0.057 at ~50 requests, and
# 0.088 for round-robin when a busy machine served only 33)
HIT_RATE_TOLERANCE_REQUESTS = 4


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    root = tmp_path_factory.mktemp("fidelity")
    result = subprocess.run([sys.executable, "-m", "kvlab.cli", "compare", "--topology", "quickstart", "--routers",
                             ",".join(POLICIES), "--users", "8", "--duration", str(DURATION_S), "--seed", "0",
                             "--run-dir", str(root / "run")], cwd=root, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, KVLAB_RUNS_DIR=str(root / "runs")))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    live = {}
    for path in sorted(Path(root / "run" / "shared-prefix").glob("phase-*/summary.json")):
        s = json.loads(path.read_text())
        live[s["policy"]] = s
    settings = TwinSettings(topology="quickstart", users=8, duration_s=DURATION_S, requests=100_000, seed=0)
    twin = {p.policy.name: run(p, oracle=False).summary for p in plans(settings, POLICIES)}
    # the live phase's own request count: a busy machine serves fewer in 12 s, and which prompts a
    # replica has seen (the hit rate) follows how many were sent, not how long that took
    counted = {}
    for policy, s in live.items():
        [plan] = plans(TwinSettings(topology="quickstart", users=8, requests=s["requests"], seed=0), [policy])
        counted[policy] = run(plan, oracle=False).summary
    return live, twin, counted


@pytest.mark.processes
@pytest.mark.parametrize("policy", POLICIES)
def test_the_twin_delivers_the_live_hit_rate(both, policy):
    live, _, counted = both
    tolerance = HIT_RATE_TOLERANCE_REQUESTS / live[policy]["requests"]
    assert abs(counted[policy].hit_rate.delivered - live[policy]["hit_rate"]["delivered"]) <= tolerance, \
        (policy, counted[policy].hit_rate, live[policy]["hit_rate"], tolerance)


@pytest.mark.processes
@pytest.mark.parametrize("policy", POLICIES)
def test_the_twin_ttft_is_the_live_one(both, policy):
    live, twin, _ = both
    for q in ("p50", "p95"):
        ratio = getattr(twin[policy].ttft_ms, q) / live[policy]["ttft_ms"][q]
        # The live stack only adds to the model: its processes' own CPU (client, gateway, replica
        # HTTP) on 2 cores shared with the suite's other workers, which the twin does not have. So
        # the twin may be well under live (CI measured kv-aware's p95 at 0.77 and round-robin's p50
        # at 0.70), never far over it.
        assert 0.6 <= ratio <= 1.2, (policy, q, ratio)
