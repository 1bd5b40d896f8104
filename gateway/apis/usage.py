"""Each API's ``usage`` in the chat-completions shape that accounting reads.

Accounting (metrics, cost, the index-prediction check) reads ``prompt_tokens``,
``completion_tokens`` and ``prompt_tokens_details.cached_tokens``. vLLM reports the Responses and
Anthropic usages differently:

- Responses: ``input_tokens`` (the whole prompt), ``output_tokens``,
  ``input_tokens_details.cached_tokens``;
- Anthropic: ``input_tokens`` *excludes* the cache-read (and cache-creation) tokens, which come as
  ``cache_read_input_tokens`` / ``cache_creation_input_tokens``: the prompt is their sum. A cache
  field that is absent means "not reported" (vLLM without ``--enable-prompt-tokens-details``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Usage = Mapping[str, Any]


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _chat_usage(prompt: int, completion: int, cached: int | None) -> dict[str, Any]:
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def from_responses(usage: Usage | None) -> Usage | None:
    """A ``ResponseUsage`` as chat usage (None stays None)."""
    if not usage:
        return None
    details = usage.get("input_tokens_details")
    cached = _int(details.get("cached_tokens")) if isinstance(details, Mapping) else None
    return _chat_usage(
        _int(usage.get("input_tokens")) or 0, _int(usage.get("output_tokens")) or 0, cached
    )


def from_anthropic(usage: Usage | None) -> Usage | None:
    """An ``AnthropicUsage`` as chat usage: the prompt is input + cache-read + cache-creation."""
    if not usage:
        return None
    cache_read = _int(usage.get("cache_read_input_tokens"))
    created = _int(usage.get("cache_creation_input_tokens")) or 0
    prompt = (_int(usage.get("input_tokens")) or 0) + (cache_read or 0) + created
    return _chat_usage(prompt, _int(usage.get("output_tokens")) or 0, cache_read)


def from_pooling(usage: Usage | None) -> Usage | None:
    """Embeddings report chat-shaped usage already (``completion_tokens`` 0)."""
    return usage
