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
    #: Gaps between successive content chunks after the first (0 for chunks read together).
    itl_s: list[float] = field(default_factory=list)
    #: Seconds per output token after the first (set for a request that ended well).
    tpot_s: float | None = None
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


def _events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """The ``data:`` payloads of the complete events in ``buffer``, and what is left of it.

    Events end with a blank line; lines end with LF, CRLF or CR (the SSE spec allows all three:
    sse-starlette, behind llama-cpp-python's server among others, sends CRLF)."""
    # A lone CR that ends the read may be the first half of a CRLF: kept for the next read.
    # (Two end a CR-only event, whatever follows: held back, every event read one chunk late.)
    held = b"\r" if buffer.endswith(b"\r") and not buffer.endswith(b"\r\r") else b""
    if held:
        buffer = buffer[:-1]
    buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    payloads: list[bytes] = []
    while b"\n\n" in buffer:
        raw, buffer = buffer.split(b"\n\n", 1)
        for line in raw.split(b"\n"):
            if line.startswith(b"data:"):
                payloads.append(line[5:].strip())
    return payloads, buffer + held


def _stream_error(event: Mapping[str, Any]) -> str:
    """The message of an in-band error event (``data: {"error": ...}``, as vLLM and fleetgate
    send when a stream fails after its 200)."""
    error = event["error"]
    message = error.get("message") if isinstance(error, Mapping) else error
    return f"stream failed: {message}"


async def stream_completion(
    session: aiohttp.ClientSession,
    url: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    result: RequestResult,
    timeout_s: float,
) -> RequestResult:
    """POST ``body`` with ``stream: true`` and time every content chunk into ``result``.

    A request is ``ok`` only when its stream ends with ``data: [DONE]`` after some generated
    text, with no in-band error: a stream cut by a dying replica carried a few tokens and no
    ``[DONE]``, and counted as served. Content chunks that arrive in one socket read share its
    timestamp, so under load some inter-token gaps read 0; ``tpot_s`` (from the first token to
    the last, over the tokens between) does not depend on how they arrive."""
    started = time.monotonic()
    last: float | None = None
    done = False
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
                payloads, buffer = _events(buffer + chunk)
                for data in payloads:
                    if data == b"[DONE]":
                        done = True
                        continue
                    event = json.loads(data)
                    if not isinstance(event, dict):
                        result.error = f"an event that is not a JSON object: {data[:80]!r}"
                        return result
                    if "error" in event:
                        result.error = _stream_error(event)
                        return result
                    usage = event.get("usage")
                    if isinstance(usage, Mapping):
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
            if buffer.strip():  # the last event, ended by the stream (CR-only line ends)
                tail, _ = _events(buffer + b"\n\n")
                done = done or b"[DONE]" in tail
            result.e2e_s = time.monotonic() - started
            if result.ttft_s is None:
                result.error = "stream ended without any generated text"
            elif not done:
                result.error = "stream ended before data: [DONE] (cut short)"
            else:
                result.ok = True
                result.tpot_s = _tpot_s(result, started, last)
    except (aiohttp.ClientError, TimeoutError, ValueError, TypeError, AttributeError) as exc:
        # ValueError: JSON that does not parse; the others: fields of unexpected types. One
        # odd event fails its request, not the replay.
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _tpot_s(result: RequestResult, started: float, last: float | None) -> float | None:
    """Seconds per output token after the first: from the first content chunk to the last,
    over the tokens between them (the engine's count where it reported one, else the chunks')."""
    if result.ttft_s is None or last is None:
        return None
    tokens = result.completion_tokens or (len(result.itl_s) + 1)
    if tokens < 2:
        return None
    return (last - (started + result.ttft_s)) / (tokens - 1)
