"""Which of a trace's requests a replica can hold, known before a run: vLLM's length rules
(engine/sim/length.py) applied to the requests the twin will send. A request longer than the max
model length is answered 400 in the run; this says so up front, and which shipped profile would
hold every one, or the most where none does (`kvlab twin --trace X` with no profile picks it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvlab.engine.sim.profile import LatencyProfile, default_path, load_profiles
from kvlab.load.workloads import Workload
from kvlab.load.workloads.trace import Trace


@dataclass(frozen=True, slots=True)
class Lengths:
    """Prompt + max_tokens of the `requests` requests a trace sends: its rows' in order, round after
    round. Counted per row, not listed one per request: `--requests` may be in the billions (with
    `--duration` to end the run)."""

    rows: list[int]
    requests: int

    @property
    def longest(self) -> int:
        return max(self.rows[:self.requests])

    def within(self, limit: int) -> int:
        """How many of the requests are at most `limit` tokens."""
        rounds, rest = divmod(self.requests, len(self.rows))
        return sum(rounds + (i < rest) for i, n in enumerate(self.rows) if n <= limit)


@dataclass(frozen=True, slots=True)
class Fit:
    """The requests to send (prompt + max_tokens each) against one max model length."""

    lengths: Lengths
    max_model_len: int

    @property
    def longest(self) -> int:
        return self.lengths.longest

    @property
    def over(self) -> int:
        """Requests the max model length cannot hold (each a 400)."""
        return self.lengths.requests - self.lengths.within(self.max_model_len)


def request_lengths(workload: Workload[Any], requests: int) -> Lengths | None:
    """Prompt + max_tokens of the first `requests` requests of a trace, as the twin's feed builds
    them (chat template included); None for a workload that is not a trace."""
    if not isinstance(workload, Trace) or not workload.rows:
        return None
    from kvlab.twin.feed import Feed, trace_max_tokens, trace_prompt_tokens

    extra = Feed(workload).template_tokens
    return Lengths([extra + trace_prompt_tokens(workload, r) + trace_max_tokens(workload, r) for r in workload.rows],
                   requests)


def holds(profile: LatencyProfile, tokens: int) -> bool:
    """Whether a replica of the profile, at its own sizes, takes a request of `tokens`."""
    return tokens <= profile.max_model_len <= profile.num_blocks * profile.block_size


def roomiest_profile(lengths: Lengths) -> tuple[str, int]:
    """The first shipped profile (profiles.yaml order) that holds the most of these requests (every
    one, where some profile does), and how many it holds."""
    best = ("", -1)
    for name, p in load_profiles(default_path()).items():
        # every request up to its max model length, if its own KV cache takes that length at all
        n = lengths.within(p.max_model_len) if holds(p, 0) else 0
        if n > best[1]:
            best = (name, n)
    return best


def describe(fit: Fit, profile: str) -> str | None:
    """The line printed before a run whose requests a replica cannot all hold; None when it can."""
    if not fit.over:
        return None
    other, n = roomiest_profile(fit.lengths)
    if n == fit.lengths.requests:
        hint = f"profile {other} holds every one (--profile {other})"
    elif other != profile and n > fit.lengths.requests - fit.over:
        hint = f"no shipped profile holds the longest; profile {other} holds {n:,} of them (--profile {other})"
    else:
        hint = "no shipped profile holds the longest"
    verb = "exceeds" if fit.over == 1 else "exceed"
    return (f"{fit.over:,} of the {fit.lengths.requests:,} requests {verb} profile {profile}'s max model length "
            f"({fit.max_model_len:,} tokens; the longest is {fit.longest:,}): each is answered 400; {hint}")
