"""The gateway's HTTP side: an OpenAI-compatible reverse proxy that routes by KV-cache affinity.

Per request (exchange.py carries it): parse and validate the body, then `decide` — tokenize
(cached), derive retention directives, route (router.Router) with the schedule span — then the
P/D step (pd.py) or chunked decoding (chunked/), and the upstream call (upstream.py: ranked
retries and the replicas' bookkeeping) whose answer relay.py passes to the client event by event.
Usage is requested upstream so `cached_tokens` (the delivered part of the hit-rate decomposition)
is always seen, and stripped again if the client did not ask.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics

from kvlab import httpedge
from kvlab.contract import Endpoint, Usage
from kvlab.errors import NoEndpointAvailable, RequestError
from kvlab.gateway import retention, schedule_span
from kvlab.gateway.autoscale import Recommender, record_change
from kvlab.gateway.chunked.splice import ChunkedDecode
from kvlab.gateway.config import PolicyConfig
from kvlab.gateway.discovery.base import Discovery
from kvlab.gateway.endpoints import Backend, Registry
from kvlab.gateway.enginetokens import EngineTokens
from kvlab.gateway.exchange import Exchange
from kvlab.gateway.kvevents import EventFeed
from kvlab.gateway.loadview import LoadView
from kvlab.gateway.metrics import GatewayMetrics
from kvlab.gateway.parity import MATCH, MISMATCH, ParityProbe, Verdict
from kvlab.gateway.pd import Disaggregation
from kvlab.gateway.relay import Relay, upstream_error
from kvlab.gateway.resume import Broken, Progress, resume_body, unresumable
from kvlab.gateway.router import Routed, Router
from kvlab.gateway.scheduler import presets
from kvlab.gateway.tokens import LocalTokens, PromptTokenizer, chat_args
from kvlab.gateway.upstream import RETRYABLE, Attempt, Call, Failure, Upstream
from kvlab.kvcache.index import ApproximateIndex, PreciseIndex
from kvlab.kvcache.transport import Received
from kvlab.telemetry import genai, names

log = logging.getLogger(__name__)

_MAX_TOKEN_ID = 2**31   # no vocabulary is larger; bigger ids would overflow the block hashing


class Gateway:
    """The gateway's state and aiohttp application."""

    def __init__(self, cfg: PolicyConfig, discovery: Discovery, tokenizer: PromptTokenizer | EngineTokens,
                 model: str | None = None, scrape_interval_ms: int | None = None) -> None:
        self.cfg = cfg
        self.policy = cfg.name
        self.discovery = discovery
        self.tokenizer = LocalTokens(tokenizer) if isinstance(tokenizer, PromptTokenizer) else tokenizer
        self.model = model
        self.registry = Registry(cfg.health.eject_after_failures, cfg.health.readmit_after_s)
        self.registry.on_eject = self._on_eject
        self.precise = PreciseIndex(cfg.index.speculative_ttl_s)
        self.approx = ApproximateIndex(cfg.index.approx_capacity_blocks)
        self.router = Router(cfg, self.registry, self.precise, self.approx, presets.build(cfg))
        self.metrics = GatewayMetrics(self._snapshot)
        self.tracer = trace.get_tracer("kvlab.gateway")
        self.upstream = Upstream(cfg, self.registry, self.router, self.metrics, self.tracer)
        self.relay = Relay(self.metrics, self.registry, self.policy)
        self.feed = EventFeed(self.precise, self.approx, cfg.kv_events_resync_s, on_batch=self._on_batch)
        self.scrape_interval_s = (scrape_interval_ms or cfg.health.scrape_interval_ms) / 1000.0
        self.session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._feeds: dict[str, asyncio.Task[None]] = {}
        self._seen_gaps: dict[str, tuple[int, int]] = {}
        self.ready = asyncio.Event()
        self.autoscaler = Recommender(cfg.autoscale)
        self.pd = Disaggregation(cfg.pd, self.registry, self.router, self.upstream, self.metrics, self.tracer)
        self.chunked = ChunkedDecode(cfg.chunked, self.metrics.registry, self.tracer, self.router.block_size)
        self.parity = (ParityProbe(tokenizer, model, on_verdict=self._on_parity)
                       if isinstance(tokenizer, PromptTokenizer) else None)

    # ---- lifecycle ---------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.limits.max_body_bytes,
                              middlewares=[httpedge.errors])
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/debug/endpoints", self.debug_endpoints)
        app.router.add_get("/debug/autoscale", self.debug_autoscale)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    def runner(self) -> web.AppRunner:
        """The app with its server settings: a client that goes away cancels its handler, which closes
        the upstream request (the engine aborts it); a connection that sends no complete request
        within `client_idle_s` is closed (slowloris)."""
        return web.AppRunner(self.app(), access_log=None, handle_signals=False, handler_cancellation=True,
                             keepalive_timeout=self.cfg.timeouts.client_idle_s)

    async def _startup(self, app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, enable_cleanup_closed=True)
        self.session = self.upstream.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        if self.parity is not None:
            self.parity.session = self.session
        if isinstance(self.tokenizer, EngineTokens):
            self.tokenizer.bind(self.session, self.registry)
        loadview = LoadView(self.registry, self.session, self.scrape_interval_s, self.cfg.timeouts.scrape_s)
        self._tasks.append(asyncio.create_task(self._discover()))
        self._tasks.append(asyncio.create_task(loadview.run()))
        self._tasks.append(asyncio.create_task(self._autoscale()))

    async def _cleanup(self, app: web.Application) -> None:
        for t in [*self._tasks, *self._feeds.values()]:
            t.cancel()
        await asyncio.gather(*self._tasks, *self._feeds.values(), return_exceptions=True)
        if self.parity is not None:
            await self.parity.close()
        if self.session is not None:
            await self.session.close()

    async def _autoscale(self) -> None:
        """Re-evaluate the desired-replica recommendation every scrape interval (autoscale.py)."""
        while True:
            await asyncio.sleep(self.scrape_interval_s)
            try:
                prev = self.autoscaler.last
                rec = self.autoscaler.observe(self.registry.candidates())
                self.metrics.desired_replicas.set(rec.desired)
                self.metrics.current_replicas.set(rec.current)
                if prev is None or prev.desired != rec.desired:
                    record_change(self.tracer, prev, rec)
            except Exception:  # the signal never takes the gateway down
                log.exception("autoscale evaluation failed")

    async def debug_autoscale(self, request: web.Request) -> web.Response:
        rec = self.autoscaler.last
        return web.json_response({"settings": msgspec.to_builtins(self.cfg.autoscale),
                                  "recommendation": None if rec is None else msgspec.to_builtins(rec)})

    async def _discover(self) -> None:
        try:
            await self.discovery.run(self.set_endpoints)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("discovery stopped; keeping the last known endpoints")

    async def set_endpoints(self, endpoints: list[Endpoint]) -> None:
        added, removed = self.registry.update(endpoints)
        for r in removed:
            task = self._feeds.pop(r.name, None)
            if task is not None:
                task.cancel()
            self.precise.remove(r.name)
            self.approx.remove(r.name)
            if self.parity is not None:
                self.parity.stop(r.name)
                if r.tokenizer in (MATCH, MISMATCH):
                    self.metrics.tokenizer_parity.remove(r.name)
        for r in added:
            if self.parity is not None:
                self.parity.start(r)
            else:
                r.tokenizer = "engine"     # tokens-in, tokens-out: the ids are the engine's own
            if r.endpoint.kv_events and self.cfg.index.kind == "precise":
                self._feeds[r.name] = asyncio.create_task(self._run_feed(r))
        self.ready.set()

    async def _run_feed(self, r: Backend) -> None:
        try:
            await self.feed.run(r)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never takes the gateway down; the replica falls back to approximate
            r.events_state = "stale"
            log.warning("KV-event feed of %s stopped: %s", r.name, exc)

    def _on_batch(self, r: Backend, rec: Received) -> None:
        self.metrics.kv_events.labels(r.name).inc()
        if rec.gap or rec.restarted:
            self.metrics.kv_event_gaps.labels(r.name, "restart" if rec.restarted else "gap").inc()

    def _on_parity(self, r: Backend, verdict: Verdict) -> None:
        if verdict.state in (MATCH, MISMATCH):
            self.metrics.tokenizer_parity.labels(r.name).set(1.0 if verdict.state == MATCH else 0.0)

    def _on_eject(self, r: Backend) -> None:
        """An ejected replica's blocks stop attracting routing at once: both indexes forget them and
        learn again when it is back (its KV events after the restart, or the requests routed to it)."""
        self.metrics.ejections.labels(r.name).inc()
        self.precise.clear(r.name)
        self.approx.clear(r.name)
        log.warning("ejected %s: %s; its index entries are dropped", r.name, r.last_error)

    def _snapshot(self) -> Iterator[tuple[str, int, bool, int, int, str]]:
        for r in list(self.registry.replicas.values()):
            yield (r.name, r.inflight, r.healthy, self.precise.blocks(r.name), self.approx.blocks(r.name),
                   r.events_state)

    # ---- small endpoints ---------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        healthy = [r.name for r in self.registry.replicas.values() if r.healthy]
        status = 200 if healthy else 503
        mismatch = [r.name for r in self.registry.replicas.values() if r.tokenizer == MISMATCH]
        return web.json_response({"status": "ok" if healthy else "no healthy replica",
                                  "policy": self.policy, "healthy": healthy,
                                  "tokenizer": {"source": self.tokenizer.source, "mismatch": mismatch}},
                                 status=status)

    async def prometheus(self, request: web.Request) -> web.Response:
        # Prometheus asks for OpenMetrics when exemplar storage is on: only that format carries
        # the trace-id exemplars Grafana links from latency panels to traces
        if "application/openmetrics-text" in request.headers.get("Accept", ""):
            return web.Response(body=openmetrics.generate_latest(self.metrics.registry),  # type: ignore[no-untyped-call]
                                headers={"Content-Type": openmetrics.CONTENT_TYPE_LATEST})
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def debug_endpoints(self, request: web.Request) -> web.Response:
        out = []
        for r in self.registry.replicas.values():
            out.append({
                "name": r.name, "url": r.url, "kv_events": r.endpoint.kv_events, "role": r.endpoint.role,
                "healthy": r.healthy, "failures": r.failures, "ejections": r.ejections,
                "last_error": r.last_error, "last_scrape": r.last_scrape,
                "load": {"waiting": r.waiting, "running": r.running, "kv_usage": r.kv_usage,
                         "inflight": r.inflight, "inflight_tokens": r.inflight_tokens},
                "block_size": self.router.block_size(r), "num_gpu_blocks": r.num_gpu_blocks,
                "index": {"used": "precise" if self.router.uses_precise(r) else "approximate",
                          "precise_blocks": self.precise.blocks(r.name),
                          "speculative_blocks": self.precise.speculative_blocks(r.name),
                          "approximate_blocks": self.approx.blocks(r.name)},
                "tokenizer": {"state": r.tokenizer, "detail": r.tokenizer_detail},
                "events": {"state": r.events_state, "batches": r.events_received,
                           "gaps": r.events_gaps, "restarts": r.events_restarts, "replayed": r.events_replayed},
                "routed": r.routed,
            })
        return web.json_response({"policy": self.policy, "replicas": out})

    async def models(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        for r in self.registry.candidates():
            try:
                async with self.session.get(r.url + "/v1/models", timeout=self.upstream.timeout(False)) as resp:
                    body = await resp.read()
                    return web.Response(body=body, status=resp.status, content_type="application/json")
            except (TimeoutError, *RETRYABLE) as exc:
                self.registry.failure(r, f"models: {exc}")
        return upstream_error("no healthy replica to route to", 503)

    # ---- the proxy ---------------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, "text_completion")

    async def _read_json(self, request: web.Request) -> dict[str, Any]:
        payload: dict[str, Any] = httpedge.decode(await httpedge.read_body(
            request, self.cfg.limits.max_body_bytes, self.cfg.timeouts.client_body_s))
        if "stream" in payload and not isinstance(payload["stream"], bool | None):
            raise RequestError("`stream` must be a boolean", "stream")
        return payload

    async def _tokenize(self, payload: dict[str, Any], operation: str) -> tuple[list[int], int]:
        """The prompt's token ids as the engine computes them (kvlab.tokenizer, vLLM's rules)."""
        tok = self.tokenizer
        if operation == "chat":
            return await tok.encode_chat(payload.get("messages"), **chat_args(payload))
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompt = prompt[0]   # a batch is routed by its first prompt
        add = payload.get("add_special_tokens", True)
        if not isinstance(add, bool):
            raise RequestError("`add_special_tokens` must be a boolean", "add_special_tokens")
        if isinstance(prompt, str):
            return await tok.encode_text(prompt, add)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            if not all(0 <= t < _MAX_TOKEN_ID for t in prompt):
                raise RequestError(f"token ids must be between 0 and {_MAX_TOKEN_ID - 1}", "prompt")
            return list(prompt), 0
        raise RequestError("`prompt` must be a string, a list of strings or a list of token ids", "prompt")

    async def decide(self, ex: Exchange, client_headers: Mapping[str, str] | None = None,
                     exclude: frozenset[str] = frozenset()) -> None:
        """Tokenize, check the prompt limit, derive retention directives and route `ex` (the schedule
        span included) without calling any replica: `kvlab gateway` forwards after it, `kvlab epp` hands
        the ranking to the proxy. Without `client_headers` no directives are derived (the EPP's proxy
        sends the body as it is). Raises RequestError, NoEndpointAvailable."""
        span = ex.span
        if ex.operation:
            t0 = time.perf_counter()   # attributes, not a child span: one span fewer per request
            ex.tokens, cache_hit = await self._tokenize(ex.payload, ex.operation)
            dt = time.perf_counter() - t0
            span.set_attributes({names.TOKENIZE_SOURCE: self.tokenizer.source, names.TOKENIZE_CACHED: cache_hit,
                                 names.TOKENIZE_MS: dt * 1000})
            self.metrics.tokenize.observe(dt)
            limit = self.cfg.limits.max_prompt_tokens
            if limit is not None and len(ex.tokens) > limit:
                raise RequestError(f"prompt of {len(ex.tokens)} tokens exceeds the gateway limit of {limit}", "prompt")
        span.set_attribute(names.PROMPT_TOKENS, len(ex.tokens))
        typed = None
        if client_headers is not None:
            ex.retention, typed = await self._retention(client_headers, ex.payload, ex.tokens, ex.operation)
        ex.routed = self._schedule(ex.tokens, typed, exclude)
        span.set_attribute(names.PREFIX_AVAILABLE_TOKENS, ex.routed.decision.available_tokens)

    async def _proxy(self, request: web.Request, operation: str) -> web.StreamResponse:
        ctx = propagate.extract(request.headers)
        with self.tracer.start_as_current_span(names.SPAN_GATEWAY_REQUEST, context=ctx, kind=SpanKind.SERVER,
                                               attributes=genai.span_attributes(names.SPAN_GATEWAY_REQUEST,
                                                                                f"http://{request.host}")) as span:
            span.set_attribute(names.GEN_AI_OPERATION_NAME, operation)
            span.set_attribute(names.POLICY, self.policy)
            ex = Exchange(operation, {}, span, self.policy)
            try:
                ex.payload = await self._read_json(request)
                model = ex.payload.get("model")
                if isinstance(model, str):
                    span.set_attribute(names.GEN_AI_REQUEST_MODEL, model)
                if isinstance(ex.payload.get("max_tokens"), int):
                    span.set_attribute(names.GEN_AI_REQUEST_MAX_TOKENS, ex.payload["max_tokens"])
                span.set_attribute(names.GEN_AI_REQUEST_STREAM, ex.stream)
                await self.decide(ex, request.headers)
                ex.chunk_tokens = self.chunked.chunk_tokens(request.headers, ex.payload, operation)
            except RequestError as err:
                span.set_status(Status(StatusCode.ERROR, err.message))
                span.set_attribute(names.HTTP_RESPONSE_STATUS_CODE, err.status)
                return httpedge.json_error(err, {names.HEADER_POLICY: self.policy})
            except NoEndpointAvailable as err:
                span.set_status(Status(StatusCode.ERROR, str(err)))
                span.set_attribute(names.HTTP_RESPONSE_STATUS_CODE, 503)
                return upstream_error(str(err), 503)
            ex.ask_usage()
            try:
                if ex.chunk_tokens:   # chunked decoding replaces P/D and retries for this request
                    return await self._chunked(request, ex)
                prefilled = await self.pd.run(ex)
                return await self._serve(request, ex, names.SPAN_DECODE_CALL if prefilled else names.SPAN_UPSTREAM)
            except (ConnectionResetError, asyncio.CancelledError):
                genai.client_gone(span)
                self.metrics.requests.labels(ex.served.name if ex.served else "", self.policy, "499").inc()
                raise

    async def _serve(self, request: web.Request, ex: Exchange, name: str) -> web.StreamResponse:
        """Call the ranked replicas and relay the answer; a replica that fails mid-way is replaced by
        another that continues from what the client already received (resume.py), at most
        `limits.max_resumes` times."""
        prog = Progress(prompt_tokens=len(ex.tokens) or None)
        why_not = unresumable(ex.payload, ex.operation)
        body, ranked, lost = ex.payload, ex.decision.ranked, set[str]()

        async def answer(at: Attempt) -> web.StreamResponse | Broken:
            self.pd.observe_transfer(at.span, at.resp.headers)
            if prog.pending is not None:
                self._resumed(ex, prog, prog.pending, at)
                prog.pending = None
            got = await self.relay.answer(request, ex, at, prog)
            if name == names.SPAN_DECODE_CALL:
                self.pd.decoded(ex, at)
            return got

        while True:
            call = Call(name, ex.path, msgspec.json.encode(body), stream=ex.stream, headers=ex.retention)
            got: web.StreamResponse | Broken | Failure = await self.upstream.call(ex, ranked, call, answer)
            if isinstance(got, Failure):
                msg = f"upstream failed: {got.error}"
                if got.kind in ("connect", "timeout"):
                    msg, status = f"no replica could serve the request: {got.error}", 503
                else:
                    status = 502
                return await self._give_up(ex, prog, msg, status)
            if not isinstance(got, Broken):
                return got
            lost.add(got.replica.name)
            limit = self.cfg.limits.max_resumes
            if prog.text and why_not is not None:
                return await self._give_up(ex, prog, f"{got.error}; not resumed: {why_not}")
            if prog.resumes >= limit:
                return await self._give_up(ex, prog, f"{got.error}; not resumed: {limit} resumes already")
            try:
                routed = self._schedule(ex.tokens, None, frozenset(lost))
            except NoEndpointAvailable:
                return await self._give_up(ex, prog, f"{got.error}; no healthy replica left to resume on", 503)
            remaining = self._remaining(ex.payload, prog.tokens)
            if remaining is not None and remaining <= 0:
                return await self._give_up(ex, prog, f"{got.error}; max_tokens were already sent")
            body = resume_body(ex.payload, ex.operation, prog.text) if prog.text else dict(ex.payload)
            body.pop("kv_transfer_params", None)
            if remaining is not None:
                body.pop("max_completion_tokens", None)
                body["max_tokens"] = remaining
            if isinstance(ex.payload.get("min_tokens"), int):
                body["min_tokens"] = max(0, ex.payload["min_tokens"] - prog.tokens)
            ex.routed, ranked, name = routed, routed.decision.ranked, names.SPAN_UPSTREAM
            prog.resumes += 1
            prog.carried = prog.tokens
            prog.pending = got
            self.metrics.resumes.labels(got.reason).inc()
            ex.span.set_attribute(names.RESUME_COUNT, prog.resumes)

    @staticmethod
    def _remaining(payload: dict[str, Any], sent: int) -> int | None:
        limit = payload.get("max_completion_tokens") or payload.get("max_tokens")
        return limit - sent if type(limit) is int else None

    def _resumed(self, ex: Exchange, prog: Progress, lost: Broken, at: Attempt) -> None:
        """The resume's span event: which replica was lost, what the client had, who continues and
        the prompt the new replica has to prefill beyond its cached prefix (the resume's cost)."""
        prefill = max(0, len(ex.tokens) + prog.carried - at.cand.prefix_tokens)
        attrs: dict[str, AttributeValue] = {names.RESUME_REASON: lost.reason, names.RESUME_FROM: lost.replica.name,
                 names.RESUME_TOKENS_SENT: prog.carried, names.RESUME_INDEX: prog.resumes,
                 names.REPLICA: at.cand.name, names.RESUME_PREFILL_TOKENS: prefill,
                 names.UPSTREAM_ERROR: lost.error}
        ex.span.add_event(names.EVENT_RESUME, attrs)
        at.span.set_attributes({names.RESUME_INDEX: prog.resumes, names.RESUME_TOKENS_SENT: prog.carried})

    async def _give_up(self, ex: Exchange, prog: Progress, message: str, status: int = 502) -> web.StreamResponse:
        """The request ends in an OpenAI-shaped error: a response, or an error event in the started stream."""
        log.warning("request failed: %s", message)
        if prog.out is not None:
            return await self.relay.end(ex, prog, message, status)
        return self.relay.failed(ex, message, status)

    async def _chunked(self, request: web.Request, ex: Exchange) -> web.StreamResponse:
        """Generation in chunks on the chosen replica (gateway/chunked/, docs/chunked-decoding.md),
        leased for the whole request like any other."""
        cand = ex.decision.ranked[0]
        ex.serve(cand)
        lease = self.upstream.lease(cand.replica, ex.work(cand))

        def first_token() -> None:
            lease.first_token()
            ex.first_token(self.metrics.ttft)

        def usage(u: dict[str, Any]) -> None:
            ex.record_usage(msgspec.convert(u, Usage), self.metrics.prefix_tokens)

        lost: set[str] = set()

        def reroute(failed: Backend, error: str) -> Backend | None:
            """Another replica for the rest of the generation (the resume event and counter as for streams)."""
            nonlocal cand, lease
            lost.add(failed.name)
            try:
                routed = self._schedule(ex.tokens, None, frozenset(lost))
            except NoEndpointAvailable:
                return None
            new = routed.decision.ranked[0]
            ex.span.add_event(names.EVENT_RESUME, {names.RESUME_REASON: "stream", names.RESUME_FROM: failed.name,
                                                   names.REPLICA: new.name, names.UPSTREAM_ERROR: error})
            self.metrics.resumes.labels("stream").inc()
            lease.release()
            ex.routed, cand = routed, new
            ex.serve(new)
            lease = self.upstream.lease(new.replica, ex.work(new))
            return new.replica

        try:
            resp = await self.chunked.serve(request, ex, self.upstream, first_token, usage, reroute,
                                            self.cfg.limits.max_resumes)
        finally:
            lease.release()
        self.metrics.requests.labels(cand.name, self.policy, str(resp.status)).inc()
        return resp

    async def _retention(self, client_headers: Mapping[str, str], payload: dict[str, Any], tokens: list[int],
                         operation: str) -> tuple[dict[str, str], str | None]:
        """Upstream headers with the request's retention directives (gateway/retention.py) and the
        typed prefix for the decision span: the client's own header passed through, else derived
        from a chat request's roles by the policy. A client's body field is left to the replica."""
        own = client_headers.get(names.HEADER_RETENTION)
        if own is not None:
            return {names.HEADER_RETENTION: own}, own
        if operation != "chat" or self.cfg.retention.mode == "off" or "retention_directives" in payload:
            return {}, None
        found = await retention.derive(self.cfg.retention, payload, tokens, client_headers.get(names.HEADER_KV_HINT),
                                       self.tokenizer, chat_args(payload))
        if not found:
            return {}, None
        return {names.HEADER_RETENTION: retention.header(found)}, retention.span_value(found)

    def _schedule(self, tokens: list[int], typed: str | None = None, exclude: frozenset[str] = frozenset()) -> Routed:
        with self.tracer.start_as_current_span(names.SPAN_SCHEDULE) as s:
            routed = self.router.route(tokens, exclude)
            self.metrics.routing.labels(self.policy).observe(routed.total_s)
            self.metrics.decisions.labels(self.policy, routed.decision.reason).inc()
            if s.is_recording():
                schedule_span.annotate(self.tracer, s, routed, self.router, self.policy, len(tokens), typed,
                                       names.PROFILE_DECODE if self.cfg.pd.enabled else names.PROFILE_DEFAULT)
            schedule_span.annotate_pull(self.tracer, routed)
        return routed
