"""The cluster twin alone (no processes): deterministic runs, what the router sees, the decode
fast-forward's exactness, settings refused before running, and the live runs' outputs."""

from __future__ import annotations

import json

import msgspec
import pytest

from kvlab.load.summary import read_summary
from kvlab.run.document import read_run
from kvlab.twin import cli
from kvlab.twin.cluster import Cluster
from kvlab.twin.runner import TwinResult, plans, run
from kvlab.twin.settings import Information, TwinSettings, resolve

# quickstart's shape, smaller: 8 groups of a 400-token system prompt, capacity for about 4 of them
SMALL = TwinSettings(topology="quickstart", replicas=4, num_blocks=120, requests=160, users=8,
                     workload="shared-prefix", workload_params={"groups": 8, "system_tokens": 400,
                                                                "question_tokens": 24, "output_tokens": 12})


def _run(policy: str, **over: object) -> TwinResult:
    return run(resolve(msgspec.structs.replace(SMALL, policy=policy, **over)))


@pytest.fixture(scope="module")
def runs() -> dict[str, TwinResult]:
    return {p: _run(p) for p in ("round-robin", "kv-aware", "prefix")}


def test_a_run_is_deterministic_for_its_seed(runs):
    again = _run("kv-aware")
    assert again.summary.to_json() == runs["kv-aware"].summary.to_json()
    other = _run("kv-aware", seed=1)
    assert other.summary.ttft_ms != runs["kv-aware"].summary.ttft_ms


def test_every_request_completes_and_the_summary_is_the_live_one(runs):
    for policy, r in runs.items():
        s = r.summary
        assert s.requests == s.ok == 160 and s.errors == 0, policy
        assert s.policy == policy and s.target == "twin" and s.users == 8
        assert sum(s.replicas.values()) == 160
        assert s.ttft_ms.p50 is not None and s.ttft_ms.p50 > 0 and s.itl_ms.p50 is not None
        # the engine delivers at most what the router predicted was cached plus what it found itself
        assert r.oracle is not None and s.hit_rate.delivered <= r.oracle.hit_rate + 1e-9


def test_cache_aware_routing_beats_round_robin_when_the_cache_is_short(runs):
    rr, kv, approx = (runs[p].summary for p in ("round-robin", "kv-aware", "prefix"))
    assert kv.hit_rate.delivered > rr.hit_rate.delivered + 0.2
    assert approx.hit_rate.delivered > rr.hit_rate.delivered + 0.2
    assert kv.ttft_ms.p50 < rr.ttft_ms.p50


def test_kv_events_that_never_arrive_leave_the_precise_router_blind():
    blind = _run("kv-aware", information=Information(kv_event_delay_ms=1e12, speculative_ttl_s=0))
    seeing = _run("kv-aware", information=Information(perfect=True, speculative_ttl_s=0))
    assert blind.summary.hit_rate.available == 0.0      # its index never held a block
    assert seeing.summary.hit_rate.available > 0.5
    assert seeing.summary.hit_rate.delivered > blind.summary.hit_rate.delivered + 0.2
    # the speculative layer alone (routing decisions, no events) brings most of it back
    spec = _run("kv-aware", information=Information(kv_event_delay_ms=1e12))
    assert spec.summary.hit_rate.speculative > 0.5 and spec.summary.hit_rate.delivered > 0.5


def test_perfect_information_switches_every_lag_off():
    info = Information(perfect=True).effective()
    assert (info.kv_event_delay_ms, info.scrape_interval_ms, info.tokenize_ms_per_1k, info.request_overhead_ms) \
        == (0, 0, 0, 0)
    assert Information().scrape_interval_ms == 200.0   # the live gateway's default


def test_the_decode_fast_forward_changes_no_figure(monkeypatch, runs):
    monkeypatch.setattr(Cluster, "_cruise", lambda self, replica: False)
    slow = _run("kv-aware")
    fast = runs["kv-aware"]
    assert slow.outcome.steps == fast.outcome.steps
    for a, b in zip(slow.records, fast.records):
        assert (a.replica, a.cached_tokens, a.output_tokens) == (b.replica, b.cached_tokens, b.output_tokens)
        assert a.ttft_ms == pytest.approx(b.ttft_ms) and a.e2e_ms == pytest.approx(b.e2e_ms)
        assert a.itl_ms == pytest.approx(b.itl_ms)


