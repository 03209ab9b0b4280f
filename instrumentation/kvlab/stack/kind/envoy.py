"""Envoy's static bootstrap for the standalone Inference Extension data plane (no gateway controller).

The layout of the Inference Extension's standalone chart: Envoy and the endpoint picker in one
pod; Envoy's `ext_proc` HTTP filter sends every request to the picker on localhost over gRPC
(full-duplex streamed bodies both ways, so the picker sees the prompt before the route is taken),
and the only upstream cluster is an ORIGINAL_DST cluster whose host is read from the
`x-gateway-destination-endpoint` request header the picker set. The picker's gRPC health service
gates the ext_proc cluster. Checked against Envoy's own protobuf schema (xds-protos) in the tests.
"""

from __future__ import annotations

from typing import Any

from kvlab.epp import DESTINATION_HEADER, SERVICE_NAME

LISTEN_PORT = 8081          # the data plane's HTTP port (what clients and the NodePort reach)
READY_PORT = 19001          # /ready and /stats/prometheus
ADMIN_PORT = 19000          # loopback only
EPP_PORT = 9002             # the picker's ext_proc gRPC port (the protocol's default)

_T = "type.googleapis.com/envoy."


def _socket(address: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": address, "port_value": port}}


def _static_cluster(name: str, port: int, **extra: Any) -> dict[str, Any]:
    return {"name": name, "type": "STATIC", "connect_timeout": "1s",
            "load_assignment": {"cluster_name": name, "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": _socket("127.0.0.1", port)}}]}]}, **extra}


def _hcm(prefix: str, routes: list[dict[str, Any]], filters: list[dict[str, Any]]) -> dict[str, Any]:
    return {"name": "envoy.filters.network.http_connection_manager", "typed_config": {
        "@type": _T + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": prefix,
        "route_config": {"name": prefix, "virtual_hosts": [{"name": prefix, "domains": ["*"], "routes": routes}]},
        "http_filters": [*filters, {"name": "envoy.filters.http.router", "typed_config": {
            "@type": _T + "extensions.filters.http.router.v3.Router", "suppress_envoy_headers": True}}],
    }}


def bootstrap(epp_port: int = EPP_PORT, listen_port: int = LISTEN_PORT,
              message_timeout_s: int = 1000) -> dict[str, Any]:
    """The whole Envoy config as a dict (written as YAML into a ConfigMap)."""
    ext_proc = {"name": "envoy.filters.http.ext_proc", "typed_config": {
        "@type": _T + "extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "ext_proc"}, "timeout": "10s"},
        # the picker needs the body to pick; it answers the headers once the body is in
        "processing_mode": {"request_header_mode": "SEND", "response_header_mode": "SEND",
                            "request_body_mode": "FULL_DUPLEX_STREAMED",
                            "response_body_mode": "FULL_DUPLEX_STREAMED",
                            "request_trailer_mode": "SEND", "response_trailer_mode": "SEND"},
        "message_timeout": f"{message_timeout_s}s",
        "failure_mode_allow": False,     # FailClose, the InferencePool default
    }}
    inference = _hcm("inference", [{"match": {"prefix": "/"}, "route": {
        "cluster": "original_destination_cluster", "timeout": "86400s", "idle_timeout": "86400s"}}], [ext_proc])
    ready = _hcm("ready", [{"match": {"prefix": "/stats/prometheus"}, "route": {"cluster": "admin"}}], [
        {"name": "envoy.filters.http.health_check", "typed_config": {
            "@type": _T + "extensions.filters.http.health_check.v3.HealthCheck", "pass_through_mode": False,
            "headers": [{"name": ":path", "string_match": {"exact": "/ready"}}]}}])
    return {
        "admin": {"address": _socket("127.0.0.1", ADMIN_PORT)},
        "static_resources": {
            "listeners": [
                {"name": "inference", "address": _socket("0.0.0.0", listen_port),
                 "filter_chains": [{"filters": [inference]}]},
                {"name": "ready", "address": _socket("0.0.0.0", READY_PORT), "filter_chains": [{"filters": [ready]}]},
            ],
            "clusters": [
                {"name": "original_destination_cluster", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                 "connect_timeout": "10s",
                 "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER}},
                _static_cluster("ext_proc", epp_port, typed_extension_protocol_options={
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": _T + "extensions.upstreams.http.v3.HttpProtocolOptions",
                        "explicit_http_config": {"http2_protocol_options": {}}}},
                    health_checks=[{"timeout": "2s", "interval": "5s", "unhealthy_threshold": 3,
                                    "healthy_threshold": 1, "grpc_health_check": {"service_name": SERVICE_NAME}}]),
                _static_cluster("admin", ADMIN_PORT),
            ],
        },
    }
