"""The Locust user that replays a workload against an OpenAI-compatible target.

Each user takes the next session from the workload's shared, seeded stream and sends its requests
in order (streaming chat completions with usage). Per request it opens the trace's root span
(`client.request`, W3C `traceparent` injected) and reports to Locust: the request itself
(type POST, name "chat", response time = end-to-end, failures included) and, for successful ones,
"TTFT" and "ITL" entries, so the web UI and CSVs show time to first token separately. The full
measurement travels in the event's context; the locustfile's hook writes it to requests.jsonl.

Open loop (the feed has a schedule of send times): one user is the dispatcher. It sleeps until each
scheduled time and starts that session in its own greenlet, whether or not earlier ones finished;
TTFT and E2E count from the scheduled time, and how late the send was is recorded with it. Run it
with one user (`-u 1`); the web UI shows its requests like any other.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import gevent
import msgspec
import requests
from gevent.pool import Group
from locust import User, constant, task
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from kvlab.load.measure import UNFINISHED, Record, chat_body, stream_chat
from kvlab.load.workloads import Workload, WorkloadRequest
from kvlab.telemetry import genai, names

tracer = trace.get_tracer("kvlab.load")


class Feed:
    """The workload's session stream shared by every user of this process (gevent: no locking)."""

    def __init__(self, workload: Workload[Any], model: str, phase: str = "", policy: str = "",
                 schedule: Iterator[float] | None = None) -> None:
        self.workload = workload
        self.model = model
        self.phase = phase
        self.policy = policy
        self._sessions: Iterator[tuple[int, list[WorkloadRequest]]] = enumerate(workload.sessions())
        self.counter = itertools.count()
        self.schedule = schedule            # open loop: send times in seconds from the start
        self.dispatching = False
        self.inflight: dict[int, Record] = {}   # open loop: requests sent and not finished

    def warm(self) -> Feed:
        """Draw the first session now (a workload makes its shared texts then, which takes a while):
        done before Locust's run time starts, it does not eat into the phase."""
        first = next(self._sessions)
        self._sessions = itertools.chain([first], self._sessions)
        return self

    def unfinished(self) -> list[Record]:
        """The open-loop requests still running (at the end of the phase), as error records."""
        now = time.time()
        out = []
        for record in self.inflight.values():
            record.error, record.e2e_ms = UNFINISHED, (now - record.ts) * 1000
            out.append(record)
        self.inflight.clear()
        return out

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
        # the open loop's dispatcher has many requests in flight at once: a connection each
        adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=1024)
        self.http.mount("http://", adapter)
        self.http.mount("https://", adapter)

    def on_stop(self) -> None:
        self.http.close()

    @task
    def run_session(self) -> None:
        feed = FEED
        if feed is None:  # no test_start yet (cannot happen under Locust's runners)
            time.sleep(0.1)
            return
        if feed.schedule is not None:
            self.dispatch(feed, feed.schedule)
            return
        session, requests_ = feed.next_session()
        for step, req in enumerate(requests_):
            if req.pause_s:
                time.sleep(req.pause_s)
            if self.send(feed, req, session, step).status == 0:  # target unreachable: back off instead of spinning
                time.sleep(0.5)
                return

    def dispatch(self, feed: Feed, schedule: Iterator[float]) -> None:
        """Send each session at its scheduled time in a greenlet of its own (the open loop)."""
        if feed.dispatching:   # one dispatcher per process; another user has nothing to do
            gevent.sleep(1.0)
            return
        feed.dispatching = True
        group = Group()
        # each session is drawn before its time comes (a workload's first texts take a while to
        # make), the first one before the clock starts
        pending = feed.next_session()
        start = time.time()
        for offset in schedule:
            due = start + offset
            if (wait := due - time.time()) > 0:
                gevent.sleep(wait)
            if self._state != "running":   # Locust is stopping this user: no new sends
                break
            group.spawn(self.send_session, feed, *pending, due)
            pending = feed.next_session()
        group.join()
        while self._state == "running":   # the schedule (a trace) has ended: wait for Locust's run time
            gevent.sleep(0.5)

    def send_session(self, feed: Feed, session: int, requests_: list[WorkloadRequest], due: float) -> None:
        """One open-loop session: its first request at `due`, the rest after it as a closed loop does."""
        for step, req in enumerate(requests_):
            if req.pause_s:
                time.sleep(req.pause_s)
            self.send(feed, req, session, step, due=due if step == 0 else None)

    def send(self, feed: Feed, req: WorkloadRequest, session: int | None = None, step: int = 0,
             due: float | None = None) -> Record:
        """One request; with `due` (open loop) its latency counts from that scheduled time."""
        n = next(feed.counter)
        now = time.time()
        record = Record(ts=due if due is not None else now, phase=feed.phase, policy=feed.policy,
                        workload=feed.workload.name, group=req.group, turn=req.turn, session=session, step=step)
        if due is not None:
            record.lateness_ms = round(max(0.0, now - due) * 1000, 3)
            feed.inflight[n] = record
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
            try:
                stream_chat(self.http, f"{(self.host or '').rstrip('/')}/v1/chat/completions",
                            chat_body(req, feed.model, feed.workload.seed + n), headers, record)
            except BaseException as exc:
                if not isinstance(exc, Exception):
                    # Locust stopped this user mid-request (GreenletExit, or any other BaseException):
                    # OTel marks only an Exception, and the span would read as a finished request
                    # without usage
                    span.set_status(Status(StatusCode.ERROR, "cancelled: the load stopped mid-request"))
                    span.set_attribute(names.ERROR_TYPE, "cancelled")
                raise
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
        if record.lateness_ms is not None:
            if feed.inflight.pop(n, None) is None:   # the phase ended and counted it unfinished already
                return record
            record.e2e_ms += record.lateness_ms
            if record.ttft_ms is not None:
                record.ttft_ms += record.lateness_ms
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
