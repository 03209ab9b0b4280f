"""The interval index answers as the precise index does: both driven by the same random calls
(speculation, stored and removed blocks, clears, expiry, lookups) on keys shaped as the twin's
are (ascending, in runs, shared heads, unread keys and answer hashes above)."""

from __future__ import annotations

import random

import pytest

from kvlab.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvlab.kvcache.index import PreciseIndex
from kvlab.kvcache.intervals import IntervalIndex, Intervals, runs

BS = 16
UNREAD = 5_000


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Ascending keys: a shared head, then pieces of a few branches, then (sometimes) unread ones."""
    out = []
    for _ in range(n):
        keys = list(range(1, 1 + rng.randrange(1, 6)))
        at = 10
        for _ in range(rng.randrange(0, 5)):
            at += rng.randrange(0, 200)
            length = rng.randrange(1, 40)
            keys.extend(range(at, at + length))
            at += length
        if rng.random() < 0.3:
            at = UNREAD + rng.randrange(0, 1000)
            keys.extend(range(at, at + rng.randrange(1, 10)))
        out.append(keys)
    return out


def drive(seed: int, replicas: int = 5, steps: int = 400, unread: int | None = UNREAD) -> None:
    rng = random.Random(seed)
    clock = Clock()
    ttl = rng.choice([0.0, 1.0, 5.0, 30.0])
    old = PreciseIndex(ttl, clock=clock, engine_keys=True)
    new = IntervalIndex(replicas, ttl, clock=clock)
    old.unread_from = new.unread_from = unread
    names = [f"r{i}" for i in range(replicas)]
    pool = prompts(rng, 30)
    stored: dict[str, list[int]] = {n: [] for n in names}
    for step in range(steps):
        clock.t += rng.choice([0.0, 0.1, 0.5, 2.0])
        name = rng.choice(names)
        op = rng.random()
        if op < 0.2:
            keys = rng.choice(pool)
            assert old.speculate(name, keys) == new.speculate(name, keys), step
        elif op < 0.6:
            keys = rng.choice(pool)
            held = set(stored[name])
            starts = [0] + [i for i in range(1, len(keys)) if keys[i - 1] in held]   # parents held
            at = rng.choice(starts)
            cut = rng.randrange(at + 1, len(keys) + 1)
            part = keys[at:cut] + [rng.getrandbits(64) | 1 << 63 for _ in range(rng.randrange(0, 3))]
            parent = keys[at - 1] if at else None
            if rng.random() < 0.1:
                parent = rng.getrandbits(64)
            ev = BlockStored(block_hashes=part, parent_block_hash=parent, token_ids=[], block_size=BS)
            stored[name].extend(part)
            assert old.apply(name, [ev]) == new.apply(name, [ev]), step
        elif op < 0.75:
            held = stored[name]
            gone = rng.sample(held, min(len(held), rng.randrange(0, 60)))
            gone += rng.sample(range(1, 300), 3)   # some never stored
            ev2 = BlockRemoved(block_hashes=list(dict.fromkeys(gone)))
            stored[name] = [k for k in held if k not in set(gone)]
            assert old.apply(name, [ev2]) == new.apply(name, [ev2]), step
        elif op < 0.78:
            keep = rng.random() < 0.5
            assert old.apply(name, [AllBlocksCleared()], keep) == new.apply(name, [AllBlocksCleared()], keep)
            stored[name] = []
        else:
            keys = rng.choice(pool)
            sizes = dict.fromkeys(rng.sample(names + ["never"], rng.randrange(1, replicas + 2)), BS)
            spec = rng.random() < 0.7
            assert old.match({BS: keys}, sizes, spec) == new.match({BS: keys}, sizes, spec), step
        for n in names:
            assert old.blocks(n) == new.blocks(n), (step, n)
            assert old.speculative_blocks(n, expire=False) == new.speculative_blocks(n, expire=False), (step, n)
        assert (old.confirmed, old.expired, old.unresolved) == (new.confirmed, new.expired, new.unresolved), step
    assert old.total_blocks() == new.total_blocks()
    assert len(new.table.starts) < 2 * sum(len(k) for k in pool)   # neighbours merged


@pytest.mark.parametrize("seed", range(12))
def test_the_interval_index_answers_as_the_precise_index(seed):
    drive(seed)


def test_without_unread_keys_and_with_many_replicas():
    drive(100, replicas=40, steps=300, unread=None)


def test_runs_are_found_in_ascending_keys():
    assert runs([]) == []
    assert runs([3, 4, 5]) == [(3, 6)]
    assert runs([1, 2, 5, 6, 7, 9, 20, 21]) == [(1, 3), (5, 8), (9, 10), (20, 22)]
    rng = random.Random(1)
    keys = sorted(rng.sample(range(10_000), 3_000))
    assert [k for a, b in runs(keys) for k in range(a, b)] == keys


def test_intervals_merge_equal_neighbours():
    iv = Intervals(0)
    i, j = iv.span(10, 20)
    iv.put(i, j, [1] * (j - i))
    i, j = iv.span(20, 30)
    iv.put(i, j, [1] * (j - i))
    assert (iv.starts, iv.values) == ([-1, 10, 30], [0, 1, 0])
    assert (iv.at(9), iv.at(10), iv.at(29), iv.at(30)) == (0, 1, 1, 0)


def test_a_fill_is_a_put_over_its_span():
    """`fill` moves the next interval's start where it can (an LRU's top keys evicted one by one),
    and is `span` then `put` everywhere: the same map, intervals and all."""
    rng = random.Random(3)
    fast, ref = Intervals(None), Intervals(None)
    for _ in range(3_000):
        first = rng.randrange(0, 200)
        end = first + rng.randrange(1, 6)
        value = rng.choice([None, 0, 1])
        fast.fill(first, end, value)
        i, j = ref.span(first, end)
        ref.put(i, j, [value] * (j - i))
        assert (fast.starts, fast.values) == (ref.starts, ref.values)
    iv = Intervals(None)
    iv.fill(10, 20, 0)
    iv.fill(19, 20, None)   # the top key of [10, 20): the interval after it starts one lower
    assert (iv.starts, iv.values) == ([-1, 10, 19], [None, 0, None])


def test_more_replicas_than_its_width_are_refused():
    idx = IntervalIndex(2)
    idx.bit("a")
    idx.bit("b")
    with pytest.raises(ValueError, match="2 replicas"):
        idx.bit("c")
