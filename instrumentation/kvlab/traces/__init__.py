"""Traces of a kvlab run as tables and figures.

Sources (`kvlab.traces.sources`): the OTLP JSON files the local sink writes, or a Jaeger v2 query
API. Views: a waterfall of one trace, the "why this replica" view of a routing decision, and the
per-request hit-rate decomposition (available / predicted / delivered) joined with client TTFT.
`kvlab traces list|show|explain` is the command-line face (kvlab.traces.cli).
"""

from kvlab.traces.span import Span, SpanEvent, Trace

__all__ = ["Span", "SpanEvent", "Trace"]
