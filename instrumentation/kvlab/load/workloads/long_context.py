"""long-context: prompts near the model's context limit, a few contexts popular, some new.

Each request is one long context (a code base, a contract, a long chat export) followed by a
question. Contexts are drawn with Zipf-like popularity (weight 1/rank), and a fraction of
requests bring a context nobody has seen. A miss costs a whole near-limit prefill, and a handful
of contexts already fill a large share of a replica's KV cache, so where each context lives and
what the new ones evict decide the hit rate. Unlike long-doc-qa (uniform, mid-length documents)
the cost of one wrong decision is at its largest here.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from kvlab.load.workloads.base import Params, Workload, WorkloadRequest, text


class LongContextParams(Params, frozen=True):
    contexts: int = 6
    context_tokens: int = 3600     # cpu-tiny's max_model_len is 4096
    question_tokens: int = 48
    new_fraction: float = 0.1      # requests with a context never seen before
    output_tokens: int = 32


class LongContext(Workload[LongContextParams]):
    name = "long-context"
    Params = LongContextParams

    def sessions(self) -> Iterator[list[WorkloadRequest]]:
        p = self.params
        contexts = self.texts("context", p.contexts, p.context_tokens)
        rng = self.rng("order")
        weights = [1 / (c + 1) for c in range(p.contexts)]
        for n in itertools.count():
            question = text(self.rng("question", n), p.question_tokens) + "?"
            if rng.random() < p.new_fraction:
                context, group = text(self.rng("new", n), p.context_tokens), "new"
            else:
                c = rng.choices(range(p.contexts), weights)[0]
                context, group = contexts[c], f"c{c}"
            yield [WorkloadRequest(messages=[{"role": "user", "content": f"{context}\n\nQuestion: {question}"}],
                           max_tokens=p.output_tokens, group=group)]
