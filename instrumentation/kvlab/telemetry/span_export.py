"""Span export in a child process: the serving process only packs finished spans.

The SDK's BatchSpanProcessor encodes OTLP in a thread of the serving process. In CPython that
thread holds the GIL for ~50 µs per span (protobuf objects built in Python), so at saturation it
competes with the event loop it is meant to spare: at 100 % sampling the gateway lost two thirds
of its throughput (docs/benchmarks.md, "Tracing cost"). `SpanRelay` instead turns each sampled
span into a plain tuple (a few µs), sends batches as one msgpack message down a pipe from a
background thread (C encode, GIL released while writing), and a spawned child runs the same
exporters (every OTEL_EXPORTER_* and OTEL_BSP_* variable applies there: it inherits the
environment). The SDK's OTLP/HTTP exporter, the lab's default, gets request bytes written by
`kvlab.telemetry.otlp.OtlpEncoder` (6x cheaper than the SDK's protobuf objects); any other
exporter gets rebuilt spans through the SDK's own BatchSpanProcessor.

Back-pressure never reaches a request: the pending list is bounded (OTEL_BSP_MAX_QUEUE_SIZE,
overflow dropped and counted), and only the sender thread can block on a full pipe. A dead child
costs the spans, once logged, never the process.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import threading
from importlib.metadata import entry_points
from multiprocessing.connection import Connection
from typing import Any

import msgspec
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter

from kvlab.telemetry.packed import Packed, pack, unpack

log = logging.getLogger(__name__)

_FLUSH = b"F"     # control messages; a span batch is a msgpack array, never one of these bytes
_STOP = b"S"


def _env_number(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


class _BytesExport:
    """The SDK's OTLP/HTTP exporter fed request bytes from `OtlpEncoder` on a thread of its own:
    its endpoint, headers, compression, timeout and retries (every OTEL_EXPORTER_OTLP_* variable)
    apply unchanged, only the SDK's per-span protobuf objects are skipped. A slow or dead
    collector fills the bounded queue (OTEL_BSP_MAX_QUEUE_SIZE spans' worth of batches), and
    later batches are dropped as the BatchSpanProcessor drops them, never blocking the pipe."""

    def __init__(self, exporter: Any) -> None:
        self._exporter = exporter
        max_batches = max(1, int(_env_number("OTEL_BSP_MAX_QUEUE_SIZE", 2048)
                                 // _env_number("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512)))
        self._queue: queue.Queue[bytes | None] = queue.Queue(max_batches)
        self._dropped = 0
        self._thread = threading.Thread(target=self._run, name="kvlab-otlp-bytes", daemon=True)
        self._thread.start()

    @staticmethod
    def accepts(exporter: Any) -> bool:
        """Whether `exporter` is the SDK's OTLP/HTTP span exporter with the client this relies
        on (a private attribute of opentelemetry-exporter-otlp-proto-http; tests pin it)."""
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        client = getattr(exporter, "_client", None)
        return type(exporter) is OTLPSpanExporter and callable(getattr(client, "export", None))

    def put(self, request: bytes) -> None:
        try:
            self._queue.put_nowait(request)
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1:
                log.warning("OTLP export is behind; span batches are dropped")

    def _run(self) -> None:
        while (request := self._queue.get()) is not None:
            try:
                result = self._exporter._client.export(request)
                if not result.success:
                    log.warning("OTLP span export failed: %s", result.reason or result.error)
            except Exception as exc:  # telemetry never breaks the caller
                log.warning("OTLP span export failed: %s", exc)
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def force_flush(self) -> None:
        self._queue.join()

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._exporter.shutdown()


def build_exporter(name: str) -> SpanExporter:
    """The installed exporter of that entry-point name, configured from the environment."""
    found = list(entry_points(group="opentelemetry_traces_exporter", name=name))
    if not found:
        raise LookupError(f"no trace exporter named {name!r} is installed")
    exporter: SpanExporter = found[0].load()()   # each reads its endpoint, headers, timeout... from OTEL_* itself
    return exporter


def _child_main(conn: Connection, exporter_names: list[str], resource_attrs: dict[str, Any]) -> None:
    """The exporting process: OTLP/HTTP exporters get request bytes from `OtlpEncoder`, any other
    exporter rebuilt spans through the SDK's batch processor."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from kvlab.lifecycle import settle_gc
    from kvlab.telemetry.otlp import OtlpEncoder

    # A stack stops a server by SIGTERM to its process group, this child included; the server then
    # sends its last spans here. So this child ignores the signal and ends when the pipe does.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)

    resource = Resource(resource_attrs)
    limits = SpanLimits()
    processors: list[BatchSpanProcessor] = []
    byte_exports: list[_BytesExport] = []
    for name in exporter_names:
        try:
            exporter = build_exporter(name)
            if _BytesExport.accepts(exporter):
                byte_exports.append(_BytesExport(exporter))
            else:
                processors.append(BatchSpanProcessor(exporter))
        except Exception as exc:  # telemetry never breaks the caller
            log.warning("trace exporter %s disabled: %s", name, exc)
    encoder = OtlpEncoder(resource, limits) if byte_exports else None
    decoder = msgspec.msgpack.Decoder()
    settle_gc()   # it allocates per span, as a server does per request
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            break   # the serving process is gone
        if msg == _STOP:
            break
        if msg == _FLUSH:
            for export in byte_exports:
                export.force_flush()
            for proc in processors:
                proc.force_flush()
            conn.send_bytes(_FLUSH)
            continue
        batch = decoder.decode(msg)
        if encoder is not None:
            try:
                request = encoder.encode(batch)
            except Exception as exc:  # what OTLP cannot carry costs that batch, as in the SDK
                log.warning("dropped %d spans: %s", len(batch), exc)
            else:
                for export in byte_exports:
                    export.put(request)
        for packed in batch if processors else ():
            span = unpack(packed, resource, limits)
            for proc in processors:
                proc.on_end(span)
    for export in byte_exports:
        export.shutdown()
    for proc in processors:
        proc.shutdown()  # type: ignore[no-untyped-call]  # opentelemetry-sdk leaves it unannotated


class SpanRelay(SpanProcessor):
    """A SpanProcessor that exports through a child process (see the module docstring)."""

    def __init__(self, exporter_names: list[str], resource: Resource) -> None:
        ctx = multiprocessing.get_context("spawn")   # no fork of a process with threads and a loop
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child_main, name="kvlab-span-export", daemon=True,
                                 args=(child, exporter_names, dict(resource.attributes)))
        self._proc.start()
        child.close()
        self._pending: list[Packed] = []
        self._max_queue = int(_env_number("OTEL_BSP_MAX_QUEUE_SIZE", 2048))
        self._delay_s = _env_number("OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000
        self._batch = int(_env_number("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512))
        self.dropped = 0
        self._send_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self._broken = False
        self._encoder = msgspec.msgpack.Encoder()
        self._thread = threading.Thread(target=self._run, name="kvlab-span-relay", daemon=True)
        self._thread.start()

    def on_start(self, span: Any, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if span.context.trace_flags.sampled:
            self.add(pack(span))

    def add(self, packed: Packed) -> None:
        """Queue one sampled span in `pack`'s format (kvlab.telemetry.recorder's spans come here)."""
        if self._stopped:
            return
        if len(self._pending) >= self._max_queue:
            self.dropped += 1
            return
        self._pending.append(packed)
        if len(self._pending) >= self._batch and not self._wake.is_set():
            self._wake.set()

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait(self._delay_s)
            self._wake.clear()
            self._send()

    def _send(self) -> bool:
        """Ship what is pending; False once the child is unreachable."""
        with self._send_lock:
            batch, self._pending = self._pending, []
            if not batch or self._broken:
                return not self._broken
            try:
                message = self._encoder.encode(batch)
            except (TypeError, OverflowError) as exc:   # an attribute value OTLP cannot carry either
                log.warning("dropped %d spans: %s", len(batch), exc)
                return True
            try:
                self._conn.send_bytes(message)
            except (OSError, ValueError) as exc:
                self._broken = True
                log.warning("span export process gone (%s); spans are dropped from now on", exc)
            return not self._broken

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        if not self._send():
            return False
        with self._send_lock:
            try:
                self._conn.send_bytes(_FLUSH)
                while self._conn.poll(timeout_millis / 1000):
                    if self._conn.recv_bytes() == _FLUSH:
                        return True
            except (OSError, EOFError, ValueError):
                self._broken = True
        return False

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._send()
        self._stopped = True
        self._wake.set()
        self._thread.join(5)
        with self._send_lock:
            try:
                self._conn.send_bytes(_STOP)
            except (OSError, ValueError):
                pass
        self._proc.join(30)   # the child's processors flush, bounded by their own timeouts
        if self._proc.is_alive():
            self._proc.kill()
        self._conn.close()
