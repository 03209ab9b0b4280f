"""random: every prompt is new, nothing to reuse (the control: routing cannot help here)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from kvlab.load.workloads.base import Params, Workload, WorkloadRequest, text


class RandomParams(Params, frozen=True):
    prompt_tokens: int = 1000
    output_tokens: int = 32


class Random(Workload[RandomParams]):
    name = "random"
    Params = RandomParams

    def sessions(self) -> Iterator[list[WorkloadRequest]]:
        p = self.params
        for i in itertools.count():
            yield [WorkloadRequest(messages=[{"role": "user", "content": text(self.rng("prompt", i), p.prompt_tokens)}],
                           max_tokens=p.output_tokens, group=f"r{i}")]
