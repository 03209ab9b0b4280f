"""The cluster twin alone (no processes): deterministic runs, what the router sees, the decode
fast-forward's exactness, open-loop traces and sessions, settings refused before running, the live
runs' outputs, prefill/decode pools and data-parallel lockstep."""

from __future__ import annotations

import dataclasses
import gc
import json

import msgspec
import pytest

from kvlab.errors import ConfigError
from kvlab.lifecycle import GC_GEN0_DEFAULT
from kvlab.load.measure import Record
from kvlab.load.summary import read_summary
from kvlab.run.document import read_run
from kvlab.twin import cli
from kvlab.twin.cluster import Cluster
from kvlab.twin.runner import TwinResult, plans, run
from kvlab.twin.settings import Information, TwinSettings, resolve

# quickstart's shape, smaller: 8 groups of a 400-token system prompt, capacity for about 4 of them
SMALL = TwinSettings(topology="quickstart", replicas=4, num_blocks=120, max_model_len=1024, requests=160, users=8,
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


def test_a_cruise_a_scrape_reads_goes_on_as_if_begun_again(monkeypatch, runs):
    """A scrape settles each cruise at the step in progress and lets it go on from there, with no
    event in between (`Cluster._settle`, `read`): the very records of ending it there and beginning
    it again, as anything else reaching the replica does."""
    monkeypatch.setattr(Cluster, "_settle_all", lambda self: [self._settle(r) for r in list(self._cruising)])
    ended = _run("kv-aware")
    assert msgspec.json.encode(ended.records) == msgspec.json.encode(runs["kv-aware"].records)
    assert ended.outcome.steps == runs["kv-aware"].outcome.steps


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


def test_an_open_loop_sessions_later_requests_each_follow_the_answer_before_after_its_pause():
    # agentic sessions at a constant 0.5 a second: each session's first request at its arrival,
    # every later step sent when the step before was answered plus the tool call's pause
    r = run(resolve(TwinSettings(topology="agentic", replicas=2, requests=4, rate=0.5, arrival="constant",
                                 policy="kv-aware")), oracle=False)
    sessions: dict[int, list[Record]] = {}
    for rec in r.records:
        sessions.setdefault(rec.session or 0, []).append(rec)
    assert sorted(sessions) == [0, 1, 2, 3]
    gaps = []
    for n, recs in sessions.items():
        recs.sort(key=lambda rec: rec.step or 0)
        assert [rec.step for rec in recs] == list(range(len(recs))) and len(recs) > 1, n
        assert recs[0].ts == pytest.approx(2.0 * n)
        gaps += [b.ts - (a.ts + a.e2e_ms / 1000.0) for a, b in zip(recs, recs[1:])]
    assert gaps[0] > 0.1 and gaps == pytest.approx([gaps[0]] * len(gaps))


@pytest.mark.parametrize(("flags", "message"), [
    (["--profile", "no-such-gpu"], "unknown latency profile 'no-such-gpu'"),
    (["--replicas", "0"], "replicas must be between 1 and 128"),
    (["--replicas", "129"], "replicas must be between 1 and 128"),
    (["--policy", "kv-aware,psychic"], "unknown policy 'psychic'"),
    (["--topology", "nowhere"], "no topology named 'nowhere'"),
    (["--workload", "nonsense"], "unknown workload 'nonsense'"),
    (["--kv-event-delay-ms", "-1"], "Expected `float` >= 0"),
    (["--rate", "2", "--users", "3"], "not both"),
    (["--jobs", "0"], "--jobs must be 1 or more (got 0)"),
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
    assert cli.main(["--policies", "round-robin,kv-aware", "--replicas", "4", "--num-blocks", "120", "--max-model-len", "1024", "--requests",
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


# pd's 2 prefill + 2 decode replicas, pd-mix (30 % fresh ~1,550-token prompts, 70 % on 4 shared ones)
PD = TwinSettings(topology="pd", workload="pd-mix", requests=60, users=6)


def _pd(policy: str, **profile: float) -> tuple[Cluster, list[Record]]:
    plan = resolve(msgspec.structs.replace(PD, policy=policy))
    if profile:
        plan = dataclasses.replace(plan, profile=msgspec.structs.replace(plan.profile, **profile))
    cluster = Cluster(plan, keep_keys=False)
    return cluster, cluster.run().records


def test_pd_splits_long_uncached_prompts_prefill_then_decode_and_serves_the_rest_whole():
    cluster, records = _pd("kv-aware")
    split = [r for r in records if r.pd == "split"]
    assert len(records) == 60 and split and len(split) < 60
    assert all(r.replica is not None and r.replica.startswith("decode-") for r in records)
    # each split was one call to a prefill replica, which served nothing else (it never decodes)
    prefills = [cluster.by_name[n] for n in ("prefill-a", "prefill-b")]
    assert sum(p.backend.routed for p in prefills) == len(split) and all(p.steps for p in prefills)
    threshold = cluster.plan.policy.pd.threshold_tokens
    for r in records:
        assert r.prompt_tokens is not None and r.predicted_tokens is not None
        assert (r.pd == "split") == (r.prompt_tokens - r.predicted_tokens >= threshold), r
    # the decode replica pulled the KV: it reports the prompt as cached but its last block
    assert all(r.cached_tokens and r.cached_tokens >= r.prompt_tokens - 16 for r in split)


def test_pd_first_token_waits_for_the_kv_transfer():
    _, records = _pd("kv-aware", kv_transfer_ms_fixed=5000.0)
    split = [r.ttft_ms for r in records if r.pd == "split"]
    whole = [r.ttft_ms for r in records if r.pd == "unified"]
    assert split and whole and min(split) > 5000.0 and min(whole) < 5000.0


def test_pd_off_serves_every_request_whole_on_all_four_replicas():
    _, records = _pd("kv-aware-unified")
    assert len(records) == 60 and all(r.pd is None for r in records)
    assert {r.replica for r in records} == {"prefill-a", "prefill-b", "decode-a", "decode-b"}


def test_pd_the_decode_fast_forward_changes_no_figure(monkeypatch):
    _, fast = _pd("kv-aware")
    monkeypatch.setattr(Cluster, "_cruise", lambda self, replica: False)
    _, slow = _pd("kv-aware")
    assert [(r.replica, r.pd, r.cached_tokens, round(r.ttft_ms or 0, 6), round(r.e2e_ms, 6)) for r in slow] \
        == [(r.replica, r.pd, r.cached_tokens, round(r.ttft_ms or 0, 6), round(r.e2e_ms, 6)) for r in fast]


def test_replicas_of_a_pd_topology_keep_its_pools_ratio_and_dp_replicas_bring_their_ranks():
    plan = resolve(msgspec.structs.replace(PD, replicas=8))
    assert [m.name for m in plan.members] == ["prefill-a-0", "prefill-a-1", "prefill-b-0", "prefill-b-1",
                                              "decode-a-0", "decode-a-1", "decode-b-0", "decode-b-1"]
    with pytest.raises(ConfigError, match="multiple of 4"):
        resolve(msgspec.structs.replace(PD, replicas=6))
    wide = resolve(TwinSettings(topology="wide-ep", replicas=3))
    assert wide.replicas == 12 and wide.members[5].name == "sim-1-dp1" and wide.members[5].replica == "sim-1"


def test_the_ranks_of_a_dp_replica_step_in_lockstep_and_dp_aware_routing_pays():
    out = {}
    for policy in ("rank-blind", "dp-aware"):
        cluster = Cluster(resolve(TwinSettings(topology="wide-ep", policy=policy, requests=150, users=8)),
                          keep_keys=False)
        out[policy] = cluster.run()
        for replica in ("sim-0", "sim-1"):
            steps = {cluster.by_name[f"{replica}-dp{r}"].steps for r in range(4)}
            assert len(steps) == 1 and steps.pop() > 0, (policy, replica)   # idle ranks step too
    hit = {p: sum(r.cached_tokens or 0 for r in o.records) / sum(r.prompt_tokens or 0 for r in o.records)
           for p, o in out.items()}
    assert hit["dp-aware"] > hit["rank-blind"] + 0.1


# chunked decoding: 40-token answers in 16-token chunks (kv-aware-chunked-16: 4 slots a replica, 1 reserved)
CHUNKED = msgspec.structs.replace(SMALL, requests=48, workload_params={**SMALL.workload_params, "output_tokens": 40})


def _chunked(monkeypatch, policy: str, **over: object) -> tuple[Cluster, list[tuple[int, int, int]], list[int]]:
    """A run with (tokens generated before, prompt tokens, cached tokens) of every engine call as it
    ended, and the requests each replica held after each call reached it."""
    calls: list[tuple[int, int, int]] = []
    held: list[int] = []
    finish, submit = Cluster._finish, Cluster._submit

    def on_finish(self, f):
        calls.append((f.done, len(f.req.prompt), f.req.num_cached or 0))
        finish(self, f)

    def on_submit(self, f):
        submit(self, f)
        held.append(len(f.replica.sched.running) + len(f.replica.sched.waiting))

    monkeypatch.setattr(Cluster, "_finish", on_finish)
    monkeypatch.setattr(Cluster, "_submit", on_submit)
    cluster = Cluster(resolve(msgspec.structs.replace(CHUNKED, policy=policy, **over)), keep_keys=False)
    cluster.run()
    monkeypatch.undo()
    return cluster, calls, held


def test_chunked_decoding_resumes_each_answer_chunk_by_chunk_from_the_prefix_cache(monkeypatch):
    cluster, calls, _ = _chunked(monkeypatch, "kv-aware-chunked-16")
    records = cluster._records
    assert len(records) == 48 and all(r.output_tokens == 40 for r in records)
    assert sorted({done for done, _, _ in calls}) == [0, 16, 32] and len(calls) == 3 * 48
    bs = cluster.plan.sim.block_size
    for done, prompt, cached in calls:
        if done:   # a resumed chunk recomputes at most its last block (splice.py's "resume hit")
            assert prompt - cached <= bs, (done, prompt, cached)
    # the answer reports the first chunk's cached tokens, as the live gateway's usage does
    first = sorted(cached for done, _, cached in calls if not done)
    assert sorted(r.cached_tokens for r in records) == first
    # one user alone on one replica, 200-ms request hops: each of the two resumptions is one more
    # hop (its resume step, a few tokens of prefill, costs about what the decode step it replaces does)
    alone = {"users": 1, "replicas": 1, "num_blocks": 400, "information": Information(request_overhead_ms=200.0)}
    chunked, _, _ = _chunked(monkeypatch, "kv-aware-chunked-16", **alone)
    plain, _, _ = _chunked(monkeypatch, "kv-aware", **alone)
    for c, p in zip(chunked._records, plain._records):
        assert (c.replica, round(c.ttft_ms or 0, 6), c.cached_tokens) == (p.replica, round(p.ttft_ms or 0, 6), p.cached_tokens)
        assert 2 * 200 - 30 < c.e2e_ms - p.e2e_ms < 2 * 200 + 30, (c.e2e_ms, p.e2e_ms)


def test_chunk_slots_bound_what_a_replica_runs_and_requests_queue_for_them(monkeypatch):
    # one replica, 8 users: unchunked it holds all 8; chunked, 3 (4 slots, 1 kept for the high class)
    one = {"replicas": 1, "num_blocks": 400}
    chunked, _, held = _chunked(monkeypatch, "kv-aware-chunked-16", **one)
    plain, _, held_plain = _chunked(monkeypatch, "kv-aware", **one)
    assert max(held) == 3 and max(held_plain) == 8
    ttft = sorted(r.ttft_ms or 0 for r in chunked._records)
    assert ttft[len(ttft) // 2] > sorted(r.ttft_ms or 0 for r in plain._records)[len(ttft) // 2]


def test_chunked_decoding_the_decode_fast_forward_changes_no_figure(monkeypatch):
    fast = _chunked(monkeypatch, "kv-aware-chunked-16")[0]._records
    monkeypatch.setattr(Cluster, "_cruise", lambda self, replica: False)
    slow = _chunked(monkeypatch, "kv-aware-chunked-16")[0]._records
    assert [(r.replica, r.cached_tokens, r.output_tokens, round(r.ttft_ms or 0, 6), round(r.e2e_ms, 6)) for r in slow] \
        == [(r.replica, r.cached_tokens, r.output_tokens, round(r.ttft_ms or 0, 6), round(r.e2e_ms, 6)) for r in fast]


def test_a_run_collects_cycles_seldom_and_leaves_the_collector_as_it_found_it():
    """A run raises the collector's gen-0 threshold to a served process's (the interpreter's 700
    walked the young objects every few requests) and puts it back, even when the run fails."""
    before = gc.get_threshold()
    seen: list[int] = []
    cluster = Cluster(resolve(msgspec.structs.replace(SMALL, requests=20)), keep_keys=False)
    assert len(cluster.run(lambda n: seen.append(gc.get_threshold()[0])).records) == 20
    assert set(seen) == {GC_GEN0_DEFAULT} and gc.get_threshold() == before

    def fail(n: int) -> None:
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        Cluster(resolve(SMALL), keep_keys=False).run(fail)
    assert gc.get_threshold() == before
