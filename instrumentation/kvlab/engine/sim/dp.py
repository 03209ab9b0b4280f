"""Data-parallel ranks stepping in lockstep, as wide-EP deployments run them.

A replica started with `--data-parallel-size N` has N ranks, each with its own KV cache,
scheduler, metrics, KV-event stream and HTTP port (vLLM's per-rank API servers). Attention is
data parallel but the MoE layers are expert parallel across all ranks, so every rank runs every
step together (an idle rank runs a dummy batch): a step lasts

    max over DP ranks r of dense_ms(r)  +  moe_ms(tokens of all ranks)

where dense_ms is the profile's step time of rank r's own batch (profile.py) and moe_ms is the
MoE cost of moe.py. A rank with less work waits for the busiest one (`dp_wait_ms`) and every
rank waits for the slowest EP rank (`wait_ms`): DP and expert imbalance both cost time.
A profile with a `moe` section uses this loop even with one rank.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from opentelemetry import trace
from opentelemetry.context import Context

from kvlab.engine.sim.engine import JITTER_S, Engine
from kvlab.engine.sim.moe import MoeModel, MoeStats, StepCost
from kvlab.engine.sim.profile import LatencyProfile
from kvlab.engine.sim.scheduler import Batch, Request
from kvlab.lifecycle import cancel
from kvlab.telemetry import names

if TYPE_CHECKING:
    from kvlab.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class RankEngine(Engine):
    """One rank's engine: its own scheduler, stepped by the group's shared clock."""

    def __init__(self, group: LockstepGroup, dp_rank: int | None, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = group
        self.dp_rank = dp_rank

    def start(self) -> None:
        self._wake = self.group.start_member()

    async def stop(self) -> None:
        await self.group.stop_member()


class LockstepGroup:
    """The ranks of one replica (or one MoE replica alone), driven by one loop."""

    def __init__(self, profile: LatencyProfile, time_scale: float, moe: MoeModel | None = None) -> None:
        self.profile = profile
        self.time_scale = time_scale
        self.moe = moe
        self.members: list[RankEngine] = []
        self.stats: dict[str, MoeStats] = {}     # request id -> what it saw (popped by its span)
        self.steps = 0
        self.last_dense: list[float] = []        # the last step's dense time per rank (unscaled)
        self.last_moe: StepCost | None = None    # the last step's MoE cost
        self._started = 0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def member(self, dp_rank: int | None, *args: Any, **kwargs: Any) -> RankEngine:
        """A rank engine (Engine's arguments) joined to this group."""
        eng = RankEngine(self, dp_rank, *args, **kwargs)
        self.members.append(eng)
        return eng

    def start_member(self) -> asyncio.Event:
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._started += 1
        assert self._wake is not None
        return self._wake

    async def stop_member(self) -> None:
        self._started -= 1
        if self._started <= 0:
            await cancel(self._task)
            self._task = None

    # ---- the loop --------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        wake = self._wake
        assert wake is not None
        next_start: float | None = None
        while True:
            if not any(m.scheduler.has_work() for m in self.members):
                wake.clear()
                await wake.wait()
                next_start = None
            now = loop.time()
            start = next_start if next_start is not None and now - next_start <= JITTER_S else now
            batches = [m.schedule_step() for m in self.members]
            step_ms = self.cost(batches)
            target = start + step_ms * self.time_scale / 1000.0
            delay = target - loop.time()
            await asyncio.sleep(delay if delay > 0 else 0)
            next_start = target
            self.steps += 1
            for m, batch in zip(self.members, batches):
                m.steps += 1
                try:
                    m._deliver(m.scheduler.complete(batch))
                except Exception:  # a bug here must not kill the group's loop silently
                    log.exception("engine step failed")
                m._publish()

    def cost(self, batches: list[Batch]) -> float:
        """Unscaled duration of one lockstep step; accumulates every request's MoE/DP stats."""
        profile, scale = self.profile, self.time_scale
        dense = [profile.step_ms(b.prefill_tokens, b.decode_seqs, b.prefill_ctx_k, len(b.admitted), b.loaded_blocks)
                 if b.requests else 0.0 for b in batches]
        slowest = max(dense)
        self.last_dense, self.last_moe = dense, None
        reqs = [req for b in batches for req in b.requests]
        stats = [self._stat(req) for req in reqs]
        for b, d in zip(batches, dense):
            if b.requests and slowest > d:
                for req in b.requests:
                    self.stats[req.id].dp_wait_ms += (slowest - d) * scale
        if self.moe is None or not reqs:
            return slowest
        cost = self.last_moe = self.moe.step([_computed(req) for req in reqs], stats)
        for st in stats:
            st.steps += 1
            st.imbalance_sum += cost.imbalance
            st.wait_ms += cost.wait_ms * scale
        return slowest + cost.moe_ms

    def _stat(self, req: Request) -> MoeStats:
        st = self.stats.get(req.id)
        if st is None:
            st = self.stats[req.id] = MoeStats()
        return st

    # ---- spans -----------------------------------------------------------------------
    def end_spans(self, span: trace.Span, parent: Context | None, req: Request, dp_rank: int | None,
                  child: Callable[[str, Context | None, int, int, dict[str, Any]], None]) -> None:
        """Rank attributes on the request span and an `engine.moe_dispatch` child (server.py
        calls this with its `_child(name, parent, start, end, attrs)` helper)."""
        st = self.stats.pop(req.id, None)
        if dp_rank is not None:
            span.set_attribute(names.DP_RANK, dp_rank)
        if st is None or not req.t_scheduled:
            return
        attrs: dict[str, Any] = {names.DP_WAIT_MS: round(st.dp_wait_ms, 3)}
        if dp_rank is not None:
            attrs[names.DP_RANK] = dp_rank
        if self.moe is not None and st.steps:
            attrs.update({
                names.MOE_EXPERTS_HIT: int(st.experts.sum()) if st.experts is not None else 0,
                names.MOE_EXPERTS_TOTAL: self.moe.spec.experts,
                names.MOE_TOP_K: self.moe.spec.top_k,
                names.MOE_TOKENS_PER_EP_RANK: [int(x) for x in st.tokens_per_ep_rank]
                if st.tokens_per_ep_rank is not None else [0] * self.moe.spec.ep_ranks,
                names.MOE_IMBALANCE: round(st.imbalance_sum / st.steps, 4),
                names.MOE_WAIT_MS: round(st.wait_ms, 3),
                names.MOE_STEPS: st.steps,
            })
            end = req.t_finished or time.time_ns()
            child(names.SPAN_ENGINE_MOE_DISPATCH, parent, req.t_scheduled, end, attrs)
        else:
            span.set_attribute(names.DP_WAIT_MS, attrs[names.DP_WAIT_MS])


def lockstep_group(profile: LatencyProfile, time_scale: float, tokenizer: Tokenizer,
                   dp: int) -> LockstepGroup | None:
    """The shared clock of one replica's ranks, or None for a dense single-rank replica
    (`kvlab engine sim` and `kvlab twin` both build their groups here)."""
    if dp == 1 and profile.moe is None:
        return None
    moe = MoeModel(profile.moe, tokenizer.vocab_size) if profile.moe is not None else None
    return LockstepGroup(profile, time_scale, moe)


def _computed(req: Request) -> np.ndarray:
    """The token ids a request computes in the current step."""
    start, n = req.num_computed, req.scheduled
    if n == 1:
        return np.array((req.token(start),), dtype=np.int64)
    return np.asarray(req.tokens(start, start + n), dtype=np.int64)
