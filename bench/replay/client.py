"""One streamed completion, timed client-side: TTFT, inter-token latencies, usage.

aiohttp rather than the ``openai`` SDK: the timing must be taken at each server-sent event as it
arrives, with no client-side buffering or retries in between.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

__all__ = ["RequestResult", "stream_completion"]


@dataclass
class RequestResult:
    """What one request measured (seconds, monotonic clock)."""

    index: int
    #: Seconds the send started after its scheduled time (client lag; should stay near 0).
    start_lag_s: float
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    #: Gaps between successive content chunks after the first.
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None


def _content(event: Mapping[str, Any]) -> str:
    """The generated text of one streamed chunk (completions or chat)."""
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    text = choice.get("text")
    if text is None:
        text = (choice.get("delta") or {}).get("content")
    return text or ""


async def stream_completion(
    session: aiohttp.ClientSession,
    url: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    result: RequestResult,
    timeout_s: float,
) -> RequestResult:
    """POST ``body`` with ``stream: true`` and time every content chunk into ``result``."""
    started = time.monotonic()
    last: float | None = None
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.post(url, json=body, headers=headers, timeout=timeout) as response:
            if response.status != 200:
                text = await response.text()
                result.error = f"HTTP {response.status}: {text[:200]}"
                return result
            buffer = b""
            async for chunk in response.content.iter_any():
                now = time.monotonic()
                buffer += chunk
                # Events are separated by a blank line; a chunk may hold several or half of one.
                while b"\n\n" in buffer:
                    raw, buffer = buffer.split(b"\n\n", 1)
                    for line in raw.splitlines():
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            continue
                        event = json.loads(data)
                        usage = event.get("usage")
                        if usage:
                            result.prompt_tokens = usage.get("prompt_tokens")
                            result.completion_tokens = usage.get("completion_tokens")
                            details = usage.get("prompt_tokens_details") or {}
                            result.cached_tokens = details.get("cached_tokens")
                        if _content(event):
                            if last is None:
                                result.ttft_s = now - started
                            else:
                                result.itl_s.append(now - last)
                            last = now
            result.e2e_s = time.monotonic() - started
            result.ok = result.ttft_s is not None
            if not result.ok:
                result.error = "stream ended without any generated text"
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result
