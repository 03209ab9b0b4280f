"""Stepped open-loop ramps (load/stages.py): inference-perf's `stages: [{rate, duration}]` with a
warm-up, sent by the twin in virtual time, with per-stage results in the summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlab.errors import ConfigError
from kvlab.load.measure import Record
from kvlab.load.stages import Stage, parse, results, send_times
from kvlab.twin.runner import plans, run
from kvlab.twin.settings import TwinSettings


def test_send_times_follow_each_stage_rate_and_end_with_the_last():
    stages = [Stage(rate=10, duration=2, warmup=True), Stage(rate=1, duration=4), Stage(rate=20, duration=1)]
    times = list(send_times(stages, "constant", 0))
    assert [sum(a <= t < b for t in times) for a, b in ((0, 2), (2, 6), (6, 7))] == [20, 4, 20]
    assert max(times) < 7


def test_parse_and_its_errors():
    assert parse("15:50", warmup=True) == [Stage(rate=15, duration=50, warmup=True)]
    with pytest.raises(ConfigError, match="RATE:SECONDS"):
        parse("15")
    with pytest.raises(ConfigError, match="> 0"):
        parse("0:10")


def test_twin_reports_each_stage():
    s = TwinSettings(workload="shared-prefix", replicas=2, stages=[Stage(rate=4, duration=3, warmup=True),
                                                                  Stage(rate=2, duration=3), Stage(rate=8, duration=3)],
                     workload_params={"groups": 4, "output_tokens": 8})
    r = run(plans(s, ["kv-aware"])[0], oracle=False)
    st = r.summary.stages
    assert [x.rate for x in st] == [4, 2, 8] and [x.warmup for x in st] == [True, False, False]
    assert sum(x.requests for x in st) == len(r.records)
    assert st[2].requests > st[1].requests            # 8/s sends more than 2/s over the same 3 s
    assert st[2].hit_rate > 0 and st[2].kv_usage_mean is not None and st[2].ttft_p90_s is not None


def test_output_throughput_counts_tokens_delivered_in_the_stage():
    # one request sent at 0 s, first token at 1 s, last at 3 s: 20 tokens, 10 in each of the 1-2 and 2-4 s stages
    recs = [Record(ts=0.0, ttft_ms=1000.0, e2e_ms=3000.0, output_tokens=20, prompt_tokens=10)]
    st = results(recs, [Stage(rate=1, duration=1), Stage(rate=1, duration=1), Stage(rate=1, duration=2)])
    assert [x.output_tok_s for x in st] == [0.0, 10.0, 5.0] and [x.requests for x in st] == [1, 0, 0]


def test_twin_cli_refuses_stages_with_a_rate(capsys):
    from kvlab.twin.cli import main
    assert main(["--stages", "2:3", "--rate", "2"]) == 2
    assert "stages" in capsys.readouterr().err



def test_live_load_sends_the_stages_and_reports_them():
    import argparse

    from kvlab.load.options import add_arguments, check, specs
    from kvlab.load.runner import locust_argv, per_stage
    from kvlab.load.spec import BenchSpec

    p = argparse.ArgumentParser()
    p.add_argument("--users", type=int)
    add_arguments(p)
    args = p.parse_args(["--stages", "2:3,6:1"])
    check(args)
    (spec,) = specs(args, BenchSpec())
    assert spec.open_loop and spec.duration_s == 4 and [s.rate for s in spec.stages] == [2, 6]
    argv = locust_argv("http://x", Path("/tmp"), spec, 4)
    assert argv[argv.index("--stages") + 1] == "2:3,6:1"
    with pytest.raises(ConfigError, match="--stages"):
        check(p.parse_args(["--stages", "2:3", "--rate", "1"]))
    # live send times are unix seconds: stages count from the first send
    recs = [Record(ts=1000.0 + t, prompt_tokens=1) for t in (0, 1, 2, 3.5)]
    assert [s.requests for s in per_stage(recs, spec.stages)] == [3, 1]


def test_twin_cli_writes_the_per_stage_figure(tmp_path):
    from kvlab.twin.cli import main
    assert main(["--policy", "kv-aware", "--workload", "shared-prefix", "--replicas", "2", "--no-oracle",
                 "--warmup", "2:2", "--stages", "2:2,4:2", "--workload-params", '{"groups": 4, "output_tokens": 8}',
                 "--out", str(tmp_path)]) == 0
    assert "TTFT p90" in (tmp_path / "stages.html").read_text()
    stages = json.loads((tmp_path / "kv-aware" / "summary.json").read_text())["stages"]
    assert [(s["rate"], s["warmup"]) for s in stages] == [(2, True), (2, False), (4, False)]
