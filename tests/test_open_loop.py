"""Open-loop load without a stack: arrival processes, Mooncake trace parsing and replay, goodput,
and the command-line checks that run before anything starts."""

from __future__ import annotations

import argparse
import json
import statistics

import pytest

from kvlab.errors import ConfigError
from kvlab.gateway.tokens import PromptTokenizer
from kvlab.kvcache.hashing import block_keys
from kvlab.load import options
from kvlab.load.arrival import arrival, rates
from kvlab.load.measure import UNFINISHED, Record
from kvlab.load.runner import locust_argv, schedule
from kvlab.load.spec import BenchSpec
from kvlab.load.summary import Slo, goodput, open_loop, summarize
from kvlab.load.workloads.trace import Trace, read_trace, resolve


@pytest.mark.parametrize(("process", "cv"), [("poisson", 1.0), ("constant", 0.0), ("gamma:3", 3.0),
                                             ("gamma:0.5", 0.5)])
def test_arrivals_are_seeded_and_keep_their_mean_rate_and_cv(process, cv):
    a = arrival(8.0, process)
    times = a.times(seed=3, duration_s=2000)
    assert times == a.times(seed=3, duration_s=2000) and times[0] == 0.0
    if process != "constant":
        assert times != a.times(seed=4, duration_s=2000)
    gaps = [b - x for x, b in zip(times, times[1:])]
    assert statistics.fmean(gaps) == pytest.approx(1 / 8.0, rel=0.05)   # ~16,000 gaps
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(cv, abs=0.08)


@pytest.mark.parametrize(("rate", "process", "message"), [
    (0, "poisson", "--rate must be > 0"), (-1, "poisson", "--rate must be > 0"),
    (1, "gamma", "needs a coefficient"), (1, "gamma:0", "CV > 0"), (1, "uniform", "unknown --arrival"),
    (1, "poisson:2", "unknown --arrival")])
def test_bad_arrivals_are_clear_errors(rate, process, message):
    with pytest.raises(ConfigError, match=message):
        arrival(rate, process)


def test_rates_parse_and_refuse_nonpositive():
    assert rates("1, 2.5,4") == [1.0, 2.5, 4.0]
    for bad in ("1,0", "a,b", ","):
        with pytest.raises(ConfigError):
            rates(bad)


