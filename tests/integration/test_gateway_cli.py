"""`fleetgate up` and `fleetgate serve` as a user runs them: a real process, the `openai` client."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from pathlib import Path

import aiohttp
import openai

from gateway.server import SAME_SIGNAL_S
from tests.integration.test_gateway_support import FakeUpstream, serve
from tests.support.redis_server import free_port


async def _start(*args: str) -> tuple[asyncio.subprocess.Process, str, list[str]]:
    """Run ``fleetgate ARGS`` and wait for the line that names its URL."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "fleetgate.cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert process.stdout is not None
    lines: list[str] = []
    async with asyncio.timeout(60):
        while True:
            line = (await process.stdout.readline()).decode()
            assert line, "process exited before it was up:\n" + "".join(lines)
            lines.append(line)
            found = re.search(r"(http://127\.0\.0\.1:\d+)", line)
            if found and ("is up" in line or "listening" in line):
                return process, found.group(1), lines


async def _stop(process: asyncio.subprocess.Process) -> int:
    process.send_signal(signal.SIGINT)
    async with asyncio.timeout(30):
        return await process.wait()


async def test_fleetgate_up_serves_the_openai_client() -> None:
    process, url, _ = await _start("up", "--sim", "1", "--port", "0", "--sim-speed", "100")
    try:
        assert process.stdout is not None
        banner = "".join([(await process.stdout.readline()).decode() for _ in range(8)])
        assert "curl" in banner and "from openai import OpenAI" in banner
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        reply = await client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "Hello!"}], max_tokens=4
        )
        assert reply.choices[0].message.content
        await client.close()
    finally:
        assert await _stop(process) == 0


async def test_fleetgate_serve_quick_start_with_replica_urls() -> None:
    upstream = FakeUpstream()
    async with serve(upstream.app()) as upstream_url:
        process, url, _ = await _start(
            "serve", "--replica", upstream_url, "--host", "127.0.0.1", "--port", "0"
        )
        try:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="any", max_retries=0)
            text = await client.completions.create(model="base-model", prompt="hi")
            assert text.choices[0].text == "a b c"
            await client.close()
        finally:
            assert await _stop(process) == 0


async def test_fleetgate_serve_workers_share_the_port() -> None:
    upstream = FakeUpstream()
    port = free_port()
    async with serve(upstream.app()) as upstream_url:
        process, _, _ = await _start(
            "serve",
            "--replica",
            upstream_url,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "2",
            "--no-metrics",
        )
        try:
            url = f"http://127.0.0.1:{port}"
            await _wait_listening(url)
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="any", max_retries=0)
            for _ in range(4):
                text = await client.completions.create(model="base-model", prompt="hi")
                assert text.choices[0].text == "a b c"
            await client.close()
            # --no-metrics: no worker answers with its own share of the counters.
            async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
                assert resp.status == 404
                assert "--no-metrics" in (await resp.json())["error"]["message"]
        finally:
            assert await _stop(process) == 0
    assert len(upstream.received) == 4


async def _wait_listening(url: str) -> None:
    """Workers start after the parent's announcement; wait (bounded) until one answers."""
    async with asyncio.timeout(60), aiohttp.ClientSession() as http:
        while True:
            try:
                async with http.get(f"{url}/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.1)


async def test_sighup_reloads_the_policy(tmp_path: Path) -> None:
    upstream = FakeUpstream()
    async with serve(upstream.app()) as upstream_url:
        path = tmp_path / "policy.yaml"
        path.write_text(_POLICY.format(url=upstream_url, profile="least-loaded"))
        process, url, _ = await _start(
            "serve",
            "--config",
            str(path),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--admin-key",
            "adm",
        )
        try:
            before = os.stat(path)
            path.write_text(_POLICY.format(url=upstream_url, profile="round-robin"))
            # Same mtime as before: only SIGHUP, not the file-change poller, can reload it.
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
            process.send_signal(signal.SIGHUP)
            async with aiohttp.ClientSession() as http:
                async with asyncio.timeout(30):
                    while "round-robin" not in await _profiles(http, url):
                        await asyncio.sleep(0.1)
        finally:
            assert await _stop(process) == 0


async def _profiles(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(f"{url}/admin/policy", headers={"Authorization": "Bearer adm"}) as resp:
        return json.dumps((await resp.json())["routes"])


_POLICY = """
version: 1
replica_pools:
  - name: pool-a
    replicas: [{url}]
models:
  - name: base-model
    pools: [pool-a]
routes:
  - name: main
    profile: {profile}
"""


async def test_a_second_stop_signal_cuts_the_drain_and_says_so() -> None:
    # The second signal skips the stop delay; the log said "stopped during start-up" (the CLI
    # review).
    upstream = FakeUpstream()
    async with serve(upstream.app()) as upstream_url:
        process, _, _ = await _start(
            "serve", "--replica", upstream_url, "--host", "127.0.0.1", "--port", "0",
            "--stop-delay", "60",
        )
        assert process.stdout is not None
        process.send_signal(signal.SIGINT)
        lines: list[str] = []
        async with asyncio.timeout(30):
            while not any("stopping" in line for line in lines):
                lines.append((await process.stdout.readline()).decode())
            # Closer together, two signals are one delivered twice (to the group, and
            # forwarded by a --workers parent).
            await asyncio.sleep(SAME_SIGNAL_S + 0.1)
            process.send_signal(signal.SIGINT)
            rest = (await process.stdout.read()).decode()
            assert await process.wait() == 0  # well before the 60 s stop delay
    assert "stopped at once: a second stop signal" in rest
    assert "start-up" not in rest


async def test_a_second_stop_signal_stops_fleetgate_up_without_waiting_for_its_requests() -> None:
    # Its simulated replicas drain what they hold on a clean stop: a 3,000-token stream held a
    # second Ctrl-C for 20 s, which then said "stopped at once" (the diff review).
    process, url, _ = await _start("up", "--sim", "1", "--port", "0")
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 3000, "stream": True}
            async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
                await resp.content.readline()  # streaming: the request is in flight
                process.send_signal(signal.SIGINT)
                await asyncio.sleep(SAME_SIGNAL_S + 0.25)
                process.send_signal(signal.SIGINT)
                async with asyncio.timeout(10):  # the stream alone would take ~20 s
                    assert await process.wait() == 130
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.stdout is not None
    assert "stopped at once" in (await process.stdout.read()).decode()
