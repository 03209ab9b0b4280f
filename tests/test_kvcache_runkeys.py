"""Block keys as runs (kvcache/runkeys.py) read as the list they stand for, and the pools' and the
index's run searches take their runs as they are."""

from __future__ import annotations

import random

import pytest

from kvlab.engine.sim.runpool import key_runs
from kvlab.kvcache.events import BlockStored
from kvlab.kvcache.intervals import IntervalIndex, runs
from kvlab.kvcache.runkeys import RunKeys


def _random_runs(rng: random.Random) -> list[tuple[int, int]]:
    out, at = [], rng.randrange(1, 50)
    for _ in range(rng.randrange(0, 8)):
        n = rng.choice([1, 1, 2, 5, 40])
        out.append((at, at + n))
        at += n + rng.choice([0, 1, 30])   # 0: touching runs, which merge
    return out


@pytest.mark.parametrize("seed", range(40))
def test_run_keys_read_as_their_list(seed):
    rng = random.Random(seed)
    given = _random_runs(rng)
    keys = RunKeys(given)
    ref = [k for a, b in given for k in range(a, b)]
    assert len(keys) == len(ref) and list(keys) == ref and keys == ref
    assert all(b1 < a2 for (_, b1), (a2, _) in zip(keys.runs, keys.runs[1:]))   # touching runs merged
    for i in range(-len(ref), len(ref)):
        assert keys[i] == ref[i]
    for i in (len(ref), -len(ref) - 1):
        with pytest.raises(IndexError):
            keys[i]
    for _ in range(30):
        a, b = rng.randrange(-3, len(ref) + 3), rng.randrange(-3, len(ref) + 3)
        part = keys[a:b]
        assert isinstance(part, RunKeys) and list(part) == ref[a:b] and len(part) == len(ref[a:b])
        assert part.runs == RunKeys([(k, k + 1) for k in ref[a:b]]).runs   # runs as few as can be
    assert list(keys[::3]) == ref[::3]
    assert key_runs(keys, 1 << 62) == key_runs(ref, 1 << 62) and runs(keys) == runs(ref)
    cut = ref[len(ref) // 2] if ref else 0
    assert key_runs(keys, cut) == key_runs(ref, cut)   # none across the bound


def test_an_index_stores_run_keys_as_it_stores_their_list():
    rng = random.Random(3)
    by_list, by_runs = IntervalIndex(2), IntervalIndex(2)
    for i in range(30):
        given = _random_runs(rng)
        ref = [k for a, b in given for k in range(a, b)]
        if not ref:
            continue
        for index, keys in ((by_list, ref), (by_runs, RunKeys(given))):
            index.apply(f"r{i % 2}", [BlockStored(block_hashes=keys, parent_block_hash=None, token_ids=[],
                                                  block_size=16, medium="GPU")])
    assert by_list.table.starts == by_runs.table.starts and by_list.table.values == by_runs.table.values
    assert by_list.blocks("r0") == by_runs.blocks("r0") > 0