def write_trace(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [
    {"timestamp": 0, "input_length": 1300, "output_length": 40, "hash_ids": [1, 2, 3]},
    {"timestamp": 500, "input_length": 1400, "output_length": 20, "hash_ids": [1, 2, 4]},
    {"timestamp": 900, "input_length": 700, "output_length": 10, "hash_ids": [5, 6]},
    {"timestamp": 2000, "input_length": 600, "output_length": 10, "hash_ids": [1, 7]},
    {"timestamp": 4000, "input_length": 1536, "output_length": 5, "hash_ids": [1, 2, 3]},
]


@pytest.fixture
def trace_file(tmp_path):
    return write_trace(tmp_path / "t.jsonl", ROWS)


def common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("scale", [0.05, 0.1, 1.0])
def test_trace_prefix_structure_is_kept_for_every_block_size(trace_file, scale):
    w = Trace(seed=0, params={"path": str(trace_file), "token_scale": scale})
    tok = PromptTokenizer()
    ids = [tok.encode_chat(r.messages)[0] for r in w.requests(len(ROWS))]
    head = common(ids[0], ids[2])          # no shared hash id: only the chat template's opening
    size = w.block_tokens
    assert size == round(512 * scale)
    assert len(ids[0]) - head - len(tok.encode_chat([{"role": "user", "content": ""}])[0]) + head == \
        pytest.approx(round(1300 * scale), abs=1)   # lengths scaled
    shared = {(0, 1): 2, (0, 3): 1, (1, 3): 1, (0, 2): 0, (2, 3): 0, (1, 2): 0}
    for (i, j), blocks in shared.items():
        assert common(ids[i], ids[j]) == head + blocks * size, (i, j)
        for engine_block in (1, 3, 16, size, 64):
            ki, kj = block_keys(ids[i], engine_block), block_keys(ids[j], engine_block)
            whole = (head + blocks * size) // engine_block
            assert ki[:whole] == kj[:whole] and (len(ki) == whole or len(kj) == whole or ki[whole] != kj[whole])
    texts = [r.messages[0]["content"] for r in w.requests(len(ROWS))]
    assert texts[4].startswith(texts[0]) and len(texts[4]) > len(texts[0])   # same ids, longer: the same blocks
    assert [r.max_tokens for r in w.requests(3)] == [max(1, round(n * scale)) for n in (40, 20, 10)]


def test_trace_is_seeded_and_timed(trace_file):
    a = Trace(seed=1, params={"path": str(trace_file)})
    assert a.requests(3) == Trace(seed=1, params={"path": str(trace_file)}).requests(3)
    assert a.requests(3) != Trace(seed=2, params={"path": str(trace_file)}).requests(3)
    assert list(a.offsets(2.0)) == [0.0, 1.0, 1.8, 4.0, 8.0]
    assert a.rate == pytest.approx(4 / 4.0)
    spec = BenchSpec(workload="trace", params={"path": str(trace_file)}, arrival=arrival(4.0))
    assert schedule(spec) == (0.0, "poisson", pytest.approx(0.25))   # scaled to 4 req/s
    argv = locust_argv("http://x", trace_file.parent, spec, 10)
    assert argv[argv.index("-u") + 1] == "1" and argv[argv.index("--time-scale") + 1] == "0.25"


@pytest.mark.parametrize(("line", "message"), [
    ('{"timestamp": 0, "input_length": 10}', "line 2: .*missing required field"),
    ("not json", "line 2: "),
    ('{"timestamp": 0, "input_length": 1300, "output_length": 4, "hash_ids": [1]}', "line 2: 1 hash_ids"),
    ('{"timestamp": -5, "input_length": 10, "output_length": 4, "hash_ids": [1]}', "line 2: .*timestamp"),
])
def test_a_bad_trace_line_is_named(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + line + "\n")
    read_trace.cache_clear()
    with pytest.raises(ConfigError, match=message):
        Trace(params={"path": str(path)})


def test_trace_names_resolve_to_the_traces_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_TRACES_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match=r"download conversation_trace\.jsonl from https://github\.com/kvcache-ai"):
        resolve("mooncake-conversation")
    write_trace(tmp_path / "synthetic_trace.jsonl", ROWS)
    assert resolve("mooncake-synthetic") == tmp_path / "synthetic_trace.jsonl"
    with pytest.raises(ConfigError, match="no such file"):
        resolve(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match="a directory"):
        resolve(str(tmp_path))
    with pytest.raises(ConfigError, match="not a regular file; a trace is a Mooncake JSONL file"):
        resolve("/dev/null")


def rec(ttft, tpot, error=None, ts=0.0, e2e=1000.0, lateness=None):
    return Record(ts=ts, ttft_ms=ttft, tpot_ms=tpot, e2e_ms=e2e, error=error, output_tokens=10,
                  lateness_ms=lateness)


def test_goodput_counts_requests_meeting_both_slos():
    slo = Slo(ttft_ms=500, tpot_ms=50)
    records = [rec(100, 10), rec(500, 50),            # both met (the bounds count)
               rec(501, 10), rec(100, 51),            # one missed each
               rec(100, None),                        # a one-token reply: TTFT alone
               rec(100, 10, error="HTTP 500"), rec(None, None, error=UNFINISHED)]
    g = goodput(records, slo, window_s=2.0)
    assert (g.met, g.rps, g.share) == (3, 1.5, round(3 / 7, 4))
    s = summarize([rec(100, 10, ts=0, e2e=1000), rec(900, 10, ts=3, e2e=1000)], slo)
    assert s.duration_s == 4.0 and s.goodput is not None and s.goodput.rps == 0.25


