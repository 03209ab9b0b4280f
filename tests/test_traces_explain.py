"""`kvlab traces explain` in words: the sentence names the scorer that decided, the selectors pick
the right decisions, zero-weight scorers stay hidden, and a round-robin decision says what kv-aware
(the gateway's own scheduler, re-run on the span's recorded inputs) would have picked."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from rich.console import Console

from kvlab.telemetry import names as n
from kvlab.telemetry.sink import SpanFile
from kvlab.traces import cli, explain
from kvlab.traces.decision import Candidate, Decision
from kvlab.traces.figures import decision_figure
from kvlab.traces.sources.otlp_files import OtlpFileSource

KV_WEIGHTS = {"prefix": 3.0, "queue": 1.0, "kv_usage": 0.5, "inflight": 1.0, "inflight_tokens": 0.0,
              "pending_prefill": 0.0, "predicted_ttft": 0.0}


def raw(replica: str, prefix: int = 0, waiting: float = 0, inflight: int = 0, kv_usage: float = 0.1) -> dict:
    """One replica's inputs as the schedule span records them."""
    return {"replica": replica, "prefix_tokens": prefix, "speculative_tokens": 0, "waiting": waiting,
            "running": inflight, "kv_usage": kv_usage, "inflight": inflight, "inflight_tokens": 0,
            "pending_prefill_tokens": 0, "prefill_ms_per_token": None, "filtered": False}


def shadow(chosen: str, replicas: list[dict], prompt: int = 128) -> Decision:
    """A round-robin decision over `replicas` (no scores needed: the counterfactual recomputes them)."""
    cands = [Candidate(r["replica"], {}, 0.0, r["prefix_tokens"], r["replica"] == chosen,
                       {k: v for k, v in r.items() if k not in ("replica", "prefix_tokens")}) for r in replicas]
    return Decision("ab" * 16, "round-robin", chosen, "round-robin", True, KV_WEIGHTS, cands, prompt,
                    max(r["prefix_tokens"] for r in replicas), 0, 0, 0, 1, 0.1)


def kv_aware(replicas: list[dict], prompt: int = 128) -> Decision:
    """What the gateway's kv-aware scheduler decides on these inputs, with the weights the sentences
    below were worked out for (KV_WEIGHTS: the preset's, without its predicted_ttft)."""
    d = explain.counterfactual(shadow(replicas[0]["replica"], replicas, prompt), weights=KV_WEIGHTS)
    assert d is not None and not d.shadow and d.policy == "kv-aware"
    return d


def test_prefix_decides_when_loads_are_equal():
    d = kv_aware([raw("sim-0"), raw("sim-1", prefix=96), raw("sim-2", prefix=32)])
    assert d.chosen == "sim-1" and d.reason == "prefix"
    assert explain.deciding_scorer(d) == "prefix"
    text = explain.margin_sentence(d)
    assert text.startswith("sim-1 won by 1.50 over sim-2: +1.50 from a 64-token longer cached prefix (96 vs 32)")
    assert "against" not in text


def test_inflight_decides_load_over_prefix():
    # sim-1 holds 16 more tokens, but has 4 requests in flight; sim-3 has 1
    d = kv_aware([raw("sim-1", prefix=64, inflight=4), raw("sim-3", prefix=48, inflight=1)])
    assert d.chosen == "sim-3" and d.reason == "load-over-prefix"
    assert explain.deciding_scorer(d) == "inflight"
    text = explain.sentence(d)
    assert "sim-3 won by 0.38 over sim-1: +0.75 from fewer in-flight requests (1 vs 4)" in text
    assert "against −0.38 for a 16-token shorter cached prefix (48 vs 64)" in text


def test_queue_decides_and_the_sentence_says_so():
    d = kv_aware([raw("sim-0", waiting=6), raw("sim-1", waiting=2, kv_usage=0.5)])
    assert d.chosen == "sim-1" and explain.deciding_scorer(d) == "queue"
    assert "+0.67 from fewer queued requests (2 vs 6) against −0.20 for higher KV-cache usage (50% vs 10%)" \
        in explain.sentence(d)


