"""Two gateways sharing adapter placement in real Redis, in front of one simulated replica."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import aiohttp

from replica.sim.fleet import start_sim_fleet
from tests.integration.test_adapters_fixtures import eventually, served_adapters
from tests.integration.test_gateway_adapters_support import (
    ADMIN,
    GatedLoraLock,
    adapter,
    adapter_gateway,
    post_chat,
)


async def test_concurrent_cold_requests_on_two_gateways_load_the_adapter_once(
    tmp_path: Path, redis_url: str
) -> None:
    prefix = f"fgtest:{uuid.uuid4().hex[:8]}:"  # this test's own keys in the shared Redis
    catalog = [adapter("acme-lora")]
    gate = asyncio.Event()
    async with (
        start_sim_fleet(1, kv_events=None, kv_replay=None, speed=1000.0) as fleet,
        adapter_gateway(
            tmp_path, fleet, catalog, name="a", redis_url=redis_url, key_prefix=prefix
        ) as (url_a, gw_a),
        adapter_gateway(
            tmp_path, fleet, catalog, name="b", redis_url=redis_url, key_prefix=prefix
        ) as (url_b, gw_b),
        aiohttp.ClientSession() as http,
    ):
        # Every load call reaches the engine through its LoRA lock: count them there, and hold
        # the first one until the other gateway is seen waiting on the shared Redis lock.
        lock = GatedLoraLock(gate)
        fleet.replicas[0].replica.lora_lock = lock
        requests = [
            asyncio.create_task(post_chat(http, url, "acme", "acme-lora", f"q{i} {url}"))
            for i in range(3)
            for url in (url_a, url_b)
        ]

        def contentions() -> int:
            return sum(gw.adapters.loader.lock_contentions for gw in (gw_a, gw_b) if gw.adapters)

        await eventually(lambda: lock.calls == 1 and contentions() >= 1)
        gate.set()
        answers = await asyncio.gather(*requests)
        assert [status for status, _ in answers] == [200] * 6, answers
        assert lock.calls == 1  # one load in the fleet: the other gateway waited for it
        assert await served_adapters(http, fleet.urls[0]) == ["acme-lora"]
        for url in (url_a, url_b):  # both see the same placement
            async with http.get(f"{url}/admin/adapters", headers=ADMIN) as resp:
                report = await resp.json()
            assert report["store"] == "redis"
            assert report["adapters"][0]["loaded_on"] == ["pool-a/0"]
