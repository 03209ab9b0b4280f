"""long-doc-qa: a few long documents, many questions about each.

The document comes first in the user message and the question last, so the document is the
reusable prefix. Fewer, longer prefixes than shared-prefix: each one costs much more to recompute.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvlab.load.workloads.base import Params, Workload, WorkloadRequest, text


class LongDocQaParams(Params, frozen=True):
    documents: int = 8
    document_tokens: int = 3000
    questions_per_document: int = 20
    question_tokens: int = 32
    output_tokens: int = 32


class LongDocQa(Workload[LongDocQaParams]):
    name = "long-doc-qa"
    Params = LongDocQaParams

    def sessions(self) -> Iterator[list[WorkloadRequest]]:
        p = self.params
        documents = self.texts("document", p.documents, p.document_tokens)
        rng = self.rng("order")
        while True:
            d = rng.randrange(p.documents)
            q = rng.randrange(p.questions_per_document)
            question = text(self.rng("question", d, q), p.question_tokens) + "?"
            content = f"Document:\n{documents[d]}\n\nQuestion: {question}"
            yield [WorkloadRequest(messages=[{"role": "user", "content": content}], max_tokens=p.output_tokens,
                                   group=f"d{d}")]
