"""The precise index's tier bookkeeping: `medium: "CPU"` events feed an offloaded layer, separate
from the GPU one (one block may be in both), and `match_tiers` splits each prefix by tier."""

from __future__ import annotations

from kvlab.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvlab.kvcache.hashing import block_keys
from kvlab.kvcache.index import PreciseIndex

BS = 4
TOKENS = list(range(16))           # 4 blocks
HASHES = [101, 102, 103, 104]      # the engine's own hashes: the index never recomputes them


def _stored(hashes: list[int], parent: int | None, tokens: list[int], medium: str) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS,
                       medium=medium)


def _split(idx: PreciseIndex, replica: str = "r0") -> tuple[int, int]:
    gpu, total = idx.match_tiers({BS: block_keys(TOKENS, BS)}, {replica: BS})
    return gpu[replica], total[replica]


def test_cpu_blocks_extend_the_gpu_prefix_and_removals_are_per_tier():
    idx = PreciseIndex()
    idx.apply("r0", [_stored(HASHES[:2], None, TOKENS[:8], "GPU"),
                     _stored(HASHES, None, TOKENS, "CPU")])
    assert _split(idx) == (8, 16)
    assert idx.blocks("r0") == 2 and idx.cpu_blocks("r0") == 4
    idx.apply("r0", [BlockRemoved(block_hashes=HASHES[:2], medium="GPU")])   # evicted from GPU only
    assert _split(idx) == (0, 16)
    idx.apply("r0", [BlockRemoved(block_hashes=[HASHES[2]], medium="CPU")])  # a hole in the CPU chain
    assert _split(idx) == (0, 8)
    # a GPU block whose parent is only in CPU (loaded back) still resolves
    idx.apply("r0", [_stored([HASHES[2]], HASHES[1], TOKENS[8:12], "GPU")])
    assert _split(idx) == (0, 16)   # CPU 0-1, GPU 2, CPU 3


def test_events_without_medium_are_gpu_and_placeholders_are_skipped():
    idx = PreciseIndex()
    idx.apply("r0", [BlockStored(block_hashes=HASHES[:1], parent_block_hash=None, token_ids=TOKENS[:4],
                                 block_size=BS)])
    # vLLM's legacy offloading payload: hashes only, no tokens, block_size 0
    idx.apply("r0", [BlockStored(block_hashes=HASHES[1:], parent_block_hash=None, token_ids=[], block_size=0,
                                 medium="CPU")])
    assert _split(idx) == (4, 4) and idx.unresolved == 3


def test_clear_and_remove_forget_both_tiers():
    idx = PreciseIndex()
    idx.apply("r0", [_stored(HASHES, None, TOKENS, "CPU")])
    idx.apply("r1", [_stored(HASHES, None, TOKENS, "CPU")])
    idx.apply("r0", [AllBlocksCleared()])
    assert _split(idx, "r0") == (0, 0) and _split(idx, "r1") == (0, 16)
    idx.remove("r1")
    assert idx.cpu_blocks("r1") == 0 and not idx.table.offloaded
