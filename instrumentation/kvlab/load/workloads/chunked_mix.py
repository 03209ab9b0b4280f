"""chunked-mix: long low-priority generations among short interactive requests (lab 08).

Each session is one request. A fraction `long_fraction` are batch jobs: a fresh prompt and a long
output, sent with `x-kvlab-priority: low` and tenant `batch`; the rest are interactive: a short
question after one of a few shared system prompts and a short answer, `x-kvlab-priority: high`,
tenant `interactive`. In a closed loop the long jobs soon hold most engine slots, so without a
scheduler between decode steps a short request waits behind whole generations (the head-of-line
blocking chunked decoding bounds, docs/chunked-decoding.md). Groups are `long` and `short-<g>`.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvlab.load.workloads.base import Params, Workload, WorkloadRequest, text
from kvlab.telemetry import names

LONG_HEADERS = {names.HEADER_PRIORITY: "low", names.HEADER_TENANT: "batch"}
SHORT_HEADERS = {names.HEADER_PRIORITY: "high", names.HEADER_TENANT: "interactive"}


class ChunkedMixParams(Params, frozen=True):
    long_fraction: float = 0.3
    long_prompt_tokens: int = 256
    long_output_tokens: int = 384
    groups: int = 4
    system_tokens: int = 256
    question_tokens: int = 32
    output_tokens: int = 16               # the interactive answers


class ChunkedMix(Workload[ChunkedMixParams]):
    name = "chunked-mix"
    Params = ChunkedMixParams

    def sessions(self) -> Iterator[list[WorkloadRequest]]:
        rng = self.rng("order")
        p = self.params
        systems = self.texts("system", p.groups, p.system_tokens)
        n = 0
        while True:
            n += 1
            if rng.random() < p.long_fraction:
                prompt = text(self.rng("long", n), p.long_prompt_tokens)
                yield [WorkloadRequest(messages=[{"role": "user", "content": prompt}], max_tokens=p.long_output_tokens,
                               group="long", headers=LONG_HEADERS)]
            else:
                g = rng.randrange(p.groups)
                question = text(self.rng("question", n), p.question_tokens) + "?"
                yield [WorkloadRequest(messages=[{"role": "system", "content": systems[g]},
                                         {"role": "user", "content": question}],
                               max_tokens=p.output_tokens, group=f"short-{g}", headers=SHORT_HEADERS)]
