"""Faults the gateway must survive, against real `kvlab engine sim` and `kvlab gateway` subprocesses.

- a client that drops its connection (mid-stream or before the first byte): the gateway aborts the
  upstream request, so the engine's running count, the gateway's in-flight count and the scorers'
  in-flight tokens are back to 0 within 1 s; the simulator alone aborts it the same way;
- a replica SIGKILLed under streaming load: no request fails, its streams are resumed intact;
- a replica that accepts and never answers: bounded by the first-byte timeout, retried elsewhere;
- a trace backend that black-holes (accepts, never answers): serving unaffected.
The figures in docs/reliability.md come from `python benchmarks/faults.py`, which runs these
scenarios at a larger size and prints them.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from edge import raw_request, sim_and_gateway
from kvlab.scenarios.faults import drop_client, scrape

pytestmark = pytest.mark.slow


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def _sim_running(port: int) -> float:
    return scrape(f"http://127.0.0.1:{port}", "vllm:num_requests_running")


def _gateway_inflight(port: int) -> tuple[int, int]:
    """(requests in flight, scorer in-flight tokens) summed over the gateway's replicas."""
    reps = json.loads(_get(f"http://127.0.0.1:{port}/debug/endpoints"))["replicas"]
    return (sum(r["load"]["inflight"] for r in reps), sum(r["load"]["inflight_tokens"] for r in reps))


def _wait_until(cond, timeout_s: float) -> float | None:
    """Seconds until `cond()` held (polled every 20 ms), or None if it did not within `timeout_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.02)
    return None


LONG = {"prompt": "tell me a long story", "max_tokens": 1500, "ignore_eos": True}


@pytest.fixture(scope="module")
def stack():
    with sim_and_gateway("--time-scale", "1", "--max-model-len", "4096") as s:
        yield s


@pytest.mark.parametrize("target", ["gateway", "sim"])
@pytest.mark.parametrize("mode", ["mid-stream", "before-first-byte"])
def test_client_disconnect_aborts_the_engine_request(stack, target, mode):
    port = stack.gateway_port if target == "gateway" else stack.sim_port
    body = {**LONG, "stream": mode == "mid-stream"}
    drop_client(f"http://127.0.0.1:{port}", body, read_bytes=600 if mode == "mid-stream" else 0)
    t0 = time.monotonic()
    assert _wait_until(lambda: _sim_running(stack.sim_port) == 0, 1.0) is not None, "the engine kept generating"
    if target == "gateway":
        assert _wait_until(lambda: _gateway_inflight(port) == (0, 0), 1.0 - (time.monotonic() - t0)) is not None
    r = raw_request(port, "POST", "/v1/completions", b'{"prompt": "next", "max_tokens": 2}')
    assert r.status == 200


def test_replica_sigkill_under_streaming_load(tmp_path):
    """Streams on the killed replica are resumed on the survivor: none fails, each resumed text is
    the simulator's text up to the kill and then max_tokens words in all, one id, one finish."""
    from kvlab.scenarios.faults import sigkill_under_load
    res = sigkill_under_load(tmp_path, streams=16)
    assert res["inflight_on_killed"] > 0
    assert res["failed"] == 0, res
    assert res["resumed"] >= res["inflight_on_killed"] and res["resumed_streams_ok"] > 0, res
    assert res["resumed_intact"] == res["resumed_streams_ok"], res
    assert res["failed_after_1s"] == 0 and res["ok_after_1s"] > 0, res


def test_hung_replica_is_bounded_by_the_first_byte_timeout_and_retried(tmp_path):
    from kvlab.scenarios.faults import hung_replica
    res = hung_replica(tmp_path, requests=8, first_byte_s=1.0)
    assert res["ok"] == res["requests"], res
    assert res["routed_to_hung"] > 0, res
    assert res["max_latency_s"] < 1.0 + 1.0, res


def test_black_holed_trace_backend_does_not_touch_serving(tmp_path):
    from kvlab.scenarios.faults import trace_backend_black_hole
    res = trace_backend_black_hole(tmp_path, requests=100)
    assert res["errors"] == 0, res
    assert res["p50_ms_black_hole"] < 3 * res["p50_ms_no_traces"] + 20, res


def test_many_concurrent_streams_through_one_gateway(tmp_path):
    """200 streams at once here (1,000 in benchmarks/faults.py): no errors, all in flight together."""
    from kvlab.scenarios.faults import open_streams
    res = open_streams(tmp_path, streams=200, max_tokens=200)
    assert res["errors"] == 0, res
    assert res["peak_inflight"] >= 150, res
