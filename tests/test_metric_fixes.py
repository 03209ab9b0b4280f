"""Metric semantics (issue 21): KV-cache usage of a multi-engine replica is a mean, not a sum; the
renamed `kvlab_gateway_kv_transfer_seconds` is still exposed under its deprecated old name; the
gateway exposes the KV-event feed state and the replica count its recommendation counted."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from conftest import FakeHandler, http_server
from kvlab.gateway.loadview import parse_metrics
from kvlab.gateway.metrics import GatewayMetrics
from kvlab.telemetry import names as n

# a vLLM /metrics page of a replica with two engine cores (data-parallel size 2), trimmed
TWO_ENGINES = f"""\
# HELP {n.VLLM_NUM_REQUESTS_WAITING} Number of requests waiting to be processed.
# TYPE {n.VLLM_NUM_REQUESTS_WAITING} gauge
{n.VLLM_NUM_REQUESTS_WAITING}{{engine="0",model_name="m"}} 3.0
{n.VLLM_NUM_REQUESTS_WAITING}{{engine="1",model_name="m"}} 1.0
# HELP {n.VLLM_NUM_REQUESTS_RUNNING} Number of requests in model execution batches.
# TYPE {n.VLLM_NUM_REQUESTS_RUNNING} gauge
{n.VLLM_NUM_REQUESTS_RUNNING}{{engine="0",model_name="m"}} 4.0
{n.VLLM_NUM_REQUESTS_RUNNING}{{engine="1",model_name="m"}} 2.0
# HELP {n.VLLM_KV_CACHE_USAGE} KV-cache usage. 1 means 100 percent usage.
# TYPE {n.VLLM_KV_CACHE_USAGE} gauge
{n.VLLM_KV_CACHE_USAGE}{{engine="0",model_name="m"}} 0.9
{n.VLLM_KV_CACHE_USAGE}{{engine="1",model_name="m"}} 0.5
"""


def test_kv_usage_of_a_multi_engine_replica_is_the_mean():
    parsed = parse_metrics(TWO_ENGINES)
    assert parsed["waiting"] == 4.0 and parsed["running"] == 6.0      # work adds up
    assert parsed["kv_usage"] == 0.7                                     # fractions average
    assert "kv_usage" not in parse_metrics("")


def test_notebook_replica_metrics_average_kv_usage_too():
    from kvlab.contract import Endpoint
    from kvlab.notebook import replica_metrics
    from kvlab.stack.base import StackInfo

    class Replica(FakeHandler):
        def do_GET(self):
            self.reply(200, TWO_ENGINES.encode(), "text/plain; version=0.0.4")

    with http_server(Replica) as url:
        stack = StackInfo(id="run", run_dir="run", replicas=[Endpoint(name="vllm-0", url=url)])
        values = replica_metrics(stack)["vllm-0"]
    assert (values["waiting"], values["running"], values["kv_usage"]) == (4.0, 6.0, 0.7)


def _families(metrics: GatewayMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}


def test_renamed_metric_keeps_its_deprecated_alias():
    metrics = GatewayMetrics(list)
    for seconds in (0.002, 0.02, 0.3):
        metrics.kv_transfer.observe(seconds)
    families = _families(metrics)
    assert n.KVLAB_KV_TRANSFER_SECONDS == "kvlab_gateway_kv_transfer_seconds"
    assert n.KVLAB_DEPRECATED_ALIASES == {"kvlab_kv_transfer_seconds": n.KVLAB_KV_TRANSFER_SECONDS}
    new, old = families[n.KVLAB_KV_TRANSFER_SECONDS], families["kvlab_kv_transfer_seconds"]
    assert old.type == new.type == "histogram" and old.documentation.startswith("DEPRECATED: renamed to")
    strip = len("kvlab_gateway_")
    assert [(s.name[strip:], s.labels, s.value) for s in new.samples] == \
           [(s.name[len("kvlab_"):], s.labels, s.value) for s in old.samples]
    count = next(s.value for s in old.samples if s.name == "kvlab_kv_transfer_seconds_count")
    assert count == 3.0
    # every kvlab gateway metric now carries the kvlab_gateway_ prefix (aliases excepted)
    assert all(name.startswith(("kvlab_gateway_", *n.KVLAB_DEPRECATED_ALIASES)) for name in families)


def test_kv_events_state_and_current_replicas():
    metrics = GatewayMetrics(lambda: [("sim-0", 1, True, 10, 2, "live"), ("sim-1", 0, False, 0, 5, "stale")])
    metrics.current_replicas.set(1)
    families = _families(metrics)
    states = {(s.labels["replica"], s.labels["state"]): s.value for s in families[n.KVLAB_KV_EVENTS_STATE].samples}
    assert {k for k, v in states.items() if v == 1.0} == {("sim-0", "live"), ("sim-1", "stale")}
    assert len(states) == 8                                              # every state of every replica
    assert families[n.KVLAB_CURRENT_REPLICAS].samples[0].value == 1.0
