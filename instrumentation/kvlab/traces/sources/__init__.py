"""Trace sources: `otlp_files` (the local sink's OTLP JSON lines) and `jaeger` (a Jaeger v2
query API). `open_source` picks one from the CLI's --run / --jaeger flags."""

from __future__ import annotations

from pathlib import Path

from kvlab.traces.sources.base import TraceSource


def open_source(run_dir: Path | None = None, jaeger: str | None = None) -> TraceSource:
    """A Jaeger source when `jaeger` is given, else the run's span files
    (or the Jaeger the run's stack.json names)."""
    if jaeger:
        from kvlab.traces.sources.jaeger import JaegerSource

        return JaegerSource(jaeger)
    from kvlab.traces.run import traces_location

    kind, where = traces_location(run_dir)
    if kind == "jaeger":
        from kvlab.traces.sources.jaeger import JaegerSource

        return JaegerSource(str(where))
    from kvlab.traces.sources.otlp_files import OtlpFileSource

    return OtlpFileSource(Path(where))


__all__ = ["TraceSource", "open_source"]
