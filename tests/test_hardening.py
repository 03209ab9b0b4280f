"""Hostile and malformed requests against the simulator and the gateway in front of it (subprocesses):
every answer is vLLM's JSON error with a 4xx status, never a 500 or aiohttp's plain text; slow
clients are cut off by timeouts; both processes keep serving."""

from __future__ import annotations

import json
import socket
import time

import pytest

from edge import raw_request, sim_and_gateway

pytestmark = pytest.mark.processes   # starts servers: not in `make test-fast`

CHAT = "/v1/chat/completions"
DEEP = 100_000

# (name, path, body, extra headers, expected status)
BAD = [
    ("deeply nested arrays", CHAT, b'{"messages": ' + b"[" * DEEP + b"]" * DEEP + b"}", {}, 400),
    ("deeply nested prompt", "/v1/completions", b'{"prompt": ' + b"[" * 500 + b"1" + b"]" * 500 + b"}", {}, 400),
    ("deeply nested objects", CHAT, b'{"a":' * 5000 + b"1" + b"}" * 5000, {}, 400),
    ("invalid UTF-8 in a string", CHAT, b'{"messages": [{"role": "user", "content": "caf\xc3\x28 \xff"}]}', {}, 400),
    ("lone surrogate escape", "/v1/completions", b'{"prompt": "\\ud800"}', {}, 400),
    ("not an object", "/v1/completions", b"[1, 2, 3]", {}, 400),
    ("a bare string", "/v1/completions", b'"hello"', {}, 400),
    ("empty body", "/v1/completions", b"", {}, 400),
    ("truncated", "/v1/completions", b'{"prompt": "x', {}, 400),
    ("NaN", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', {}, 400),
    ("huge float", "/v1/completions", b'{"prompt": "x", "temperature": 1e999}', {}, 400),
    ("huge integer", "/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", {}, 400),
    ("big token id", "/v1/completions", b'{"prompt": [1, 123456789012345678901234567890]}', {}, 400),
    ("negative token id", "/v1/completions", b'{"prompt": [1, -5]}', {}, 400),
    ("wrong content type", "/v1/completions", b'{"prompt": "x"}', {"Content-Type": "text/plain"}, 400),
    ("form content type", CHAT, b"a=1", {"Content-Type": "application/x-www-form-urlencoded"}, 400),
    ("stream not a bool", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', {}, 400),
    ("unknown route", "/v1/nothing", b"{}", {}, 404),
    ("wrong method", "/v1/completions", b"", {}, 405),
]


@pytest.fixture(scope="module")
def stack():
    with sim_and_gateway("--time-scale", "0.01", config={"timeouts": {"client_idle_s": 1.0, "client_body_s": 1.0},
                                                         "limits": {"max_body_bytes": 1_000_000}}) as s:
        yield s


@pytest.mark.parametrize("target", ["gateway", "sim"])
@pytest.mark.parametrize("name,path,body,headers,status", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_json_4xx(stack, target, name, path, body, headers, status):
    port = stack.gateway_port if target == "gateway" else stack.sim_port
    method = "GET" if name == "wrong method" else "POST"
    r = raw_request(port, method, path, body, headers)
    assert r.status == status, (r.status, r.body[:300])
    r.error()
    if status == 405:
        assert "POST" in r.headers.get("allow", "")
    assert stack.gateway.poll() is None and stack.sim.poll() is None


@pytest.mark.parametrize("target", ["gateway", "sim"])
def test_duplicate_keys_keep_the_last_value_as_vllm_does(stack, target):
    port = stack.gateway_port if target == "gateway" else stack.sim_port
    r = raw_request(port, "POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": -1, "max_tokens": 2}')
    assert r.status == 200, r.body
    assert json.loads(r.body)["usage"]["completion_tokens"] == 2


def test_body_over_the_limit_is_413(stack):
    big = json.dumps({"prompt": "x" * 1_100_000}).encode()
    r = raw_request(stack.gateway_port, "POST", "/v1/completions", big)
    assert r.status == 413
    assert "exceeds" in r.error()["message"]


def test_slowloris_headers_are_cut_off(stack):
    """A client that trickles its headers is disconnected after client_idle_s (1 s here)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", stack.gateway_port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        closed = False
        for _ in range(20):
            try:
                s.sendall(b"X-Slow: 1\r\n")
                if s.recv(1, socket.MSG_DONTWAIT) == b"":
                    closed = True
                    break
            except BlockingIOError:
                pass
            except OSError:
                closed = True
                break
            time.sleep(0.25)
    assert closed and time.monotonic() - t0 < 3.0


def test_slow_body_is_bounded_by_the_body_timeout(stack):
    """Headers complete, body never arrives: 408 after client_body_s (1 s here)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", stack.gateway_port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"pro")
        data = s.recv(65536)
    assert data.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 3.0
    assert b'"code":408' in data
