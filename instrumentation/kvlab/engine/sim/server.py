"""One replica's HTTP API, vLLM's: completions, chat, models, tokenize, metrics, health.

Bodies are decoded and errors answered by kvlab.httpedge (vLLM's JSON errors, never a 500 for
client input); a request whose client disconnects is aborted in the engine, as vLLM does. Every
response carries `x-kvlab-replica`. Streaming writes pre-built SSE byte strings: one chunk per
token, several tokens of one step in one write. One SERVER span per generation request with
queue, prefill and decode children built from the engine's timestamps at the end (no prompt text).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from kvlab.engine.sim.length import too_long
from kvlab.engine.sim.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    _Generation,
    chat_ids,
    tokenize_ids,
)
from kvlab.engine.sim.render import generate_request
from kvlab.engine.sim.retention import RetentionDirective
from kvlab.engine.sim.retention import parse as parse_retention
from kvlab.engine.sim.scheduler import FINISHED, Request
from kvlab.engine.sim.transfer import Pulled, pull_hint
from kvlab.errors import ModelNotFound, PromptTooLong, RequestError
from kvlab.httpedge import decode, read_body
from kvlab.httpedge import errors as _errors
from kvlab.telemetry import genai, names

if TYPE_CHECKING:
    from kvlab.engine.sim.replica import Replica

log = logging.getLogger(__name__)
tracer = trace.get_tracer("kvlab.engine.sim")

DEFAULT_MAX_TOKENS = 16
_encode = msgspec.json.encode
_ids = itertools.count()
_DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
MAX_BODY_BYTES = 64 * 1024 * 1024
_PULLED = web.RequestKey("kvlab.pulled", Pulled)   # the P/D KV pull of a decode request


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=_encode(data), status=status, content_type="application/json")


class Api:
    """The handlers of one replica."""

    def __init__(self, replica: Replica) -> None:
        self.r = replica
        self.engine = replica.engine
        self.model = replica.model
        self.max_model_len = replica.max_model_len
        self.tokenizer = replica.tokenizer
        self.sampler = replica.sampler
        self.name = replica.name
        self._model_json = _encode(self.model)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)
        app.on_response_prepare.append(self._stamp)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions/render", self.render_completion)
        app.router.add_post("/v1/chat/completions/render", self.render_chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.router.add_get("/version", self.version)
        return app

    async def _stamp(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers[names.HEADER_REPLICA] = self.name
        pulled: Pulled | None = request.get(_PULLED)
        if pulled is not None:
            response.headers[names.HEADER_KV_TRANSFER_TOKENS] = str(pulled.tokens)
            response.headers[names.HEADER_KV_TRANSFER_MS] = f"{pulled.ms:.3f}"

    # ---- small endpoints -------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        from kvlab import __version__
        return _json({"version": f"kvlab-sim {__version__}"})

    async def models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": int(self.r.started), "owned_by": "vllm",
            "root": self.model, "parent": None, "max_model_len": self.max_model_len, "permission": []}]})

    async def metrics(self, request: web.Request) -> web.Response:
        body = self.r.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.engine.reset_prefix_cache()
        return web.Response(status=200)

    async def tokenize(self, request: web.Request) -> web.Response:
        body = decode(await read_body(request, MAX_BODY_BYTES), TokenizeRequest)
        self._check_model(body.model)
        ids = tokenize_ids(body, self.tokenizer)
        return _json({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": None})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = decode(await read_body(request, MAX_BODY_BYTES), DetokenizeRequest)
        self._check_model(body.model)
        self._check_ids(body.tokens, "tokens")
        return _json({"prompt": self.tokenizer.decode(body.tokens)})

    # ---- generation ------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model:
            raise ModelNotFound(f"The model `{model}` does not exist.", param="model")

    def _check_ids(self, ids: list[Any], param: str) -> list[int]:
        vocab = self.tokenizer.vocab_size
        for t in ids:
            if type(t) is not int:
                raise RequestError(f"`{param}` must be a string or a list of token ids", param=param)
            if not 0 <= t < vocab:
                raise RequestError(f"token id {t} is out of vocabulary (size {vocab})", param=param)
        return ids

    def _prompt_ids(self, prompt: str | list[Any], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens)
        if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            return self._prompt_ids(prompt[0], add_special_tokens)  # a batch of one
        if prompt and all(type(t) is int for t in prompt):
            return self._check_ids(prompt, "prompt")
        raise RequestError("`prompt` must be a string, a list of token ids, or a batch of one of them "
                           "(larger batches are not supported by the simulator)", param="prompt")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        t0 = time.time_ns()
        body = decode(await read_body(request, MAX_BODY_BYTES), CompletionRequest)
        self._check_model(body.model)
        ids = self._prompt_ids(body.prompt, body.add_special_tokens)
        return await self._generate(request, t0, body, ids, body.max_tokens, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        t0 = time.time_ns()
        body = decode(await read_body(request, MAX_BODY_BYTES), ChatRequest)
        self._check_model(body.model)
        if not body.messages:
            raise RequestError("`messages` must not be empty", param="messages")
        ids = chat_ids(body, self.tokenizer)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await self._generate(request, t0, body, ids, max_tokens, chat=True)

    async def render_completion(self, request: web.Request) -> web.Response:
        """vLLM's completion render: a list of one GenerateRequest (the simulator serves batches of one)."""
        body = decode(await read_body(request, MAX_BODY_BYTES), CompletionRequest)
        self._check_model(body.model)
        ids = self._prompt_ids(body.prompt, body.add_special_tokens)
        max_tokens = self._validate(body, ids, body.max_tokens)
        return _json([generate_request(f"cmpl-{self.name}-{next(_ids)}", ids, body, max_tokens)])

    async def render_chat(self, request: web.Request) -> web.Response:
        """vLLM's chat render: the GenerateRequest with the templated prompt's ids."""
        body = decode(await read_body(request, MAX_BODY_BYTES), ChatRequest)
        self._check_model(body.model)
        if not body.messages:
            raise RequestError("`messages` must not be empty", param="messages")
        ids = chat_ids(body, self.tokenizer)
        max_tokens = self._validate(body, ids, body.max_completion_tokens if body.max_completion_tokens is not None
                                    else body.max_tokens)
        return _json(generate_request(f"chatcmpl-{self.name}-{next(_ids)}", ids, body, max_tokens))

    def _validate(self, body: _Generation, ids: list[int], max_tokens: int | None) -> int:
        if body.n != 1:
            raise RequestError("the simulator serves n=1 only", param="n")
        if not ids:
            raise RequestError("the prompt must not be empty", param="prompt")
        max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
        if max_tokens < 1:
            raise RequestError("max_tokens must be at least 1", param="max_tokens")
        if body.min_tokens < 0 or body.min_tokens > max_tokens:
            raise RequestError("min_tokens must be between 0 and max_tokens", param="min_tokens")
        if body.temperature is not None and body.temperature < 0:
            raise RequestError("temperature must be non-negative", param="temperature")
        if (message := too_long(len(ids), max_tokens, self.max_model_len)) is not None:
            raise PromptTooLong(message, param="messages" if isinstance(body, ChatRequest) else "prompt")
        return max_tokens

    async def _generate(self, request: web.Request, t0: int, body: _Generation, ids: list[int],
                        max_tokens: int | None, chat: bool) -> web.StreamResponse:
        n_max = self._validate(body, ids, max_tokens)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
        req_id = f"{'chatcmpl' if chat else 'cmpl'}-{self.name}-{next(_ids)}"
        req = Request(req_id, ids, self.sampler.draw(ids, n_max, body.seed), self.engine.scheduler.prompt_keys(ids),
                      stop=stop, min_tokens=body.min_tokens, retention=self._retention(request, body))
        params = body.kv_transfer_params
        if params is None and names.HEADER_KV_PULL in request.headers:   # cross-replica pull hint
            params = pull_hint(request.headers[names.HEADER_KV_PULL], self.engine.scheduler.block_size)
        if params is not None:
            self.r.transfer.validate(params)
        ctx = propagate.extract(request.headers)
        span = tracer.start_span(names.SPAN_ENGINE_REQUEST, context=ctx, kind=SpanKind.SERVER, start_time=t0,
                                 attributes=genai.span_attributes(names.SPAN_ENGINE_REQUEST, f"http://{request.host}"))
        status = 200
        try:
            if params is not None and params.do_remote_prefill:
                request[_PULLED] = await self.r.transfer.pull(req, params)
            self.engine.submit(req)
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                return await self._stream(request, req, chat, include_usage)
            handoff = params is not None and params.do_remote_decode
            return await self._complete(req, chat, handoff)
        except (ConnectionError, asyncio.CancelledError):
            status = 499  # the client went away
            raise
        finally:
            if req.status != FINISHED:
                self.engine.abort(req)
            self._end_spans(span, req, body, chat, status, request.get(_PULLED))

    def _retention(self, request: web.Request, body: _Generation) -> list[RetentionDirective] | None:
        """The request's retention directives (body field, else header); validated even when the
        replica's cache is not typed, so a bad directive is a 400 everywhere."""
        header = request.headers.get(names.HEADER_RETENTION)
        if body.retention_directives is not None:
            directives = parse_retention(body.retention_directives)
        elif header is not None:
            directives = parse_retention(header, names.HEADER_RETENTION)
        else:
            return None
        return directives if self.engine.scheduler.pool.typed is not None else None

    def _usage(self, req: Request) -> dict[str, Any]:
        cached = req.num_cached or 0
        return {"prompt_tokens": req.num_prompt, "total_tokens": req.num_prompt + req.num_output,
                "completion_tokens": req.num_output, "prompt_tokens_details": {"cached_tokens": cached}}

    async def _wait(self, req: Request) -> None:
        fut = asyncio.get_running_loop().create_future()
        req.waiter = fut
        await fut

    def _text(self, req: Request) -> str:
        text = self.sampler.detokenize(req.output[:req.num_output])
        return text[:req.text_len] if req.finish_reason == "stop" else text

    async def _complete(self, req: Request, chat: bool, handoff: bool = False) -> web.Response:
        while req.status != FINISHED:
            await self._wait(req)
        created = req.t_arrival // 1_000_000_000
        text = self._text(req)
        stop_reason = None
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                      "logprobs": None, "finish_reason": req.finish_reason, "stop_reason": stop_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": req.finish_reason,
                      "stop_reason": stop_reason, "prompt_logprobs": None}
            obj = "text_completion"
        out = {"id": req.id, "object": obj, "created": created, "model": self.model,
               "choices": [choice], "usage": self._usage(req)}
        if handoff:   # a P/D prefill: tell the decode replica where to pull the KV from
            out["kv_transfer_params"] = self.r.transfer.handoff(req)
        return _json(out)

    async def _stream(self, request: web.Request, req: Request, chat: bool, include_usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers=_SSE_HEADERS)
        await resp.prepare(request)
        created = req.t_arrival // 1_000_000_000
        head = (f'data: {{"id":"{req.id}","object":"{"chat.completion.chunk" if chat else "text_completion"}",'
                f'"created":{created},"model":').encode() + self._model_json + b',"choices":[{"index":0,'
        if chat:
            pre, mid = head + b'"delta":{"content":"', b'"},"logprobs":null,"finish_reason":'
            tail = b"}]}\n\n"
        else:
            pre, mid = head + b'"text":"', b'","logprobs":null,"finish_reason":'
            tail = b',"stop_reason":null}]}\n\n'
        escaped = self.sampler.json
        sent = 0
        while True:
            if req.num_output == sent and req.status != FINISHED:
                await self._wait(req)
                continue
            upto = req.num_output
            parts = []
            if chat and sent == 0 and upto > 0:
                parts.append(head + b'"delta":{"role":"assistant","content":""},'
                             b'"logprobs":null,"finish_reason":null}]}\n\n')
            last = upto - 1 if req.status == FINISHED else -1
            for i in range(sent, upto):
                if i == last:
                    assert req.finish_reason is not None  # set with FINISHED; once per request
                    parts += [pre, self._last_piece(req), mid, b'"', req.finish_reason.encode(), b'"', tail]
                else:
                    parts += [pre, escaped[req.output[i]], mid, b"null", tail]
            sent = upto
            if req.status == FINISHED:
                if include_usage:
                    parts.append(head[:-len(b'{"index":0,')] + b"]," + b'"usage":' + _encode(self._usage(req))
                                 + b"}\n\n")
                parts.append(_DONE)
                await resp.write(b"".join(parts))
                break
            await resp.write(b"".join(parts))
        await resp.write_eof()
        return resp

    def _last_piece(self, req: Request) -> bytes:
        """The escaped text of the final token (cut short when a stop string matched)."""
        tok = req.output[req.num_output - 1]
        if req.finish_reason != "stop":
            return self.sampler.json[tok]
        before = len(self.sampler.detokenize(req.output[:req.num_output - 1]))
        piece = self.sampler.text[tok][:max(0, req.text_len - before)]
        return _encode(piece)[1:-1]

    # ---- tracing ---------------------------------------------------------------------
    def _tier_attrs(self, req: Request) -> dict[str, float]:
        """CPU-tier hit and its modelled load time (tier.py); nothing without a CPU tier."""
        if self.engine.scheduler.pool.tier is None:
            return {}
        cfg = self.r.cfg
        blocks = req.num_loaded // self.engine.scheduler.block_size
        return {names.ENGINE_CPU_HIT_TOKENS: req.num_loaded,
                names.ENGINE_KV_LOAD_MS: blocks * cfg.profile.kv_load_ms_per_block * cfg.time_scale}

    def _end_spans(self, span: trace.Span, req: Request, body: _Generation, chat: bool, status: int,
                   pulled: Pulled | None = None) -> None:
        try:
            cached = req.num_cached or 0
            span.set_attributes({
                names.GEN_AI_OPERATION_NAME: "chat" if chat else "text_completion",
                names.GEN_AI_REQUEST_MODEL: body.model or self.model,
                names.GEN_AI_RESPONSE_MODEL: self.model,
                names.GEN_AI_REQUEST_MAX_TOKENS: req.max_tokens,
                names.GEN_AI_RESPONSE_ID: req.id,
                names.GEN_AI_USAGE_INPUT_TOKENS: req.num_prompt,
                names.GEN_AI_USAGE_OUTPUT_TOKENS: req.num_output,
                names.REPLICA: self.name,
                names.GEN_AI_REQUEST_STREAM: bool(body.stream),
                names.PROMPT_TOKENS: req.num_prompt,
                names.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: cached,
                names.BLOCK_SIZE: self.engine.scheduler.block_size,
                names.HTTP_RESPONSE_STATUS_CODE: status,
            })
            if body.stream and req.t_first_token:
                span.set_attribute(names.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK, (req.t_first_token - req.t_arrival) / 1e9)
            span.set_attributes(self._vllm_attrs(req, body))
            if status != 200:
                genai.client_gone(span)
            params = body.kv_transfer_params
            if params is not None and (params.do_remote_decode or params.do_remote_prefill):
                span.set_attribute(names.PD_ROLE, "prefill" if params.do_remote_decode else "decode")
            parent = trace.set_span_in_context(span)
            end = req.t_finished or time.time_ns()
            if pulled is not None:
                self._child(names.SPAN_ENGINE_KV_TRANSFER, parent, pulled.t_start, pulled.t_end, {
                    names.KV_TRANSFER_TOKENS: pulled.tokens, names.KV_TRANSFER_MS: pulled.ms,
                    names.KV_TRANSFER_LOCAL_TOKENS: pulled.local_tokens,
                    names.KV_TRANSFER_OFFERED_TOKENS: pulled.offered_tokens,
                    names.PD_PREFILL_REPLICA: pulled.remote_engine_id or "",
                    **({names.KV_TRANSFER_SKIPPED: pulled.skipped} if pulled.skipped else {})})
            if req.t_scheduled:
                self._child(names.SPAN_ENGINE_QUEUE, parent, req.t_arrival, req.t_scheduled,
                            {names.ENGINE_QUEUE_MS: (req.t_scheduled - req.t_arrival) / 1e6})
                self._child(names.SPAN_ENGINE_PREFILL, parent, req.t_scheduled, req.t_first_token or end, {
                    names.PROMPT_TOKENS: req.num_prompt, names.ENGINE_CACHED_TOKENS: cached,
                    names.ENGINE_COMPUTED_TOKENS: req.num_prompt - cached, **self._tier_attrs(req)})
            else:
                self._child(names.SPAN_ENGINE_QUEUE, parent, req.t_arrival, end, {
                    names.ENGINE_QUEUE_MS: (end - req.t_arrival) / 1e6})
            if req.t_first_token:
                self._child(names.SPAN_ENGINE_DECODE, parent, req.t_first_token, end,
                            {names.GEN_AI_USAGE_OUTPUT_TOKENS: req.num_output})
            if self.r.group is not None:  # data-parallel rank / MoE (dp.py)
                self.r.group.end_spans(span, parent, req, self.r.dp_rank, self._child)
            span.end(end_time=max(end, time.time_ns()))
        except Exception:  # telemetry never breaks a request
            log.exception("span export failed")

    @staticmethod
    def _vllm_attrs(req: Request, body: _Generation) -> dict[str, Any]:
        """vLLM's `llm_request` attributes as its output processor sets them (do_tracing in
        vllm/v1/engine/output_processor.py), seconds: the engine core's queue (queued -> scheduled),
        prefill (-> first token) and decode (-> last token), TTFT and e2e from the request's arrival;
        the optional request parameters only when set, as vLLM does."""
        out: dict[str, Any] = {names.VLLM_REQUEST_ID: req.id, names.VLLM_USAGE_PROMPT_TOKENS: req.num_prompt,
                               names.VLLM_USAGE_COMPLETION_TOKENS: req.num_output,
                               names.VLLM_REQUEST_N: body.n}
        if req.max_tokens:
            out[names.GEN_AI_REQUEST_MAX_TOKENS] = req.max_tokens
        if body.temperature:
            out[names.VLLM_REQUEST_TEMPERATURE] = body.temperature
        if body.top_p:
            out[names.VLLM_REQUEST_TOP_P] = body.top_p
        if req.t_finished:
            out[names.VLLM_LATENCY_E2E] = (req.t_finished - req.t_arrival) / 1e9
        if req.t_scheduled and req.t_first_token:
            last = req.t_last_token or req.t_first_token
            out.update({names.VLLM_LATENCY_TTFT: (req.t_first_token - req.t_arrival) / 1e9,
                        names.VLLM_LATENCY_QUEUE: (req.t_scheduled - req.t_arrival) / 1e9,
                        names.VLLM_LATENCY_PREFILL: (req.t_first_token - req.t_scheduled) / 1e9,
                        names.VLLM_LATENCY_DECODE: (last - req.t_first_token) / 1e9,
                        names.VLLM_LATENCY_INFERENCE: (last - req.t_scheduled) / 1e9})
        return out

    @staticmethod
    def _child(name: str, parent: Context | None, start: int, end: int, attrs: dict[str, Any]) -> None:
        s = tracer.start_span(name, context=parent, start_time=start, attributes=attrs)
        s.end(end_time=end)
