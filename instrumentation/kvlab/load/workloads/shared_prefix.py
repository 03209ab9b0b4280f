"""shared-prefix: G groups, each with a long system prompt shared by all its questions.

The llm-d benchmark shape, scaled for CPU: every request picks a group uniformly at random and one
of that group's questions. A cache-blind router spreads each group over every replica, so with KV
capacity for only part of the groups each replica keeps evicting; a KV-aware router keeps a group
on the replica that holds its prefix.

`hot_share` > 0 makes group 0 hot: that share of requests asks it, the rest pick one of the other
groups uniformly (one popular prompt: pure prefix affinity piles it onto a single replica).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cached_property
from typing import Annotated

import msgspec

from kvlab.load.workloads.base import Params, Workload, WorkloadRequest, text


class SharedPrefixParams(Params, frozen=True):
    groups: int = 32
    prompts_per_group: int = 16
    system_tokens: int = 1800
    question_tokens: int = 48
    output_tokens: int = 32
    hot_share: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0   # share of requests to group 0

    def __post_init__(self) -> None:
        if 0.0 < self.hot_share < 1.0 and self.groups < 2:
            raise ValueError("hot_share below 1 needs at least 2 groups (the rest go to the other groups)")


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
            if not p.hot_share:
                g = rng.randrange(p.groups)   # the stream without a hot group draws only this
            elif rng.random() < p.hot_share:
                g = 0
            else:
                g = 1 + rng.randrange(p.groups - 1)
            q = rng.randrange(p.prompts_per_group)
            yield [WorkloadRequest(messages=[{"role": "system", "content": self._systems[g]},
                                     {"role": "user", "content": self._questions[g][q]}],
                           max_tokens=p.output_tokens, group=f"g{g}")]
