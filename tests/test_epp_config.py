"""llm-d / GIE EndpointPickerConfig files build kvlab's scheduler (gateway/scheduler/epp.py), the
upstream plug-ins follow upstream's semantics, and `kvlab twin`, `kvlab gateway` and `kvlab epp`
run the anchor's two files unchanged; an unknown plugin type is refused by name (exit code 2)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

import test_gateway
from conftest import free_port
from kvlab.contract import Endpoint
from kvlab.errors import ConfigError
from kvlab.gateway.config import epp_path, load_policy
from kvlab.gateway.endpoints import Backend
from kvlab.gateway.scheduler import presets
from kvlab.gateway.scheduler.base import Candidate, RouteRequest
from kvlab.gateway.scheduler.epp import load, policy_of
from kvlab.gateway.scheduler.precise_prefix_cache import PrecisePrefixCacheScorer
from kvlab.gateway.scheduler.prefix_cache import PrefixCacheParams, PrefixCacheScorer
from kvlab.gateway.scheduler.waiting_queue import QueueScorer
from kvlab.lifecycle import terminate
from test_gateway import Harness, _doc, run

APPROX, PRECISE = str(epp_path("llm-d-approximate")), str(epp_path("llm-d-precise"))
UNKNOWN = """apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: session-affinity-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: session-affinity-scorer
    weight: 1
  - pluginRef: max-score-picker
