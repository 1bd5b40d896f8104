"""The simulated replica's tokenizer as a gateway ``PromptTokenizer`` (for ``fleetgate up``).

With it the gateway hashes exactly the token ids the simulated engines cache and report in their
KV events, so the embedded index matches at token level instead of approximating with text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from routing.contracts import TokenizedPrompt
from routing.tokenize.word_hash import load_tokenizer


class SimPromptTokenizer:
    """Wraps ``routing.tokenize.word_hash``: the built-in word-hash tokenizer or an HF directory."""

    def __init__(self, tokenizer_dir: str | None = None) -> None:
        self._tokenizer = load_tokenizer(tokenizer_dir)

    async def tokenize_completion(self, model: str, prompt: str) -> TokenizedPrompt:
        return TokenizedPrompt(token_ids=self._tokenizer.encode(prompt))

    async def tokenize_chat(
        self, model: str, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any
    ) -> TokenizedPrompt:
        add_generation_prompt = bool(template_kwargs.get("add_generation_prompt", True))
        return TokenizedPrompt(
            token_ids=self._tokenizer.encode_chat(messages, add_generation_prompt)
        )
