"""kvlab.traces.overhead: a request's time outside its engines is its client TTFT minus its
engine's own queue and prefill (the simulator's engine.queue start to engine.prefill end, or vLLM's
llm_request span's engine-core time_in_queue + time_in_model_prefill); under chunked decoding the first chunk's engine request is the one,
and its wait for a slot at the gateway is not outside; a request without exactly one engine
request for its first token (unsampled, failed, a P/D request's two engines) is left out."""

from __future__ import annotations

import pytest

from kvlab.load.measure import Record
from kvlab.telemetry import names
from kvlab.traces.overhead import median_by_policy, outside_engine_ms
from kvlab.traces.span import Span, Trace

MS = 1_000_000


def _trace(tid: str, engines: list[tuple[float, float]]) -> Trace:
    """A trace with one engine queue + prefill span pair per (queue start, prefill end) in ms."""
    spans = []
    for i, (queued, first) in enumerate(engines):
        spans += [Span(tid, f"{2 * i:016x}", None, names.SPAN_ENGINE_QUEUE, "kvlab-sim", "internal",
                       int(queued * MS), int((queued + 1) * MS)),
                  Span(tid, f"{2 * i + 1:016x}", None, names.SPAN_ENGINE_PREFILL, "kvlab-sim", "internal",
                       int((queued + 1) * MS), int(first * MS))]
    return Trace(tid, spans)


def _rec(tid: str, ttft: float | None, policy: str = "kv-aware", error: str | None = None) -> Record:
    return Record(ts=0.0, policy=policy, ttft_ms=ttft, trace_id=tid, error=error)


def test_the_time_outside_the_engines_is_client_ttft_minus_the_engines_own():
    traces = {"a": _trace("a", [(1000, 1070)]), "b": _trace("b", [(50, 450)]),
              "pd": _trace("pd", [(0, 300), (310, 320)])}
    records = [_rec("a", 100), _rec("b", 430), _rec("pd", 400), _rec("gone", 90), _rec("a", None),
               _rec("b", 500, error="HTTP 503")]
    assert outside_engine_ms(records, traces) == [30.0, 30.0]


def test_the_median_is_per_policy():
    traces = {t: _trace(t, [(0, 100)]) for t in "abc"}
    records = [_rec("a", 110, "round-robin"), _rec("b", 150, "round-robin"), _rec("c", 400, "round-robin"),
               _rec("a", 125), _rec("zz", 999, "prefix")]
    assert median_by_policy(records, traces) == {"round-robin": 50.0, "kv-aware": 25.0}


def test_real_vllm_engines_count_their_engine_cores_queue_and_prefill():
    """vLLM's time_to_first_token counts from its API server's receipt: tokenizing the prompt and
    the hand-over to the engine core (and the token's way back) are outside what the twin models."""
    engine = Span("v", "0" * 16, None, names.SPAN_ENGINE_REQUEST, "vllm", "server", 0, 500 * MS,
                  attributes={names.VLLM_LATENCY_TTFT: 0.250, names.VLLM_LATENCY_QUEUE: 0.030,
                              names.VLLM_LATENCY_PREFILL: 0.090})
    assert outside_engine_ms([_rec("v", 275.0)], {"v": Trace("v", [engine])}) == [pytest.approx(155.0)]
    # a vLLM whose span has no engine-core split: its whole TTFT
    older = Span("w", "0" * 16, None, names.SPAN_ENGINE_REQUEST, "vllm", "server", 0, 500 * MS,
                 attributes={names.VLLM_LATENCY_TTFT: 0.120})
    assert outside_engine_ms([_rec("w", 145.0)], {"w": Trace("w", [older])}) == [pytest.approx(25.0)]


def test_under_chunked_decoding_the_first_chunks_engine_request_made_the_first_token():
    """One upstream call per chunk, each an engine request of its own: the later chunks' come
    after the first token and are not the engine's TTFT. The first chunk's wait for a decode slot
    at the gateway is modelled by the twin too, so it is not counted outside."""
    tid, spans = "c", []
    for i, (queued, first) in enumerate([(200, 260), (0, 90), (400, 420)]):   # chunk 1 starts first here
        chunk = f"c{i:015x}"
        spans += [Span(tid, chunk, None, names.SPAN_CHUNK, "kvlab-gateway", "client", int(queued * MS),
                       int((first + 50) * MS), attributes={names.CHUNK_INDEX: (1, 0, 2)[i], names.CHUNK_WAIT_MS: 5.0}),
                  Span(tid, f"{2 * i:016x}", chunk, names.SPAN_ENGINE_QUEUE, "kvlab-sim", "internal",
                       int(queued * MS), int((queued + 1) * MS)),
                  Span(tid, f"{2 * i + 1:016x}", chunk, names.SPAN_ENGINE_PREFILL, "kvlab-sim", "internal",
                       int((queued + 1) * MS), int(first * MS))]
    assert outside_engine_ms([_rec(tid, 110.0)], {tid: Trace(tid, spans)}) == [15.0]


def test_the_simulators_llm_request_reads_as_real_vllms():
    """The simulator's `llm_request` carries vLLM's engine-core split: read from it as from real
    vLLM's, whatever its kvlab children say; a run from before (no such attributes) is read from
    its engine.queue and engine.prefill spans."""
    tid = "s"
    engine = Span(tid, "e" * 16, None, names.SPAN_ENGINE_REQUEST, "kvlab-sim", "server", 0, 300 * MS,
                  attributes={names.SPAN_ROLE: names.SPAN_ENGINE_REQUEST, names.VLLM_LATENCY_QUEUE: 0.010,
                              names.VLLM_LATENCY_PREFILL: 0.040})
    queue = Span(tid, "1" * 16, "e" * 16, names.SPAN_ENGINE_QUEUE, "kvlab-sim", "internal", 0, 20 * MS)
    prefill = Span(tid, "2" * 16, "e" * 16, names.SPAN_ENGINE_PREFILL, "kvlab-sim", "internal", 20 * MS, 90 * MS)
    assert outside_engine_ms([_rec(tid, 80.0)], {tid: Trace(tid, [engine, queue, prefill])}) == [pytest.approx(30.0)]
    old = Span(tid, "e" * 16, None, "chat m", "kvlab-sim", "server", 0, 300 * MS,
               attributes={names.SPAN_ROLE: "engine.request"})
    assert outside_engine_ms([_rec(tid, 80.0)], {tid: Trace(tid, [old, queue, prefill])}) == [pytest.approx(-10.0)]
