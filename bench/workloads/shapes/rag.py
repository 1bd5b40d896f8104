"""RAG chatbot: a long system prompt shared by every request, then retrieved chunks and a question.

``rag-cache-buster`` is the same traffic with a per-request timestamp at the *top* of the system
prompt (``"Current time: 2025-…"``), a common layout mistake: the first block differs for every
request, and since hash ids form a prefix chain, no block of any request is ever shared.
"""

from __future__ import annotations

import random

from bench.workloads.blocks import Segment
from bench.workloads.shapes.base import Shape, ShapedRequest, Zipf

#: Long enough that, at the default block size, ~70% of a prompt is the shared system prompt.
SYSTEM_PROMPT_TOKENS = 3000
#: A rendered timestamp line ("Current time: 2025-06-01T12:00:03Z\n") is about a dozen tokens.
TIMESTAMP_TOKENS = 12
CORPUS_CHUNKS = 500
CHUNKS_PER_REQUEST = 3


class RagChatbot(Shape):
    """Shared system prompt + popular (Zipf) retrieved chunks + a unique user question."""

    name = "rag"
    summary = (
        f"RAG chatbot: {SYSTEM_PROMPT_TOKENS}-token shared system prompt, "
        f"{CHUNKS_PER_REQUEST} retrieved chunks, a short question"
    )
    cache_buster = False

    def __init__(self, rng: random.Random) -> None:
        super().__init__(rng)
        # Popular documents are retrieved more often; retrieval order still varies per question.
        self.corpus = Zipf(range(CORPUS_CHUNKS), exponent=1.0)
        self.chunk_tokens = [self.tokens(400, 0.3, 150, 800) for _ in range(CORPUS_CHUNKS)]

    def next_request(self) -> ShapedRequest:
        segments: list[Segment] = []
        if self.cache_buster:
            segments.append(self.unique("timestamp", TIMESTAMP_TOKENS))
        segments.append(Segment("rag-system-prompt", SYSTEM_PROMPT_TOKENS))
        for _ in range(CHUNKS_PER_REQUEST):
            chunk = int(self.corpus.pick(self.rng))
            segments.append(Segment(("chunk", chunk), self.chunk_tokens[chunk]))
        segments.append(self.unique("question", self.tokens(60, 0.6, 5, 500)))
        return ShapedRequest(tuple(segments), output_length=self.tokens(250, 0.6, 10, 2000))


class RagCacheBuster(RagChatbot):
    """``rag`` with a per-request timestamp as the first line of the system prompt."""

    name = "rag-cache-buster"
    summary = "RAG chatbot with a timestamp at the top of the system prompt (nothing is shared)"
    cache_buster = True
