"""A replica's engine loop: drives the scheduler in real time, one step after another.

Each step sleeps for its modelled duration (profile × time scale), then applies its results:
KV-events batch published, sampled tokens handed to the waiting response writers (one future
wake-up per request per step), metrics observed. Steps chain on their ideal end times, so timer
jitter (≈1 ms) does not accumulate; a loop that falls further behind (the process is overloaded)
starts the next step late, and that overhead shows in latency, as it would on a real engine.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvlab.engine.sim.metrics import ReplicaMetrics
from kvlab.engine.sim.profile import LatencyProfile
from kvlab.engine.sim.sampler import Sampler
from kvlab.engine.sim.scheduler import FINISHED, Batch, Request, Scheduler
from kvlab.kvcache.transport import EventPublisher
from kvlab.lifecycle import cancel

log = logging.getLogger(__name__)

JITTER_S = 0.002  # lateness absorbed by chaining steps on their ideal end time


class Engine:
    def __init__(self, scheduler: Scheduler, profile: LatencyProfile, time_scale: float,
                 sampler: Sampler, metrics: ReplicaMetrics | None = None,
                 publisher: EventPublisher | None = None) -> None:
        self.scheduler = scheduler
        self.profile = profile
        self.time_scale = time_scale
        self.sampler = sampler
        self.metrics = metrics
        self.publisher = publisher
        self.steps = 0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        if metrics is not None:
            metrics.bind(lambda: len(scheduler.running), lambda: len(scheduler.waiting),
                         lambda: scheduler.pool.usage)

    # ---- API for the server ----------------------------------------------------------
    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        await cancel(self._task)
        self._task = None

    def submit(self, req: Request) -> None:
        req.t_arrival = time.time_ns()
        self.scheduler.add(req)
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(req.num_prompt)
        assert self._wake is not None, "engine not started"
        self._wake.set()

    def abort(self, req: Request) -> None:
        """The client went away: free the request's blocks now."""
        if req.status != FINISHED:
            self.scheduler.abort(req)
            req.t_finished = time.time_ns()
            if self.metrics is not None:
                self.metrics.success["abort"].inc()
            self._publish()

    def reset_prefix_cache(self) -> None:
        self.scheduler.reset_prefix_cache()
        self._publish()

    # ---- the loop --------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        sched, profile, scale = self.scheduler, self.profile, self.time_scale / 1000.0
        wake = self._wake
        assert wake is not None
        next_start: float | None = None
        while True:
            if not sched.has_work():
                wake.clear()
                await wake.wait()
                next_start = None
            now = loop.time()
            start = next_start if next_start is not None and now - next_start <= JITTER_S else now
            batch = self.schedule_step()
            target = start + profile.step_ms(batch.prefill_tokens, batch.decode_seqs, batch.prefill_ctx_k,
                                           len(batch.admitted), batch.loaded_blocks) * scale
            delay = target - loop.time()
            # always yield once, so HTTP handlers run between steps even when the loop is late
            await asyncio.sleep(delay if delay > 0 else 0)
            next_start = target
            self.steps += 1
            try:
                self._deliver(sched.complete(batch))
            except Exception:  # a bug here must not kill the replica's loop silently
                log.exception("engine step failed")
            self._publish()

    def schedule_step(self) -> Batch:
        """The scheduler's next batch, with admission times and metrics recorded."""
        batch = self.scheduler.schedule()
        if batch.admitted:
            t_ns = time.time_ns()
            for req in batch.admitted:
                req.t_scheduled = t_ns
            if self.metrics is not None:
                self._observe_admitted(batch.admitted)
        if batch.preempted and self.metrics is not None:
            self.metrics.preemptions.inc(batch.preempted)
        return batch

    def _publish(self) -> None:
        events = self.scheduler.pool.take_events()
        if events and self.publisher is not None:
            self.publisher.publish(events)

    def _observe_admitted(self, admitted: list[Request]) -> None:
        m = self.metrics
        assert m is not None
        for req in admitted:
            m.prefix_queries.inc(req.num_tokens)
            m.prefix_hits.inc((req.num_cached or 0) - req.num_loaded)
            if self.scheduler.pool.tier is not None:   # vLLM counts connector lookups only with a connector
                m.external_queries.inc(req.num_tokens)
                m.external_hits.inc(req.num_loaded)
            m.queue.observe((req.t_scheduled - req.t_arrival) / 1e9)

    def _deliver(self, sampled: list[Request]) -> None:
        t_ns = time.time_ns()
        m = self.metrics
        for req in sampled:
            if req.num_output == 1:
                req.t_first_token = t_ns
                if m is not None:
                    m.ttft.observe((t_ns - req.t_arrival) / 1e9)
            elif m is not None:
                m.itl.observe((t_ns - req.t_last_token) / 1e9)
            req.t_last_token = t_ns
            if req.stop and req.status != FINISHED and req.num_output >= req.min_tokens:
                self._check_stop(req)
            if req.status == FINISHED:
                req.t_finished = t_ns
                if m is not None:
                    m.generation_tokens.inc(req.num_output)
                    m.e2e.observe((t_ns - req.t_arrival) / 1e9)
                    m.success[req.finish_reason or "length"].inc()
            waiter = req.waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def _check_stop(self, req: Request) -> None:
        text = self.sampler.detokenize(req.output[:req.num_output])
        last = len(self.sampler.text[req.output[req.num_output - 1]])
        for stop in req.stop:
            # only a match that ends in the newest token is new
            idx = text.find(stop, max(0, len(text) - last - len(stop) + 1))
            if idx >= 0:
                req.text_len = idx
                self.scheduler.finish(req, "stop")
                return