def test_open_loop_summary_reports_lateness_and_unfinished():
    records = [rec(100, 10, lateness=1), rec(100, 10, lateness=80), rec(None, None, UNFINISHED, lateness=2)]
    loop = open_loop(records, 4.0, "poisson")
    assert (loop.sent, loop.late, loop.unfinished, loop.lateness_max_ms) == (3, 1, 1, 80)
    assert open_loop(records, 4.0, "trace", 0.5, duration_s=2.0).sent_rps == 1.5
    assert loop.behind
    assert not open_loop([rec(1, 1, lateness=1)] * 200, 4.0, "poisson").behind


def namespace(**kw):
    base = {"rate": None, "rates": None, "arrival": None, "trace": None, "time_scale": None, "token_scale": None,
            "slo_ttft": 2000.0, "slo_tpot": 200.0, "users": None, "workload": None}
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize(("given", "message"), [
    ({"rate": 0}, "--rate must be > 0"), ({"rates": "1,-2"}, "must be > 0"),
    ({"rate": 2, "users": 4}, "--users"), ({"rate": 1, "rates": "1,2"}, "not both"),
    ({"arrival": "poisson"}, "needs --rate"), ({"rate": 1, "arrival": "gamma:x"}, "coefficient"),
    ({"trace": "t", "token_scale": 0}, "--token-scale must be > 0"),
    ({"trace": "t", "time_scale": -1}, "--time-scale must be > 0"),
    ({"token_scale": 0.5}, "applies to --trace"), ({"trace": "t", "rate": 1, "arrival": "constant"}, "own arrival"),
    ({"slo_ttft": 0}, "--slo-ttft"),
])
def test_bad_open_loop_options_fail_before_anything_starts(given, message):
    with pytest.raises(ConfigError, match=message):
        options.check(namespace(**given))


