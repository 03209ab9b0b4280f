"""shared-prefix: G groups, each with a long system prompt shared by all its questions.

The llm-d benchmark shape, scaled for CPU: every request picks a group uniformly at random and one
of that group's questions. A cache-blind router spreads each group over every replica, so with KV
capacity for only part of the groups each replica keeps evicting; a KV-aware router keeps a group
on the replica that holds its prefix.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cached_property

from kvlab.load.workloads.base import Params, Workload, WorkloadRequest, text


class SharedPrefixParams(Params, frozen=True):
    groups: int = 32
    prompts_per_group: int = 16
    system_tokens: int = 1800
    question_tokens: int = 48
    output_tokens: int = 32


class SharedPrefix(Workload[SharedPrefixParams]):
    name = "shared-prefix"
    Params = SharedPrefixParams

    @cached_property
    def _systems(self) -> list[str]:
        return [text(self.rng("system", g), self.params.system_tokens) for g in range(self.params.groups)]

    @cached_property
    def _questions(self) -> list[list[str]]:
        p = self.params
        return [[text(self.rng("question", g, q), p.question_tokens) + "?" for q in range(p.prompts_per_group)]
                for g in range(p.groups)]

    def sessions(self) -> Iterator[list[WorkloadRequest]]:
        rng = self.rng("order")
        p = self.params
        while True:
            g = rng.randrange(p.groups)
            q = rng.randrange(p.prompts_per_group)
            yield [WorkloadRequest(messages=[{"role": "system", "content": self._systems[g]},
                                     {"role": "user", "content": self._questions[g][q]}],
                           max_tokens=p.output_tokens, group=f"g{g}")]
