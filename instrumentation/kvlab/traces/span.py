"""The span and trace records every trace source produces (independent of OTLP or Jaeger)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvlab.telemetry import names


@dataclass(frozen=True, slots=True)
class SpanEvent:
    name: str
    time_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Span:
    """One span, times in Unix nanoseconds, attribute values as plain Python values."""

    trace_id: str                  # 32 lowercase hex digits
    span_id: str                   # 16 lowercase hex digits
    parent_id: str | None
    name: str
    service: str
    kind: str                      # server | client | internal | producer | consumer | unspecified
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    status: str = "unset"          # unset | ok | error
    status_message: str = ""
    events: tuple[SpanEvent, ...] = ()

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6

    @property
    def role(self) -> str:
        """What the span is, by its llm-d, vLLM or kvlab name (`gateway.request_orchestration`,
        `llm_request`, ...): kvlab's GenAI client spans carry it as an attribute, their name being
        `{operation} {model}`; other spans are named by it. A trace written before issue 46 reads
        with today's names (names.RENAMED_ROLES, RENAMED_SPANS)."""
        role = self.attributes.get(names.SPAN_ROLE)
        if isinstance(role, str):
            return names.RENAMED_ROLES.get(role, role)
        return names.RENAMED_SPANS.get(self.name, self.name)

    @property
    def origin(self) -> str:
        """Whose name the span carries: `llm-d` (llm-d-router's), `vLLM`, or `kvlab` (kvlab's own,
        the GenAI-named client calls included); docs/tracing.md has the table."""
        role = self.role
        if role in names.LLMD_SPANS or role.startswith(names.SPAN_SCORER_PREFIX):
            return "llm-d"
        return "vLLM" if role in names.VLLM_SPANS else "kvlab"

    def attr(self, key: str, default: Any = None) -> Any:
        return self.attributes.get(key, default)

    def json_attr(self, key: str, default: Any = None) -> Any:
        """An attribute that carries JSON text (e.g. the schedule candidates), decoded."""
        value = self.attributes.get(key)
        if value is None:
            return default
        if isinstance(value, (list, dict)):
            return value
        try:
            return json.loads(value)
        except (TypeError, ValueError):
            return default


class Trace:
    """The spans of one trace id, ordered by start time, with tree helpers."""

    def __init__(self, trace_id: str, spans: Iterable[Span]) -> None:
        self.trace_id = trace_id
        unique: dict[str, Span] = {}
        for s in spans:  # an exporter retry may deliver a span twice
            unique.setdefault(s.span_id, s)
        self.spans: list[Span] = sorted(unique.values(), key=lambda s: (s.start_ns, s.end_ns))

    def __len__(self) -> int:
        return len(self.spans)

    def __iter__(self) -> Iterator[Span]:
        return iter(self.spans)

    @property
    def start_ns(self) -> int:
        return min(s.start_ns for s in self.spans)

    @property
    def end_ns(self) -> int:
        return max(s.end_ns for s in self.spans)

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6

    @property
    def root(self) -> Span:
        """The earliest span whose parent is not in this trace (the true root if it arrived)."""
        ids = {s.span_id for s in self.spans}
        orphans = [s for s in self.spans if s.parent_id is None or s.parent_id not in ids]
        return (orphans or self.spans)[0]

    @property
    def services(self) -> list[str]:
        return sorted({s.service for s in self.spans})

    def find(self, role: str) -> list[Span]:
        """The spans of that role (see `Span.role`)."""
        return [s for s in self.spans if s.role == role]

    def first(self, name: str) -> Span | None:
        found = self.find(name)
        return found[0] if found else None

    def attr(self, key: str, names: Iterable[str] = ()) -> Any:
        """`key` from the first span named in `names` (in that order) that has it, else from any span."""
        for name in names:
            for s in self.find(name):
                if key in s.attributes:
                    return s.attributes[key]
        for s in self.spans:
            if key in s.attributes:
                return s.attributes[key]
        return None

    def children(self) -> dict[str | None, list[Span]]:
        ids = {s.span_id for s in self.spans}
        tree: dict[str | None, list[Span]] = {}
        for s in self.spans:
            parent = s.parent_id if s.parent_id in ids else None
            tree.setdefault(parent, []).append(s)
        return tree

    def walk(self) -> list[tuple[int, Span]]:
        """Depth-first (depth, span) pairs, children in start order: the waterfall's row order."""
        tree = self.children()
        out: list[tuple[int, Span]] = []

        def visit(parent: str | None, depth: int) -> None:
            for s in tree.get(parent, []):
                out.append((depth, s))
                visit(s.span_id, depth + 1)

        visit(None, 0)
        return out


def group_traces(spans: Iterable[Span]) -> list[Trace]:
    """Spans grouped by trace id; traces ordered by their first span's start."""
    by_id: dict[str, list[Span]] = {}
    for s in spans:
        by_id.setdefault(s.trace_id, []).append(s)
    traces = [Trace(tid, ss) for tid, ss in by_id.items()]
    traces.sort(key=lambda t: t.start_ns)
    return traces
