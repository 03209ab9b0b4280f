"""Block keys held as runs of consecutive integers: a twin trace prompt's (twin/keys.py).

A trace prompt's ~800 block keys come in a few runs of consecutive integers. Held as a list, each
key is an int object of its own, and every copy, slice, sort and search for runs that the router,
the engines' pools and the index make of them reads all of them again, scattered in memory. Held
as runs, those are a few tuples each: the pools and the index take the runs as they are
(`runs`), the rest reads them as the list they stand for. A request's answer blocks extend its
keys by one more run where they are keyed by structure (twin/keys.py `AnswerKeys`); hashed (a key a
block), the engine holds them as a list (engine/sim/scheduler.py).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Sequence
from itertools import accumulate, chain, starmap
from typing import overload


class RunKeys(Sequence[int]):
    """The keys `first` to `end` (excluded) of each of `runs`, in order."""

    __slots__ = ("_at", "runs")

    def __init__(self, runs: list[tuple[int, int]] | None = None) -> None:
        self.runs: list[tuple[int, int]] = []   # (first, end): not to be changed but by `add`
        self._at = [0]   # where each run starts among the keys, and their count last
        for first, end in runs or ():
            self.add(first, end)

    def add(self, first: int, end: int) -> None:
        """The keys `first` to `end` (excluded) after the others."""
        if end <= first:
            return
        runs = self.runs
        if runs and runs[-1][1] == first:
            runs[-1] = (runs[-1][0], end)
            self._at[-1] += end - first
        else:
            runs.append((first, end))
            self._at.append(self._at[-1] + end - first)

    def __len__(self) -> int:
        return self._at[-1]

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> RunKeys: ...

    def __getitem__(self, i: int | slice) -> int | RunKeys:
        at = self._at
        n = at[-1]
        if isinstance(i, slice):
            start, stop, step = i.indices(n)
            if step != 1:
                return RunKeys([(k, k + 1) for k in list(self)[i]])
            return self._cut(start, stop)
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError("key index out of range")
        r = len(at) - 2 if j >= at[-2] else bisect_right(at, j) - 1   # the last run: an answer's newest keys
        return self.runs[r][0] + j - at[r]

    def _cut(self, start: int, stop: int) -> RunKeys:
        out = RunKeys.__new__(RunKeys)
        if start >= stop:
            out.runs, out._at = [], [0]
            return out
        at, runs = self._at, self.runs
        r = len(at) - 2 if start >= at[-2] else bisect_right(at, start) - 1
        last = len(at) - 2 if stop > at[-2] else bisect_right(at, stop - 1) - 1
        if r == last:
            first = runs[r][0] - at[r]
            out.runs, out._at = [(first + start, first + stop)], [0, stop - start]
            return out
        a, b = runs[r]
        z, _ = runs[last]
        out.runs = [(a + start - at[r], b), *runs[r + 1:last], (z, z + stop - at[last])]
        out._at = [0, *accumulate(b - a for a, b in out.runs)]
        return out

    def __iter__(self) -> Iterator[int]:
        return chain.from_iterable(starmap(range, self.runs))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RunKeys):
            return self.runs == other.runs
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RunKeys({self.runs!r})"


Keys = list[int] | RunKeys   # a request's block keys: hashed (a list), or a twin trace prompt's runs
