"""kvlab's spans carry llm-d's and vLLM's names where they are the same step: names.py against a
record of those names read from llm-d/llm-d-router's and vLLM's code (tests/data/
upstream_span_names.json, with the commit each was read at), so a rename on either side is a
visible change to that file; and a gateway's schedule written with them, one scorer span per
scorer of the policy, whatever scorers it registers."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvlab.contract import Endpoint
from kvlab.gateway import schedule_span
from kvlab.gateway.config import load_policy
from kvlab.gateway.endpoints import Backend
from kvlab.gateway.scheduler import presets
from kvlab.gateway.scheduler.base import RouteRequest
from kvlab.telemetry import names
from kvlab.telemetry.packed import Packed, pack, unpack
from kvlab.telemetry.recorder import RecorderProvider
from kvlab.traces.decision import decision_of
from kvlab.traces.span import Span, Trace

UPSTREAM = json.loads((Path(__file__).parent / "data" / "upstream_span_names.json").read_text())
NAMED = [(project, kind, name, entry["constant"]) for project in ("llm-d", "vllm")
         for kind in ("spans", "attributes") for name, entry in UPSTREAM[project][kind].items()]


@pytest.mark.parametrize(("project", "kind", "name", "constant"), NAMED,
                         ids=[f"{p}:{n}" for p, _, n, _ in NAMED])
def test_names_py_carries_the_upstream_name(project: str, kind: str, name: str, constant: str) -> None:
    assert getattr(names, constant) == name, (project, UPSTREAM[project]["repository"], constant)


def test_the_record_says_where_each_name_was_read() -> None:
    for project in ("llm-d", "vllm"):
        p = UPSTREAM[project]
        assert len(p["commit"]) == 40 and p["repository"].count("/") == 1
        assert all(e["path"] for kind in ("spans", "attributes") for e in p[kind].values())
    # the name that llm-d's code does not have is not invented
    assert "llm_d.kv_cache.index" in UPSTREAM["llm-d"]["not_found"]
    assert not any(v == "llm_d.kv_cache.index" for v in vars(names).values())


def test_traces_of_earlier_kvlab_versions_read_with_the_new_names() -> None:
    def span(name: str, **attrs: object) -> Span:
        return Span("a" * 32, "b" * 16, None, name, "svc", "internal", 0, 1, dict(attrs))

    assert span("chat m", **{names.SPAN_ROLE: "gateway.request"}).role == names.SPAN_GATEWAY_REQUEST
    assert span("chat m", **{names.SPAN_ROLE: "engine.request"}).role == names.SPAN_ENGINE_REQUEST
    assert span("gateway.schedule").role == names.SPAN_SCHEDULE
    assert span("gateway.pd_decision").role == names.SPAN_PD_DECISION
    assert span("epp.request").role == names.SPAN_EPP_REQUEST
    assert span("llm_request").role == names.SPAN_ENGINE_REQUEST          # real vLLM's
    assert span("gateway.request").role == names.SPAN_EPP_REQUEST          # today's EPP span, by name


def test_schedule_spans_have_llm_ds_shape_one_scorer_span_per_scorer() -> None:
    ranker = presets.build(load_policy("kv-aware"), random.Random(0))
    replicas = [Backend(Endpoint(name=f"sim-{i}", url=f"http://sim-{i}"), waiting=i) for i in range(3)]
    d = ranker.schedule(RouteRequest(256), replicas, {"sim-1": 128})
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span(names.SPAN_SCHEDULE) as s:
        schedule_span.steps(tracer, trace.set_span_in_context(s), d, ranker)
    finished = exporter.get_finished_spans()
    spans = {sp.name: sp for sp in finished}
    run, scoring = spans[names.SPAN_SCHEDULE], spans[names.SPAN_SCORING]
    for child in (names.SPAN_FILTER, names.SPAN_SCORING, names.SPAN_PICK):
        parent = spans[child].parent
        assert parent is not None and parent.span_id == run.context.span_id
    scorer_spans = [sp for sp in finished if sp.name.startswith(names.SPAN_SCORER_PREFIX)]
    weighted = [(sc, w) for sc, w in ranker.scorers if w]     # the policy's scorers, as an llm-d profile's
    assert len(weighted) > 1 and [sp.name for sp in scorer_spans] == [names.SPAN_SCORER_PREFIX + sc.name
                                                                      for sc, _ in weighted]
    assert (spans[names.SPAN_SCORING].attributes or {})[names.LLMD_SCORER_COUNT] == len(weighted)
    for sp, (sc, w) in zip(scorer_spans, weighted, strict=True):
        assert sp.parent is not None and sp.parent.span_id == scoring.context.span_id
        a = sp.attributes or {}
        scores = [c.scores[sc.name] for c in d.candidates]
        assert a[names.LLMD_SCORER_TYPE] == sc.name and a[names.LLMD_SCORER_WEIGHT] == w
        assert a[names.LLMD_SCORER_SCORE_MAX] == max(scores)
        assert a[names.LLMD_SCORER_SCORE_AVG] == pytest.approx(sum(scores) / len(scores))
        assert a[names.LLMD_SCORER_ENDPOINTS_SCORED] == 3
    assert (spans[names.SPAN_PICK].attributes or {})[names.LLMD_PICKER_TOP_ENDPOINTS][0] == d.best.name


class _Relay:
    def __init__(self) -> None:
        self.spans: list[Packed] = []

    def add(self, packed: Packed) -> None:
        self.spans.append(packed)

    def shutdown(self) -> None:
        pass


def _tree(spans: list[Packed]) -> list[tuple[object, ...]]:
    """Each span by name: its parent's name, kind, times and attributes (ids differ run to run)."""
    by_id = {p[2]: p[0] for p in spans}
    return sorted((p[0], by_id.get(p[4]), p[6], p[7], p[8], sorted(p[9].items()), p[1] == spans[0][1])
                  for p in spans)


