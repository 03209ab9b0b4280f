"""The twin's clients: who sends next, and when.

Open loop, sessions start at the arrival times (`arrivals.py`), one queued at a time (a trace's
prompts are large); closed loop, each user sends its next request after the answer to its last
(`pause_s` later), starting a new session when its own has ended. Either way a session's later
requests follow its earlier ones, each after the answer before it.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvlab.twin.arrivals import arrivals
from kvlab.twin.clock import SEND, Clock
from kvlab.twin.feed import Feed, Prompt
from kvlab.twin.settings import Plan


class Clients:
    """The plan's requests, sent on the clock until as many were sent as it asks for (or its
    duration is over)."""

    def __init__(self, plan: Plan, feed: Feed, clock: Clock) -> None:
        self.clock = clock
        self._left = plan.settings.requests   # requests still to send
        self._sessions = feed.sessions(self._left)
        self._until_ms = (plan.settings.duration_s or float("inf")) * 1000.0
        self._rest: dict[int, list[Prompt]] = {}   # a user's (or a session's key's) requests still to send
        self._followed = 0                          # open-loop sessions' keys: -1, -2, …
        self._times: Iterator[float] | None = None
        if plan.users is not None:
            for u in range(min(plan.users, self._left)):
                self._next_of_user(u, 0.0)
        else:
            self._times = arrivals(plan)
            self._next_arrival()

    def sent(self, prompt: Prompt) -> None:
        """A request reached the gateway: open loop, a session's first one brings the next session."""
        if self._times is not None and prompt.step == 0:
            self._next_arrival()

    def follow(self, rest: list[Prompt]) -> int:
        """An open-loop session's later requests, to follow the request just sent: the key its
        answer is to be reported with (`answered`)."""
        self._followed -= 1
        self._rest[self._followed] = rest
        return self._followed

    def answered(self, user: int, t_ms: float) -> None:
        """`user` (a closed-loop user, or a key from `follow`) had its answer (or an error) at `t_ms`."""
        if user < 0:   # an open-loop session's next request
            rest = self._rest.pop(user)
            self.clock.push(t_ms + rest[0].pause_s * 1000.0, SEND, (rest[0], None, rest[1:]))
        else:
            self._next_of_user(user, t_ms)

    def _next_arrival(self) -> None:
        """Open loop: queue the next session's send."""
        assert self._times is not None
        t_s = next(self._times, None)
        if t_s is None or self._left <= 0 or t_s * 1000.0 >= self._until_ms:
            return
        session = next(self._sessions)
        self._left -= 1
        self.clock.push(t_s * 1000.0, SEND, (session[0], None, session[1:]))

    def _next_of_user(self, user: int, t_ms: float) -> None:
        """A closed-loop user sends its session's next request, or starts a new session."""
        rest = self._rest.get(user)
        if t_ms >= self._until_ms:
            return
        if not rest:
            if self._left <= 0:
                return
            rest = next(self._sessions)
        self._left -= 1
        prompt, rest = rest[0], rest[1:]
        self._rest[user] = rest
        self.clock.push(t_ms + prompt.pause_s * 1000.0, SEND, (prompt, user, []))
