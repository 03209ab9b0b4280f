"""The pool on key runs (the twin's) answers as the simulator's block pool does: both driven by the same
random calls, as the scheduler and a P/D pull make them (lookups, hits taken, blocks allocated
with eviction, cached, freed tail first), on keys shaped as the twin's; every count and every KV
event compared after each call."""

from __future__ import annotations

import random

import pytest

from kvlab.engine.sim.blockpool import BlockPool
from kvlab.engine.sim.runpool import Held, RunPool, key_runs
from kvlab.kvcache.events import BlockRemoved, BlockStored, Event
from kvlab.kvcache.intervals import runs
from kvlab.kvcache.runkeys import RunKeys

BS = 4


def prompt_keys(rng: random.Random, hashed: bool = True) -> list[int]:
    """Ascending keys in runs: a shared head, pieces of a few branches; sometimes continued by
    hashed blocks (a prompt continued over an answer)."""
    keys = list(range(1, 1 + rng.randrange(1, 5)))
    at = 10
    for _ in range(rng.randrange(0, 4)):
        at += rng.randrange(0, 40)
        n = rng.randrange(1, 12)
        keys.extend(range(at, at + n))
        at += n
    if hashed and rng.random() < 0.15:
        keys.extend(rng.getrandbits(64) for _ in range(rng.randrange(1, 4)))
    return keys


class Req:
    def __init__(self, keys: list[int], answer: int = 0) -> None:
        self.keys = keys
        self.prompt = len(keys)
        self.answer = answer   # the first key of its answer's blocks, keyed by structure; 0: hashed
        self.old: list = []
        self.new: Held | list = []


def quieted(events: list[Event], quiet: int | None) -> list[Event]:
    """The events with the keys from `quiet` up left out (a stored event's come after its others)."""
    if quiet is None:
        return events
    out: list[Event] = []
    for e in events:
        if isinstance(e, BlockStored):
            if e.block_hashes[0] < quiet:
                out.append(e)
        elif keys := [k for k in e.block_hashes if k < quiet]:
            out.append(BlockRemoved(block_hashes=keys, medium=e.medium))
    return out


def check(old: BlockPool, new: RunPool, step: int, quiet: int | None = None) -> None:
    assert (old.num_free, old.num_cached) == (new.num_free, new.num_cached), step
    assert quieted(old.take_events(), quiet) == new.take_events(), step