def test_round_robin_counterfactual_uses_kv_aware_weights_and_filters():
    replicas = [raw("sim-0"), raw("sim-1", prefix=64), raw("sim-2", prefix=96, waiting=20)]
    d = shadow("sim-0", replicas)
    cf = explain.counterfactual(d)
    # sim-2 holds the longest prefix but its queue (20) is over kv-aware's max_waiting (16): filtered
    assert cf is not None and cf.chosen == "sim-1" and cf.predicted == 64
    assert [c.replica for c in cf.candidates if c.extra["filtered"]] == ["sim-2"]
    text = explain.sentence(d)
    assert text.startswith("round-robin sent it to sim-0 without looking at the cache (0 cached tokens there); "
                           "kv-aware would have picked sim-1 (64 cached tokens, load-over-prefix)")
    # the same replica: said so, without a made-up difference
    same = shadow("sim-1", [raw("sim-0"), raw("sim-1", prefix=64)])
    assert "kv-aware would have rated sim-1 as high as any" in explain.sentence(same)
    # a span without the load inputs (older runs) gets no invented counterfactual
    bare = Decision("cd" * 16, "round-robin", "sim-0", "round-robin", True, KV_WEIGHTS,
                    [Candidate("sim-0", {"prefix": 0.0}, 0.0, 0, True)], 128, 0, 0, 0, 0, 1, 0.1)
    assert explain.counterfactual(bare) is None and "lacks the per-replica inputs" in explain.sentence(bare)


def test_zero_weight_scorers_hidden_unless_asked():
    d = kv_aware([raw("sim-0"), raw("sim-1", prefix=96)])
    console = Console(width=250, record=True)
    console.print(cli.decision_table(d))
    short = console.export_text()
    assert "prefix ×3" in short and "inflight ×1" in short and "predicted_ttft" not in short
    assert "in-flight" in short and "queue" in short and "KV use" in short
    console.print(cli.decision_table(d, all_scorers=True))
    assert "predicted_ttft ×0" in console.export_text()
    assert list(decision_figure(d).data[0].x) == ["prefix ×3", "queue ×1", "kv_usage ×0.5", "inflight ×1"]
    assert "predicted_ttft ×0" in decision_figure(d, all_scorers=True).data[0].x


# ---- selectors on a run's span files ------------------------------------------------------------

