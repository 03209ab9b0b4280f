"""Prefill/decode disaggregation: vLLM's `kv_transfer_params` protocol and the KV-transfer cost.

The protocol is the one llm-d's routing sidecar drives against vLLM with a KV connector
(NixlConnector, `kv_role: kv_both`):

1. The *prefill* request carries `kv_transfer_params: {"do_remote_decode": true,
   "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null,
   "remote_host": null, "remote_port": null}`, `max_tokens: 1`, `stream: false`. The prefill
   replica computes the prompt's KV as usual and answers with `kv_transfer_params:
   {"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [...],
   "remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size"}`.
2. The *decode* request is the client's request plus those params. The decode replica keeps
   what its own prefix cache holds, *pulls* the other full prompt blocks from the prefill replica
   (modelled: `kv_transfer_ms_fixed + tokens × kv_transfer_ms_per_token` of the latency profile,
   times the time scale; nothing crosses the network), caches them (BlockStored events, as vLLM
   caches received blocks) and then schedules the request: the received blocks are prefix hits,
   so only the last partial block is computed before the first token.

Every simulated replica speaks both sides (vLLM's `kv_both`); `--role` only labels it for the
gateway. A pull that finds no free blocks is skipped and the prompt is recomputed locally
(vLLM's recompute policy for failed KV loads).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import msgspec

from kvlab.errors import RequestError

if TYPE_CHECKING:
    from kvlab.engine.sim.blockpool import Block, BlockPool
    from kvlab.engine.sim.replica import Replica
    from kvlab.engine.sim.scheduler import Request


class KVTransferParams(msgspec.Struct, kw_only=True):
    """`kv_transfer_params` of a request, as vLLM's NixlConnector reads it (extra keys ignored)."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[Any] | None = None   # block ids, or one list per KV-cache group
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None
    tp_size: int = 1


def pull_hint(value: str, block_size: int) -> KVTransferParams:
    """The gateway's `x-kvlab-kv-pull: HOLDER;TOKENS` hint (docs/tiered.md) as the params of a pull:
    the prompt's first TOKENS tokens come from HOLDER at the profile's transfer cost, as a P/D decode
    side pulls them. The holder is trusted to hold them (the gateway's index says so)."""
    holder, _, tokens = value.partition(";")
    try:
        n = int(tokens)
    except ValueError:
        n = -1
    if not holder or n < 0:
        raise RequestError("x-kvlab-kv-pull must be HOLDER;TOKENS", param="x-kvlab-kv-pull")
    return KVTransferParams(do_remote_prefill=True, remote_engine_id=holder,
                            remote_block_ids=list(range(n // block_size)))


def remote_block_count(ids: list[Any] | None) -> int:
    """Blocks offered by the prefill replica (vLLM's hybrid allocator sends one list per group)."""
    if not ids:
        return 0
    return len(ids[0]) if isinstance(ids[0], list) else len(ids)


@dataclass(frozen=True, slots=True)
class Pulled:
    """What a decode replica received for one request."""

    tokens: int                 # tokens whose KV came from the prefill replica
    local_tokens: int           # prompt tokens the decode replica already had cached
    offered_tokens: int         # full-block tokens the prefill replica offered
    remote_engine_id: str | None
    t_start: int                # ns
    t_end: int                  # ns
    skipped: str | None = None  # why nothing was pulled although blocks were offered

    @property
    def ms(self) -> float:
        return (self.t_end - self.t_start) / 1e6


class KVTransfer:
    """One replica's side of the protocol: hand KV over (prefill) and pull it in (decode)."""

    def __init__(self, replica: Replica) -> None:
        self.r = replica

    def validate(self, params: KVTransferParams) -> None:
        if params.do_remote_prefill and params.do_remote_decode:
            raise RequestError("kv_transfer_params: do_remote_prefill and do_remote_decode are exclusive",
                               param="kv_transfer_params")
        if params.do_remote_prefill and params.remote_block_ids is None:
            raise RequestError("kv_transfer_params.remote_block_ids is required with do_remote_prefill",
                               param="kv_transfer_params.remote_block_ids")

    def handoff(self, req: Request) -> dict[str, Any]:
        """The params a prefill replica returns: its cached full blocks of the prompt."""
        blocks = offered(self.r.engine.scheduler.pool, req)
        url = urlsplit(self.r.url or "")
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": [b.id for b in blocks], "remote_engine_id": self.r.name,
                "remote_request_id": req.id, "remote_host": url.hostname, "remote_port": url.port,
                "tp_size": 1}

    async def pull(self, req: Request, params: KVTransferParams) -> Pulled:
        """Receive the prompt blocks this replica lacks; they end up cached and free, so the
        scheduler finds them as prefix hits when the request is submitted right after."""
        sched = self.r.engine.scheduler
        offered = remote_block_count(params.remote_block_ids)
        t0 = time.time_ns()
        p = reserve(sched.pool, req, offered)

        def done(tokens: int, skipped: str | None = None) -> Pulled:
            return Pulled(tokens, p.local_tokens, offered * p.block_size, params.remote_engine_id, t0,
                          time.time_ns(), skipped)

        if not p.tokens:
            return done(0, p.skipped)
        try:
            cfg = self.r.cfg
            await asyncio.sleep(cfg.profile.transfer_ms(p.tokens) * cfg.time_scale / 1000.0)
            p.land(req)
        finally:
            p.release()
        return done(p.tokens)


@dataclass(slots=True)
class Pull:
    """A decode replica's pull in progress: the blocks it holds until the KV has landed. The live
    replica waits `transfer_ms(tokens)` between `reserve` and `land`; `kvlab twin` schedules it."""

    pool: BlockPool
    block_size: int
    local: list[Block]           # prompt blocks the replica already had cached (referenced)
    new: list[Block]             # blocks allocated for the pulled KV
    skipped: str | None = None   # why nothing is pulled although blocks were offered

    @property
    def tokens(self) -> int:
        return len(self.new) * self.block_size

    @property
    def local_tokens(self) -> int:
        return len(self.local) * self.block_size

    def land(self, req: Request) -> None:
        """The KV arrived: cache the pulled blocks under the prompt's keys (BlockStored events)."""
        bs, start = self.block_size, len(self.local)
        end = start + len(self.new)
        self.pool.cache(self.new, req.keys[start:end], req.keys[start - 1] if start else None,
                        req.tokens(start * bs, end * bs))

    def release(self) -> None:
        """Drop the pull's references: its blocks stay cached for the request to hit."""
        self.pool.free(reversed(self.local + self.new))


def offered(pool: BlockPool, req: Request) -> list[Block]:
    """What a prefill replica hands over after computing a prompt: its cached full blocks of it
    (`KVTransfer.handoff`; `kvlab twin` counts them the same way)."""
    return pool.cached_prefix(req.keys[:req.num_prompt // pool.block_size])


def reserve(pool: BlockPool, req: Request, offered: int) -> Pull:
    """Hold what a decode replica keeps of the prompt and allocate the blocks it lacks of the
    `offered` full blocks (at most (prompt - 1) // block_size: the last token is always computed
    locally). Out of free blocks nothing is pulled and the prompt is recomputed (vLLM's policy)."""
    bs = pool.block_size
    keys = req.keys[:min(offered, (req.num_prompt - 1) // bs)]
    local = pool.cached_prefix(keys)
    n = len(keys) - len(local)
    if n <= 0:
        return Pull(pool, bs, local, [])
    pool.touch(local)
    new = pool.allocate(n)
    if new is None:
        pool.free(reversed(local))
        return Pull(pool, bs, local, [], "no free blocks: recomputed locally")
    return Pull(pool, bs, local, new)
