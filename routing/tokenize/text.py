"""``TextTokenizer``: approximate mode, for when no tokenizer is available.

Blocks are made of characters instead of tokens. Prefix affinity still works (equal prefixes
give equal character blocks), but the chains never match engine KV events, which carry tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from routing.contracts import TokenizedPrompt
from routing.tokenize.messages import normalise_messages

__all__ = ["TextTokenizer", "flatten_messages"]


def flatten_messages(messages: Sequence[Mapping[str, Any]]) -> str:
    """One deterministic text for a conversation: each message as ``<|role|>\\ncontent\\n``.

    Each message renders on its own and nothing follows the last one, so a conversation's text
    is a prefix of the text of any conversation that continues it (multi-turn chat keeps its
    prefix). Fields other than role and content (``name``, ``tool_calls``, ...) are appended as
    sorted JSON, so they count without making the text depend on dict order.
    """
    parts: list[str] = []
    for message in normalise_messages(messages):
        role = message.pop("role")
        content = message.pop("content") or ""
        extra = f"{json.dumps(message, sort_keys=True, default=str)}\n" if message else ""
        parts.append(f"<|{role}|>\n{extra}{content}\n")
    return "".join(parts)


class TextTokenizer:
    """A ``PromptTokenizer`` that returns text; ``prompt_chain`` then hashes character blocks."""

    async def tokenize_completion(self, model: str, prompt: str) -> TokenizedPrompt:
        """The prompt itself, as text."""
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string (got {type(prompt).__name__})")
        return TokenizedPrompt(token_ids=None, text=prompt)

    async def tokenize_chat(
        self, model: str, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any
    ) -> TokenizedPrompt:
        """The flattened conversation (``flatten_messages``); template options do not apply."""
        return TokenizedPrompt(token_ids=None, text=flatten_messages(messages))