def _write_run(tmp_path: Path, decisions: list[tuple[str, str, str, list[dict], float]]) -> Path:
    """Span files + requests.jsonl; each decision: (policy, chosen, reason, candidates, client TTFT)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "kvlab-gateway"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("kvlab.gateway")
    records = []
    for policy, chosen, reason, cands, ttft in decisions:
        with tracer.start_as_current_span(n.SPAN_GATEWAY_REQUEST) as root:
            root.set_attributes({n.POLICY: policy, n.PROMPT_TOKENS: 128, n.REPLICA: chosen})
            with tracer.start_as_current_span(n.SPAN_SCHEDULE) as s:
                s.set_attributes({n.SCHEDULE_CANDIDATES: json.dumps(cands), n.SCHEDULE_CHOSEN: chosen,
                                  n.SCHEDULE_WEIGHTS: json.dumps(KV_WEIGHTS), n.SCHEDULE_REASON: reason,
                                  n.SCHEDULE_SHADOW: policy == "round-robin", n.POLICY: policy})
            records.append({"ts": 1.0, "trace_id": format(root.get_span_context().trace_id, "032x"), "ttft_ms": ttft})
    traces = tmp_path / "run" / "traces"
    traces.mkdir(parents=True)
    sink = SpanFile(traces)
    sink.write(encode_spans(exporter.get_finished_spans()))
    sink.close()
    (tmp_path / "run" / "phase-1").mkdir()
    (tmp_path / "run" / "phase-1" / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return tmp_path / "run"


def _scored(replicas: list[dict]) -> list[dict]:
    """Candidates with the scores and totals the kv-aware scheduler gives them."""
    d = kv_aware(replicas)
    return [{**r, "scores": c.scores, "total": c.total} for r, c in zip(replicas, d.candidates)]


@pytest.fixture
def run(tmp_path: Path) -> Path:
    hit = _scored([raw("sim-0"), raw("sim-1", prefix=96)])
    lop = _scored([raw("sim-1", prefix=64, inflight=4), raw("sim-3", prefix=48, inflight=1)])
    rr = [raw("sim-0"), raw("sim-1", prefix=96)]
    return _write_run(tmp_path, [
        ("kv-aware", "sim-1", "prefix", hit, 40.0),
        ("kv-aware", "sim-3", "load-over-prefix", lop, 900.0),
        ("round-robin", "sim-0", "round-robin", rr, 1500.0),
        ("kv-aware", "sim-3", "load-over-prefix", lop, 300.0),
    ])


def test_selectors(run: Path, capsys):
    ids = [t.trace_id for t in OtlpFileSource(run / "traces").traces()]
    assert cli.main(["explain", "--run", str(run), "--reason", "load-over-prefix"]) == 0
    out = capsys.readouterr().out
    assert "2 decisions with reason load-over-prefix" in out
    assert out.count("from fewer in-flight requests (1 vs 4)") == 2
    assert ids[1][:12] in out and ids[3][:12] in out and ids[0][:12] not in out

    assert cli.main(["explain", "--run", str(run), "--replica", "sim-1"]) == 0
    out = capsys.readouterr().out
    assert "1 decisions with replica sim-1" in out and ids[0][:12] in out

    assert cli.main(["explain", "--run", str(run), "--worst", "1"]) == 0
    out = capsys.readouterr().out
    assert ids[2][:12] in out and "TTFT 1500.0 ms" in out and "kv-aware would have picked sim-1" in out
    assert ids[1][:12] not in out

    assert cli.main(["explain", "--run", str(run), "--reason", "load-over-prefix", "--limit", "1"]) == 0
    assert "first 1" in capsys.readouterr().out

    assert cli.main(["explain", "--run", str(run), "--reason", "nope"]) == 1
    out = capsys.readouterr().out
    assert "load-over-prefix (2)" in out and "round-robin (1)" in out


def test_single_decision_prints_its_sentence(run: Path, capsys):
    tid = OtlpFileSource(run / "traces").traces()[2].trace_id
    assert cli.main(["explain", tid, "--run", str(run)]) == 0
    out = capsys.readouterr().out
    assert "kv-aware would have picked sim-1 (96 cached tokens, prefix)" in out


# ---- words and table agree ----------------------------------------------------------------------
TERM = re.compile(r"([+−])(\d+\.\d\d) (?:from|for) ")
PRESET = {**KV_WEIGHTS, "predicted_ttft": 1.0}      # kv-aware as shipped


def _terms(text: str) -> tuple[float, list[float]]:
    margin = float(re.search(r"won by (−?\d+\.\d\d)", text).group(1).replace("−", "-"))
    return margin, [float(v) * (1 if s == "+" else -1) for s, v in TERM.findall(text)]


def test_the_sentences_terms_add_up_to_the_margin():
    """Every term the sentence lists, and nothing else, makes up the margin it states (to rounding):
    loads that differ in every scorer at once, so no term may be left out."""
    rng = random.Random(7)
    checked = 0
    for _ in range(200):
        replicas = [{**raw(f"sim-{i}", prefix=rng.choice([0, 16, 48, 96]), waiting=rng.randint(0, 6),
                           inflight=rng.randint(0, 5), kv_usage=rng.random()),
                     "prefill_ms_per_token": rng.choice([0.5, 1.0, 2.0]), "pending_prefill_tokens": rng.randint(0, 900)}
                    for i in range(4)]
        d = explain.counterfactual(shadow("sim-0", replicas), weights=PRESET)
        text = explain.margin_sentence(d)
        if "won by" not in text:
            continue
        margin, terms = _terms(text)
        assert abs(sum(terms) - margin) <= 0.005 * (len(terms) + 1), text
        # each term is one of the table's columns: a scorer with a weight
        shown = set(explain.visible_scorers(d))
        win, other = explain.winner(d), explain.runner_up(d)
        listed = [c.scorer for c in explain.contributions(d, win, other) if abs(c.delta) >= 0.005]
        assert set(listed) <= shown and len(listed) == len(terms), text
        checked += 1
    assert checked > 150


def test_a_total_the_scorers_do_not_itemise_is_named_as_the_rest():
    cands = [Candidate("a", {"prefix": 1.0, "inflight": 0.5}, 3.6, 96, True),
             Candidate("b", {"prefix": 0.2, "inflight": 1.0}, 1.6, 16, False)]
    d = Decision("ef" * 16, "kv-aware", "a", "prefix", False, {"prefix": 3.0, "inflight": 1.0}, cands, 128,
                 96, 96, 0, 96, 1, 0.1)
    text = explain.margin_sentence(d)
    margin, terms = _terms(text)
    assert margin == 2.0 and terms == [2.4, -0.5, 0.1], text
    assert "from the rest of the totals" in text


def test_a_round_robin_explanation_shows_the_table_its_terms_come_from(run: Path, capsys):
    """The sentence weighs kv-aware's scorers for a round-robin request: their table is printed too,
    so every term it names (predicted TTFT included) has a column."""
    tid = OtlpFileSource(run / "traces").traces()[2].trace_id
    assert cli.main(["explain", tid, "--run", str(run)]) == 0
    out = capsys.readouterr().out
    assert "what kv-aware would have scored on the same inputs" in out
    assert "prefix ×3" in out.split("what kv-aware would have scored", 1)[1]
