"""The gateway in the twin: the live router with its indexes, and the gateway's calls to replicas.

A request is routed as the live gateway routes it (`gateway/router.py`, the router's view as it is
at that virtual instant), then served by calls: one, or with prefill/decode pools and a split
decision (`gateway/split.py` `plan_split`) a one-token call on the chosen prefill replica and,
one request hop after its answer, a call on the decode replica that pulls the prompt's KV; with
chunked decoding (the policy's `chunked:`) one call per chunk, each waiting for a slot in its
replica's `SlotQueue` (the live `gateway/chunked/splice.py`, on the virtual clock). Each call
holds the gateway's lease on its replica (upstream.py `Lease`: in flight, routed, its uncached
tokens as pending prefill work) until it ends.
"""

from __future__ import annotations

import random
from array import array

from kvlab.engine.sim.sampler import Sampler
from kvlab.engine.sim.scheduler import Request
from kvlab.engine.sim.transfer import offered
from kvlab.gateway.chunked.slots import SlotQueue, class_rank
from kvlab.gateway.endpoints import Registry
from kvlab.gateway.prefill import PrefillBook
from kvlab.gateway.router import Router
from kvlab.gateway.scheduler import presets
from kvlab.gateway.split import SPLIT, plan_split, prefill_replicas
from kvlab.kvcache.hashing import continue_keys
from kvlab.kvcache.index import ApproximateIndex, PreciseIndex
from kvlab.kvcache.intervals import IntervalIndex
from kvlab.kvcache.runkeys import Keys, RunKeys
from kvlab.load.measure import Record
from kvlab.load.oracle import Prompt as Blocks
from kvlab.twin.clock import SUBMIT, Clock
from kvlab.twin.feed import Feed, Prompt
from kvlab.twin.flight import Flight
from kvlab.twin.replica import Replica
from kvlab.twin.settings import Plan

_OUTPUT_TOKEN = 1000   # the id every simulated output token has (its value never matters here)


