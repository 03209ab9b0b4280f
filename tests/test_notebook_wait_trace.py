"""`notebook.wait_trace` waits for a trace's spans by count: each process exports its own batch, so
a prefill/decode split's trace can hold the decode replica's engine.request before the prefill
replica's (lab 05, prefill/decode, asserted on such a trace once in a fresh-clone CI run)."""

from __future__ import annotations

import pytest

from kvlab import notebook as nb
from kvlab.stack.base import StackInfo
from kvlab.telemetry import names as n
from kvlab.traces.span import Span, Trace

TRACE = "ab" * 16


def _span(i: int, name: str, role: str | None = None) -> Span:
    return Span(trace_id=TRACE, span_id=f"{i:016x}", parent_id=None, name=name, service=f"svc-{i}",
                kind="internal", start_ns=i, end_ns=i + 1, attributes={n.PD_ROLE: role} if role else {})


@pytest.fixture
def arriving(monkeypatch):
    """A trace source whose trace gains one span a poll: the decode side first, then the prefill side."""
    batches = [[_span(1, n.SPAN_DECODE_CALL), _span(2, n.SPAN_ENGINE_REQUEST, "decode")],
               [_span(3, n.SPAN_ENGINE_REQUEST, "prefill")]]
    polls = []

    class Source:
        def trace(self, trace_id: str) -> Trace:
            polls.append(trace_id)
            return Trace(trace_id, [s for b in batches[:len(polls)] for s in b])

    monkeypatch.setattr("kvlab.traces.sources.open_source", lambda **_: Source())
    monkeypatch.setattr(nb.time, "sleep", lambda _s: None)
    return polls


def test_a_name_listed_twice_waits_for_two_spans(arriving, tmp_path):
    stack = StackInfo(id="t", run_dir=str(tmp_path))
    trace = nb.wait_trace(stack, TRACE, spans=(n.SPAN_DECODE_CALL, n.SPAN_ENGINE_REQUEST, n.SPAN_ENGINE_REQUEST))
    assert {s.attr(n.PD_ROLE) for s in trace.find(n.SPAN_ENGINE_REQUEST)} == {"prefill", "decode"}
    assert len(arriving) == 2


def test_a_name_listed_once_takes_the_first_span(arriving, tmp_path):
    stack = StackInfo(id="t", run_dir=str(tmp_path))
    trace = nb.wait_trace(stack, TRACE, spans=(n.SPAN_DECODE_CALL, n.SPAN_ENGINE_REQUEST))
    assert len(trace.find(n.SPAN_ENGINE_REQUEST)) == 1 and len(arriving) == 1
