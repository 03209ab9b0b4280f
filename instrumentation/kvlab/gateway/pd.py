"""Prefill/decode disaggregation in the gateway: the split-or-unified decision and the prefill call.

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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from kvlab.gateway.config import PDSettings
from kvlab.gateway.endpoints import Replica
from kvlab.gateway.scheduler.base import Candidate, RouteRequest
from kvlab.kvcache.hashing import block_keys
from kvlab.telemetry import genai, names

if TYPE_CHECKING:
    from kvlab.gateway.router import Routed
    from kvlab.gateway.server import Gateway

SPLIT, UNIFIED, FALLBACK = "split", "unified", "fallback"

# what llm-d's sidecar sends to the prefill replica (NIXL protocol v2)
PREFILL_PARAMS: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                  "remote_block_ids": None, "remote_host": None, "remote_port": None}

_CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


def decide(settings: PDSettings, prompt_tokens: int, decode_prefix_tokens: int,
           prefill_available: bool) -> tuple[str, str, int]:
    """(decision, reason, uncached tokens on the decode replica). Reasons: no-prefill-replica,
    short-prompt, cached-on-decode (unified); uncached-above-threshold (split)."""
    uncached = max(0, prompt_tokens - decode_prefix_tokens)
    if not prefill_available:
        return UNIFIED, "no-prefill-replica", uncached
    if prompt_tokens < settings.threshold_tokens:
        return UNIFIED, "short-prompt", uncached
    if uncached < settings.threshold_tokens:
        return UNIFIED, "cached-on-decode", uncached
    return SPLIT, "uncached-above-threshold", uncached


@dataclass(slots=True)
class PDPlan:
    decision: str
    reason: str
    uncached_tokens: int
    prefill: list[Candidate] = field(default_factory=list)   # prefill replicas in the order to try


class Disaggregation:
    """The gateway's P/D step, between scheduling and the decode (upstream) call."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.settings = gw.cfg.pd

    def _prefill_replicas(self) -> list[Replica] | None:
        """Healthy prefill-role replicas; None when the topology has none at all (P/D off)."""
        pool = [r for r in self.gw.registry.replicas.values() if r.endpoint.role == "prefill"]
        return [r for r in pool if r.healthy] if pool else None

    def plan(self, tokens: list[int], routed: Routed) -> PDPlan | None:
        """The decision for a routed request, in its own span; None when P/D is off."""
        prefills = self._prefill_replicas() if self.settings.enabled else None
        if prefills is None:
            return None
        gw = self.gw
        with gw.tracer.start_as_current_span(names.SPAN_PD_DECISION) as s:
            decode = routed.decision.chosen
            decision, reason, uncached = decide(self.settings, len(tokens), decode.prefix_tokens, bool(prefills))
            plan = PDPlan(decision, reason, uncached)
            if decision == SPLIT:
                keys = dict(routed.keys_by_size)
                for bs in {gw.router.block_size(r) for r in prefills} - keys.keys():
                    keys[bs] = block_keys(tokens, bs)
                prefix, _, _ = gw.router.prefix_of(prefills, keys, len(tokens))
                d = gw.router.scheduler.schedule(RouteRequest(len(tokens)), prefills, prefix)
                plan.prefill = d.ranked
                s.set_attribute(names.PD_PREFILL_REPLICA, d.chosen.name)
                s.set_attribute(names.PD_PREFILL_CANDIDATES, json.dumps([
                    {"replica": c.name, "prefix_tokens": c.prefix_tokens, "total": round(c.total, 4),
                     "inflight": c.replica.inflight, "waiting": c.replica.waiting} for c in d.candidates]))
            s.set_attributes({names.PD_DECISION: decision, names.PD_REASON: reason,
                              names.PD_UNCACHED_TOKENS: uncached, names.PD_THRESHOLD: self.settings.threshold_tokens,
                              names.PD_DECODE_REPLICA: decode.name, names.PROMPT_TOKENS: len(tokens),
                              names.PREFIX_PREDICTED_TOKENS: decode.prefix_tokens})
        gw.metrics.pd_decisions.labels(decision, reason).inc()
        return plan

    async def run(self, path: str, payload: dict[str, Any], tokens: list[int], routed: Routed,
                  root: trace.Span, headers: dict[str, str]) -> str:
        """Decide; when splitting, prefill and put the returned kv_transfer_params in `payload`.
        Returns the span name of the call that follows (decode call after a split, else upstream)."""
        plan = self.plan(tokens, routed)
        if plan is None:
            return names.SPAN_UPSTREAM
        root.set_attribute(names.PD_DECISION, plan.decision)
        root.set_attribute(names.PD_REASON, plan.reason)
        headers[names.HEADER_PD_DECISION] = plan.decision
        if plan.decision != SPLIT:
            return names.SPAN_UPSTREAM
        got = await self.prefill(path, payload, plan, root)
        if got is None:
            headers[names.HEADER_PD_DECISION] = FALLBACK
            return names.SPAN_UPSTREAM
        params, r = got
        payload["kv_transfer_params"] = params
        headers[names.HEADER_PREFILLED_BY] = r.name
        root.set_attribute(names.PD_PREFILL_REPLICA, r.name)
        return names.SPAN_DECODE_CALL

    async def prefill(self, path: str, payload: dict[str, Any], plan: PDPlan,
                      root: trace.Span) -> tuple[dict[str, Any], Replica] | None:
        """Run the remote prefill; the kv_transfer_params for the decode call and the prefill
        replica, or None after recording the fallback to unified serving on `root`."""
        gw = self.gw
        assert gw.session is not None
        # one token, not streamed (llm-d's sidecar does the same); min_tokens would exceed max_tokens
        body = {k: v for k, v in payload.items() if k not in ("stream_options", "min_tokens")}
        body.update(kv_transfer_params=PREFILL_PARAMS, stream=False, max_tokens=1)
        if path.endswith("chat/completions"):
            body["max_completion_tokens"] = 1
        data = msgspec.json.encode(body)
        kind, error, last = "none", "no prefill replica", None
        for attempt, cand in enumerate(plan.prefill[: 1 + gw.cfg.limits.max_retries]):
            r = last = cand.replica
            call_name, attrs = genai.call_of(root, names.SPAN_PREFILL_CALL, r.url)
            with gw.tracer.start_as_current_span(call_name, kind=SpanKind.CLIENT, attributes=attrs) as ps:
                ps.set_attributes({names.REPLICA: r.name, names.ENDPOINT: r.url, names.SCHEDULE_ATTEMPT: attempt,
                                   names.PREFIX_PREDICTED_TOKENS: cand.prefix_tokens})
                headers = {"Content-Type": "application/json"}
                propagate.inject(headers)
                r.inflight += 1
                r.routed += 1
                try:
                    async with gw.session.post(r.url + path, data=data, headers=headers,
                                               timeout=gw._timeout_unary) as resp:
                        raw = await resp.read()
                        ps.set_attribute(names.HTTP_RESPONSE_STATUS_CODE, resp.status)
                    if resp.status != 200:
                        kind, error = "status", f"{r.name} answered {resp.status}"
                    else:
                        params, usage = _params(raw)
                        if params is None:
                            kind, error = "no-kv-transfer-params", f"{r.name} returned no kv_transfer_params"
                        else:
                            gw.registry.success(r)
                            ps.set_attribute(names.ENGINE_CACHED_TOKENS, usage)
                            ps.set_attribute(names.KV_TRANSFER_OFFERED_TOKENS,
                                             _block_count(params.get("remote_block_ids")) * gw.router.block_size(r))
                            return params, r
                except _CONNECT_ERRORS as exc:
                    kind, error = "connect", f"{r.name}: {type(exc).__name__}: {exc}"
                    gw.registry.failure(r, error)
                    ps.set_attribute(names.UPSTREAM_ERROR, kind)
                    ps.set_status(Status(StatusCode.ERROR, error))
                    gw.metrics.upstream_errors.labels(r.name, "prefill_connect").inc()
                    continue          # nothing was computed: the next prefill replica may serve it
                except (TimeoutError, aiohttp.ClientError) as exc:
                    kind = "timeout" if isinstance(exc, asyncio.TimeoutError) else "body"
                    error = f"{r.name}: {type(exc).__name__}: {exc}"
                finally:
                    r.inflight -= 1
                ps.set_attribute(names.UPSTREAM_ERROR, kind)
                ps.set_status(Status(StatusCode.ERROR, error))
                gw.metrics.upstream_errors.labels(r.name, f"prefill_{kind}").inc()
                break
        root.add_event(names.EVENT_PD_FALLBACK, {names.PD_REASON: f"prefill-{kind}", names.ERROR_TYPE: error,
                                                 names.PD_PREFILL_REPLICA: last.name if last else ""})
        root.set_attribute(names.PD_FALLBACK, True)
        gw.metrics.pd_decisions.labels(FALLBACK, f"prefill-{kind}").inc()
        return None

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
        self.gw.metrics.kv_transfer.observe(seconds)
        span.set_attribute(names.KV_TRANSFER_MS, seconds * 1000.0)
        span.set_attribute(names.KV_TRANSFER_TOKENS, tokens)


def _block_count(ids: Any) -> int:
    if not isinstance(ids, list) or not ids:
        return 0
    return len(ids[0]) if isinstance(ids[0], list) else len(ids)


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens_details: _Details | None = None


class _PrefillResponse(msgspec.Struct):
    kv_transfer_params: dict[str, Any] | None = None
    usage: _Usage | None = None


def _params(raw: bytes) -> tuple[dict[str, Any] | None, int]:
    """The prefill response's kv_transfer_params and its cached tokens."""
    try:
        out = msgspec.json.decode(raw, type=_PrefillResponse)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None, 0
    details = out.usage.prompt_tokens_details if out.usage else None
    return out.kv_transfer_params, (details.cached_tokens or 0) if details else 0
