"""The twin against the live simulator stack (reduced fidelity check, docs/twin.md has the full
table): the session's quick lab (`kvlab lab --quick`: quickstart, 4 replicas, round-robin then
kv-aware, 8 users, 25-s phases, seed 0; conftest.quick_lab, shared with test_lab) and the twin on the
same topology, workload, seed, users and duration. Delivered hit rate (the twin sending as many
requests as the live phase did) and TTFT (the same run time) within tolerance. A phase has about
80-200 requests, where one request moves a hit rate by ~0.01 and a TTFT quantile by one rank: the
test allows six requests' worth of hit rate and four ranks of TTFT; the 30-s table in docs/twin.md
holds ±0.03."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvlab.load.measure import read_records
from kvlab.load.summary import Summary
from kvlab.run.presets import LAB_QUICK
from kvlab.traces.overhead import engine_ttft_ms, of_run
from kvlab.traces.run import load_requests
from kvlab.traces.sources import open_source
from kvlab.traces.span import Trace
from kvlab.twin.runner import plans, run
from kvlab.twin.settings import Information, TwinSettings

POLICIES = ["round-robin", "kv-aware"]     # the lab's two phases
# Which prompts meet their group on a replica follows the order concurrent users' requests arrive in:
# the live order is timing's, the twin's fixed (a constant request overhead shifts every request
# alike and leaves it). The hit-rate tolerance is this many requests' worth of the live phase: 37
# live round-robin phases of this lab on the dev VM (the notebooks' runs, seed 0, 69-81 requests)
# were within 2.0 of the twin at their own request count, 35 of them, and +4.6 (fresh-clone CI:
# 0.280 against 0.221 at 79) and +5.0 over it; 50 of 51 kv-aware ones within 1.0 (one, served
# slowly, 16.6 under)
HIT_TOLERANCE_REQUESTS = 6
# A TTFT quantile is allowed this many requests' rank either side (test_the_twin_ttft_is_the_live_one)
TOLERANCE_REQUESTS = 4
EMPTY = Trace("", ())


@dataclass(frozen=True)
class Both:
    """The quick lab's phases and the twin's, by policy."""

    live: dict[str, dict]             # each phase's summary.json
    ttfts: dict[str, list[float]]     # each phase's successful requests' TTFTs
    twin: dict[str, Summary]          # the twin over the phase's duration
    counted: dict[str, Summary]       # the twin sending as many requests as the phase did
    overhead: dict[str, float]        # the live time outside the engines (traces/overhead.py)
    run_dir: str                      # the quick lab's run


@pytest.fixture(scope="module")
def both(quick_lab) -> Both:
    assert quick_lab.returncode == 0, quick_lab.stdout[-3000:] + quick_lab.stderr[-3000:]
    live, ttfts = {}, {}
    for path in sorted(Path(quick_lab.run_dir).glob("phase-*/summary.json")):
        s = json.loads(path.read_text())
        live[s["policy"]] = s
        ttfts[s["policy"]] = [r.ttft_ms for r in read_records(path.parent / "requests.jsonl")
                              if not r.error and r.ttft_ms is not None]
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
    return Both(live, ttfts, twin, counted, of_run(Path(quick_lab.run_dir)), quick_lab.run_dir)


@pytest.mark.processes
@pytest.mark.parametrize("policy", POLICIES)
def test_the_twin_delivers_the_live_hit_rate(both, policy):
    live, counted = both.live, both.counted
    tolerance = HIT_TOLERANCE_REQUESTS / live[policy]["requests"]
    assert abs(counted[policy].hit_rate.delivered - live[policy]["hit_rate"]["delivered"]) <= tolerance, \
        (policy, counted[policy].hit_rate, live[policy]["hit_rate"], tolerance)


@pytest.mark.processes
@pytest.mark.parametrize("policy", POLICIES)
def test_the_twin_ttft_is_the_live_one(both, policy):
    """Each quantile within a band: TOLERANCE_REQUESTS ranks either side of it in the live phase.

    A quantile of ~80 requests is set by a handful of them, and round-robin's p95 sits on a cliff:
    the 8 users start together, so each replica's second first request waits a whole cold prefill
    (~2.4 s, 4 requests, live and twin). The twin's users stay in step after that (its engines have
    no noise) and collide once more at ~2.9 s (3 more); live ones drift apart. So the twin's p95 is
    ~2,390 ms every time, and the live one 2,390-2,460 ms when a 5th request collided and 1,914 ms
    when none did (official CI, 80 requests: 1.25x). Four ranks either side absorb that.

    The twin alone must not be more than 20 % over the band's top. The live stack only adds to the
    model (its processes' CPU: client, gateway, replica HTTP on 2 cores shared with the suite's
    other workers), so from below it is the twin plus that measured time outside the engines
    (traces/overhead.py) that must reach half the band's bottom: kv-aware's p50 is a cache hit of
    ~66 ms in the twin, and a loaded machine adds 17-52 ms to it (official CI: 51 ms, the twin alone
    at 0.58 of the band's bottom; 32 notebook runs of this lab on the dev VM: 0.36-0.82 alone,
    0.65-1.09 with it) and slows the live engines' steps too (a fresh-clone CI run: live p50 214 ms,
    the twin's 66 + 46 ms at 0.585 of the band's bottom, which a floor of 0.6 failed).

    Except kv-aware's p95 from below: it is one of its few cold misses (hit rate ~0.83), and how
    many of those meet in a replica's queue is timing's. Live it is one cold prefill or two
    (1,292-2,477 ms measured: docs/twin-validation.md, "live p95 is noisy"), the twin's ~1,315 ms
    every time; official CI once served 8 of 82 requests in 2.4 s or more. So from below the twin's
    must be a cold miss too: at least half the live stack's own (round-robin's p50, hit rate
    ~0.24). A twin whose engines ran 3.3x fast, or whose kv-aware tail were a hit, fails it."""
    live, twin, overhead = both.live, both.twin, both.overhead
    values = both.ttfts[policy]
    band = 100.0 * TOLERANCE_REQUESTS / len(values)
    for q, at in (("p50", 50.0), ("p95", 95.0)):
        # the records are the summary's population: the same quantile
        assert np.percentile(values, at) == pytest.approx(live[policy]["ttft_ms"][q], abs=0.01), (policy, q)
        lo, hi = np.percentile(values, (max(0.0, at - band), min(100.0, at + band)))
        t = getattr(twin[policy].ttft_ms, q)
        floor = live["round-robin"]["ttft_ms"]["p50"] if (policy, q) == ("kv-aware", "p95") else lo
        assert 0.5 * floor <= t + overhead[policy] and t <= 1.2 * hi, \
            (policy, q, t, overhead[policy], (floor, hi), live[policy]["ttft_ms"][q])


@pytest.mark.processes
def test_the_twins_engines_take_the_live_engines_time_to_a_first_token(both):
    """What the twin models is the engines' queue and prefill: with no request overhead and sending
    as many requests as the live phase did, its mean TTFT is the live engines' own (their
    `llm_request` spans' time in queue plus prefill, traces/overhead.py) for both policies: not
    more than 20 % over it (that would be a fault of the model), and down to 0.75 of it, since a
    loaded machine slows the simulator's engine steps too. A twin whose engines ran 3.3x fast (0.3
    of live) fails it.

    The mean, not the p50: kv-aware's engine times are hits of tens of ms and cold misses of ~1.2 s,
    and its p50 is a hit only while hits are well over half its requests. A busy machine serves
    fewer requests in the phase, so each group's first miss weighs more (the hit-rate test above
    sends the live count for the same reason). On the dev VM the live p50 is a hit (60 ms against
    the twin's 67, the means 414 against 399 ms); an official CI run whose suite took 1,428 s served
    kv-aware 102 requests instead of 177, and its engines' p50 fell between the two (359 ms, the
    twin's at 102 requests 124) while the means stayed 742 against 639 ms (0.86). Round-robin's
    means: 1,096-1,134 ms live, 1,104 ms twin.

    The client's TTFT adds the time outside the engines, which the band check above adds from below.
    Adding its median to the twin does not give the client's p50 on a loaded machine: there the
    outside time is wide and comes with slow engine steps on the same requests (a fresh-clone CI
    run: kv-aware's engines 78 ms at p50 against the twin's 66, outside 52, the client's p50 234)."""
    requests = load_requests(Path(both.run_dir))
    traces = {t.trace_id: t for t in open_source(Path(both.run_dir)).traces()}
    for policy in POLICIES:
        engine = [ms for rec in requests if rec.policy == policy and not rec.error and rec.ttft_ms is not None
                  and (ms := engine_ttft_ms(traces.get(rec.trace_id or "", EMPTY))) is not None]
        assert engine, policy
        s = both.live[policy]
        settings = TwinSettings(topology="quickstart", users=s["users"], seed=s["seed"], requests=s["requests"],
                                information=Information(request_overhead_ms=0.0))
        [plan] = plans(settings, [policy])
        mean = run(plan, oracle=False).summary.ttft_ms.mean
        assert mean is not None, policy
        ratio = mean / float(np.mean(engine))
        assert 0.75 <= ratio <= 1.2, (policy, ratio, float(np.mean(engine)))
