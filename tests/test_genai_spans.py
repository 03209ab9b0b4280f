"""The spans of a real lab run follow the OpenTelemetry GenAI semantic conventions and carry
llm-d's and vLLM's names where they are the same step.

The session's `kvlab lab --quick` (conftest.quick_lab: simulated replicas, the gateway, real Locust
users, the OTLP sink) writes its spans; read back from the sink's files, every GenAI span — the
Locust user's, the gateway's request and upstream call, the replica's — must carry the required and
recommended attributes (open-telemetry/semantic-conventions-genai docs/gen-ai/gen-ai-spans.md,
inference span), the client's and the upstream call's be named `{gen_ai.operation.name}
{gen_ai.request.model}`, the gateway's request be llm-d's `gateway.request_orchestration` and the
replica's vLLM's `llm_request`; and no span may still carry a kvlab.* name the conventions now
define. The gateway's schedule has llm-d's shape (one `llm_d.epp.scorer.<type>` per scorer of the
policy) and the simulator's `llm_request` vLLM's latency attributes.
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
            named = role if role in (n.SPAN_GATEWAY_REQUEST, n.SPAN_ENGINE_REQUEST) else f"{op} {requested}"
            assert s.name == named, (role, s.name)
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


def test_llm_d_and_vllm_shapes_of_a_lab_run(run: Path):
    traces = OtlpFileSource(run / "traces").traces()
    spans = [s for t in traces for s in t]
    by_id = {s.span_id: s for s in spans}
    scoring = [s for s in spans if s.name == n.SPAN_SCORING]
    assert scoring
    for sc in scoring:
        parent = by_id.get(sc.parent_id or "")
        assert parent is not None and parent.name == n.SPAN_SCHEDULE
        scorers = [s for s in spans if s.parent_id == sc.span_id]
        assert len(scorers) == sc.attr(n.LLMD_SCORER_COUNT) > 1
        assert all(s.name == n.SPAN_SCORER_PREFIX + s.attr(n.LLMD_SCORER_TYPE) for s in scorers)
        assert all(0 <= s.attr(n.LLMD_SCORER_SCORE_MAX) <= 1 for s in scorers)
    schedule = next(s for s in spans if s.name == n.SPAN_SCHEDULE)
    assert by_id[schedule.parent_id or ""].name == n.SPAN_GATEWAY_REQUEST
    children = {s.name for s in spans if s.parent_id == schedule.span_id}
    assert {n.SPAN_INDEX_LOOKUP, n.SPAN_FILTER, n.SPAN_SCORING, n.SPAN_PICK} <= children
    engines = [s for s in spans if s.name == n.SPAN_ENGINE_REQUEST and s.status != "error"]
    assert engines and all(s.kind == "server" for s in engines)
    for s in engines:
        queue, prefill = s.attr(n.VLLM_LATENCY_QUEUE), s.attr(n.VLLM_LATENCY_PREFILL)
        assert isinstance(queue, float) and queue >= 0 and isinstance(prefill, float) and prefill > 0, s.attributes
        assert s.attr(n.VLLM_USAGE_PROMPT_TOKENS) == s.attr(n.GEN_AI_USAGE_INPUT_TOKENS)
        assert s.attr(n.VLLM_LATENCY_TTFT) <= s.attr(n.VLLM_LATENCY_E2E) <= s.duration_ms / 1000 + 1e-3