"""


def _weights(cfg):
    r = presets.build(cfg, random.Random(0))
    return {s.name: w for s, w in r.scorers if w}, type(r.picker).__name__, r


def test_anchor_files_build_upstreams_scorers_weights_and_index():
    a, p = policy_of(APPROX), policy_of(PRECISE)
    assert _weights(a)[:2] == ({"kv-cache-utilization-scorer": 1.0, "queue-scorer": 1.0,
                                "prefix-cache-scorer": 1.0}, "MaxScorePicker")
    assert (a.name, a.index.kind) == ("llm-d-approximate", "approximate")
    gie = next(s for s, _ in _weights(a)[2].scorers if isinstance(s, PrefixCacheScorer))
    assert (gie.block_tokens, gie.capacity, gie.params.max_prefix_blocks_to_match) == (16, 31250, 256)
    assert _weights(p)[:2] == ({"precise-prefix-cache-scorer": 3.0, "kv-cache-utilization-scorer": 2.0,
                                "queue-scorer": 2.0}, "MaxScorePicker")
    assert (p.index.kind, p.index.default_block_size) == ("precise", 64)
    assert load("llm-d-precise") == p     # a policy name points at the shipped file


def test_kv_aware_written_as_an_endpoint_picker_config_builds_the_same_ranker():
    ours, theirs = load_policy("kv-aware"), load("kv-aware-epp")
    w1, pick1, r1 = _weights(ours)
    w2, pick2, r2 = _weights(theirs)
    assert (w1, pick1) == (w2, pick2)
    assert [(type(f).__name__, f.t) for f in r1.filters] == [(type(f).__name__, f.t) for f in r2.filters]
    assert ours.index.kind == theirs.index.kind == "precise"


def test_unknown_plugin_type_and_bad_parameters_are_refused_by_name(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(UNKNOWN)
    with pytest.raises(ConfigError, match="session-affinity-scorer"):
        policy_of(bad)
    bad.write_text(Path(APPROX).read_text().replace("hashBlockSize", "hashBlockSise"))
    with pytest.raises(ConfigError, match="hashBlockSise"):
        policy_of(bad)


def _cand(name: str, waiting: int = 0, prefix: int = 0, bs: int = 16) -> Candidate:
    return Candidate(Backend(Endpoint(name=name, url=f"http://{name}"), waiting=waiting, block_size=bs), prefix)


def test_gie_prefix_index_outlives_the_cache_it_guesses():
    s = PrefixCacheScorer(PrefixCacheParams(hash_block_size=64, max_prefix_blocks_to_match=4,
                                            lru_capacity_per_server=6))
    a, b = list(range(100)), list(range(1000, 1100))
    cands = [_cand("x"), _cand("y")]
    # nothing learned: no server matches
    assert s.score(RouteRequest(100, a), cands) == [0.0, 0.0]
    s.chosen(RouteRequest(100, a), cands[0])
    # the model's block + 4 blocks of 16 tokens (the match limit: 64 of 100 tokens) all on x
    cands = [_cand("x"), _cand("y")]
    assert s.score(RouteRequest(100, a), cands) == [1.0, 0.0]
    assert cands[0].prefix_tokens == 64
    s.chosen(RouteRequest(100, a), cands[0])
    s.score(RouteRequest(100, b), [_cand("x")])
    s.chosen(RouteRequest(100, b), _cand("x"))   # 4 new hashes: x's LRU of 6 drops a's first 3
    cands = [_cand("x"), _cand("y")]
    assert s.score(RouteRequest(100, a), cands)[0] == pytest.approx(1 / 5)   # only the model's block left


def test_queue_scorer_is_min_max_and_precise_scorer_normalises_over_holders():
    q = QueueScorer().score(RouteRequest(1), [_cand("a", 10), _cand("b", 12), _cand("c", 11)])
    assert q == [1.0, 0.0, 0.5]
    assert QueueScorer().score(RouteRequest(1), [_cand("a", 3), _cand("b", 3)]) == [1.0, 1.0]
    p = PrecisePrefixCacheScorer().score(RouteRequest(640), [_cand("a", prefix=640, bs=64), _cand("b", prefix=128, bs=64),
                                                              _cand("c", prefix=0, bs=64)])
    assert p == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("path", [APPROX, PRECISE])
def test_twin_runs_the_anchor_files_unchanged(path, tmp_path):
    from kvlab.twin.cli import main
    assert main(["--epp-config", path, "--requests", "20", "--rate", "4", "--no-oracle",
                 "--run-dir", str(tmp_path)]) == 0
    name = os.path.basename(path)[:-5]
    summary = json.loads((tmp_path / name / "summary.json").read_text())
    assert summary["ok"] == 20


@pytest.mark.parametrize("name", ["llm-d-approximate", "llm-d-precise"])
def test_gateway_serves_with_an_anchor_file_and_keeps_a_group_together(name, monkeypatch):
    monkeypatch.setattr(test_gateway, "load_policy", load)   # the harness loads its policy by name

    async def go():
        async with Harness(name) as h:
            seen = set()
            for q in range(4):
                status, headers, _ = await h.post("/v1/chat/completions", {
                    "model": "m", "max_tokens": 4, "messages": [{"role": "system", "content": _doc(3)},
                                                                {"role": "user", "content": f"question {q}"}]})
                assert status == 200
                seen.add(headers["x-kvlab-replica"])
            assert {s.name for s, _ in h.gw.router.ranker.scorers} & {"prefix-cache-scorer",
                                                                      "precise-prefix-cache-scorer"}
            return seen
    assert len(run(go())) == 1


def test_cli_refuses_an_unknown_plugin_with_exit_2(tmp_path, capsys):
    from kvlab.epp.cli import main as epp_main
    from kvlab.gateway.cli import main as gateway_main
    from kvlab.twin.cli import main as twin_main
    bad = tmp_path / "bad.yaml"
    bad.write_text(UNKNOWN)
    assert gateway_main(["--port", "1", "--endpoints", "a=http://127.0.0.1:1", "--epp-config", str(bad)]) == 2
    assert epp_main(["--port", "1", "--endpoints", "a=http://127.0.0.1:1", "--epp-config", str(bad)]) == 2
    assert twin_main(["--epp-config", str(bad), "--requests", "1"]) == 2
    assert "session-affinity-scorer" in capsys.readouterr().err


@pytest.mark.processes
@pytest.mark.parametrize("path", [APPROX, PRECISE])
def test_epp_starts_with_an_anchor_file(path, tmp_path):
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "kvlab.cli", "epp", "--port", str(free_port()),
                             "--metrics-port", str(free_port()), "--endpoints", "a=http://127.0.0.1:9",
                             "--epp-config", path, "--ready-file", str(ready)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OTEL_TRACES_EXPORTER": "none"})
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "epp did not become ready"
            time.sleep(0.05)
        assert json.loads(ready.read_text())["policy"] == Path(path).stem
    finally:
        terminate(proc, 15)
