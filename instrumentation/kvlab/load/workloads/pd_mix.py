"""pd-mix: long prompts seen once mixed with prompts whose long prefix is cached (the P/D lab).

A fraction `long_fraction` of requests carries a fresh long document nobody has cached (the case
where a remote prefill pays: the decode replica lacks almost all of it); the others share one of a
few system prompts, so after the first request of each group they are cache hits on their decode
replica (the case where splitting would only add a hop). Outputs are longer than in the other
workloads, so decode steps, which a long prefill on the same replica stalls, weigh in the result.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvlab.load.workloads.base import Params, Workload, WorkloadRequest, text


class PdMixParams(Params, frozen=True):
    long_fraction: float = 0.3
    long_tokens: int = 1500
    groups: int = 4
    system_tokens: int = 1500
    question_tokens: int = 48
    output_tokens: int = 64


class PdMix(Workload[PdMixParams]):
    name = "pd-mix"
    Params = PdMixParams

    def sessions(self) -> Iterator[list[WorkloadRequest]]:
        rng = self.rng("order")
        p = self.params
        systems = self.texts("system", p.groups, p.system_tokens)
        n = 0
        while True:
            n += 1
            question = text(self.rng("question", n), p.question_tokens) + "?"
            if rng.random() < p.long_fraction:
                doc = text(self.rng("long", n), p.long_tokens)
                yield [WorkloadRequest(messages=[{"role": "user", "content": f"{doc}\n\n{question}"}],
                               max_tokens=p.output_tokens, group="long")]
            else:
                g = rng.randrange(p.groups)
                yield [WorkloadRequest(messages=[{"role": "system", "content": systems[g]},
                                         {"role": "user", "content": question}],
                               max_tokens=p.output_tokens, group=f"g{g}")]
