"""What every trace source offers: recent traces, and one trace by id."""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvlab.traces.span import Trace


class TraceSource(ABC):
    """A place spans can be read back from (files of the local sink, a Jaeger query API)."""

    @abstractmethod
    def traces(self, limit: int | None = None, service: str | None = None) -> list[Trace]:
        """Traces ordered by start time (oldest first); the newest `limit` when given;
        only those with a span of `service` when given."""

    @abstractmethod
    def trace(self, trace_id: str) -> Trace:
        """One trace by id (32 hex digits, case-insensitive); KvlabError when absent."""

    @abstractmethod
    def describe(self) -> str:
        """Where the spans come from, for messages."""
