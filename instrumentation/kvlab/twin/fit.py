"""Which of a trace's requests a replica can hold, known before a run: vLLM's length rules
(engine/sim/length.py) applied to the requests the twin will send. A request longer than the max
model length is answered 400 in the run; this says so up front, and which shipped profile would
hold every one, or the most where none does (`kvlab twin --trace X` with no profile picks it)."""

from __future__ import annotations

import itertools
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

from kvlab.engine.sim.profile import LatencyProfile, default_path, load_profiles
from kvlab.load.workloads import Workload
from kvlab.load.workloads.trace import Trace


@dataclass(frozen=True, slots=True)
class Fit:
    """The requests to send (prompt + max_tokens each) against one max model length."""

    lengths: list[int]
    max_model_len: int

    @property
    def longest(self) -> int:
        return max(self.lengths, default=0)

    @property
    def over(self) -> int:
        """Requests the max model length cannot hold (each a 400)."""
        return sum(1 for n in self.lengths if n > self.max_model_len)


def request_lengths(workload: Workload[Any], requests: int) -> list[int] | None:
    """Prompt + max_tokens of each of the first `requests` requests of a trace, as the twin's feed
    builds them (chat template included); None for a workload that is not a trace."""
    if not isinstance(workload, Trace) or not workload.rows:
        return None
    from kvlab.twin.feed import Feed, trace_max_tokens, trace_prompt_tokens

    extra = Feed(workload).template_tokens
    rows = itertools.islice(itertools.cycle(workload.rows), requests)
    return [extra + trace_prompt_tokens(workload, r) + trace_max_tokens(workload, r) for r in rows]


def holds(profile: LatencyProfile, tokens: int) -> bool:
    """Whether a replica of the profile, at its own sizes, takes a request of `tokens`."""
    return tokens <= profile.max_model_len <= profile.num_blocks * profile.block_size


def roomiest_profile(lengths: list[int]) -> tuple[str, int]:
    """The first shipped profile (profiles.yaml order) that holds the most of these requests (every
    one, where some profile does), and how many it holds."""
    ordered = sorted(lengths)
    best = ("", -1)
    for name, p in load_profiles(default_path()).items():
        # every request up to its max model length, if its own KV cache takes that length at all
        n = bisect_right(ordered, p.max_model_len) if holds(p, 0) else 0
        if n > best[1]:
            best = (name, n)
    return best


def describe(fit: Fit, profile: str) -> str | None:
    """The line printed before a run whose requests a replica cannot all hold; None when it can."""
    if not fit.over:
        return None
    other, n = roomiest_profile(fit.lengths)
    if n == len(fit.lengths):
        hint = f"profile {other} holds every one (--profile {other})"
    elif other != profile and n > len(fit.lengths) - fit.over:
        hint = f"no shipped profile holds the longest; profile {other} holds {n:,} of them (--profile {other})"
    else:
        hint = "no shipped profile holds the longest"
    verb = "exceeds" if fit.over == 1 else "exceed"
    return (f"{fit.over:,} of the {len(fit.lengths):,} requests {verb} profile {profile}'s max model length "
            f"({fit.max_model_len:,} tokens; the longest is {fit.longest:,}): each is answered 400; {hint}")
