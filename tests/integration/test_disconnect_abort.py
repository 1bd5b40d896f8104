"""A client that disconnects aborts its request on the engine, streamed or not.

Checked by the engine's own gauge (``vllm:num_requests_running`` of the simulated replica), not
by the gateway's bookkeeping: the request must stop running where the tokens are generated.
vLLM aborts a request whose connection closes; the simulated replica does the same, and the
gateway closes its upstream connection when its client leaves.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from fleetgate.embedded import embedded_stack
from tests.support.polling import wait_until


async def _running(http: aiohttp.ClientSession, replica_url: str) -> float:
    async with http.get(f"{replica_url}/metrics") as resp:
        text = await resp.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:num_requests_running")
    )


async def _post_and_wait(url: str, body: dict[str, object]) -> None:
    """The client: posts and reads the answer (never completes here: it is cancelled)."""
    async with aiohttp.ClientSession() as client, client.post(url, json=body) as resp:
        await resp.read()


@pytest.mark.parametrize("stream", [False, True])
async def test_client_disconnect_aborts_the_engine_request(stream: bool) -> None:
    # Real-time speed: 4,000 output tokens take the simulated H100 well over a minute, so the
    # request is certainly still running when the client leaves.
    async with embedded_stack(1, sim_speed=1.0) as stack, aiohttp.ClientSession() as http:
        (replica_url,) = stack.replica_urls
        body = {
            "model": stack.model,
            "prompt": "tell me a long story",
            "max_tokens": 4000,
            "stream": stream,
        }
        client = asyncio.create_task(_post_and_wait(f"{stack.url}/v1/completions", body))

        async def runs() -> bool:
            return await _running(http, replica_url) == 1

        await wait_until(runs, "the request runs on the engine", timeout_s=30)
        assert not client.done()
        client.cancel()  # the client goes away: its connection to the gateway closes
        with pytest.raises(asyncio.CancelledError):
            await client

        async def stopped() -> bool:
            return await _running(http, replica_url) == 0

        await wait_until(stopped, "the engine no longer runs the request", timeout_s=30)
