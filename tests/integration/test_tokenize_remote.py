"""RemoteTokenizer's HTTP behaviour against a fake ``/tokenize`` upstream on port 0.

The upstream is an aiohttp app that speaks vLLM's request and response shapes; it stands in for
the network peer only (tokens are code points), not for vLLM's tokenization.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from routing.tokenize import RemoteTokenizer, TokenizationError
from routing.tokenize.scope import TOKENIZE_CACHE_SCOPE
from tests.support.redis_server import free_port


@dataclass
class FakeTokenizeServer:
    """Answers ``POST /tokenize`` like vLLM, records the bodies, and can misbehave on demand."""

    bodies: list[dict[str, Any]] = field(default_factory=list)
    #: While set, requests wait on ``release`` before answering (concurrency tests).
    hold: bool = False
    release: asyncio.Event = field(default_factory=asyncio.Event)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    #: Next answers to give instead of a good one: (status, body text).
    failures: list[tuple[int, str]] = field(default_factory=list)

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        self.arrived.set()
        if self.hold:
            await self.release.wait()
        if self.failures:
            status, text = self.failures.pop(0)
            return web.Response(status=status, text=text, content_type="application/json")
        if "messages" in body:
            text = "".join(f"<{m['role']}>{m['content']}" for m in body["messages"])
            if body.get("add_generation_prompt"):
                text += "<assistant>"
        else:
            text = body["prompt"]
        tokens = [ord(char) for char in text]
        return web.json_response({"count": len(tokens), "max_model_len": 4096, "tokens": tokens})


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[FakeTokenizeServer, str]]:
    fake = FakeTokenizeServer()
    app = web.Application()
    app.router.add_post("/tokenize", fake.tokenize)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield fake, f"http://127.0.0.1:{port}"
    finally:
        fake.release.set()
        await runner.cleanup()


@pytest.fixture
async def remote(upstream: tuple[FakeTokenizeServer, str]) -> AsyncIterator[RemoteTokenizer]:
    tokenizer = RemoteTokenizer(upstream[1] + "/", cache_size=2, timeout_s=2.0)
    try:
        yield tokenizer
    finally:
        await tokenizer.close()


async def test_completion_request_and_answer(
    upstream: tuple[FakeTokenizeServer, str], remote: RemoteTokenizer
) -> None:
    fake, _ = upstream
    prompt = await remote.tokenize_completion("base", "hi!")
    assert prompt.token_ids == (104, 105, 33)
    assert fake.bodies == [{"model": "base", "prompt": "hi!"}]


async def test_chat_request_carries_vllms_fields(
    upstream: tuple[FakeTokenizeServer, str], remote: RemoteTokenizer
) -> None:
    fake, _ = upstream
    messages = [{"role": "user", "content": "yo"}]
    prompt = await remote.tokenize_chat("support-bot", messages, tools=[{"type": "function"}])
    assert prompt.token_ids == tuple(ord(c) for c in "<user>yo<assistant>")
    assert fake.bodies == [
        {
            "model": "support-bot",
            "messages": messages,
            "add_generation_prompt": True,
            "tools": [{"type": "function"}],
        }
    ]
    await remote.tokenize_chat("support-bot", messages, add_generation_prompt=False)
    assert fake.bodies[-1]["add_generation_prompt"] is False


async def test_answers_are_cached_in_a_bounded_lru(
    upstream: tuple[FakeTokenizeServer, str], remote: RemoteTokenizer
) -> None:
    fake, _ = upstream
    for prompt in ("a", "b", "a"):  # the second "a" is a hit and makes "a" the youngest
        await remote.tokenize_completion("m", prompt)
    assert [body["prompt"] for body in fake.bodies] == ["a", "b"]
    await remote.tokenize_completion("m", "c")  # cache_size=2: evicts "b"
    await remote.tokenize_completion("m", "a")
    await remote.tokenize_completion("m", "b")
    assert [body["prompt"] for body in fake.bodies] == ["a", "b", "c", "b"]
    # The model is part of the key: another model's answer is never reused.
    await remote.tokenize_completion("other", "b")
    assert fake.bodies[-1] == {"model": "other", "prompt": "b"}
    assert (remote.hits, remote.misses) == (2, 5)


async def test_identical_requests_in_flight_share_one_upstream_call(
    upstream: tuple[FakeTokenizeServer, str], remote: RemoteTokenizer
) -> None:
    fake, _ = upstream
    fake.hold = True
    first = asyncio.create_task(remote.tokenize_completion("m", "shared prefix"))
    await fake.arrived.wait()
    second = asyncio.create_task(remote.tokenize_completion("m", "shared prefix"))
    await asyncio.sleep(0)  # one loop turn: the second call runs up to the shared future
    # Nothing is cached yet, so a hit here can only be the second call joining the first.
    assert (remote.hits, remote.misses) == (1, 1)
    fake.release.set()
    results = await asyncio.gather(first, second)
    assert results[0] == results[1]
    assert len(fake.bodies) == 1


async def test_the_cache_and_shared_calls_are_per_tenant(
    upstream: tuple[FakeTokenizeServer, str], remote: RemoteTokenizer
) -> None:
    # A hit (or a call joined in flight) for tenant B on the prompt tenant A just sent would
    # let B time that A sent it: entries are keyed on the tenant's scope too.
    fake, _ = upstream

    async def as_tenant(scope: str) -> None:
        TOKENIZE_CACHE_SCOPE.set(scope)  # its own task: the gateway sets it per request
        await remote.tokenize_completion("m", "the same prompt")

    await asyncio.create_task(as_tenant("salt-a"))
    await asyncio.create_task(as_tenant("salt-b"))
    await asyncio.create_task(as_tenant("salt-a"))
    assert len(fake.bodies) == 2 and (remote.hits, remote.misses) == (1, 2)
    fake.hold = True
    first = asyncio.create_task(as_tenant("salt-c"))
    await fake.arrived.wait()
    fake.arrived.clear()
    second = asyncio.create_task(as_tenant("salt-d"))
    await fake.arrived.wait()  # not joined to the first: a call of its own
    fake.release.set()
    await asyncio.gather(first, second)
    assert len(fake.bodies) == 4


@pytest.mark.parametrize(
    ("status", "body", "message"),
    [
        (500, '{"error": "boom"}', "answered 500"),
        (400, '{"object": "error", "message": "bad"}', "answered 400"),
        (200, "not json", "no 'tokens'"),
        (200, '{"count": 1}', "no 'tokens'"),
        (200, '{"tokens": [1, "x"]}', "must be a list of integers"),
    ],
)
async def test_upstream_failures_raise_and_are_not_cached(
    upstream: tuple[FakeTokenizeServer, str],
    remote: RemoteTokenizer,
    status: int,
    body: str,
    message: str,
) -> None:
    fake, _ = upstream
    fake.failures.append((status, body))
    with pytest.raises(TokenizationError, match=message):
        await remote.tokenize_completion("m", "x")
    assert (await remote.tokenize_completion("m", "x")).token_ids == (120,)


async def test_an_unreachable_upstream_raises() -> None:
    remote = RemoteTokenizer(f"http://127.0.0.1:{free_port()}", timeout_s=1.0)
    try:
        with pytest.raises(TokenizationError, match="ConnectError"):
            await remote.tokenize_completion("m", "x")
    finally:
        await remote.close()


async def test_a_silent_upstream_times_out(upstream: tuple[FakeTokenizeServer, str]) -> None:
    fake, url = upstream
    fake.hold = True
    remote = RemoteTokenizer(url, timeout_s=0.05)
    try:
        with pytest.raises(TokenizationError, match="Timeout"):
            await remote.tokenize_completion("m", "x")
    finally:
        await remote.close()


async def test_messages_are_checked_before_any_request(
    upstream: tuple[FakeTokenizeServer, str], remote: RemoteTokenizer
) -> None:
    fake, _ = upstream
    with pytest.raises(ValueError, match=r"messages\[0\]\.role"):
        await remote.tokenize_chat("m", [{"content": "x"}])
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        await remote.tokenize_chat("m", [{"role": "user", "content": "x"}], tools={1, 2})
    assert fake.bodies == []
