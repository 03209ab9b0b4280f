"""The P/D scenario's pieces: the pd-mix workload, the pd topology and the report's P/D section."""

from __future__ import annotations

from conftest import phase_result
from kvlab.gateway.config import load_policy
from kvlab.load.measure import Record
from kvlab.load.summary import Summary
from kvlab.load.workloads import create
from kvlab.report.html import render
from kvlab.report.pd import section
from kvlab.topology import builtin, load_topology


def test_pd_topology_and_baseline_policy():
    t = load_topology(builtin("pd"))
    assert {p.role for p in t.pools} == {"prefill", "decode"}
    assert load_policy("kv-aware-unified").pd.enabled is False
    assert load_policy("kv-aware").pd.enabled is True


def test_pd_mix_mixes_fresh_long_prompts_and_shared_prefixes():
    w = create("pd-mix", seed=3, params={"long_fraction": 0.5, "groups": 2})
    reqs = w.requests(200)
    longs = [r for r in reqs if r.group == "long"]
    assert 60 < len(longs) < 140
    docs = [r.messages[-1]["content"] for r in longs]
    assert len(set(docs)) == len(docs)                      # never repeated: uncached everywhere
    systems = {r.messages[0]["content"] for r in reqs if r.group != "long"}
    assert len(systems) == 2                                # a few shared, cacheable prefixes
    assert [r.messages for r in create("pd-mix", seed=3, params={"long_fraction": 0.5, "groups": 2}).requests(20)] \
        == [r.messages for r in reqs[:20]]                  # same seed, same prompts (both phases)


def test_report_pd_section_only_when_decisions_exist():
    base = {"ts": 1.0, "replica": "decode-0", "ttft_ms": 100.0, "itl_ms": 10.0, "e2e_ms": 800.0, "error": None}
    unified = [Record(**base, group="long"), Record(**base, group="g1")]
    assert section({"kv-aware": unified}) == ""
    split = [Record(**{**base, "group": "long", "pd": "split", "ttft_ms": 300.0}),
             Record(**base, group="g1", pd="unified"), Record(**{**base, "group": "g1", "pd": "unified", "error": "boom"})]
    html = section({"kv-aware-unified": unified, "kv-aware": split})
    assert "Prefill/decode" in html
    assert "<td>kv-aware</td><td>long uncached</td><td>split</td><td>1</td><td>300</td>" in html
    assert "<td>kv-aware</td><td>shared prefix</td><td>unified</td><td>1</td>" in html   # the error is left out
    assert "<td>kv-aware-unified</td><td>long uncached</td><td>off</td>" in html
    summary = Summary(ok=1, errors=0)
    page = render({"kv-aware": phase_result("kv-aware", split, summary)}, {"run": "x"})
    assert "Prefill/decode disaggregation" in page


def test_report_pd_section_shows_decode_stalls():
    def rec(phase_pd, worst, kind="g1"):
        gaps = [10.0] * 9 + [worst]
        return Record(ts=1.0, group=kind, pd=phase_pd, ttft_ms=100.0, itl_ms=sum(gaps) / 10,
                      itl_max_ms=worst, itl_gaps_ms=gaps, e2e_ms=900.0, error=None)
    unified = [rec(None, 400.0)] * 4
    split = [rec("unified", 30.0)] * 4
    html = section({"kv-aware-unified": unified, "kv-aware": split})
    # worst gap p50 / p95 and ITL p99 over every gap, per row
    assert "<td>kv-aware-unified</td><td>shared prefix</td><td>off</td><td>4</td><td>100</td><td>100</td>" \
           "<td>49</td><td>400</td><td>400</td><td>400</td>" in html
    assert "<td>kv-aware</td><td>shared prefix</td><td>unified</td><td>4</td>" in html and "<td>30</td>" in html
    assert "Decode stalls: CDF of each request" in html                   # the plotly figure
    for name in ("kv-aware-unified", "kv-aware-unified, shared prefix", "kv-aware", "kv-aware, shared prefix"):
        assert f'"name":"{name}"' in html                                # one CDF per phase and subset
