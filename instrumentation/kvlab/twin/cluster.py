"""The whole system in virtual time: clients, the gateway, replicas, one clock.

Events, in time order (`clock.py`): a client sends (`clients.py`), the gateway routes the request
with the router's view as it is at that moment and makes its calls (`gateway.py`), a call reaches
its replica's queue (after the tokenize and request overheads), a replica's engine step ends
(tokens delivered, KV events emitted), a batch of KV events reaches the gateway's precise index,
the load view is scraped. Nothing waits on a clock: a run of an hour of traffic takes as long as
its Python work.

A P/D split's decode call pulls the prompt's KV (`engine/sim/transfer.py` `reserve`, `transfer_ms`
later `land`) before it is queued. The ranks of a data-parallel replica step together
(`replica.Lockstep`, the simulator's `LockstepGroup`).

The loop and the engines' steps are here; beside them: `feed.py` (the workload's prompts,
tokenized), `arrivals.py` (open-loop send times), `flight.py` (a request from its send to its last
token), `replica.py` (a replica's engine and the gateway's view of it, its data-parallel ranks'
lockstep), `cruise.py` (identical decode steps fast-forwarded as one event) and `watchdog.py` (a
run that stops advancing ends with an error).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from heapq import heappop
from typing import cast

from kvlab.engine.sim.length import too_long
from kvlab.engine.sim.runpool import RunPool
from kvlab.engine.sim.scheduler import FINISHED
from kvlab.engine.sim.transfer import Pull, reserve
from kvlab.kvcache.events import BlockRemoved, BlockStored, Event
from kvlab.lifecycle import GC_GEN0_DEFAULT
from kvlab.load.measure import Record
from kvlab.load.oracle import Prompt as Blocks
from kvlab.twin.clients import Clients
from kvlab.twin.clock import CRUISE, EVENTS, LOCKSTEP, SCRAPE, SEND, STEP, SUBMIT, TRANSFER, Clock
from kvlab.twin.cruise import advance, cruise_steps
from kvlab.twin.feed import Feed, Prompt
from kvlab.twin.flight import Flight
from kvlab.twin.gateway import Gateway
from kvlab.twin.keys import HASHED, AnswerKeys
from kvlab.twin.replica import Lockstep, Replica, join_ranks
from kvlab.twin.settings import Plan
from kvlab.twin.watchdog import STALL_EVENTS, STALL_STEPS, Watchdog, stalled


def _read(event: Event, unread: int) -> bool:
    """Whether the event holds a block the index reads (a key below `unread`); a stored event's
    unread keys come after its others (twin/keys.py)."""
    if isinstance(event, BlockStored):
        return cast(list[int], event.block_hashes)[0] < unread
    if isinstance(event, BlockRemoved):
        return any(map(unread.__gt__, cast(list[int], event.block_hashes)))
    return True


@dataclass(slots=True)
class Outcome:
    """What a run produced: one record per request, and how the run went."""

    records: list[Record]
    virtual_s: float
    steps: int
    replicas: list[str]
    index_blocks: int              # blocks in the precise index at the end
    speculative_confirmed: int
    speculative_expired: int


class Cluster:
    """Build the replicas and the gateway for a plan; `run` sends its requests."""

    def __init__(self, plan: Plan, feed: Feed | None = None, keep_keys: bool = True) -> None:
        self.plan = plan
        self.info = plan.information
        self.clock = Clock()
        events = plan.policy.index.kind == "precise"
        self.feed = feed or Feed(plan.workload)
        # a trace's keys ascend in runs (keys.py): untyped replicas with no CPU tier keep their
        # blocks, and the gateway its index, by key runs (engine/sim/runpool.py, kvcache/intervals.py)
        sim = plan.sim
        runs = (self.feed.keys_ascend(sim.block_size) and not (sim.cpu_kv_blocks or plan.profile.cpu_kv_blocks)
                and sim.typed_retention is None)
        self._runs = runs
        self.replicas = [Replica(m, plan.profile, sim, plan.num_blocks, events, runs) for m in plan.members]
        sampler = join_ranks(plan, self.replicas, self.feed.tok.tok)
        for r in self.replicas:
            r.backend.events_state = "live" if events else "none"
        self.gateway = Gateway(plan, self.replicas, self.feed, self.clock, sampler, keep_keys, runs)
        self.by_name = self.gateway.by_name
        self._pending_events: dict[str, list[Event]] = {}
        self._cruising: dict[Replica, None] = {}   # insertion order: runs stay deterministic
        self._watchdog = Watchdog(STALL_STEPS)
        self._records: list[Record] = []
        self._end_ms = 0.0            # the last request's end
        # a stepped ramp's load view at each scrape: (seconds, KV usage, waiting per replica)
        self.samples: list[tuple[float, list[float], list[float]]] = []

    @property
    def now_ms(self) -> float:
        return self.clock.now_ms

    @property
    def sent(self) -> list[Blocks] | None:
        """The block keys of every routed prompt, in send order (for the oracle), when kept."""
        return self.gateway.sent

    def run(self, progress: Callable[[int], None] | None = None) -> Outcome:
        """Send the plan's requests, run until every one finished; `progress(n)` after each finishes."""
        # few cycles die in a run, yet the interpreter's gen-0 threshold of 700 walked the young
        # objects about 100 times and every pool's blocks once more in 16 x 10,000 (0.4 s); a
        # served process's threshold (lifecycle.settle_gc) for the run's length (docs/benchmarks.md)
        before = gc.get_threshold()
        gc.set_threshold(GC_GEN0_DEFAULT, *before[1:])
        try:
            return self._run(progress)
        finally:
            gc.set_threshold(*before)

    def _run(self, progress: Callable[[int], None] | None) -> Outcome:
        plan, clock = self.plan, self.clock
        self.clients = Clients(plan, self.feed, clock)
        # blocks a single prompt holds are looked up only by it, before it is sent anywhere: the
        # index keeps none of them (twin/keys.py), the router's answers are the same
        unread = self.gateway.precise.unread_from = self.feed.unread(plan.sim.block_size)
        if self._runs:   # the pools are empty yet: from where their keys are kept one by one (hashed)
            bs = plan.sim.block_size
            bound = self.feed.key_bound(bs)
            # an answer's blocks keyed by structure, above the prompts' keys, where no one but the
            # pools reads them: every output token one id, and no chunk continuing an answer
            answers = AnswerKeys(bound, plan.num_blocks + 1, bs) \
                if unread is not None and self.gateway.sampler is None and self.gateway.chunking is None else None
            for r in self.replicas:
                pool = cast(RunPool, r.pool)
                pool.bound = bound if answers is None else HASHED   # (nothing hashed then)
                if answers is not None:
                    r.sched.answer_keys = answers.first
                if unread is not None:   # and from where their KV events leave the keys out
                    pool.quiet = unread
        self._progress = progress
        self._scrape = 0              # the scrapes' grid: the k-th is at k × the interval
        self._sampled_ms = sum(st.duration for st in plan.stages) * 1000.0   # a stepped ramp's length
        if self.info.scrape_interval_ms > 0:
            clock.push(0.0, SCRAPE, None)
        heap, intake, flights = clock.heap, clock.intake, self.gateway.flights
        last, same = -1.0, 0
        while heap or intake:
            # client-side events (sends, a request reaching its engine) and engine-side ones, in time order
            if intake and (not heap or intake[0][0] < heap[0][0]):
                t, _, kind, obj = heappop(intake)
            else:
                t, _, kind, obj = heappop(heap)
            if t != last:
                last, same = t, 0
            else:
                same += 1
                if same >= STALL_EVENTS:
                    raise stalled(t, len(self._records), len(flights), f"{same:,} events in a row at one instant")
            clock.now_ms = t
            if kind == STEP:
                self._step_end(obj)  # type: ignore[arg-type]
            elif kind == SEND:
                self._send(*obj)  # type: ignore[misc]
            elif kind == SUBMIT:
                self._submit(obj)  # type: ignore[arg-type]
            elif kind == CRUISE:
                self._cruise_end(*obj)  # type: ignore[misc]
            elif kind == EVENTS:
                name, events = cast(tuple[str, list[Event] | None], obj)
                self.gateway.precise.apply(name, self._pending_events.pop(name, []) if events is None else events)
            elif kind == SCRAPE:
                self._settle_all()
                for r in self.replicas:
                    r.scrape()
                if self.plan.stages:
                    self.samples.append((t / 1000.0, [r.backend.kv_usage for r in self.replicas],
                                         [r.backend.waiting for r in self.replicas]))
                self._next_scrape()
            elif kind == TRANSFER:
                self._landed(*obj)  # type: ignore[misc]
            elif kind == LOCKSTEP:
                self._lockstep_end(obj)  # type: ignore[arg-type]
        if flights:
            raise stalled(clock.now_ms, len(self._records), len(flights),
                          "no event left that could finish the requests in flight")
        return self.outcome()

    def _next_scrape(self) -> None:
        """Queue the next scrape on the interval's grid while requests are still to come or in
        flight. While no engine has anything to do, the load view cannot change before the next
        send or submit, so the scrapes up to it are skipped: an idle hour of a trace, or a request
        overhead of days, costs one event, not millions (a stepped ramp's scrapes are its samples:
        skipped only past its end)."""
        clock = self.clock
        intake, heap = clock.intake, clock.heap
        if not intake and (not self.gateway.flights or not heap):
            return   # nothing to come; or requests in flight and nothing left to move them (`run` says so)
        every = self.info.scrape_interval_ms
        k = self._scrape + 1
        if not heap and clock.now_ms >= self._sampled_ms:
            k = max(k, int(intake[0][0] // every))
        self._scrape = k
        clock.push(k * every, SCRAPE, None)

    def outcome(self) -> Outcome:
        """What has finished so far (all of it once `run` returns; a stopped run's part)."""
        precise = self.gateway.precise
        return Outcome(self._records, self._end_ms / 1000.0, sum(r.steps for r in self.replicas),
                       [r.name for r in self.replicas], precise.total_blocks(), precise.confirmed, precise.expired)

    # ---- the clients and the gateway -------------------------------------------------------
    def _send(self, prompt: Prompt, user: int | None, rest: list[Prompt]) -> None:
        """A client's request reaches the gateway now."""
        self.clients.sent(prompt)
        if self.plan.max_model_len and (message := too_long(len(prompt.tokens), prompt.max_tokens,
                                                            self.plan.max_model_len)) is not None:
            self._refuse(prompt, user, rest, message)
            return
        if self.info.scrape_interval_ms <= 0:   # the router reads every replica's state as it is now
            self._settle_all()
            for r in self.replicas:
                r.scrape()
        flight = self.gateway.send(prompt, user)
        if rest:   # an open-loop session's later requests follow this one (closed loop inside it)
            flight.user = self.clients.follow(rest)

    def _refuse(self, prompt: Prompt, user: int | None, rest: list[Prompt], message: str) -> None:
        """vLLM's 400 for a request longer than the max model length (engine/sim/length.py): an
        error record, and its client goes on as after any answer."""
        now, plan = self.clock.now_ms, self.plan
        took = self.info.request_overhead_ms
        self._records.append(Record(ts=now / 1000.0, phase=plan.policy.name, policy=plan.policy.name,
                                    workload=plan.workload.name, group=prompt.group, session=prompt.session,
                                    step=prompt.step, status=400, prompt_tokens=len(prompt.tokens), e2e_ms=took,
                                    error=f"HTTP 400: {message}"))
        self._end_ms = max(self._end_ms, now + took)
        if self._progress is not None:
            self._progress(len(self._records))
        if user is None and rest:
            user = self.clients.follow(rest)
        if user is not None:
            self.clients.answered(user, now + took)

    def _finish(self, f: Flight) -> None:
        """A call's last token: the answer is complete (unless chunked decoding goes on)."""
        if f.chunk and self.gateway.chunk_ended(f):
            return
        self.gateway.release(f)
        now = self.clock.now_ms
        rec = f.record
        rec.e2e_ms = now - f.sent_ms
        self._end_ms = now
        rec.output_tokens = f.done + f.req.num_output
        if not f.chunk:
            rec.cached_tokens = f.req.num_cached or 0
        if f.gap_n:
            rec.itl_ms = f.gap_sum / f.gap_n
            rec.itl_max_ms = f.gap_max
            assert rec.ttft_ms is not None
            rec.tpot_ms = (rec.e2e_ms - rec.ttft_ms) / (rec.output_tokens - 1)
        self._records.append(rec)
        if self._progress is not None:
            self._progress(len(self._records))
        if f.user is not None:
            self.clients.answered(f.user, now)

    # ---- the engines -----------------------------------------------------------------------
    def _settle_all(self) -> None:
        """Settle every cruise for a read of the replicas' state (a scrape, an always-fresh send)."""
        for r in list(self._cruising):
            self._settle(r, read=True)

    def _submit(self, flight: Flight) -> None:
        """A call reaches its replica."""
        replica = flight.replica
        self._settle(replica)
        if flight.offered:   # a decode call with KV to pull: queued once the KV has landed
            pull = reserve(replica.pool, flight.req, flight.offered)
            flight.offered = 0
            if pull.tokens:
                self.clock.push(self.clock.now_ms + replica.profile.transfer_ms(pull.tokens) * replica.scale,
                                TRANSFER, (flight, pull))
                return
        replica.sched.add(flight.req)
        if not replica.busy:
            self._start(replica)

    def _landed(self, flight: Flight, pull: Pull) -> None:
        """A decode replica's KV pull is done: the blocks are cached, the request queued."""
        self._settle(flight.replica)
        pull.land(flight.req)
        pull.release()
        self._submit(flight)

    def _start(self, replica: Replica) -> None:
        """An idle replica with work starts its next step (or a cruise of identical decode steps);
        a rank starts its whole group's (no cruise: a group step's cost depends on every rank)."""
        group = replica.group
        if group is not None:
            self.clock.push(self.clock.now_ms + group.start_step(), LOCKSTEP, group)
        elif not self._cruise(replica):
            self.clock.push(self.clock.now_ms + replica.start_step(), STEP, replica)
            if not replica.batch.requests:   # type: ignore[union-attr]
                what = self._watchdog.idle_step(replica)   # a step that scheduled nothing
                if what is not None:
                    raise stalled(self.clock.now_ms, len(self._records), len(self.gateway.flights), what)

    def _cruise(self, replica: Replica) -> bool:
        """Start a cruise of the replica's next decode steps when it can (`cruise_steps`). Nothing
        is applied yet: whatever could change or read the replica's state first (a request
        reaching it, a send, a scrape) settles the cruise at the step in progress (`_settle`)."""
        k = cruise_steps(replica)
        if not k:
            return False
        now = self.clock.now_ms
        dur = replica.profile.step_ms(0, len(replica.sched.running)) * replica.scale
        replica.cruise = (now, dur, k)
        replica.busy = True
        replica.batch = None
        self._cruising[replica] = None
        replica.gen += 1
        self.clock.push(now + k * dur, CRUISE, (replica, replica.gen))
        return True

    def _settle(self, replica: Replica, read: bool = False) -> None:
        """Apply a cruise's steps up to the one in progress now; it ends with that step. For a
        `read`, which changes nothing, the rest of the cruise goes on from that step's end as the
        replica would begin it again there (`_start`), with no event in between; anything else
        reaching the replica before then ends it there."""
        cruise = replica.cruise
        if cruise is None:
            return
        t0, dur, k = cruise
        now = self.clock.now_ms
        if now < t0:   # a cruise going on from a read's step, not begun
            if not read:
                replica.cruise = None
                self._cruising.pop(replica, None)
                replica.gen += 1
                self.clock.push(t0, CRUISE, (replica, replica.gen))
            return
        j = min(k, int((now - t0) / dur) + 1)
        end = t0 + j * dur
        advance(replica, j, dur, end, self.gateway.flights)
        self._cruising.pop(replica, None)
        if replica.events:
            self._publish(replica)
        replica.gen += 1   # the cruise's end event is stale now: it ends with this step
        if read and k - j >= 2:   # `cruise_steps` would say k - j there: nothing else has changed
            replica.cruise = (end, dur, k - j)
            self._cruising[replica] = None
            self.clock.push(end + (k - j) * dur, CRUISE, (replica, replica.gen))
            return
        self.clock.push(end, CRUISE, (replica, replica.gen))

    def _cruise_end(self, replica: Replica, gen: int) -> None:
        if gen != replica.gen:   # the end of a cruise cut short since: its own end event follows
            return
        if replica.cruise is not None:
            _, dur, k = replica.cruise
            advance(replica, k, dur, self.clock.now_ms, self.gateway.flights)
            self._cruising.pop(replica, None)
            if replica.events:
                self._publish(replica)
        replica.busy = False
        done, replica.done = replica.done, []
        for f in done:
            replica.sched.finish(f.req, "length")
            self._finish(f)
        if replica.sched.has_work():
            self._start(replica)

    def _step_end(self, replica: Replica) -> None:
        self._deliver(replica)
        if replica.sched.has_work() and not replica.busy:
            self._start(replica)

    def _lockstep_end(self, group: Lockstep) -> None:
        ranks = group.ranks
        for r in ranks:
            self._deliver(r)
        if any(r.sched.has_work() for r in ranks):
            self._start(ranks[0])

    def _deliver(self, replica: Replica) -> None:
        """The step in progress ends: its tokens reach their clients, its KV events are published."""
        now = self.clock.now_ms
        batch = replica.batch
        assert batch is not None   # the step in progress
        replica.busy = False
        replica.batch = None
        flights = self.gateway.flights
        for req in replica.sched.complete(batch):
            f = flights[req.id]
            if req.num_output == 1 and not f.done:
                if f.decode is not None:   # a P/D prefill call's answer
                    self.gateway.handoff(f)
                    continue
                f.record.ttft_ms = now - f.sent_ms
                self.gateway.book.first_token(f.prefill, now / 1000.0)
            else:
                gap = now - f.last_ms
                f.gap_sum += gap
                f.gap_n += 1
                f.gap_max = max(f.gap_max, gap)
            f.last_ms = now
            if req.status == FINISHED:
                self._finish(f)
        if replica.events:
            self._publish(replica)

    def _publish(self, replica: Replica) -> None:
        events = replica.pool.take_events()
        unread = self.gateway.precise.unread_from
        if unread is not None and events and not self._runs:
            # an event the index would skip whole (mostly a decode step's answer blocks, stored or
            # evicted) is not delivered: the same answers, an event fewer in the loop (kvcache/index.py);
            # a run pool leaves those keys out itself (`RunPool.quiet`)
            events = [e for e in events if _read(e, unread)]
        if not events:
            return
        info = self.info
        name = replica.name
        if info.kv_event_batch_ms > 0:
            held = self._pending_events.get(name)
            if held is not None:
                held.extend(events)
                return
            self._pending_events[name] = events
            w = info.kv_event_batch_ms
            due = (self.clock.now_ms // w + 1) * w + info.kv_event_delay_ms
            self.clock.push(due, EVENTS, (name, None))   # None: the window's events, whatever they are then
            return
        if info.kv_event_delay_ms <= 0:
            self.gateway.precise.apply(name, events)
        else:
            self.clock.push(self.clock.now_ms + info.kv_event_delay_ms, EVENTS, (name, events))

