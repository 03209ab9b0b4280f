"""The twin on any input: requests over the max model length are 400s, sizes no engine would start
are refused, a livelock ends with an error, a stopped run writes what had finished (all virtual time);
policies run side by side in processes of their own give the same figures and stop the same ways."""

from __future__ import annotations

import json
import os
import signal

import msgspec
import pytest

from kvlab.engine.sim.scheduler import Batch, Scheduler
from kvlab.errors import ConfigError, TwinError
from kvlab.load.summary import read_summary
from kvlab.twin import cli, cluster, runner
from kvlab.twin.clock import SCRAPE
from kvlab.twin.feed import Feed
from kvlab.twin.fit import describe
from kvlab.twin.progress import RunProgress
from kvlab.twin.runner import Stopped, plans, run
from kvlab.twin.settings import Information, TwinSettings, resolve
from kvlab.twin.workers import Interrupt


def _trace(tmp_path, lengths: list[int]) -> str:
    rows = [{"timestamp": i * 200, "input_length": n, "output_length": 8,
             "hash_ids": list(range(i * 100, i * 100 + -(-n // 512)))} for i, n in enumerate(lengths)]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_requests_over_the_max_model_length_are_answered_400_and_counted(tmp_path):
    trace = _trace(tmp_path, [600, 3000, 700, 5000, 650, 800])
    plan = resolve(TwinSettings(trace=trace, replicas=2, requests=6, policy="kv-aware", max_model_len=2048))
    assert plan.fit is not None and plan.fit.over == 2   # said before the run
    r = run(plan)
    s = r.summary
    assert s.requests == 6 and s.ok == 4 and s.errors == 2 and s.too_long == 2
    assert s.too_long_prompt_max is not None and 5000 <= s.too_long_prompt_max < 5100   # the template's few tokens
    bad = [rec for rec in r.records if rec.error]
    assert all(rec.status == 400 and "maximum context length is 2048 tokens" in (rec.error or "") for rec in bad)


def test_a_trace_with_no_profile_named_runs_on_a_shipped_profile_that_holds_it(tmp_path):
    plan = resolve(TwinSettings(trace=_trace(tmp_path, [600, 20_000]), replicas=2, requests=2))
    assert plan.profile_name == "h100-llama3-8b" and plan.max_model_len >= 20_000
    assert plan.profile_reason is not None and "longest request" in plan.profile_reason
    assert plan.fit is not None and plan.fit.over == 0
    named = resolve(TwinSettings(trace=_trace(tmp_path, [600, 20_000]), replicas=2, requests=2, profile="cpu-tiny"))
    assert named.profile_name == "cpu-tiny" and named.fit is not None and named.fit.over == 1



def test_a_trace_no_profile_holds_runs_on_the_profile_that_holds_the_most(tmp_path):
    trace = _trace(tmp_path, [600, 20_000, 140_000])   # the last is over every shipped profile
    plan = resolve(TwinSettings(trace=trace, replicas=2, requests=3))
    assert plan.profile_name == "h100-llama3-8b" and plan.fit is not None and plan.fit.over == 1
    assert plan.profile_reason is not None and "holds the most of the trace's requests (2 of 3" in plan.profile_reason
    named = resolve(TwinSettings(trace=trace, replicas=2, requests=3, profile="cpu-tiny"))
    assert named.fit is not None and named.fit.over == 2
    note = describe(named.fit, "cpu-tiny") or ""
    assert "no shipped profile holds the longest; profile h100-llama3-8b holds 2 of them" in note


@pytest.mark.timeout(60)
def test_any_number_of_requests_is_counted_per_row_not_listed(tmp_path):
    """`--requests` in the billions with `--duration` to end the run: the requests' lengths are
    counted per row of the trace (a list of them hung), the keys stay 64-bit (no block is set apart
    as unread so far out), and the run sends what fits its duration."""
    trace = _trace(tmp_path, [600, 3000, 700])
    plan = resolve(TwinSettings(trace=trace, replicas=2, requests=10**30 + 1, duration_s=2.0, policy="kv-aware",
                                max_model_len=2048))
    assert plan.fit is not None and plan.fit.over == (10**30 + 1) // 3 + 1 and plan.fit.longest > 3000
    assert f"of the {10**30 + 1:,} requests" in (describe(plan.fit, "cpu-tiny") or "")
    r = run(plan)
    assert r.summary.requests == 10 and r.summary.too_long == 3   # two seconds, a row every 200 ms; 10**30 + 1 = 3k + 2: the long row once more


def test_a_max_model_length_over_the_kv_cache_is_refused_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["--num-blocks", "100", "--max-model-len", "4096", "--run-dir", str(out)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--max-model-len 4096 exceeds the KV cache (100 blocks x 16 tokens = 1600)" in err
    assert not out.exists()


def _never_admits(self: Scheduler) -> Batch:
    return Batch()


def test_the_watchdog_ends_a_livelock_with_an_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(Scheduler, "schedule", _never_admits)
    monkeypatch.setattr(cluster, "STALL_STEPS", 500)
    with pytest.raises(Stopped) as stopped:
        run(resolve(TwinSettings(replicas=2, requests=10, users=2, policy="round-robin")))
    assert isinstance(stopped.value.__cause__, TwinError) and stopped.value.result.summary.partial
    assert "stepped 500 times in a row scheduling nothing" in stopped.value.why
    assert cli.main(["--replicas", "2", "--requests", "10", "--run-dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert "the twin stopped advancing" in err and "Traceback" not in err
    # side by side, two at a time: both stop, and the third policy never starts (nor hangs the command)
    out = tmp_path / "three"
    assert cli.main(["--replicas", "2", "--requests", "10", "--policies", "round-robin,kv-aware,prefix",
                     "--jobs", "2", "--run-dir", str(out)]) == 1
    assert "the twin stopped advancing" in capsys.readouterr().err and not (out / "prefix").exists()



def _scrapes(monkeypatch) -> list[float]:
    """The virtual times of the load view's scrapes, as the run makes them."""
    times: list[float] = []
    scrape = cluster.Cluster._next_scrape

    def counted(self):
        times.append(self.now_ms)
        scrape(self)
    monkeypatch.setattr(cluster.Cluster, "_next_scrape", counted)
    return times


def _every_interval(self) -> None:
    """The scrapes without skipping: one every interval while anything is to come or in flight."""
    if self.clock.intake or self.gateway.flights:
        self._scrape += 1
        self.clock.push(self._scrape * self.info.scrape_interval_ms, SCRAPE, None)


def test_idle_virtual_time_costs_no_scrapes_and_changes_no_figure(monkeypatch):
    # 20 requests with ~20 s between sends: a request takes well under a second, so the engines
    # are idle almost all the time and a scrape every 200 ms would be ~2,000 events
    settings = TwinSettings(replicas=2, requests=20, rate=0.05, arrival="constant", policy="kv-aware")
    times = _scrapes(monkeypatch)
    skipped = run(resolve(settings), oracle=False)
    assert skipped.summary.ok == 20 and len(times) < 400, len(times)
    # a request overhead of days is one idle stretch each, not millions of scrapes
    times.clear()
    days = run(resolve(TwinSettings(replicas=2, requests=5, users=1,
                                    information=Information(request_overhead_ms=3e8))), oracle=False)
    assert days.summary.ok == 5 and all(r.e2e_ms > 3e8 for r in days.records) and len(times) < 400, len(times)
    monkeypatch.setattr(cluster.Cluster, "_next_scrape", _every_interval)
    every = run(resolve(settings), oracle=False)
    assert [msgspec.json.encode(r) for r in every.records] == [msgspec.json.encode(r) for r in skipped.records]


def test_requests_left_in_flight_with_nothing_to_move_them_are_an_error(monkeypatch):
    # a submit that never reaches its engine: no event is left, the requests still in flight
    monkeypatch.setattr(cluster.Cluster, "_submit", lambda self, flight: None)
    for scrape_ms in (0.0, 200.0):
        with pytest.raises(Stopped) as stopped:
            run(resolve(TwinSettings(replicas=2, requests=4, users=2,
                                     information=Information(scrape_interval_ms=scrape_ms))), oracle=False)
        assert "no event left that could finish the requests in flight" in stopped.value.why
        assert "2 in flight" in stopped.value.why


def test_a_scrape_interval_under_a_millisecond_is_refused():
    with pytest.raises(ConfigError, match="scrape_interval_ms must be 0"):
        resolve(TwinSettings(information=Information(scrape_interval_ms=0.001)))
    resolve(TwinSettings(information=Information(scrape_interval_ms=0.0)))   # always fresh: fine

def _sigterm_once(monkeypatch, when) -> None:
    """SIGTERM this process once `when(reports)` holds; `reports`: policy -> requests done, as the
    progress bars are told (in this process, also for runs side by side)."""
    task = RunProgress.task
    reports: dict[str, int] = {}

    def patched(self, name, total):
        update = task(self, name, total)

        def wrapped(done, virtual_s):
            update(done, virtual_s)
            if reports.get("sent"):
                return
            reports[name] = done
            if when(reports):
                reports["sent"] = 1
                os.kill(os.getpid(), signal.SIGTERM)
        return wrapped

    monkeypatch.setattr(RunProgress, "task", patched)


def test_sigterm_writes_what_had_finished_marked_partial(monkeypatch, tmp_path):
    _sigterm_once(monkeypatch, lambda reports: reports.get("round-robin") == 20)
    out = tmp_path / "run"
    assert cli.main(["--policies", "round-robin,kv-aware", "--replicas", "2", "--requests", "200", "--jobs", "1",
                     "--run-dir", str(out)]) == 143
    s = read_summary(out / "round-robin" / "summary.json")
    assert s.partial and 20 <= s.requests < 200
    assert len((out / "round-robin" / "requests.jsonl").read_text().splitlines()) == s.requests
    assert not (out / "kv-aware").exists()       # never started
    assert signal.getsignal(signal.SIGTERM) is not None and (out / "compare.json").exists()


def test_policies_side_by_side_give_the_figures_of_one_after_another(tmp_path):
    args = ["--policies", "round-robin,kv-aware,prefix", "--replicas", "4", "--requests", "150"]
    assert cli.main([*args, "--jobs", "1", "--run-dir", str(tmp_path / "one")]) == 0
    assert cli.main([*args, "--jobs", "2", "--run-dir", str(tmp_path / "two")]) == 0   # the third waits its turn
    for policy in ("round-robin", "kv-aware", "prefix"):
        one = (tmp_path / "one" / policy / "requests.jsonl").read_text()
        assert one and one == (tmp_path / "two" / policy / "requests.jsonl").read_text()
    tables = [json.loads((tmp_path / d / "compare.json").read_text())["workloads"] for d in ("one", "two")]
    assert tables[0] == tables[1]
    [section] = tables[1].values()
    assert [r["router"] for r in section["routers"]] == ["round-robin", "kv-aware", "prefix"]   # as asked


def test_sigterm_inside_the_chat_template_still_stops_the_run_with_what_had_finished(monkeypatch):
    """A signal lands anywhere: in the chat template too, whose own errors are the request's (a 400);
    the stop must not be taken for one, or the run's part would be lost."""
    plan = resolve(TwinSettings(replicas=2, requests=200))
    feed = Feed(plan.workload)
    hf = feed.tok.tok.hf
    real, calls = hf.apply_chat_template, [0]

    def apply(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 60:
            raise Interrupt("SIGTERM")
        return real(*args, **kwargs)

    monkeypatch.setattr(hf, "apply_chat_template", apply)
    with pytest.raises(Stopped, match="stopped by Interrupt") as stopped:
        run(plan, feed=feed)
    assert stopped.value.result.summary.partial and stopped.value.result.records


def test_sigterm_stops_every_policy_running_side_by_side_and_writes_their_parts(monkeypatch, tmp_path):
    _sigterm_once(monkeypatch, lambda reports: min(reports.get("round-robin", 0), reports.get("kv-aware", 0)) >= 20)
    out = tmp_path / "run"
    assert cli.main(["--policies", "round-robin,kv-aware", "--replicas", "2", "--requests", "4000", "--jobs", "2",
                     "--run-dir", str(out)]) == 143
    for policy in ("round-robin", "kv-aware"):
        s = read_summary(out / policy / "summary.json")
        assert s.partial and 0 < s.requests < 4000
        assert len((out / policy / "requests.jsonl").read_text().splitlines()) == s.requests
    assert (out / "compare.json").exists()


def test_a_policy_that_fails_when_told_to_stop_is_named_and_the_others_are_written(monkeypatch, tmp_path, capsys):
    real = runner.run

    def fails_on_the_way_out(plan, **kwargs):
        try:
            return real(plan, **kwargs)
        except Stopped:
            if plan.policy.name == "round-robin":
                raise RuntimeError("lost on the way out") from None
            raise

    monkeypatch.setattr(runner, "run", fails_on_the_way_out)
    _sigterm_once(monkeypatch, lambda reports: min(reports.get("round-robin", 0), reports.get("kv-aware", 0)) >= 20)
    out = tmp_path / "run"
    assert cli.main(["--policies", "round-robin,kv-aware", "--replicas", "2", "--requests", "4000", "--jobs", "2",
                     "--run-dir", str(out)]) == 143
    err = capsys.readouterr().err
    assert "stopped by Interrupt; the round-robin run raised RuntimeError: lost on the way out instead of stopping" in err
    assert read_summary(out / "kv-aware" / "summary.json").partial and not (out / "round-robin").exists()


def test_a_policy_whose_process_dies_is_named_and_the_others_are_written(monkeypatch, tmp_path, capsys):
    real = runner.run

    def dies_on_kv_aware(plan, **kwargs):
        if plan.policy.name == "kv-aware":
            os._exit(9)   # as the kernel's OOM killer would leave it: no result, no traceback
        return real(plan, **kwargs)

    monkeypatch.setattr(runner, "run", dies_on_kv_aware)
    out = tmp_path / "run"
    assert cli.main(["--policies", "round-robin,kv-aware", "--replicas", "2", "--requests", "40", "--jobs", "2",
                     "--run-dir", str(out)]) == 1
    err = capsys.readouterr().err
    assert "the kv-aware run ended without a result (exit code 9)" in err
    assert read_summary(out / "round-robin" / "summary.json").requests == 40 and not (out / "kv-aware").exists()


def test_a_bug_in_a_policy_run_side_by_side_raises_with_its_traceback(monkeypatch):
    def broken(plan, **kwargs):
        raise ValueError(f"no such thing in {plan.policy.name}")

    monkeypatch.setattr(runner, "run", broken)
    todo = plans(TwinSettings(replicas=2, requests=10), ["round-robin", "kv-aware"])
    with pytest.raises(RuntimeError, match=r"(?s)the round-robin run failed:.*ValueError: no such thing in round-robin"):
        runner.run_all(todo, False, lambda plan: lambda n, v: None, 2)


def test_the_table_stays_whole_in_80_columns_of_a_log(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["--policies", "round-robin,kv-aware,kv-aware-chunked-256", "--replicas", "16",
                     "--requests", "16", "--run-dir", str(out)]) == 0
    err = capsys.readouterr().err   # a non-terminal console: 80 columns
    assert "…" not in err and "round-robin" in err and "kv-aware-chunked-" in err
    assert max(len(line) for line in err.splitlines() if "│" in line or "┃" in line) <= 80
    rows = json.loads((out / "compare.json").read_text())["workloads"]
    [section] = rows.values()
    for r in section["routers"]:
        assert f"{r['hit_rate']:.3f}" in err   # every figure whole


def test_a_bad_flag_is_one_line_naming_the_setting(capsys):
    assert cli.main(["--requests", "0"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err == "kvlab twin: flags: Expected `int` >= 1 - at `$.requests`"
