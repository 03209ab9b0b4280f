"""The spans of a real lab run follow the OpenTelemetry GenAI semantic conventions.

The session's `kvlab lab --quick` (conftest.quick_lab: simulated replicas, the gateway, real Locust
users, the OTLP sink) writes its spans; read back from the sink's files, every GenAI span — the Locust user's, the gateway's
request and upstream call, the replica's — must be named `{gen_ai.operation.name}
{gen_ai.request.model}` and carry the required and recommended attributes
(open-telemetry/semantic-conventions-genai docs/gen-ai/gen-ai-spans.md, inference span), and no
span may still carry a kvlab.* name the conventions now define.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import QuickLab
from kvlab.stack.base import read_info
from kvlab.telemetry import names as n
from kvlab.traces.sources.otlp_files import OtlpFileSource

pytestmark = pytest.mark.slow

GENAI_ROLES = (n.SPAN_CLIENT_REQUEST, n.SPAN_GATEWAY_REQUEST, n.SPAN_UPSTREAM, n.SPAN_ENGINE_REQUEST)
REPLACED = ("kvlab.stream", "kvlab.prefix.delivered_tokens", "kvlab.client.ttft_ms", "gen_ai.system")


@pytest.fixture(scope="module")
def run(quick_lab: QuickLab) -> Path:
    assert quick_lab.returncode == 0, (quick_lab.stdout + quick_lab.stderr)[-5000:]
    return Path(quick_lab.run_dir)


def test_genai_spans_of_a_lab_run(run: Path):
    traces = OtlpFileSource(run / "traces").traces()
    info = read_info(run)
    model = info.model if info is not None else None
    spans = [s for t in traces for s in t]
    by_role = {role: [s for s in spans if s.role == role] for role in GENAI_ROLES}
    assert all(by_role.values()), {r: len(v) for r, v in by_role.items()}
    for role, found in by_role.items():
        for s in found:
            a = s.attributes
            op, requested = a.get(n.GEN_AI_OPERATION_NAME), a.get(n.GEN_AI_REQUEST_MODEL)
            assert op in ("chat", "text_completion"), (role, a)
            assert a.get(n.GEN_AI_PROVIDER_NAME) == n.GEN_AI_PROVIDER_VLLM, (role, a)
            assert isinstance(requested, str) and requested and (model is None or requested == model)
            assert s.name == f"{op} {requested}", (role, s.name)
            assert isinstance(a.get(n.SERVER_ADDRESS), str) and a[n.SERVER_ADDRESS], (role, a)
            assert isinstance(a.get(n.SERVER_PORT), int) and a[n.SERVER_PORT] > 0, (role, a)
            assert s.kind == ("server" if role in (n.SPAN_GATEWAY_REQUEST, n.SPAN_ENGINE_REQUEST) else "client")
        ok = [s for s in found if s.status != "error"]
        assert ok, role
        for s in ok:
            if role != n.SPAN_UPSTREAM:
                assert s.attributes.get(n.GEN_AI_REQUEST_STREAM) is True, (role, s.attributes)   # Locust streams
                assert isinstance(s.attributes.get(n.GEN_AI_USAGE_INPUT_TOKENS), int), role
                assert isinstance(s.attributes.get(n.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS), int), role
                assert 0 < s.attributes[n.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] < s.duration_ms / 1000 + 1e-3, role
    # the replica a gateway called is the server its upstream span names
    up = by_role[n.SPAN_UPSTREAM][0]
    engine = next(s for s in by_role[n.SPAN_ENGINE_REQUEST] if s.parent_id == up.span_id)
    assert (up.attributes[n.SERVER_ADDRESS], up.attributes[n.SERVER_PORT]) == \
           (engine.attributes[n.SERVER_ADDRESS], engine.attributes[n.SERVER_PORT])
    for s in spans:
        assert not set(REPLACED) & set(s.attributes), (s.name, s.attributes)
