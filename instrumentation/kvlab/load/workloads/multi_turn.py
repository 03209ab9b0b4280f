"""multi-turn: chat sessions whose history grows every turn.

Each session is sent by one user in order; turn k repeats the whole conversation so far (system
prompt, earlier questions and answers) plus a new question, so the reusable prefix grows with the
turn. The assistant turns in the history are fixed text from the seed (not the model's output),
which keeps the stream deterministic; the prefix up to the previous question is still reusable.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from kvlab.load.workloads.base import Params, Workload, WorkloadRequest, text


class MultiTurnParams(Params, frozen=True):
    turns: int = 6
    system_tokens: int = 200
    user_tokens: int = 120
    answer_tokens: int = 64     # length of each assistant turn kept in the history
    output_tokens: int = 32


class MultiTurn(Workload[MultiTurnParams]):
    name = "multi-turn"
    Params = MultiTurnParams

    def session(self, i: int) -> list[WorkloadRequest]:
        p = self.params
        rng = self.rng("session", i)
        messages = [{"role": "system", "content": text(rng, p.system_tokens)}]
        out = []
        for turn in range(p.turns):
            messages = [*messages, {"role": "user", "content": text(rng, p.user_tokens) + "?"}]
            out.append(WorkloadRequest(messages=messages, max_tokens=p.output_tokens, group=f"s{i}", turn=turn))
            messages = [*messages, {"role": "assistant", "content": text(rng, p.answer_tokens) + "."}]
        return out

    def sessions(self) -> Iterator[list[WorkloadRequest]]:
        for i in itertools.count():
            yield self.session(i)
