"""`kvlab plan` on a load whose answer is known by construction: prompts that each take one engine
step of S ms on an idle replica, arriving every S/k ms; round-robin keeps up (no queue, TTFT ~S)
with ceil(k) replicas and falls behind (a queue growing with every request) with fewer."""

from __future__ import annotations

import json
import math

import pytest

from kvlab.engine.sim.profile import get_profile
from kvlab.plan import cli
from kvlab.plan.search import Target, replicas_needed
from kvlab.twin.settings import TwinSettings

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


def test_a_bad_slo_is_refused(tmp_path, capsys):
    assert cli.main(["--ttft-p90-ms", "-1", "--run-dir", str(tmp_path / "p")]) == 2
    assert "ttft_p90_ms" in capsys.readouterr().err
