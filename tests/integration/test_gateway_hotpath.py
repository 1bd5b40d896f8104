"""Text-mode units end to end, and one index write per request (policy-less gateway, text mode)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.policy_view import GatewayPolicy, ReplicaSpec
from gateway.state import GATEWAY, GatewayState
from routing.index.memory import MemoryBlockIndex
from routing.types import ReplicaId
from tests.integration.test_gateway_support import FakeUpstream, serve

# ~6,000 characters: ~1,500 tokens by the text-mode estimate (characters / 4).
LONG = " ".join(f"sentence {i} of a long shared document." for i in range(180))


class CountingIndex(MemoryBlockIndex):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    async def record(self, *args: Any, **kwargs: Any) -> None:
        self.writes += 1
        await super().record(*args, **kwargs)


class EngineUpstream(FakeUpstream):
    """Reports the prompt's tokens and the cached tokens of an engine holding the whole prompt."""

    prompt_tokens: int = 0

    def _usage(self, body: dict[str, Any]) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": 3,
            "total_tokens": self.prompt_tokens + 3,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@asynccontextmanager
async def text_gateway(
    upstream: FakeUpstream, index: MemoryBlockIndex
) -> AsyncIterator[tuple[str, GatewayState]]:
    async with serve(upstream.app()) as upstream_url:
        upstream.url = upstream_url
        spec = ReplicaSpec("r0", upstream_url, models=frozenset(upstream.models))
        app = create_app(
            GatewayConfig(health_interval_s=3600),
            GatewayPolicy.default([spec], profile="expected-ttft"),
            index=index,
        )
        async with serve(app, handler_cancellation=True) as url:
            yield url, app[GATEWAY]


async def _chat(http: aiohttp.ClientSession, url: str) -> None:
    body = {"model": "base-model", "messages": [{"role": "user", "content": LONG}]}
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()


async def test_text_mode_counts_tokens_in_the_units_of_matched_blocks() -> None:
    upstream = EngineUpstream()
    index = CountingIndex()
    async with text_gateway(upstream, index) as (url, gw), aiohttp.ClientSession() as http:
        await _chat(http, url)
        first = gw.decisions[-1]
        # The engine's own count, and a cache holding every full block of the prompt.
        upstream.prompt_tokens = first.prompt_tokens
        upstream.cached_tokens = first.blocks * 16
        await _chat(http, url)
        second = gw.decisions[-1]
    tokens = second.prompt_tokens
    assert abs(tokens - len(LONG) / 4) < 20  # an estimate in tokens, not characters
    matched = second.explanations[ReplicaId("r0")].matched_blocks
    assert matched == second.blocks
    # Holding the whole prompt leaves less than one block uncached (was 75 % in characters).
    assert 0 <= tokens - matched * 16 < 16
    # The cached-token prediction matches the engine's (it was 4x low).
    assert second.prediction is not None
    assert second.prediction.outcome == "exact"
    assert second.prediction.predicted_cached_tokens == upstream.cached_tokens
    # One index write per request: the speculative insert, no refresh after the answer.
    assert index.writes == 2