def test_the_recorder_writes_the_schedule_spans_the_sdk_writes() -> None:
    """schedule_span packs its after-the-fact children straight for kvlab's relay
    (RecordedSpan.record_child); the tree and attributes must be the SDK's spans'."""
    ranker = presets.build(load_policy("kv-aware"), random.Random(0))
    replicas = [Backend(Endpoint(name=f"sim-{i}", url=f"http://sim-{i}"), waiting=i) for i in range(3)]
    d = ranker.schedule(RouteRequest(256), replicas, {"sim-1": 128})
    exporter = InMemorySpanExporter()
    sdk = TracerProvider()
    sdk.add_span_processor(SimpleSpanProcessor(exporter))
    relay = _Relay()
    recorder = RecorderProvider(Resource({}), relay)   # type: ignore[arg-type]  # a sink, not a SpanRelay
    for provider in (sdk, recorder):
        tracer = provider.get_tracer("t")
        s = tracer.start_span(names.SPAN_SCHEDULE, start_time=1)
        schedule_span.steps(tracer, trace.set_span_in_context(s), d, ranker)
        s.end(end_time=2)
    recorded = [pack(unpack(p, Resource({}), SpanLimits())) for p in relay.spans]   # as the child reads them
    assert _tree(recorded) == _tree([pack(sp) for sp in exporter.get_finished_spans()])
    assert len(recorded) == 3 + 1 + len([w for _, w in ranker.scorers if w])


def test_kvlab_traces_explain_reads_a_trace_written_with_the_old_names() -> None:
    tid = "c" * 32
    cands = '[{"replica": "sim-0", "prefix_tokens": 64, "scores": {"prefix": 1.0}, "total": 3.0}]'
    spans = [Span(tid, "1" * 16, None, "chat m", "kvlab-gateway", "server", 0, 100,
                  {names.SPAN_ROLE: "gateway.request", names.POLICY: "kv-aware", names.PREFIX_AVAILABLE_TOKENS: 64}),
             Span(tid, "2" * 16, "1" * 16, "gateway.schedule", "kvlab-gateway", "internal", 1, 2,
                  {names.SCHEDULE_CHOSEN: "sim-0", names.SCHEDULE_REASON: "prefix", names.SCHEDULE_CANDIDATES: cands}),
             Span(tid, "3" * 16, "1" * 16, "chat m", "kvlab-sim", "server", 3, 90,
                  {names.SPAN_ROLE: "engine.request", names.ENGINE_CACHED_TOKENS: 64})]
    d = decision_of(Trace(tid, spans))
    assert d is not None and d.chosen == "sim-0" and d.reason == "prefix" and d.policy == "kv-aware"
    assert d.available == 64 and d.delivered == 64 and d.candidates[0].prefix_tokens == 64
