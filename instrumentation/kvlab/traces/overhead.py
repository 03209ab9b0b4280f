"""The live stack's time outside its engines before a first token: per request, the client's TTFT
minus the engine's own queue and prefill, the part the twin models: its
`llm_request` span's engine-core `gen_ai.latency.time_in_queue` plus `time_in_model_prefill`, the
simulator's as real vLLM's. vLLM's own `time_to_first_token` counts from its API
server's receipt, so it also holds the request's tokenization and hand-over to the engine core and
the first token's way back (on a loaded 2-core machine 130 ms for a 1,867-token prompt served from
cache, more for a cold one): outside the model, so counted here. Under chunked decoding the first
chunk's engine request made the first token, and its wait for one of the gateway's decode slots is
taken out too: the twin models those slots.

That is what a model of the engines leaves out: Locust, the gateway, the HTTP hops, the replica's
request handling and the first token's way back. The cluster twin's `--request-overhead-ms` is this
time (docs/twin-validation.md); on a loaded 2-core machine it is tens to hundreds of milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from kvlab.load.measure import Record
from kvlab.telemetry import names
from kvlab.traces.run import load_requests
from kvlab.traces.sources import open_source
from kvlab.traces.span import Span, Trace


def engine_ttft_ms(trace: Trace) -> float | None:
    """The TTFT the engine that made this trace's first token measured itself; None without
    exactly one engine request for it (unsampled, or a P/D request's two). Under chunked decoding
    the first chunk's engine request made it. Real vLLM's and the simulator's `llm_request` are read
    alike; a trace from before the simulator emitted vLLM's attributes is read from its
    engine.queue and engine.prefill spans."""
    spans = _first_chunk(trace)
    engine = [s for s in spans if s.role == names.SPAN_ENGINE_REQUEST]
    if len(engine) > 1:
        return None
    attrs = engine[0].attributes if engine else {}
    queue, prefill = attrs.get(names.VLLM_LATENCY_QUEUE), attrs.get(names.VLLM_LATENCY_PREFILL)
    if isinstance(queue, (int, float)) and isinstance(prefill, (int, float)):
        return (float(queue) + float(prefill)) * 1000.0
    queues = [s for s in spans if s.role == names.SPAN_ENGINE_QUEUE]
    prefills = [s for s in spans if s.role == names.SPAN_ENGINE_PREFILL]
    if len(queues) == 1 and len(prefills) == 1:
        return (prefills[0].end_ns - queues[0].start_ns) / 1e6
    ttft = attrs.get(names.VLLM_LATENCY_TTFT)    # a vLLM without the engine-core split
    return float(ttft) * 1000.0 if isinstance(ttft, (int, float)) else None


def _first_chunk(trace: Trace) -> list[Span]:
    """The spans under the first gateway.chunk span (one upstream call per chunk), or all of them."""
    chunks = trace.find(names.SPAN_CHUNK)
    if not chunks:
        return list(trace.spans)
    tree, out, todo = trace.children(), [], [_chunk_zero(chunks)]
    while todo:
        span = todo.pop()
        out.append(span)
        todo += tree.get(span.span_id, [])
    return out


def slot_wait_ms(trace: Trace) -> float:
    """How long the first chunk waited for a decode slot at the gateway (0 without chunks)."""
    chunks = trace.find(names.SPAN_CHUNK)
    if not chunks:
        return 0.0
    wait = _chunk_zero(chunks).attr(names.CHUNK_WAIT_MS, 0.0)
    return float(wait) if isinstance(wait, (int, float)) else 0.0


def outside_engine_ms(records: Iterable[Record], traces: Mapping[str, Trace]) -> list[float]:
    """Each request's client TTFT minus its engine's (and its first chunk's slot wait), for the
    records whose trace has one engine request for the first token (an unsampled, failed or P/D
    request is left out)."""
    out = []
    for rec in records:
        trace = traces.get(rec.trace_id or "")
        if rec.error or rec.ttft_ms is None or trace is None:
            continue
        engine = engine_ttft_ms(trace)
        if engine is not None:
            out.append(rec.ttft_ms - engine - slot_wait_ms(trace))
    return out


def median_by_policy(records: Iterable[Record], traces: Mapping[str, Trace]) -> dict[str, float]:
    """The median time outside the engines of each policy's requests."""
    by: dict[str, list[Record]] = {}
    for rec in records:
        by.setdefault(rec.policy, []).append(rec)
    return {policy: float(np.median(ms)) for policy, recs in by.items() if (ms := outside_engine_ms(recs, traces))}


def of_run(run_dir: Path) -> dict[str, float]:
    """`median_by_policy` over a run's requests (every phase's requests.jsonl) and its traces."""
    return median_by_policy(load_requests(run_dir), {t.trace_id: t for t in open_source(run_dir).traces()})


def _chunk_zero(chunks: list[Span]) -> Span:
    return min(chunks, key=lambda s: (s.attr(names.CHUNK_INDEX, 0), s.start_ns))
