"""The whole system in virtual time: clients, the gateway's router, replicas, one event queue.

Events, in time order: a client sends (the prompt is tokenized and routed with the router's view
as it is at that moment), the request reaches its replica's queue (after the tokenize and request
overheads), a replica's engine step ends (tokens delivered, KV events emitted), a batch of KV
events reaches the gateway's precise index, the load view is scraped. Nothing waits on a clock: a
run of an hour of traffic takes as long as its Python work.

With prefill/decode pools the gateway's own P/D decision (`gateway/split.py` `plan_split`) decides each
request: a split one is first a one-token request on the chosen prefill replica, then, one
request hop after its answer, a request on the decode replica that pulls the prompt's KV
(`engine/sim/transfer.py` `reserve`, `transfer_ms` later `land`) before it is queued. The ranks of
a data-parallel replica step together (`replica.Lockstep`, the simulator's `LockstepGroup`).

With chunked decoding (the policy's `chunked:`), a request generates in chunks as the live
gateway's `gateway/chunked/splice.py` does: each chunk waits for a slot in its replica's
`SlotQueue` (the live queue, on the virtual clock), then is a call to that replica with the prompt
and the tokens generated so far, one request hop after the grant; the gateway's lease spans them all.

The loop, the gateway's calls and the engines' step ends are here; the rest beside it: `feed.py`
(the workload's prompts, tokenized), `arrivals.py` (open-loop send times), `flight.py` (a request
from its send to its last token), `replica.py` (a replica's engine and the gateway's view of it,
its data-parallel ranks' lockstep), `cruise.py` (identical decode steps fast-forwarded as one
event) and `watchdog.py` (a run that stops advancing ends with an error).
"""

from __future__ import annotations

import heapq
import random
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import cast

from kvlab.engine.sim.length import too_long
from kvlab.engine.sim.scheduler import FINISHED, Request
from kvlab.engine.sim.transfer import Pull, offered, reserve
from kvlab.gateway.chunked.slots import SlotQueue, class_rank
from kvlab.gateway.endpoints import Registry
from kvlab.gateway.prefill import PrefillBook
from kvlab.gateway.router import Router
from kvlab.gateway.scheduler import presets
from kvlab.gateway.split import SPLIT, plan_split, prefill_replicas
from kvlab.kvcache.events import Event
from kvlab.kvcache.hashing import continue_keys
from kvlab.kvcache.index import ApproximateIndex, PreciseIndex
from kvlab.load.measure import Record
from kvlab.load.oracle import Prompt as Blocks
from kvlab.twin.arrivals import arrivals
from kvlab.twin.cruise import advance
from kvlab.twin.feed import Feed, Prompt
from kvlab.twin.flight import Flight
from kvlab.twin.replica import Lockstep, Replica, join_ranks
from kvlab.twin.settings import Plan
from kvlab.twin.watchdog import STALL_EVENTS, STALL_STEPS, Watchdog, stalled

