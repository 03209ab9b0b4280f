"""Prefill/decode disaggregation in the gateway: the split-or-unified decision (made in split.py,
which `kvlab twin` shares) and the prefill call.

The decode replica is chosen first, by the ordinary (KV-aware) scheduler over the decode and
`both` replicas. What it lacks of the prompt decides: when its uncached part reaches
`pd.threshold_tokens`, a prefill replica (chosen by the same scheduler over the prefill pool)
computes the prompt first and the decode replica pulls the KV; otherwise the decode replica serves
the request alone (unified). The calls follow vLLM's disaggregated-serving protocol as llm-d's
routing sidecar drives it (engine/sim/transfer.py describes it). The gateway orchestrates both
calls itself rather than through a sidecar: it already holds the decision, the trace and the
replicas' health, so one process decides, calls, falls back and records it (docs/pd.md).
A failed prefill call never fails the request: it is served unified, with a span event saying so.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import msgspec
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from kvlab.contract import answer_decoder
from kvlab.gateway import schedule_span
from kvlab.gateway.config import PDSettings
from kvlab.gateway.endpoints import Backend, Registry
from kvlab.gateway.exchange import Exchange
from kvlab.gateway.metrics import GatewayMetrics
from kvlab.gateway.router import Routed, Router
from kvlab.gateway.scheduler.base import Decision
from kvlab.gateway.split import SPLIT, PDPlan, plan_split, prefill_replicas
from kvlab.gateway.upstream import Attempt, Call, Failure, Upstream
from kvlab.telemetry import genai, names

FALLBACK = "fallback"

# what llm-d's sidecar sends to the prefill replica (NIXL protocol v2)
PREFILL_PARAMS: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


class Disaggregation:
    """The gateway's P/D step, between scheduling and the decode (upstream) call."""

    def __init__(self, settings: PDSettings, registry: Registry, router: Router, upstream: Upstream,
                 metrics: GatewayMetrics, tracer: trace.Tracer) -> None:
        self.settings, self.registry, self.router = settings, registry, router
        self.upstream, self.metrics, self.tracer = upstream, metrics, tracer

    def plan(self, tokens: list[int], routed: Routed) -> PDPlan | None:
        """The decision for a routed request, in its own span; None when P/D is off."""
        prefills = prefill_replicas(self.registry) if self.settings.enabled else None
        if prefills is None:
            return None
        with self.tracer.start_as_current_span(names.SPAN_PD_DECISION) as s:
            decode = routed.decision.chosen
            plan = plan_split(self.settings, self.router, prefills, tokens, routed)
            d = plan.prefill_decision
            if d is not None:
                self._prefill_profile(s, d)
                s.set_attribute(names.PD_PREFILL_REPLICA, d.chosen.name)
                s.set_attribute(names.PD_PREFILL_CANDIDATES, json.dumps([
                    {"replica": c.name, "prefix_tokens": c.prefix_tokens, "total": round(c.total, 4),
                     "inflight": c.replica.inflight, "waiting": c.replica.waiting} for c in d.candidates]))
            s.set_attributes({names.PD_DECISION: plan.decision, names.PD_REASON: plan.reason,
                              names.PD_UNCACHED_TOKENS: plan.uncached_tokens,
                              names.PD_THRESHOLD: self.settings.threshold_tokens,
                              names.PD_DECODE_REPLICA: decode.name, names.PROMPT_TOKENS: len(tokens),
                              names.PREFIX_PREDICTED_TOKENS: decode.prefix_tokens})
        with self.tracer.start_as_current_span(names.SPAN_PD_PREPARE) as s:
            s.set_attribute(names.LLMD_PD_USED, plan.decision == SPLIT)
            if plan.decision == SPLIT and d is not None:
                s.set_attribute(names.LLMD_PD_PREFILL_TARGET, _host_port(d.chosen.replica.url))
        self.metrics.pd_decisions.labels(plan.decision, plan.reason).inc()
        return plan

    def _prefill_profile(self, s: trace.Span, d: Decision) -> None:
        """The prefill pool's scheduling as llm-d's prefill profile run: `run_scheduler_profile`
        (profile `prefill`) with its filter, scorer and picker spans, under `pick_disagg_profile`."""
        if d.phases is None or not s.is_recording():
            return
        run = self.tracer.start_span(names.SPAN_SCHEDULE, context=trace.set_span_in_context(s),
                                     start_time=d.phases.filter_start,
                                     attributes={names.LLMD_PROFILE_NAME: names.PROFILE_PREFILL,
                                                 names.SCHEDULE_CHOSEN: d.chosen.name})
        schedule_span.steps(self.tracer, trace.set_span_in_context(run), d, self.router.ranker)
        run.end(end_time=d.phases.end)

    async def run(self, ex: Exchange) -> bool:
        """Decide; when splitting, prefill and put the returned kv_transfer_params in the payload.
        True when the request was prefilled elsewhere (the call that follows is a decode call)."""
        assert ex.routed is not None
        plan = self.plan(ex.tokens, ex.routed)
        if plan is None:
            return False
        ex.span.set_attribute(names.PD_DECISION, plan.decision)
        ex.span.set_attribute(names.PD_REASON, plan.reason)
        ex.facts[names.HEADER_PD_DECISION] = plan.decision
        if plan.decision != SPLIT:
            return False
        got = await self.prefill(ex, plan)
        if got is None:
            ex.facts[names.HEADER_PD_DECISION] = FALLBACK
            return False
        params, r = got
        ex.payload["kv_transfer_params"] = params
        ex.facts[names.HEADER_PREFILLED_BY] = r.name
        ex.span.set_attribute(names.PD_PREFILL_REPLICA, r.name)
        return True

    async def prefill(self, ex: Exchange, plan: PDPlan) -> tuple[dict[str, Any], Backend] | None:
        """Run the remote prefill (the same upstream calls, retries and bookkeeping as any request);
        the kv_transfer_params for the decode call and the prefill replica, or None after recording
        the fallback to unified serving on the request's span."""
        # one token, not streamed (llm-d's sidecar does the same); min_tokens would exceed max_tokens
        body = {k: v for k, v in ex.payload.items() if k not in ("stream_options", "min_tokens")}
        body.update(kv_transfer_params=PREFILL_PARAMS, stream=False, max_tokens=1)
        if ex.operation == "chat":
            body["max_completion_tokens"] = 1
        call = Call(names.SPAN_PREFILL_CALL, ex.path, msgspec.json.encode(body), primary=False,
                    error_label="prefill_", retry_timeouts=False)

        async def params(at: Attempt) -> tuple[dict[str, Any], Backend] | Failure:
            got = await self._params(at)
            ex.prefill_ns = (at.start_ns, time.time_ns())
            at.span.set_attributes({names.LLMD_PD_PREFILL_TARGET: _host_port(at.cand.replica.url),
                                    names.LLMD_PD_PREFILL_STATUS: at.resp.status,
                                    names.LLMD_PD_PREFILL_DURATION: (ex.prefill_ns[1] - at.start_ns) / 1e6})
            return got

        got = await self.upstream.call(ex, plan.prefill, call, params)
        if isinstance(got, Failure):
            ex.span.add_event(names.EVENT_PD_FALLBACK, {
                names.PD_REASON: f"prefill-{got.kind}", names.ERROR_TYPE: got.error,
                names.PD_PREFILL_REPLICA: got.replica.name if got.replica else ""})
            ex.span.set_attribute(names.PD_FALLBACK, True)
            self.metrics.pd_decisions.labels(FALLBACK, f"prefill-{got.kind}").inc()
            return None
        return got

    async def _params(self, at: Attempt) -> tuple[dict[str, Any], Backend] | Failure:
        r, ps = at.cand.replica, at.span
        kind, error = "status", f"{r.name} answered {at.resp.status}"
        try:
            raw = await at.resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            kind = "timeout" if isinstance(exc, asyncio.TimeoutError) else "body"
            error = f"{r.name}: {type(exc).__name__}: {exc}"
        else:
            if at.resp.status == 200:
                at.lease.first_token()      # max_tokens 1: the answer is the first token
                try:
                    answer = answer_decoder.decode(raw)
                except msgspec.DecodeError:
                    answer = None
                if answer is not None and answer.kv_transfer_params is not None:
                    ps.set_attribute(names.ENGINE_CACHED_TOKENS, answer.usage.cached_tokens if answer.usage else 0)
                    ps.set_attribute(names.KV_TRANSFER_OFFERED_TOKENS,
                                     _block_count(answer.kv_transfer_params.get("remote_block_ids"))
                                     * self.router.block_size(r))
                    return answer.kv_transfer_params, r
                kind, error = "no-kv-transfer-params", f"{r.name} returned no kv_transfer_params"
        ps.set_attribute(names.UPSTREAM_ERROR, kind)
        ps.set_status(Status(StatusCode.ERROR, error))
        self.metrics.upstream_errors.labels(r.name, f"prefill_{kind}").inc()
        return Failure(kind, error, r)

    @staticmethod
    def decoded(ex: Exchange, at: Attempt) -> None:
        """The decode leg is over: llm-d's P/D proxy timings on its span (pkg/sidecar/proxy/
        connector_nixlv2.go, the sequential connector): the decode's own duration and, end to end,
        the true TTFT (the request's start to the decode call's: routing, scheduling, prefill and
        coordination that the engines' own metrics miss), prefill, decode, total and the gap between
        prefill and decode. Milliseconds, as fractions (llm-d truncates to whole ones)."""
        if ex.prefill_ns is None or not at.span.is_recording():
            return
        now = time.time_ns()
        start = now - int((time.perf_counter() - ex.t_start) * 1e9)
        (p0, p1), d0 = ex.prefill_ns, at.start_ns
        at.span.set_attributes({names.LLMD_PD_DECODE_TARGET: _host_port(at.cand.replica.url),
                                names.LLMD_PD_DECODE_DURATION: (now - d0) / 1e6,
                                names.LLMD_PD_TOTAL_MS: (now - start) / 1e6,
                                names.LLMD_PD_TRUE_TTFT_MS: (d0 - start) / 1e6,
                                names.LLMD_PD_PREFILL_MS: (p1 - p0) / 1e6,
                                names.LLMD_PD_DECODE_MS: (now - d0) / 1e6,
                                names.LLMD_PD_COORDINATOR_MS: (d0 - p1) / 1e6})

    def observe_transfer(self, span: trace.Span, headers: Any) -> None:
        """A decode replica's report of its KV pull (kvlab's simulator sends it; vLLM does not)."""
        ms = headers.get(names.HEADER_KV_TRANSFER_MS)
        if ms is None:
            return
        try:
            seconds = float(ms) / 1000.0
            tokens = int(headers.get(names.HEADER_KV_TRANSFER_TOKENS, 0))
        except ValueError:
            return
        self.metrics.kv_transfer.observe(seconds)
        span.set_attribute(names.KV_TRANSFER_MS, seconds * 1000.0)
        span.set_attribute(names.KV_TRANSFER_TOKENS, tokens)


def _block_count(ids: Any) -> int:
    if not isinstance(ids, list) or not ids:
        return 0
    return len(ids[0]) if isinstance(ids[0], list) else len(ids)


def _host_port(url: str) -> str:
    """host:port of a replica's URL, as llm-d's proxy names its targets."""
    host, port = genai.server_of(url)
    return f"{host}:{port}"
