"""``fleetgate sim``'s options drive a real fleet on consecutive ports."""

from __future__ import annotations

import argparse
import asyncio

import aiohttp

from fleetgate.commands import sim
from replica.sim.fleet import SimFleet
from tests.support.redis_server import free_port_block


# The HTTP and event ports come from one block of four consecutive ports below the kernel's
# ephemeral range (tests/support/redis_server.py): no client connection can take one between the
# probe and the fleet's bind.
async def test_sim_command_serves_replicas_on_consecutive_ports() -> None:
    parser = argparse.ArgumentParser()
    sim.add_arguments(parser)
    http_port = free_port_block(4)
    events_port = http_port + 2
    args = parser.parse_args([
        "--replicas", "2", "--port", str(http_port), "--profile", "tiny", "--speed", "1000",
        "--kv-events", f"tcp://*:{events_port}", "--model", "cli-model", "--block-size", "32",
    ])
    stop = asyncio.Event()
    ready: asyncio.Future[SimFleet] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(sim.serve(args, stop, ready.set_result))
    try:
        fleet = await asyncio.wait_for(asyncio.shield(ready), timeout=30)
        assert fleet.urls == [f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{http_port + 1}"]
        assert fleet.kv_event_endpoints == [
            f"tcp://127.0.0.1:{events_port}", f"tcp://127.0.0.1:{events_port + 1}",
        ]
        assert [h.replica.engine_config.block_size for h in fleet.replicas] == [32, 32]
        async with aiohttp.ClientSession() as http:
            for url in fleet.urls:
                async with http.get(url + "/v1/models") as resp:
                    assert [m["id"] for m in (await resp.json())["data"]] == ["cli-model"]
        assert "replica 1:" in sim.describe(fleet)
    finally:
        stop.set()
        await task