def test_a_trace_replays_at_its_own_timing_open_loop(tmp_path):
    rows = [{"timestamp": i * 500, "input_length": 700, "output_length": 5, "hash_ids": [1, 2 + i % 2]}
            for i in range(12)]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = run(resolve(TwinSettings(trace=str(trace), replicas=2, requests=12, policy="kv-aware",
                                 information=Information(perfect=True))))
    s = r.summary
    assert s.ok == 12 and s.open_loop is not None and s.open_loop.arrival == "trace" and s.users is None
    assert [rec.ts for rec in r.records] == [i * 0.5 for i in range(12)]
    # every request shares its first 512-token block with the first: most of it comes from the cache
    assert s.hit_rate.delivered > 0.5


@pytest.mark.parametrize(("flags", "message"), [
    (["--profile", "no-such-gpu"], "unknown latency profile 'no-such-gpu'"),
    (["--replicas", "0"], "replicas must be between 1 and 128"),
    (["--replicas", "129"], "replicas must be between 1 and 128"),
    (["--policy", "kv-aware,psychic"], "unknown policy 'psychic'"),
    (["--topology", "nowhere"], "no topology named 'nowhere'"),
    (["--workload", "nonsense"], "unknown workload 'nonsense'"),
    (["--kv-event-delay-ms", "-1"], "Expected `float` >= 0"),
    (["--rate", "2", "--users", "3"], "not both"),
])
def test_bad_settings_are_refused_before_anything_runs(tmp_path, capsys, flags, message):
    out = tmp_path / "run"
    assert cli.main([*flags, "--out", str(out)]) == 2
    assert message in capsys.readouterr().err.replace("\n", " ")
    assert not out.exists()


def test_a_trace_that_does_not_parse_is_refused_naming_its_line(tmp_path, capsys):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n{"timestamp": 1}\n')
    assert cli.main(["--trace", str(trace), "--out", str(tmp_path / "run")]) == 2
    assert "line 2" in capsys.readouterr().err


def test_the_command_writes_the_live_runs_files_labelled_as_the_twin(tmp_path):
    out = tmp_path / "run"
    params = json.dumps(SMALL.workload_params)
    assert cli.main(["--policy", "round-robin,kv-aware", "--replicas", "4", "--num-blocks", "120", "--requests",
                     "40", "--workload", "shared-prefix", "--workload-params", params, "--out", str(out)]) == 0
    for policy in ("round-robin", "kv-aware"):
        s = read_summary(out / policy / "summary.json")
        assert s.ok == 40 and s.policy == policy and s.target == "twin"
        assert len((out / policy / "requests.jsonl").read_text().splitlines()) == 40
    doc = json.loads((out / "compare.json").read_text())
    assert doc["engine"] == "twin" and doc["routers"] == ["round-robin", "kv-aware"]
    rows = doc["workloads"]["shared-prefix"]["routers"]
    assert [r["router"] for r in rows] == ["round-robin", "kv-aware"]
    assert all(0 < r["hit_rate"] <= r["oracle_hit_rate"] + 1e-9 for r in rows)
    twin = doc["twin"]
    assert read_run(out / "compare.json").scenario == "twin"
    assert twin["information"]["scrape_interval_ms"] == 200.0 and twin["replicas"] == 4
    for page in ("report.html", "compare.html"):
        text = (out / page).read_text()
        assert "<h1>[twin] " in text and "not a live run" in text


def test_every_policy_is_checked_before_the_first_runs():
    checked = plans(SMALL, ["round-robin", "kv-aware"])
    assert [p.policy.name for p in checked] == ["round-robin", "kv-aware"]
    assert checked[0].workload is checked[1].workload   # texts made once for every policy


def test_a_calibrated_profile_and_a_config_file_drive_the_twin(tmp_path, monkeypatch):
    from kvlab.engine.sim.profile import get_profile, write_user_profile

    monkeypatch.setenv("KVLAB_HOME", str(tmp_path / "home"))
    slow = msgspec.structs.replace(get_profile("cpu-tiny"), prefill_ms_per_token=2.0)
    write_user_profile("local", slow)    # what `kvlab calibrate` writes
    config = tmp_path / "twin.yaml"
    config.write_text("topology: quickstart\nprofile: local\nreplicas: 2\nrequests: 30\nusers: 4\n"
                      "workload: shared-prefix\nworkload_params: {groups: 4, system_tokens: 300}\n"
                      "information: {scrape_interval_ms: 50}\n")
    out = tmp_path / "run"
    assert cli.main(["--config", str(config), "--policy", "round-robin", "--out", str(out)]) == 0
    doc = json.loads((out / "compare.json").read_text())["twin"]
    assert doc["profile"] == "local" and doc["information"]["scrape_interval_ms"] == 50
    assert doc["settings"]["replicas"] == 2 and read_summary(out / "round-robin" / "summary.json").ok == 30
    config.write_text("replicas: 2\nscrape: 50\n")
    assert cli.main(["--config", str(config), "--out", str(out / "again")]) == 2   # a typo is an error
