"""One simulated replica in the twin: the simulator's scheduler and block pool, and the gateway's
view of it (`Backend`), stepped by the cluster's event loop instead of an asyncio task."""

from __future__ import annotations

from typing import Any

from kvlab.contract import Endpoint
from kvlab.engine.sim.blockpool import BlockPool
from kvlab.engine.sim.profile import LatencyProfile
from kvlab.engine.sim.scheduler import Batch, Scheduler
from kvlab.gateway.endpoints import Backend
from kvlab.topology import SimSettings


class Replica:
    """Engine state of one replica; `step_ms` is the live engine's step-time model."""

    __slots__ = ("backend", "batch", "busy", "cruise", "done", "events", "gen", "name", "pool", "profile", "scale",
                 "sched", "steps")

    def __init__(self, index: int, profile: LatencyProfile, sim: SimSettings, num_blocks: int, events: bool,
                 seed: int) -> None:
        self.name = f"sim-{index}"
        self.profile = profile
        self.scale = sim.time_scale
        self.pool = BlockPool(num_blocks, sim.block_size, events=events,
                              cpu_blocks=sim.cpu_kv_blocks or profile.cpu_kv_blocks, pinned_share=sim.typed_retention)
        # the same per-replica hash seeds as `kvlab engine sim --replicas N` (engine/sim/cli.py)
        self.sched = Scheduler(self.pool, sim.max_num_seqs, sim.max_num_batched_tokens,
                               hash_seed=seed * 1009 + index + 1)
        self.backend = Backend(Endpoint(name=self.name, url=f"twin://{self.name}",
                                        kv_events=f"twin://{self.name}/events" if events else None))
        self.backend.block_size = sim.block_size            # what the first scrape tells the gateway
        self.backend.num_gpu_blocks = num_blocks
        self.events = events              # KV events published (a precise-index policy)
        self.busy = False
        self.batch: Batch | None = None
        self.cruise: tuple[float, float, int] | None = None   # (start ms, step ms, steps) of a decode cruise
        self.gen = 0                       # which cruise end event is current
        self.done: list[Any] = []          # flights a fast-forwarded decode run finishes (cluster.py)
        self.steps = 0

    def start_step(self) -> float:
        """Schedule the next batch; its modelled duration in ms."""
        b = self.sched.schedule()
        self.batch = b
        self.busy = True
        self.steps += 1
        return self.profile.step_ms(b.prefill_tokens, b.decode_seqs, b.prefill_ctx_k, len(b.admitted),
                                    b.loaded_blocks) * self.scale

    def scrape(self) -> None:
        """What a /metrics scrape would tell the gateway now (gateway/loadview.py `apply_metrics`)."""
        r = self.backend
        r.waiting = float(len(self.sched.waiting))
        r.running = float(len(self.sched.running))
        r.kv_usage = self.pool.usage
