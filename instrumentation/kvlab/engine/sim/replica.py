"""One simulated replica: its own block pool, scheduler, engine loop, metrics, KV-event socket and
HTTP port. Several replicas share one process and one event loop (`kvlab engine sim --replicas N`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

from kvlab.contract import Endpoint
from kvlab.engine.sim.blockpool import BlockPool
from kvlab.engine.sim.engine import Engine
from kvlab.engine.sim.metrics import ReplicaMetrics
from kvlab.engine.sim.profile import LatencyProfile
from kvlab.engine.sim.sampler import Sampler
from kvlab.engine.sim.scheduler import Scheduler
from kvlab.engine.sim.transfer import KVTransfer
from kvlab.kvcache.transport import EventPublisher
from kvlab.tokenizer import Tokenizer

if TYPE_CHECKING:
    from kvlab.engine.sim.dp import LockstepGroup


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Sizes and timing of a replica (the profile's defaults, overridden by flags)."""

    profile: LatencyProfile
    time_scale: float
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    cpu_kv_blocks: int = 0          # the CPU offload tier (tier.py); 0: none
    pinned_share: float | None = None   # not None: typed retention (retention.py), pinned blocks' bound


class Replica:
    def __init__(self, name: str, model: str, cfg: EngineConfig, tokenizer: Tokenizer, sampler: Sampler,
                 kv_events: str | None = None, hash_seed: int = 1, role: str = "both",
                 dp_rank: int | None = None, replica: str | None = None,
                 group: LockstepGroup | None = None) -> None:
        self.name = name
        self.role = role                  # both | prefill | decode: a label for the gateway (transfer.py)
        self.dp_rank = dp_rank            # data-parallel rank (dp.py); None: not data parallel
        self.replica_name = replica       # the replica this rank belongs to
        self.group = group                # dp.LockstepGroup stepping this rank, or None
        self.model = model
        self.cfg = cfg
        self.max_model_len = cfg.max_model_len
        self.tokenizer = tokenizer
        self.sampler = sampler
        self.started = time.time()
        # a replay endpoint as vLLM's (same host, a free port): the gateway fetches lost batches there
        replay = kv_events.rsplit(":", 1)[0] + ":*" if kv_events and kv_events.startswith("tcp://") else None
        self.publisher = EventPublisher(kv_events, bind=True, data_parallel_rank=dp_rank,
                                        replay=replay) if kv_events else None
        pool = BlockPool(cfg.num_blocks, cfg.block_size, events=self.publisher is not None,
                         cpu_blocks=cfg.cpu_kv_blocks, pinned_share=cfg.pinned_share)
        scheduler = Scheduler(pool, cfg.max_num_seqs, cfg.max_num_batched_tokens, hash_seed=hash_seed)
        self.metrics = ReplicaMetrics(model, cfg.block_size, cfg.num_blocks, engine=str(dp_rank or 0))
        if pool.typed is not None:
            self.metrics.bind_retention(pool, str(dp_rank or 0))
        if group is None:
            self.engine = Engine(scheduler, cfg.profile, cfg.time_scale, sampler, self.metrics, self.publisher)
        else:
            self.engine = group.member(dp_rank, scheduler, cfg.profile, cfg.time_scale, sampler, self.metrics,
                                       self.publisher)
        self.transfer = KVTransfer(self)
        self.url: str | None = None
        self._runner: web.AppRunner | None = None

    @property
    def kv_events(self) -> str | None:
        return self.publisher.endpoint if self.publisher else None

    async def start(self, host: str, port: int) -> None:
        """Start the engine loop and listen (port 0: a free one)."""
        from kvlab.engine.sim.server import Api

        self.engine.start()
        # a disconnected client cancels its handler (the engine aborts the request, as vLLM does); a
        # connection without a complete request is closed after 75 s (above the gateway's 60 s keep-alive)
        self._runner = web.AppRunner(Api(self).app(), handler_cancellation=True, access_log=None,
                                     keepalive_timeout=75.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, backlog=1024)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{host}:{bound}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.engine.stop()
        if self.publisher is not None:
            self.publisher.close()

    def endpoint(self) -> Endpoint:
        assert self.url is not None, "replica not started"
        return Endpoint(name=self.name, url=self.url, kv_events=self.kv_events,
                        kv_replay=self.publisher.replay_endpoint if self.publisher else None, role=self.role,
                        dp_rank=self.dp_rank, replica=self.replica_name)