def test_missing_or_malformed_trace_fails_at_the_command_line(tmp_path, capsys):
    from kvlab.load.cli import main

    assert main(["--trace", str(tmp_path / "none.jsonl"), "--target", "http://127.0.0.1:9"]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{}\n")
    assert main(["--trace", str(bad), "--target", "http://127.0.0.1:9"]) == 2
    assert main(["--rate", "2", "--users", "3", "--target", "http://127.0.0.1:9"]) == 2
    err = " ".join(capsys.readouterr().out.split())
    assert "no such file" in err and "line 1" in err and "--users" in err


def test_sweep_specs_one_per_rate(trace_file):
    spec = BenchSpec(users=8)
    swept = options.specs(namespace(rates="1,2", arrival="gamma:2"), spec)
    assert [(s.arrival.rate, s.arrival.label) for s in swept] == [(1.0, "gamma:2"), (2.0, "gamma:2")]
    args = namespace(trace=str(trace_file), token_scale=0.1)
    name, params = options.trace_workload(args)
    [replay] = options.specs(args, BenchSpec(workload=name, params=params))
    assert replay.time_scale == 1.0 and replay.open_loop and params["token_scale"] == 0.1
    assert not options.specs(namespace(), spec)[0].open_loop


def test_sweep_knee_is_the_last_rate_kept_up_with():
    from kvlab.compare.sweep import Point, knee

    def pt(offered, rps, unfinished=0, sent=None):
        return Point(offered_rps=offered, sent_rps=sent, rps=rps, goodput_rps=None, ttft_p50_ms=None, ttft_p99_ms=None,
                     itl_p99_ms=None, hit_rate=None, oracle_hit_rate=None, late=0, unfinished=unfinished,
                     errors=0, requests=10)

    assert knee([pt(4, 3.7), pt(2, 2.0), pt(8, 5.0)]) == 4        # 3.7 >= 0.9 x 4; 5 < 0.9 x 8
    assert knee([pt(2, 2.0), pt(4, 4.0, unfinished=3)]) == 2      # requests left running: not kept up
    assert knee([pt(2, 1.0)]) is None
    # a trace whose start sends slower than its mean rate: judged against what it sent
    assert knee([pt(2, 1.9, sent=1.9), pt(4, 3.55, sent=3.55), pt(8, 4.7, sent=6.6)]) == 4


def test_the_oracle_fed_by_a_trace_counts_only_shared_blocks(tmp_path):
    from kvlab.load.oracle import oracle

    shared = Trace(params={"path": str(write_trace(tmp_path / "s.jsonl", ROWS[:2])), "token_scale": 0.25})
    alone = Trace(params={"path": str(write_trace(tmp_path / "a.jsonl", [ROWS[0], ROWS[2]])), "token_scale": 0.25})
    tok = PromptTokenizer()
    hit = oracle(shared.requests(2), 16, replicas=2, blocks_per_replica=None, tokenizer=tok)
    miss = oracle(alone.requests(2), 16, replicas=2, blocks_per_replica=None, tokenizer=tok)
    # the second prompt reuses the first one's two 128-token blocks (and the template's opening), no more
    assert 2 * 128 - 16 <= hit.hit_tokens <= 2 * 128 + 16
    assert miss.hit_tokens <= 16   # at most the chat template's opening block
    assert oracle(shared.requests(2), 16, replicas=1, blocks_per_replica=4, tokenizer=tok).hit_tokens < hit.hit_tokens


def test_a_labs_open_loop_phases_become_a_sweep_in_its_report():
    from kvlab.compare.sweep import from_summaries
    from kvlab.report.sweep import sweep_section

    slo = Slo(ttft_ms=500, tpot_ms=50)

    def phase(policy, rate, ttft):
        records = [rec(ttft, 10, ts=i / rate, e2e=ttft + 100) for i in range(int(rate * 10))]
        s = summarize(records, slo, min_window_s=10.0)
        return s.__class__(**{**{f: getattr(s, f) for f in s.__struct_fields__}, "policy": policy,
                              "open_loop": open_loop(records, rate, "poisson")})

    phases = {"rr@2": phase("rr", 2, 100), "rr@4": phase("rr", 4, 900), "kv@2": phase("kv", 2, 100),
              "kv@4": phase("kv", 4, 200)}
    s = from_summaries("shared-prefix", phases)
    assert s is not None and [c.router for c in s.curves] == ["rr", "kv"]
    rr, kv = s.curves
    assert [p.offered_rps for p in rr.points] == [2, 4] and rr.points[1].goodput_rps == 0.0
    assert kv.points[1].goodput_rps == pytest.approx(4.0, rel=0.05) and kv.knee_rps == 4
    html = sweep_section(s)
    assert "saturation knee" in html and "TTFT ≤ 500 ms" in html
    assert from_summaries("w", {"a": phases["rr@2"], "b": phases["kv@2"]}) is None   # one rate: no sweep


@pytest.mark.parametrize("command", ["lab", "compare"])
@pytest.mark.parametrize("argv", [["--rate", "2", "--users", "3"], ["--rates", "2,0"], ["--trace", "nope.jsonl"],
                                  ["--trace", "nope.jsonl", "--token-scale", "0"]])
def test_lab_and_compare_refuse_bad_open_loop_input_before_starting(command, argv, tmp_path, monkeypatch, capsys):
    import importlib

    monkeypatch.setenv("KVLAB_RUNS_DIR", str(tmp_path / "runs"))
    main = importlib.import_module("kvlab.lab" if command == "lab" else "kvlab.compare.command").main
    assert main(argv) == 1
    assert f"kvlab {command}:" in capsys.readouterr().out
    assert not (tmp_path / "runs").exists()   # no run directory, nothing started