def drive(seed: int, blocks: int, steps: int = 1500, quiet: int | None = None, answers: bool = False) -> None:
    """With `answers`, an answer's blocks are keyed by structure (twin/keys.py `AnswerKeys`): from
    one first key per prompt shape up, the run pool given them as runs."""
    rng = random.Random(seed)
    old, new = BlockPool(blocks, BS), RunPool(blocks, BS, bound=rng.choice([1 << 62, 30]))
    if quiet is not None:
        new.quiet = quiet
    shapes = [prompt_keys(rng, hashed=not answers) for _ in range(25)]
    running: list[Req] = []
    admit, fill, grow = (0.2, 0.7, 0.9) if answers else (0.35, 0.6, 0.75)   # answers: longer lives
    for step in range(steps):
        op = rng.random()
        if op < admit or not running:   # admit: hits taken, the rest allocated (or given back)
            shape = rng.randrange(len(shapes))
            req = Req(list(shapes[shape]), 1000 + 100 * shape if answers else 0)
            cap = rng.randrange(0, len(req.keys) + 1)
            hits_o, hits_n = old.cached_prefix(req.keys[:cap]), new.cached_prefix(req.keys[:cap])
            assert len(hits_o) == len(hits_n), step
            need = max(len(req.keys) - len(hits_o), 0) + rng.randrange(0, 6 if answers else 3) - rng.randrange(0, 2)
            old.touch(hits_o)
            new.touch(hits_n)
            got_o, got_n = old.allocate(max(need, 0)), new.allocate(max(need, 0))
            assert (got_o is None) == (got_n is None), step
            if got_o is None or got_n is None:
                old.free(reversed(hits_o))
                new.free(reversed(hits_n))
            else:
                req.old, req.new = hits_o + got_o, hits_n + got_n
                running.append(req)
        elif op < fill:   # cache what is computed, as Scheduler._cache_blocks does
            req = rng.choice(running)
            end = rng.randrange(0, len(req.old) + 1)
            if answers and rng.random() < 0.7:   # the next block or two, as decode steps fill them
                end = len(req.old)
                for i, block in enumerate(req.old):
                    if block.key is None:
                        end = min(end, i + rng.randrange(1, 3))
                        break
            while len(req.keys) < end:   # an answer's blocks, hashed or by structure
                req.keys.append(req.answer + len(req.keys) - req.prompt if req.answer else rng.getrandbits(64))
            start = 0
            while start < end and req.old[start].key == req.keys[start]:
                start += 1
            other = 0
            while other < end and req.new[other].key == req.keys[other]:
                other += 1
            assert start == other, step
            if start < end and all(b.key is None for b in req.old[start:end]):
                parent = req.keys[start - 1] if start else None
                tokens = list(range((end - start) * BS))
                old.cache(req.old[start:end], req.keys[start:end], parent, tokens)
                keys = req.keys[start:end]
                new.cache(req.new[start:end], RunKeys(runs(keys)) if answers else keys, parent, tokens)
        elif op < grow:   # grow by decode
            req = rng.choice(running)
            n = rng.randrange(1, 3)
            got_o, got_n = old.allocate(n), new.allocate(n)
            assert (got_o is None) == (got_n is None), step
            if got_o is not None and got_n is not None:
                req.old.extend(got_o)
                req.new.extend(got_n)
        else:   # finish or preempt: freed tail first
            req = running.pop(rng.randrange(len(running)))
            old.free(reversed(req.old))
            new.free(reversed(req.new))
        check(old, new, step, quiet)
        probe = rng.choice(shapes)
        assert len(old.cached_prefix(probe)) == len(new.cached_prefix(probe)), step
        assert all(old.is_cached(k) == new.is_cached(k) for k in probe), step
    for req in running:
        old.free(reversed(req.old))
        new.free(reversed(req.new))
    check(old, new, steps, quiet)
    assert old.num_free == new.num_free == blocks


@pytest.mark.parametrize("seed", range(10))
def test_the_run_pool_answers_as_the_block_pool(seed):
    drive(seed, blocks=[30, 60, 120][seed % 3])


@pytest.mark.parametrize("seed", range(4))
def test_a_run_pool_told_to_leave_keys_out_of_its_events_answers_the_same_and_reports_the_rest(seed):
    """The twin's pools leave out of their KV events the keys its index reads none of (an answer's,
    and a prompt's own from `unread` up): the same answers, the events less those keys."""
    drive(seed, blocks=[30, 60][seed % 2], quiet=[20, 40][seed // 2])


@pytest.mark.parametrize("seed", range(4))
def test_answers_keyed_by_structure_are_cached_as_the_block_pool_caches_them(seed):
    """An answer's next blocks, going on from the keys its request holds, move one interval
    (`RunPool._extend`); shared with a request of the same prompt, or reported, they take the
    general way: the same answers either way."""
    drive(seed, blocks=[60, 120][seed % 2], quiet=1000 if seed < 3 else None, answers=True)


def test_keys_in_no_order_are_split_into_runs_all_the_same():
    assert key_runs([1, 2, 3, 10, 11, 99, 5, 6], 1 << 62) == [(1, 4), (10, 12), (99, 100), (5, 7)]
    assert key_runs([4, 5, 6], 1 << 62) == [(4, 7)]
    assert key_runs([4, 5, 6, 7], 6) == [(4, 6), (6, 8)]   # none across the bound


def test_a_run_pool_frees_only_what_it_handed_out():
    pool = RunPool(4, BS)
    pool.free(reversed([]))
    with pytest.raises(TypeError):
        pool.free([object()])