SEND, SUBMIT, STEP, EVENTS, SCRAPE, CRUISE, TRANSFER, LOCKSTEP = 0, 1, 2, 3, 4, 5, 6, 7
_OUTPUT_TOKEN = 1000   # the id every simulated output token has (its value never matters here)


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
    """Build the replicas and the gateway's router for a plan; `run` sends its requests."""

    def __init__(self, plan: Plan, feed: Feed | None = None, keep_keys: bool = True) -> None:
        self.plan = plan
        self.sent: list[Blocks] | None = [] if keep_keys else None   # for the oracle, in send order
        info = plan.information
        self.info = info
        cfg = plan.policy
        ttl = cfg.index.speculative_ttl_s if info.speculative_ttl_s is None else info.speculative_ttl_s
        self.now_ms = 0.0
        # the twin's engines hash as the gateway does: their KV events carry its keys
        self.precise = PreciseIndex(ttl, clock=lambda: self.now_ms / 1000.0, engine_keys=True)
        self.approx = ApproximateIndex(cfg.index.approx_capacity_blocks)
        events = cfg.index.kind == "precise"
        self.replicas = [Replica(m, plan.profile, plan.sim, plan.num_blocks, events)
                         for m in plan.members]
        self.by_name = {r.name: r for r in self.replicas}
        self.feed = feed or Feed(plan.workload)
        self.sampler = join_ranks(plan, self.replicas, self.feed.tok.tok)
        self.registry = Registry()
        self.registry.update([r.backend.endpoint for r in self.replicas])
        self.registry.replicas = {r.name: r.backend for r in self.replicas}
        for r in self.replicas:
            r.backend.events_state = "live" if events else "none"
        # a twin replica's event stream never goes stale: no approximate fallback is kept for it
        self.router = Router(cfg, self.registry, self.precise, self.approx, presets.build(cfg, _rng(plan)),
                             fallback=False)
        # the prefill pool when the policy splits (a twin replica never fails: it is fixed)
        self.prefills = prefill_replicas(self.registry) if cfg.pd.enabled else None
        self.book = PrefillBook()
        self.chunking = cfg.chunked if cfg.chunked.chunk_tokens > 0 else None
        self._slots: dict[str, SlotQueue] = {}
        self._rank = class_rank(cfg.chunked.default_priority)   # no priority header in the twin's requests
        self._heap: list[tuple[float, int, int, object]] = []     # engine-side events
        self._intake: list[tuple[float, int, int, object]] = []   # sends and submits
        self._seq = 0
        self._flights: dict[str, Flight] = {}
        self._pending_events: dict[str, list[Event]] = {}
        self._cruising: dict[Replica, None] = {}   # insertion order: runs stay deterministic
        self._watchdog = Watchdog(STALL_STEPS)
        self._ids = 0
        # a stepped ramp's load view at each scrape: (seconds, KV usage, waiting per replica)
        self.samples: list[tuple[float, list[float], list[float]]] = []

    # ---- the event queues -----------------------------------------------------------------
    def _push(self, t: float, kind: int, obj: object) -> None:
        self._seq += 1
        heapq.heappush(self._intake if kind <= SUBMIT else self._heap, (t, self._seq, kind, obj))

    def run(self, progress: Callable[[int], None] | None = None) -> Outcome:
        """Send the plan's requests, run until every one finished; `progress(n)` after each finishes."""
        plan = self.plan
        self._left = plan.settings.requests            # requests still to send
        self._sessions = self.feed.sessions(self._left)
        # blocks a single prompt holds are looked up only by it, before it is sent anywhere: the
        # index keeps none of them (twin/keys.py), the router's answers are the same
        self.precise.unread_from = self.feed.unread(plan.sim.block_size)
        self._until_ms = (plan.settings.duration_s or float("inf")) * 1000.0
        self._records: list[Record] = []
        self._end_ms = 0.0            # the last request's end
        self._progress = progress
        self._user_session: dict[int, list[Prompt]] = {}
        self._times: Iterator[float] | None = None
        if plan.users is not None:
            for u in range(min(plan.users, self._left)):
                self._next_of_user(u, 0.0)
        else:
            self._times = arrivals(plan)
            self._next_arrival()
        self._scrape = 0              # the scrapes' grid: the k-th is at k × the interval
        self._sampled_ms = sum(st.duration for st in plan.stages) * 1000.0   # a stepped ramp's length
        if self.info.scrape_interval_ms > 0:
            self._push(0.0, SCRAPE, None)
        heap, intake = self._heap, self._intake
        pop = heapq.heappop
        last, same = -1.0, 0
        while heap or intake:
            # client-side events (sends, a request reaching its engine) and engine-side ones, in time order
            if intake and (not heap or intake[0][0] < heap[0][0]):
                t, _, kind, obj = pop(intake)
            else:
                t, _, kind, obj = pop(heap)
            if t != last:
                last, same = t, 0
            else:
                same += 1
                if same >= STALL_EVENTS:
                    raise stalled(t, len(self._records), len(self._flights),
                                  f"{same:,} events in a row at one instant")
            self.now_ms = t
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
                self.precise.apply(name, self._pending_events.pop(name, []) if events is None else events)
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
        if self._flights:
            raise stalled(self.now_ms, len(self._records), len(self._flights),
                          "no event left that could finish the requests in flight")
        return self.outcome()

    def _next_scrape(self) -> None:
        """Queue the next scrape on the interval's grid while requests are still to come or in
        flight. While no engine has anything to do, the load view cannot change before the next
        send or submit, so the scrapes up to it are skipped: an idle hour of a trace, or a request
        overhead of days, costs one event, not millions (a stepped ramp's scrapes are its samples:
        skipped only past its end)."""
        intake, heap = self._intake, self._heap
        if not intake and (not self._flights or not heap):
            return   # nothing to come; or requests in flight and nothing left to move them (`run` says so)
        every = self.info.scrape_interval_ms
        k = self._scrape + 1
        if not heap and self.now_ms >= self._sampled_ms:
            k = max(k, int(intake[0][0] // every))
        self._scrape = k
        self._push(k * every, SCRAPE, None)

    def outcome(self) -> Outcome:
        """What has finished so far (all of it once `run` returns; a stopped run's part)."""
        return Outcome(self._records, self._end_ms / 1000.0, sum(r.steps for r in self.replicas),
                       [r.name for r in self.replicas], self.precise.total_blocks(), self.precise.confirmed,
                       self.precise.expired)

    def _next_arrival(self) -> None:
        """Open loop: queue the next session's send (one at a time: a trace's prompts are large)."""
        assert self._times is not None
        t_s = next(self._times, None)
        if t_s is None or self._left <= 0 or t_s * 1000.0 >= self._until_ms:
            return
        session = next(self._sessions)
        self._left -= 1
        self._push(t_s * 1000.0, SEND, (session[0], None, session[1:]))

    def _next_of_user(self, user: int, t_ms: float) -> None:
        """A closed-loop user sends its session's next request, or starts a new session."""
        rest = self._user_session.get(user)
        if t_ms >= self._until_ms:
            return
        if not rest:
            if self._left <= 0:
                return
            rest = next(self._sessions)
        self._left -= 1
        prompt, rest = rest[0], rest[1:]
        self._user_session[user] = rest
        self._push(t_ms + prompt.pause_s * 1000.0, SEND, (prompt, user, []))

    # ---- the gateway -----------------------------------------------------------------------
    def _send(self, prompt: Prompt, user: int | None, rest: list[Prompt]) -> None:
        """The gateway receives a request: tokenize, route (the router's view as it is now), lease."""
        now = self.now_ms
        if self._times is not None and prompt.step == 0:
            self._next_arrival()
        if self.plan.max_model_len and (message := too_long(len(prompt.tokens), prompt.max_tokens,
                                                            self.plan.max_model_len)) is not None:
            self._refuse(prompt, user, rest, message)
            return
        if self.info.scrape_interval_ms <= 0:   # the router reads every replica's state as it is now
            self._settle_all()
            for r in self.replicas:
                r.scrape()
        tokens = prompt.tokens
        bs = self.plan.sim.block_size   # every replica's
        routed = self.router.route(tokens, keys={bs: self.feed.block_keys(prompt, bs)})
        d = routed.decision
        if self.sent is not None:
            # 8 bytes a key, not a list of int objects: 10,000 trace prompts hold ~9 million keys
            self.sent.append(Blocks(len(tokens), array("Q", routed.keys_by_size[bs])))
        replica = self.by_name[d.chosen.name]
        pd = plan_split(self.plan.policy.pd, self.router, self.prefills, tokens, routed) \
            if self.prefills is not None else None
        plan = self.plan
        record = Record(ts=now / 1000.0, phase=plan.policy.name, policy=plan.policy.name,
                        workload=plan.workload.name, group=prompt.group, session=prompt.session, step=prompt.step,
                        status=200, prompt_tokens=len(tokens), available_tokens=d.available_tokens,
                        predicted_tokens=d.predicted_tokens, speculative_tokens=d.speculative_tokens,
                        replica=replica.name, pd=pd.decision if pd is not None else None)
        delay = self.info.request_overhead_ms + self.info.tokenize_ms_per_1k * len(tokens) / 1000.0
        if pd is not None and pd.decision == SPLIT:
            # the prefill call: the same prompt, one token, on the prefill pool's first choice
            first = pd.prefill[0]
            flight = self._call(prompt, now, self.by_name[first.name], max(len(tokens) - first.prefix_tokens, 0),
                                record, user, now + delay, 1, keys=routed.keys_by_size[bs])
            flight.decode = replica
        else:
            flight = self._call(prompt, now, replica, max(len(tokens) - d.chosen.prefix_tokens, 0), record, user,
                                now + delay, prompt.max_tokens, self.chunking.chunk_tokens if self.chunking else 0,
                                keys=routed.keys_by_size[bs])
        if rest:   # an open-loop session's later requests follow this one (closed loop inside it)
            self._user_session[-self._ids] = rest
            flight.user = -self._ids
        if flight.chunk:
            self._acquire(flight, delay)
        else:
            self._push(now + delay, SUBMIT, flight)

    def _call(self, prompt: Prompt, sent_ms: float, replica: Replica, work: int, record: Record, user: int | None,
              at_ms: float, max_tokens: int, chunk: int = 0, *, keys: list[int]) -> Flight:
        """A call to `replica` reaching it at `at_ms`, with the gateway's lease on it (upstream.py
        `Lease`: in flight, routed, its uncached tokens as pending prefill work); with `chunk`, the
        call generates the first chunk of the answer. `keys`: the prompt's block keys the router
        used, which are the engine's too (a twin engine keys blocks as the gateway does)."""
        backend = replica.backend
        backend.inflight += 1
        backend.routed += 1
        backend.inflight_tokens += work
        prefill = self.book.start(backend, work)
        prefill.started = at_ms / 1000.0   # the gateway's clock for the TTFT sample
        self._ids += 1
        rid = f"t{self._ids}"
        tokens = prompt.tokens
        out = self.sampler.draw(tokens, max_tokens) if self.sampler is not None else [_OUTPUT_TOKEN] * max_tokens
        flight = Flight(prompt, sent_ms, replica,
                        Request(rid, tokens, out[:chunk] if chunk else out, list(keys)),
                        prefill, work, record, user, chunk=chunk, total=max_tokens, out=out)
        self._flights[rid] = flight
        return flight

    def _acquire(self, f: Flight, delay_ms: float) -> None:
        """A chunk waits for a slot in its replica's queue; its call reaches the replica `delay_ms`
        after the grant (splice.py: `acquire`, then the upstream call)."""
        q = self._slots.get(f.replica.name)
        if q is None:
            c = self.chunking
            assert c is not None
            q = self._slots[f.replica.name] = SlotQueue(c.slots_per_replica, c.reserved_slots, c.aging_s,
                                                         clock=lambda: self.now_ms / 1000.0)
        q.enqueue(self._rank, "default", lambda: self._push(self.now_ms + delay_ms, SUBMIT, f))
        q.pump()

    def _next_chunk(self, f: Flight, done: int) -> None:
        """A chunk ended short of the answer: the next one resumes on the same replica with the
        prompt and the tokens so far (its prefix cache holds them), once it has a slot again."""
        del self._flights[f.req.id]      # this call is over; the gateway's lease goes on
        if f.replica.group is not None:
            f.replica.group.group.stats.pop(f.req.id, None)
        assert f.out is not None
        tokens = f.prompt.tokens + f.out[:done]
        self._ids += 1
        rid = f"t{self._ids}"
        replica = f.replica
        # the keys of the call before cover a prefix of these tokens; the rest chain on from them
        keys = continue_keys(f.req.keys[:len(tokens) // replica.pool.block_size], tokens, replica.pool.block_size)
        req = Request(rid, tokens, f.out[done:done + min(f.chunk, f.total - done)], keys)
        nxt = Flight(f.prompt, f.sent_ms, replica, req, f.prefill, f.work, f.record, f.user, f.last_ms, f.gap_sum,
                     f.gap_n, f.gap_max, chunk=f.chunk, done=done, total=f.total, out=f.out)
        self._flights[rid] = nxt
        self._acquire(nxt, self.info.request_overhead_ms)

    def _settle_all(self) -> None:
        for r in list(self._cruising):
            self._settle(r)

    def _submit(self, flight: Flight) -> None:
        replica = flight.replica
        self._settle(replica)
        if flight.offered:   # a decode call with KV to pull: queued once the KV has landed
            pull = reserve(replica.pool, flight.req, flight.offered)
            flight.offered = 0
            if pull.tokens:
                self._push(self.now_ms + replica.profile.transfer_ms(pull.tokens) * replica.scale, TRANSFER,
                           (flight, pull))
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

    def _handoff(self, f: Flight) -> None:
        """A prefill call answered (its one token): the gateway releases its lease and makes the
        decode call, which offers the prefill replica's cached full prompt blocks (transfer.py
        `offered`, as the live `handoff`) and reaches the decode replica one request hop later."""
        now = self.now_ms
        self.book.first_token(f.prefill, now / 1000.0)   # the answer is the first token
        self._release(f)
        decode = f.decode
        assert decode is not None
        at = now + self.info.request_overhead_ms
        # the decode call's lease: the prompt beyond the decode replica's predicted prefix (exchange.py `work`)
        work = max(len(f.prompt.tokens) - (f.record.predicted_tokens or 0), 0)
        keys = f.req.keys[:len(f.prompt.tokens) // decode.pool.block_size]   # the prefill call's prompt keys
        d = self._call(f.prompt, f.sent_ms, decode, work, f.record, f.user, at, f.prompt.max_tokens, keys=keys)
        d.offered = len(offered(f.replica.pool, f.req))
        self._push(at, SUBMIT, d)

    # ---- the engines -----------------------------------------------------------------------
    def _start(self, replica: Replica) -> None:
        """An idle replica with work starts its next step (or a cruise of identical decode steps);
        a rank starts its whole group's (no cruise: a group step's cost depends on every rank)."""
        group = replica.group
        if group is not None:
            self._push(self.now_ms + group.start_step(), LOCKSTEP, group)
        elif not self._cruise(replica):
            self._push(self.now_ms + replica.start_step(), STEP, replica)
            if not replica.batch.requests:   # type: ignore[union-attr]
                what = self._watchdog.idle_step(replica)   # a step that scheduled nothing
                if what is not None:
                    raise stalled(self.now_ms, len(self._records), len(self._flights), what)

    def _cruise(self, replica: Replica) -> bool:
        """Start up to k identical pure-decode steps as one event, when no request waits and every
        running one decodes (k: until the first of them finishes, with free blocks for all).
        Nothing is applied yet: whatever could change or read the replica's state first (a request
        reaching it, a send, a scrape) settles the cruise at the step in progress (`_settle`)."""
        sched, pool = replica.sched, replica.pool
        running = sched.running
        if sched.waiting or not running or pool.tier is not None or pool.typed is not None:
            return False
        for req in running:
            if req.num_output == 0 or req.num_computed != req.num_tokens - 1:
                return False
        k = min(req.max_tokens - req.num_output for req in running)
        if k < 2:
            return False
        bs = pool.block_size
        if sum(-(-(req.num_computed + k) // bs) - len(req.blocks) for req in running) > pool.num_free:
            return False
        dur = replica.profile.step_ms(0, len(running)) * replica.scale
        replica.cruise = (self.now_ms, dur, k)
        replica.busy = True
        replica.batch = None
        self._cruising[replica] = None
        replica.gen += 1
        self._push(self.now_ms + k * dur, CRUISE, (replica, replica.gen))
        return True

    def _settle(self, replica: Replica) -> None:
        """Apply a cruise's steps up to the one in progress now; it ends with that step."""
        cruise = replica.cruise
        if cruise is None:
            return
        t0, dur, k = cruise
        j = min(k, int((self.now_ms - t0) / dur) + 1)
        advance(replica, j, dur, t0 + j * dur, self._flights)
        self._cruising.pop(replica, None)
        if replica.events:
            self._publish(replica)
        replica.gen += 1   # the cruise's end event is stale now: it ends with this step
        self._push(t0 + j * dur, CRUISE, (replica, replica.gen))

    def _cruise_end(self, replica: Replica, gen: int) -> None:
        if gen != replica.gen:   # the end of a cruise cut short since: its own end event follows
            return
        if replica.cruise is not None:
            _, dur, k = replica.cruise
            advance(replica, k, dur, self.now_ms, self._flights)
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
        now = self.now_ms
        batch = replica.batch
        assert batch is not None   # the step in progress
        replica.busy = False
        replica.batch = None
        flights = self._flights
        for req in replica.sched.complete(batch):
            f = flights[req.id]
            if req.num_output == 1 and not f.done:
                if f.decode is not None:   # a P/D prefill call's answer
                    self._handoff(f)
                    continue
                f.record.ttft_ms = now - f.sent_ms
                self.book.first_token(f.prefill, now / 1000.0)
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
            due = (self.now_ms // w + 1) * w + info.kv_event_delay_ms
            self._push(due, EVENTS, (name, None))   # None: the window's events, whatever they are then
            return
        if info.kv_event_delay_ms <= 0:
            self.precise.apply(name, events)
        else:
            self._push(self.now_ms + info.kv_event_delay_ms, EVENTS, (name, events))

    def _release(self, f: Flight) -> None:
        """The call is over for the gateway and its replica: the lease ends (upstream.py `Lease`)."""
        del self._flights[f.req.id]
        b = f.replica.backend
        b.inflight -= 1
        b.inflight_tokens -= f.work
        self.book.finish(f.prefill)
        if f.replica.group is not None:   # what the live server's span takes of the group's stats
            f.replica.group.group.stats.pop(f.req.id, None)

    def _finish(self, f: Flight) -> None:
        now = self.now_ms
        if f.chunk:
            self._slots[f.replica.name].release()
            if not f.done:        # the answer's usage: the first chunk's cached tokens (splice.py)
                f.record.cached_tokens = f.req.num_cached or 0
            done = f.done + f.req.num_output
            if done < f.total and f.req.num_output:
                self._next_chunk(f, done)
                return
        self._release(f)
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
            if f.user < 0:   # an open-loop session's next request
                rest = self._user_session.pop(f.user)
                self._push(now + rest[0].pause_s * 1000.0, SEND, (rest[0], None, rest[1:]))
            else:
                self._next_of_user(f.user, now)

    # ---- a refused request -----------------------------------------------------------------
    def _refuse(self, prompt: Prompt, user: int | None, rest: list[Prompt], message: str) -> None:
        """vLLM's 400 for a request longer than the max model length (engine/sim/length.py): an
        error record, and its client goes on as after any answer."""
        now, plan = self.now_ms, self.plan
        took = self.info.request_overhead_ms
        self._records.append(Record(ts=now / 1000.0, phase=plan.policy.name, policy=plan.policy.name,
                                    workload=plan.workload.name, group=prompt.group, session=prompt.session,
                                    step=prompt.step, status=400, prompt_tokens=len(prompt.tokens), e2e_ms=took,
                                    error=f"HTTP 400: {message}"))
        self._end_ms = max(self._end_ms, now + took)
        if self._progress is not None:
            self._progress(len(self._records))
        if user is not None:
            self._next_of_user(user, now + took)
        elif rest:
            self._push(now + took + rest[0].pause_s * 1000.0, SEND, (rest[0], None, rest[1:]))


def _rng(plan: Plan) -> random.Random:
    return random.Random(f"{plan.settings.seed}:twin-picker")
