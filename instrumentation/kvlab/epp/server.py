"""The EPP's gRPC server: Envoy's ExternalProcessor service plus the gRPC health services.

One `Gateway` object is the scheduler (bridge.py); it runs its discovery, load view and KV-event
feeds through its own aiohttp app, served on the metrics port (/metrics, /health, /debug/endpoints).
Health follows the protocol: `liveness` answers SERVING as soon as the process does; `readiness`
and the ext_proc service name once discovery has delivered endpoints.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import msgspec
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvlab.epp import SERVICE_NAME
from kvlab.epp import protocol as proto
from kvlab.epp.bridge import Bridge
from kvlab.epp.stream import Stream
from kvlab.errors import error_body

log = logging.getLogger("kvlab.epp")


class Processor:
    """One ext_proc stream per HTTP request; a failure answers that request, never the process."""

    def __init__(self, bridge: Bridge) -> None:
        self.bridge = bridge

    async def Process(self, request_iterator: AsyncIterator[ext_proc.ProcessingRequest],
                      context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[ext_proc.ProcessingResponse]:
        stream = Stream(self.bridge, self.bridge.gw.cfg.limits.max_body_bytes)
        try:
            async for req in request_iterator:
                try:
                    replies = await stream.on(req)
                except Exception as exc:
                    log.exception("ext_proc message failed")
                    body = error_body(f"endpoint picker failed: {type(exc).__name__}", "InternalServerError", 500)
                    yield proto.immediate(500, msgspec.json.encode(body))
                    return
                for out in replies:
                    yield out
        finally:
            stream.finish()     # the proxy closed the stream (client gone, request over)


async def set_health(h: health.aio.HealthServicer, ready: bool) -> None:
    await h.set("liveness", health_pb2.HealthCheckResponse.SERVING)
    status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", "readiness", SERVICE_NAME):
        await h.set(name, status)


def server(bridge: Bridge, h: health.aio.HealthServicer, host: str, port: int) -> grpc.aio.Server:
    srv = grpc.aio.server()
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(Processor(bridge), srv)
    health_pb2_grpc.add_HealthServicer_to_server(h, srv)
    if srv.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"cannot bind gRPC port {host}:{port}")
    return srv
