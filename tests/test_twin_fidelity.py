"""The twin against the live simulator stack (reduced fidelity check, docs/twin.md has the full
table): the session's quick lab (`kvlab lab --quick`: quickstart, 4 replicas, round-robin then
kv-aware, 8 users, 25-s phases, seed 0; conftest.quick_lab, shared with test_lab) and the twin on the
same topology, workload, seed, users and duration. Delivered hit rate (the twin sending as many
requests as the live phase did) and TTFT (the same run time) within tolerance. A phase has about
80-200 requests, where one request moves a hit rate by ~0.01: the test allows four requests' worth
and the 30-s table in docs/twin.md holds ±0.03."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlab.run.presets import LAB_QUICK
from kvlab.traces.overhead import of_run
from kvlab.twin.runner import plans, run
from kvlab.twin.settings import Information, TwinSettings

POLICIES = ["round-robin", "kv-aware"]     # the lab's two phases
# Which prompts meet their group on a replica follows the order concurrent users' requests arrive in:
# the live order is timing's, the twin's fixed. The tolerance is this many requests' worth of the
# live phase (±0.03 at 30 s in docs/twin.md; 12-s phases in CI measured 0.048 and 0.057 at ~50
# requests, and 0.088 for round-robin when a busy machine served only 33)
HIT_RATE_TOLERANCE_REQUESTS = 4


@pytest.fixture(scope="module")
def both(quick_lab):
    assert quick_lab.returncode == 0, quick_lab.stdout[-3000:] + quick_lab.stderr[-3000:]
    live = {}
    for path in sorted(Path(quick_lab.run_dir).glob("phase-*/summary.json")):
        s = json.loads(path.read_text())
        live[s["policy"]] = s
    assert sorted(live) == sorted(POLICIES)
    twin, counted = {}, {}
    for policy, s in live.items():
        same = dict(topology="quickstart", users=s["users"], seed=s["seed"])
        [plan] = plans(TwinSettings(**same, duration_s=LAB_QUICK.duration_s, requests=100_000), [policy])
        twin[policy] = run(plan, oracle=False).summary
        # the live phase's own request count: a busy machine serves fewer in a phase, and which prompts
        # a replica has seen (the hit rate) follows how many were sent, not how long that took
        [plan] = plans(TwinSettings(**same, requests=s["requests"]), [policy])
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
        # at 0.70 with 12-s phases; a quick lab in CI gave 0.73 for kv-aware's p50), never far over it.
        assert 0.6 <= ratio <= 1.2, (policy, q, ratio)


@pytest.mark.processes
def test_given_the_live_time_outside_the_engines_the_twin_ttft_p50_is_the_live_one(quick_lab, both):
    """What the twin leaves out is measured from the lab's own traces (traces/overhead.py: client
    TTFT minus the engine's); with it as the request overhead, TTFT p50 is within ±20 % of live for
    both policies, kv-aware's cache hits (tens of ms) included."""
    live, _, _ = both
    overhead = of_run(Path(quick_lab.run_dir))
    for policy in POLICIES:
        assert 0 < overhead[policy] < live[policy]["ttft_ms"]["p50"], overhead
        s = live[policy]
        settings = TwinSettings(topology="quickstart", users=s["users"], seed=s["seed"], duration_s=LAB_QUICK.duration_s,
                                requests=100_000, information=Information(request_overhead_ms=overhead[policy]))
        [plan] = plans(settings, [policy])
        ratio = run(plan, oracle=False).summary.ttft_ms.p50 / s["ttft_ms"]["p50"]
        assert 0.8 <= ratio <= 1.2, (policy, overhead[policy], ratio)
