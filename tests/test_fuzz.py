"""Property-based fuzzing of the gateway and the simulator's HTTP edge (hypothesis).

Generated requests — arbitrary JSON values, near-valid OpenAI bodies with wild field values, raw
bytes, broken UTF-8, arbitrary paths, methods, content types and extra headers — go to a real
`kvlab gateway` in front of a real `kvlab engine sim` (subprocesses). For every one: no 5xx; every
error is vLLM's JSON error with `code` equal to the status. After the run: both processes alive and
serving, the gateway's memory growth bounded. FUZZ_EXAMPLES (default 2,500 per target, 5,000 in
all) sets the size; the run takes about half a minute on a quiet 2-core machine.
"""

from __future__ import annotations

import http.client
import json
import os
import time

import psutil
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from edge import Reply, sim_and_gateway

pytestmark = pytest.mark.slow
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "2500"))
RSS_GROWTH_MB = 64

_scalars = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
            | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40))
_json = st.recursive(_scalars, lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=10), c, max_size=5),
                     max_leaves=20)
_role = st.sampled_from(["user", "system", "assistant", "tool", ""]) | st.text(max_size=8)
_content = (st.text(max_size=60) | st.none() | st.integers()
            | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"])},
                                             optional={"text": st.text(max_size=30) | _scalars}), max_size=3))
_message = st.fixed_dictionaries({}, optional={"role": _role, "content": _content, "name": st.text(max_size=5)})
_generation = {
    "model": st.sampled_from(["kvlab-tiny", "other"]) | _scalars,
    "max_tokens": st.integers(min_value=-5, max_value=8) | st.integers() | _scalars,
    "stream": st.booleans() | _scalars,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | _scalars}) | _scalars,
    "temperature": st.floats(min_value=-1, max_value=3) | _scalars,
    "n": st.integers(min_value=0, max_value=3),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=2) | _scalars,
    "seed": st.integers() | _scalars,
    "min_tokens": st.integers(min_value=-2, max_value=10),
    "kv_transfer_params": _json,
}
_completion = st.fixed_dictionaries(
    {"prompt": st.text(max_size=80) | st.lists(st.integers(min_value=-10, max_value=2**40), max_size=20)
     | st.lists(st.text(max_size=10), max_size=3) | st.lists(st.lists(st.integers(0, 1000), max_size=5), max_size=2)
     | _json},
    optional=_generation)
_chat = st.fixed_dictionaries({"messages": st.lists(_message, max_size=4) | _json},
                              optional={**_generation, "max_completion_tokens": st.integers(-2, 8) | _scalars,
                                        "add_generation_prompt": _scalars})


def _corrupt(data: bytes, cut: int, junk: bytes) -> bytes:
    """Truncate or splice bytes (often invalid UTF-8) into an encoded body."""
    i = cut % (len(data) + 1)
    return data[:i] + junk + data[i:]


_body = st.one_of(
    _completion.map(lambda d: json.dumps(d).encode()),
    _chat.map(lambda d: json.dumps(d).encode()),
    _json.map(lambda d: json.dumps(d).encode()),
    st.tuples(_chat.map(lambda d: json.dumps(d).encode()), st.integers(0, 400),
              st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\\ud800", b"[" * 40, b"\x00", b""])
              ).map(lambda t: _corrupt(*t)),
    st.binary(max_size=200),
)
_path = st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/models",
                         "/health", "/metrics", "/reset_prefix_cache", "/v1/embeddings", "/v1/completions/",
                         "/%ff", "/v1/../v1/models", "/debug/endpoints"])
_method = st.sampled_from(["POST"] * 6 + ["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
_ctype = st.sampled_from(["application/json", "application/json; charset=utf-8", "APPLICATION/JSON", "text/plain",
                          "", "multipart/form-data; boundary=x", "application/x-ndjson"]) | st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=30)
_hname = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=20).map(lambda s: "x-" + s)
_hvalue = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=60)
_headers = st.dictionaries(_hname, _hvalue, max_size=4) | st.fixed_dictionaries(
    {"traceparent": _hvalue | st.just("00-" + "0" * 32 + "-" + "0" * 16 + "-01")})


class Client:
    """A keep-alive HTTP/1.1 connection that reconnects when the server closes it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.sent = 0

    def send(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> Reply:
        for attempt in range(2):
            try:
                self.conn.request(method, path, body=body, headers=headers)
                resp = self.conn.getresponse()
                data = resp.read()
                self.sent += 1
                if resp.will_close:
                    self.conn.close()
                return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, data)
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.conn.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def stack():
    with sim_and_gateway("--time-scale", "0.001", "--max-model-len", "2048") as s:
        yield s


def _check(reply: Reply, method: str) -> None:
    assert reply.status < 500, (reply.status, reply.body[:500])
    if reply.status >= 400 and method != "HEAD":
        reply.error()


@pytest.mark.parametrize("target", ["gateway", "sim"])
def test_no_input_gets_a_5xx(stack, target):
    port = stack.gateway_port if target == "gateway" else stack.sim_port
    proc = psutil.Process((stack.gateway if target == "gateway" else stack.sim).pid)
    client = Client(port)
    for i in range(200):   # warm up: tokenizer caches, connection pools, allocator arenas
        client.send("POST", "/v1/completions", json.dumps({"prompt": f"warm {i}", "max_tokens": 2}).encode(),
                    {"Content-Type": "application/json"})
    rss0 = proc.memory_info().rss
    t0 = time.monotonic()

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=False,
              phases=[Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))
    @given(method=_method, path=_path, body=_body, ctype=_ctype, headers=_headers)
    def fuzz(method, path, body, ctype, headers):
        hdrs = {**headers, "Content-Type": ctype} if ctype else dict(headers)
        _check(client.send(method, path, body if method not in ("GET", "HEAD") else b"", hdrs), method)

    fuzz()
    elapsed = time.monotonic() - t0
    growth_mb = (proc.memory_info().rss - rss0) / 2**20
    print(f"\n{target}: {client.sent} requests in {elapsed:.1f} s, RSS growth {growth_mb:.1f} MiB")
    assert client.sent - 200 >= EXAMPLES
    assert proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    ok = client.send("POST", "/v1/completions", b'{"prompt": "still serving", "max_tokens": 2}',
                     {"Content-Type": "application/json"})
    assert ok.status == 200, ok.body
    assert growth_mb < RSS_GROWTH_MB
