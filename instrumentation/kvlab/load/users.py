"""The Locust user that replays a workload against an OpenAI-compatible target.

Each user takes the next session from the workload's shared, seeded stream and sends its requests
in order (streaming chat completions with usage). Per request it opens the trace's root span
(`client.request`, W3C `traceparent` injected) and reports to Locust: the request itself
(type POST, name "chat", response time = end-to-end, failures included) and, for successful ones,
"TTFT" and "ITL" entries, so the web UI and CSVs show time to first token separately. The full
measurement travels in the event's context; the locustfile's hook writes it to requests.jsonl.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import requests
from locust import User, constant, task
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from kvlab.load.measure import Record, chat_body, stream_chat
from kvlab.load.workloads import Workload, WorkloadRequest
from kvlab.telemetry import genai, names

tracer = trace.get_tracer("kvlab.load")


class Feed:
    """The workload's session stream shared by every user of this process (gevent: no locking)."""

    def __init__(self, workload: Workload[Any], model: str, phase: str = "", policy: str = "") -> None:
        self.workload = workload
        self.model = model
        self.phase = phase
        self.policy = policy
        self._sessions: Iterator[tuple[int, list[WorkloadRequest]]] = enumerate(workload.sessions())
        self.counter = itertools.count()

    def next_session(self) -> tuple[int, list[WorkloadRequest]]:
        """The next session and its index in the stream (recorded, so the oracle can replay it)."""
        return next(self._sessions)


FEED: Feed | None = None   # set by the locustfile when a test starts


class ChatUser(User):
    """Streams the workload's chat sessions; a `requests` session per user keeps connections alive.

    (A plain `User` rather than `HttpUser`: HttpUser's client would report each request when its
    headers arrive, before the stream is read; this user reports what it measured itself.)
    """

    wait_time = constant(0)

    def on_start(self) -> None:
        self.http = requests.Session()

    def on_stop(self) -> None:
        self.http.close()

    @task
    def run_session(self) -> None:
        feed = FEED
        if feed is None:  # no test_start yet (cannot happen under Locust's runners)
            time.sleep(0.1)
            return
        session, requests_ = feed.next_session()
        for step, req in enumerate(requests_):
            if req.pause_s:
                time.sleep(req.pause_s)
            if self.send(feed, req, session, step).status == 0:  # target unreachable: back off instead of spinning
                time.sleep(0.5)
                return

    def send(self, feed: Feed, req: WorkloadRequest, session: int | None = None, step: int = 0) -> Record:
        n = next(feed.counter)
        record = Record(ts=time.time(), phase=feed.phase, policy=feed.policy, workload=feed.workload.name,
                        group=req.group, turn=req.turn, session=session, step=step)
        attrs: dict[str, str | int | bool] = {names.GEN_AI_OPERATION_NAME: "chat", names.GEN_AI_REQUEST_MODEL: feed.model,
                 names.GEN_AI_REQUEST_MAX_TOKENS: req.max_tokens, names.WORKLOAD: feed.workload.name,
                 names.GEN_AI_REQUEST_STREAM: True, **genai.span_attributes(names.SPAN_CLIENT_REQUEST, self.host or "")}
        with tracer.start_as_current_span(names.genai_span_name("chat", feed.model), kind=SpanKind.CLIENT,
                                          attributes=attrs) as span:
            headers: dict[str, str] = {**req.headers, **({names.HEADER_KV_HINT: req.hint} if req.hint else {})}
            propagate.inject(headers)
            ctx = span.get_span_context()
            if ctx.is_valid:
                record.trace_id = format(ctx.trace_id, "032x")
            stream_chat(self.http, f"{(self.host or '').rstrip('/')}/v1/chat/completions",
                        chat_body(req, feed.model, feed.workload.seed + n), headers, record)
            span.set_attribute(names.HTTP_RESPONSE_STATUS_CODE, record.status)
            if record.ttft_ms is not None:
                span.set_attribute(names.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK, record.ttft_ms / 1000)
            if record.replica:
                span.set_attribute(names.REPLICA, record.replica)
            if record.prompt_tokens is not None:
                span.set_attribute(names.GEN_AI_USAGE_INPUT_TOKENS, record.prompt_tokens)
            span.set_attribute(names.GEN_AI_USAGE_OUTPUT_TOKENS, record.output_tokens)
            if record.cached_tokens is not None:
                span.set_attribute(names.PREFIX_DELIVERED_TOKENS, record.cached_tokens)
            if record.error:
                span.set_status(Status(StatusCode.ERROR, record.error[:200]))
                span.set_attribute(names.ERROR_TYPE, str(record.status or "connection"))
        fire = self.environment.events.request.fire
        fire(request_type="POST", name="chat", response_time=record.e2e_ms, response_length=record.output_tokens,
             exception=RuntimeError(record.error) if record.error else None,
             context={"kvlab_record": msgspec.to_builtins(record)})
        if not record.error and record.ttft_ms is not None:
            fire(request_type="TTFT", name="chat", response_time=record.ttft_ms, response_length=0,
                 exception=None, context={})
            if record.itl_ms is not None:
                fire(request_type="ITL", name="chat", response_time=record.itl_ms, response_length=0,
                     exception=None, context={})
        return record
