"""`kvlab plan` on a load whose answer is known by construction: prompts that each take one engine
step of S ms on an idle replica, arriving every S/k ms; round-robin keeps up (no queue, TTFT ~S)
with ceil(k) replicas and falls behind (a queue growing with every request) with fewer."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import warnings

import msgspec
import pytest

from conftest import require
from kvlab.engine.sim.profile import get_profile
from kvlab.plan import cli
from kvlab.plan.search import Answer, Target, dynamo_replicas_needed, judge, replicas_needed
from kvlab.twin import dynamo
from kvlab.twin.settings import TwinSettings, resolve
from test_twin_dynamo import HAS_DYNAMO, conversation

PROMPT = 2000


def _step_ms() -> float:
    """One 2,000-token prompt (plus the chat template's 13 tokens) in one cpu-tiny step: S."""
    return get_profile("cpu-tiny").step_ms(PROMPT + 13, 0)


def _trace(tmp_path, k: float, n: int = 80) -> str:
    gap = _step_ms() / k
    rows = [{"timestamp": round(i * gap), "input_length": PROMPT, "output_length": 1,
             "hash_ids": list(range(i * 4, i * 4 + 4))} for i in range(n)]   # no prompt shares a block
    path = tmp_path / f"k{k}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("k", [3.5, 5.5])
def test_the_fewest_replicas_is_the_one_that_keeps_up_by_construction(tmp_path, k):
    settings = TwinSettings(trace=_trace(tmp_path, k), requests=80, profile="cpu-tiny")
    answer = replicas_needed(settings, Target(ttft_p90_ms=1.5 * _step_ms()), "round-robin", limit=16)
    assert answer.replicas == math.ceil(k)
    assert answer.probes[math.ceil(k)].met and not answer.probes[math.ceil(k) - 1].met
    assert answer.gpus == 0   # cpu-tiny is a CPU process


def test_the_command_prints_each_probe_and_writes_the_answer_and_its_figure(tmp_path, capsys):
    out = tmp_path / "plan"
    assert cli.main(["--trace", _trace(tmp_path, 3.5, 60), "--requests", "60", "--profile", "cpu-tiny",
                     "--policies", "round-robin,least-load", "--ttft-p90-ms", str(1.5 * _step_ms()),
                     "--max-replicas", "8", "--run-dir", str(out)]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "round-robin · 4 replicas:" in err and "meets the SLO" in err and "misses the SLO" in err
    doc = json.loads((out / "plan.json").read_text())
    assert doc["answers"]["round-robin"]["replicas"] == 4
    assert "plotly" in (out / "plan.html").read_text()
    # the two searches ran side by side (two cores or more); one after the other, the same probes
    assert cli.main(["--trace", _trace(tmp_path, 3.5, 60), "--requests", "60", "--profile", "cpu-tiny",
                     "--policies", "round-robin,least-load", "--ttft-p90-ms", str(1.5 * _step_ms()),
                     "--max-replicas", "8", "--jobs", "1", "--run-dir", str(tmp_path / "one")]) == 0
    one = json.loads((tmp_path / "one" / "plan.json").read_text())

    def judged(d):
        return {k: [{f: v for f, v in p.items() if f != "wall_s"} for p in a["probes"]] for k, a in d["answers"].items()}
    assert list(doc["answers"]) == ["round-robin", "least-load"] and judged(doc) == judged(one)


def test_a_bad_slo_is_refused(tmp_path, capsys):
    assert cli.main(["--ttft-p90-ms", "-1", "--run-dir", str(tmp_path / "p")]) == 2
    assert "ttft_p90_ms" in capsys.readouterr().err


# ---- Dynamo's answer beside kvlab's (twin/dynamo.py) ---------------------------------------------
DYNAMO_SLO = Target(ttft_p90_ms=130.0)


def _dynamo_settings(tmp_path) -> TwinSettings:
    """A conversation-shaped trace at 250× its rate: a few replicas' load in both simulators."""
    path = tmp_path / "conversation.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in conversation(120)))
    return TwinSettings(trace=str(path), profile="h100-llama3-8b", requests=120, workload_params={"token_scale": 0.125},
                        time_scale=0.004)


def test_dynamos_answer_is_the_same_search_judged_by_the_same_slo(tmp_path):
    require(HAS_DYNAMO, "Dynamo's replay (pip install 'kvlab[dynamo]')")
    settings = _dynamo_settings(tmp_path)
    answer = dynamo_replicas_needed(settings, DYNAMO_SLO, "dynamo-round-robin", limit=16)   # its replay is
    # deterministic (its KV router's ties are not: a probe's p90 moves by ~1 ms between replays)
    assert answer.peer and answer.source == dynamo.source() and answer.gpus_per_replica == 1
    n = answer.replicas
    assert n is not None and n > 2 and answer.probes[n].met and not answer.probes[n - 1].met
    for k in (n - 1, n):   # each probe is Dynamo's replay of the twin's rows with k workers, judged by the SLO
        replay = dynamo.run(resolve(msgspec.structs.replace(settings, replicas=k)), "dynamo-round-robin")
        assert len(replay.records) == 120
        again = judge(replay.records, DYNAMO_SLO, k, 0.0)
        assert dataclasses.replace(answer.probes[k], wall_s=0.0) == again


def test_the_command_sets_dynamos_answer_beside_kvlabs_marked_as_its_simulator(tmp_path, capsys):
    require(HAS_DYNAMO, "Dynamo's replay (pip install 'kvlab[dynamo]')")
    out = tmp_path / "plan"
    settings = _dynamo_settings(tmp_path)
    assert cli.main(["--trace", str(settings.trace), "--profile", "h100-llama3-8b", "--requests", "120",
                     "--time-scale", "0.004", "--workload-params", '{"token_scale": 0.125}', "--ttft-p90-ms", "130",
                     "--max-replicas", "16", "--policies", "round-robin,dynamo-kv-router,dynamo-round-robin",
                     "--run-dir", str(out)]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "dynamo-kv-router (peer) · 1 replicas:" in err and "(peer) rows: Dynamo's mocker replay" in err
    doc = json.loads((out / "plan.json").read_text())
    kv, rr = doc["answers"]["dynamo-kv-router"], doc["answers"]["dynamo-round-robin"]
    assert kv["peer"] and kv["source"] == dynamo.source() and not doc["answers"]["round-robin"]["peer"]
    assert doc["saving"] is None    # kvlab's saving needs kvlab's kv-aware
    assert doc["dynamo"]["answer"].endswith(f"needs {kv['replicas']} replicas ({kv['replicas']} GPUs), "
                                            f"dynamo-round-robin {rr['replicas']}")
    assert "dynamo-kv-router (Dynamo's simulator)" in (out / "plan.html").read_text()


def test_the_saving_stays_kvlabs_and_dynamos_answer_is_its_own_line():
    answers = [Answer("round-robin", 7, 1, 16), Answer("kv-aware", 6, 1, 16),
               Answer("dynamo-kv-router", 3, 1, 16, dynamo.source()), Answer("dynamo-round-robin", None, 1, 16,
                                                                            dynamo.source())]
    assert cli.saving(answers) == "kv-aware needs 1 fewer replicas (1 GPUs) than round-robin (6 against 7)"
    assert cli.dynamo_answer(answers) == (
        "Dynamo's own replay (its router and mocker, its timing model, not kvlab's twin): dynamo-kv-router "
        "needs 3 replicas (3 GPUs); dynamo-round-robin does not meet it with 16")
    assert cli.dynamo_answer(answers[:2]) is None


def test_a_dynamo_name_without_the_package_is_refused_naming_the_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "dynamo", None)   # as if ai-dynamo-runtime were not installed
    assert cli.main(["--trace", str(_dynamo_settings(tmp_path).trace), "--requests", "120",
                     "--policies", "round-robin,dynamo-kv-router", "--run-dir", str(tmp_path / "p")]) == 2
    assert dynamo.INSTALL in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "p").exists()


def test_a_bad_flag_is_one_line_naming_the_setting(capsys):
    assert cli.main(["--goodput-share", "3"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err == "kvlab plan: flags: Expected `float` <= 1.0 - at `$.goodput_share`"


def test_a_probe_mostly_errors_is_infinite_in_the_lines_and_null_in_plan_json(tmp_path, capsys):
    # a quarter of the requests over cpu-tiny's 8,192 tokens: answered 400, their TTFT infinite
    lengths = [20_000 if i % 4 == 0 else 500 for i in range(20)]
    rows = [{"timestamp": i * 1000, "input_length": n, "output_length": 4,
             "hash_ids": list(range(i * 50, i * 50 + -(-n // 512)))} for i, n in enumerate(lengths)]
    trace = tmp_path / "long.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "p"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli.main(["--trace", str(trace), "--requests", "20", "--profile", "cpu-tiny", "--policies",
                         "round-robin", "--max-replicas", "2", "--run-dir", str(out)]) == 0
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]   # no inf - inf from numpy
    lines = " ".join(capsys.readouterr().err.split())
    assert "TTFT p90 ∞ (errors)" in lines and "nan" not in lines
    answers = json.loads((out / "plan.json").read_text(), parse_constant=pytest.fail)["answers"]
    assert answers["round-robin"]["replicas"] is None and answers["round-robin"]["probes"][0]["ttft_p90_ms"] is None


def test_the_max_model_length_the_cache_check_names_is_a_flag(capsys):
    assert cli.main(["--num-blocks", "100", "--max-model-len", "4096"]) == 2
    assert "--max-model-len 4096 exceeds the KV cache (100 blocks x 16 tokens" in " ".join(capsys.readouterr().err.split())