class Gateway:
    """The router, its precise and approximate indexes, and the calls in flight (`flights`, by
    request id); `sent` (when kept) the block keys of every routed prompt, in send order, for the
    oracle."""

    def __init__(self, plan: Plan, replicas: list[Replica], feed: Feed, clock: Clock,
                 sampler: Sampler | None, keep_keys: bool, runs: bool) -> None:
        self.plan = plan
        self.clock = clock
        self.feed = feed
        self.sampler = sampler
        self.sent: list[Blocks] | None = [] if keep_keys else None
        info = plan.information
        self.info = info
        cfg = plan.policy
        ttl = cfg.index.speculative_ttl_s if info.speculative_ttl_s is None else info.speculative_ttl_s
        # the twin's engines hash as the gateway does: their KV events carry its keys; kept by key
        # intervals where the keys ascend in runs (`runs`: Cluster says where)
        self.precise: PreciseIndex | IntervalIndex
        self._runs = runs
        if runs:
            self.precise = IntervalIndex(len(replicas), ttl, clock=clock.seconds)
        else:
            self.precise = PreciseIndex(ttl, clock=clock.seconds, engine_keys=True)
        self.approx = ApproximateIndex(cfg.index.approx_capacity_blocks)
        self.by_name = {r.name: r for r in replicas}
        self.registry = Registry()
        self.registry.update([r.backend.endpoint for r in replicas])
        self.registry.replicas = {r.name: r.backend for r in replicas}
        # a twin replica's event stream never goes stale: no approximate fallback is kept for it
        self.router = Router(cfg, self.registry, self.precise, self.approx,
                             presets.build(cfg, random.Random(f"{plan.settings.seed}:twin-picker")), fallback=False)
        # the prefill pool when the policy splits (a twin replica never fails: it is fixed)
        self.prefills = prefill_replicas(self.registry) if cfg.pd.enabled else None
        self.book = PrefillBook()
        self.chunking = cfg.chunked if cfg.chunked.chunk_tokens > 0 else None
        self._slots: dict[str, SlotQueue] = {}
        self._rank = class_rank(cfg.chunked.default_priority)   # no priority header in the twin's requests
        self.flights: dict[str, Flight] = {}
        self._ids = 0

    def send(self, prompt: Prompt, user: int | None) -> Flight:
        """A request reaches the gateway now: route it, make its first call (reaching its replica
        after the tokenize and request overheads)."""
        now = self.clock.now_ms
        tokens = prompt.tokens
        bs = self.plan.sim.block_size   # every replica's
        keys = self.feed.block_keys(prompt, bs)
        if not self._runs:   # the pools and the index read them key by key
            keys = list(keys)
        routed = self.router.route(tokens, keys={bs: keys})
        d = routed.decision
        if self.sent is not None:
            # not a list of int objects: 10,000 trace prompts hold ~9 million keys; a trace
            # prompt's as its runs (no one changes them: an engine's request takes a copy), else 8
            # bytes a key
            sent = routed.keys_by_size[bs]
            self.sent.append(Blocks(len(tokens), sent if isinstance(sent, RunKeys) else array("Q", sent)))
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
        if flight.chunk:
            self._acquire(flight, delay)
        else:
            self.clock.push(now + delay, SUBMIT, flight)
        return flight

    def _call(self, prompt: Prompt, sent_ms: float, replica: Replica, work: int, record: Record, user: int | None,
              at_ms: float, max_tokens: int, chunk: int = 0, *, keys: Keys) -> Flight:
        """A call to `replica` reaching it at `at_ms`, with the gateway's lease on it; with `chunk`,
        the call generates the first chunk of the answer. `keys`: the prompt's block keys the router
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
                        Request(rid, tokens, out[:chunk] if chunk else out, keys[:]),
                        prefill, work, record, user, chunk=chunk, total=max_tokens, out=out)
        self.flights[rid] = flight
        return flight

    def _acquire(self, f: Flight, delay_ms: float) -> None:
        """A chunk waits for a slot in its replica's queue; its call reaches the replica `delay_ms`
        after the grant (splice.py: `acquire`, then the upstream call)."""
        q = self._slots.get(f.replica.name)
        if q is None:
            c = self.chunking
            assert c is not None
            q = self._slots[f.replica.name] = SlotQueue(c.slots_per_replica, c.reserved_slots, c.aging_s,
                                                         clock=self.clock.seconds)
        clock = self.clock
        q.enqueue(self._rank, "default", lambda: clock.push(clock.now_ms + delay_ms, SUBMIT, f))
        q.pump()

    def chunk_ended(self, f: Flight) -> bool:
        """A chunk's call ended: its slot is free again; True when the answer goes on, in a next
        chunk that resumes on the same replica with the prompt and the tokens so far (its prefix
        cache holds them), once it has a slot again."""
        self._slots[f.replica.name].release()
        if not f.done:        # the answer's usage: the first chunk's cached tokens (splice.py)
            f.record.cached_tokens = f.req.num_cached or 0
        done = f.done + f.req.num_output
        if done >= f.total or not f.req.num_output:
            return False
        del self.flights[f.req.id]      # this call is over; the gateway's lease goes on
        if f.replica.group is not None:
            f.replica.group.group.stats.pop(f.req.id, None)
        assert f.out is not None
        tokens = [*f.prompt.tokens, *f.out[:done]]
        self._ids += 1
        rid = f"t{self._ids}"
        replica = f.replica
        # the keys of the call before cover a prefix of these tokens; the rest chain on from them
        keys = continue_keys(list(f.req.keys[:len(tokens) // replica.pool.block_size]), tokens, replica.pool.block_size)
        req = Request(rid, tokens, f.out[done:done + min(f.chunk, f.total - done)], keys)
        nxt = Flight(f.prompt, f.sent_ms, replica, req, f.prefill, f.work, f.record, f.user, f.last_ms, f.gap_sum,
                     f.gap_n, f.gap_max, chunk=f.chunk, done=done, total=f.total, out=f.out)
        self.flights[rid] = nxt
        self._acquire(nxt, self.info.request_overhead_ms)
        return True

    def handoff(self, f: Flight) -> None:
        """A prefill call answered (its one token): the gateway releases its lease and makes the
        decode call, which offers the prefill replica's cached full prompt blocks (transfer.py
        `offered`, as the live `handoff`) and reaches the decode replica one request hop later."""
        now = self.clock.now_ms
        self.book.first_token(f.prefill, now / 1000.0)   # the answer is the first token
        self.release(f)
        decode = f.decode
        assert decode is not None
        at = now + self.info.request_overhead_ms
        # the decode call's lease: the prompt beyond the decode replica's predicted prefix (exchange.py `work`)
        work = max(len(f.prompt.tokens) - (f.record.predicted_tokens or 0), 0)
        keys = f.req.keys[:len(f.prompt.tokens) // decode.pool.block_size]   # the prefill call's prompt keys
        d = self._call(f.prompt, f.sent_ms, decode, work, f.record, f.user, at, f.prompt.max_tokens, keys=keys)
        d.offered = len(offered(f.replica.pool, f.req))
        self.clock.push(at, SUBMIT, d)

    def release(self, f: Flight) -> None:
        """The call is over for the gateway and its replica: the lease ends (upstream.py `Lease`)."""
        del self.flights[f.req.id]
        b = f.replica.backend
        b.inflight -= 1
        b.inflight_tokens -= f.work
        self.book.finish(f.prefill)
        if f.replica.group is not None:   # what the live server's span takes of the group's stats
            f.replica.group.group.stats.pop(f.req.id, None)
