"""A replica's second KV tier: CPU memory behind the GPU block pool, as vLLM's OffloadingConnector.

vLLM's offloading connector (`kv_connector: OffloadingConnector`, CPU backend) *stores on compute*:
every full block a request computes is copied to CPU memory as well, so the CPU tier is a
write-through LRU of the most recently computed or reused blocks (its `num_blocks`), and a block the
GPU pool evicts stays loadable from CPU. A request whose GPU prefix hit stops at block i looks the
following blocks up here; those found are *loaded* (allocated on GPU, cached there, a cost per block)
instead of recomputed. A load touches the CPU copies (LRU), it does not move them.

Events, as vLLM 0.32's connector publishes them with `self_describing_kv_events` on (checked against
`vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py`): a block stored to CPU is a
`BlockStored` with `medium: "CPU"` and the block's own hashes, parent hash, token ids and block
size; one evicted from CPU is a `BlockRemoved` with `medium: "CPU"`. A block loaded back to GPU is
cached by the GPU pool, which publishes its ordinary `BlockStored` with `medium: "GPU"`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvlab.kvcache.events import BlockRemoved, BlockStored, Event

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


class CpuTier:
    """`num_blocks` blocks of CPU memory, LRU; `emit` queues an event (None: no events)."""

    def __init__(self, num_blocks: int, block_size: int, emit: Callable[[Event], None] | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError("the CPU tier needs a positive number of blocks")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._emit = emit
        self.stored = 0       # blocks copied GPU -> CPU
        self.loaded = 0       # blocks loaded CPU -> GPU
        self.evicted = 0      # blocks dropped from CPU

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: int) -> bool:
        return key in self._lru

    def lookup(self, keys: Sequence[int]) -> int:
        """How many leading `keys` the tier holds."""
        n = 0
        for k in keys:
            if k not in self._lru:
                break
            n += 1
        return n

    def load(self, keys: Sequence[int]) -> None:
        """`keys` (all held) are being loaded to GPU: most recently used now."""
        for k in keys:
            self._lru.move_to_end(k)
        self.loaded += len(keys)

    def store(self, keys: Sequence[int], parent: int | None, token_ids: list[int]) -> None:
        """Computed full blocks `keys` (chained after `parent`) are offloaded; one BlockStored for
        the new ones (a run of consecutive new blocks), then BlockRemoved for the LRU blocks the
        capacity pushes out."""
        bs = self.block_size
        lru = self._lru
        run: list[int] = []
        run_parent = parent
        run_start = 0
        prev = parent
        for i, k in enumerate(keys):
            if k in lru:
                lru.move_to_end(k)
                self._flush(run, run_parent, token_ids[run_start * bs:i * bs])
                run, run_parent, run_start = [], k, i + 1
            else:
                lru[k] = None
                if not run:
                    run_parent, run_start = prev, i
                run.append(k)
            prev = k
        self._flush(run, run_parent, token_ids[run_start * bs:(run_start + len(run)) * bs])
        over = len(lru) - self.num_blocks
        if over > 0:
            gone = [lru.popitem(last=False)[0] for _ in range(over)]
            self.evicted += over
            if self._emit is not None:
                self._emit(BlockRemoved(block_hashes=list(gone), medium=MEDIUM_CPU))

    def _flush(self, run: list[int], parent: int | None, token_ids: list[int]) -> None:
        if not run:
            return
        self.stored += len(run)
        if self._emit is not None:
            self._emit(BlockStored(block_hashes=list(run),
                                   parent_block_hash=parent,
                                   token_ids=token_ids, block_size=self.block_size, medium=MEDIUM_CPU))

    def reset(self) -> None:
        """Forget everything (`/reset_prefix_cache` resets the connector too, as vLLM's reset does)."""
        self._lru.clear()
