"""A fleet whose replicas of one model take different context lengths (``--max-model-len``), on
real sockets: simulated vLLM replicas that refuse an over-long prompt with vLLM's 400, a real
gateway and the official ``openai`` client.

A heterogeneous-fleet review found a fifth of 1,500-token prompts answered 400 by the one
replica of six with a 1,024-token context, under every policy: routing never read the
engine's context length, and a 400 was never retried.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import openai
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import GATEWAY, create_app
from gateway.config import GatewayConfig
from gateway.policy_view import GatewayPolicy, ReplicaSpec
from replica.sim.fleet import start_sim_fleet
from tests.integration.test_gateway_support import FakeUpstream, serve

MODEL = "sim-model"
SHORT_CONTEXT = 1024


@contextlib.asynccontextmanager
async def _mixed_fleet() -> AsyncIterator[str]:
    """A gateway in front of a replica with a 1,024-token context and one with the profile's
    long one; yields the gateway's URL once its health polls have read both contexts."""
    async with (
        start_sim_fleet(
            1, model=MODEL, kv_events=None, kv_replay=None, speed=1000,
            engine_overrides={"max_model_len": SHORT_CONTEXT},
        ) as short,
        start_sim_fleet(1, model=MODEL, kv_events=None, kv_replay=None, speed=1000) as long,
    ):
        specs = [
            ReplicaSpec("short", short.urls[0], models=frozenset({MODEL})),
            ReplicaSpec("long", long.urls[0], models=frozenset({MODEL})),
        ]
        app = create_app(GatewayConfig(), GatewayPolicy.default(specs))
        async with serve(app) as url:
            registry = app[GATEWAY].registry
            for _ in range(500):
                states = [registry.get(r.replica_id) for r in specs]
                if all(s is not None and s.max_model_len for s in states):
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("the gateway never read the replicas' context lengths")
            yield url


async def _status_by_replica(http: aiohttp.ClientSession, url: str) -> dict[tuple[str, str], float]:
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    counts: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "fleetgate_requests":
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.value:
                    key = (sample.labels["replica"], sample.labels["status"])
                    counts[key] = counts.get(key, 0) + sample.value
    return counts


async def _context_retries(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    for family in text_string_to_metric_families(text):
        if family.name == "fleetgate_upstream_retries":
            return sum(
                s.value for s in family.samples
                if s.name.endswith("_total") and s.labels.get("reason") == "context_length"
            )
    return 0.0


async def test_a_prompt_too_long_for_one_replica_goes_to_one_that_fits() -> None:
    async with _mixed_fleet() as url, aiohttp.ClientSession() as http:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        for i in range(6):  # distinct prompts of ~1,500 tokens: no cache keeps them together
            prompt = " ".join(f"w{i}x{n}" for n in range(1500))
            answer = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=8
            )
            assert answer.choices[0].message.content
        # Short prompts still use both replicas: the context test drops only where it must.
        for i in range(6):
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=4
            )
        counts = await _status_by_replica(http, url)
        retries = await _context_retries(http, url)
        await client.close()
    assert retries == 0  # routing sent none where it cannot fit: no retry was needed
    assert counts.get(("long", "200"), 0) >= 6
    assert counts.get(("short", "200"), 0) >= 1
    assert not any(status == "400" for _, status in counts)


async def test_an_underestimated_prompt_refused_for_its_length_is_retried_where_it_fits() -> None:
    # One-letter words: the gateway's text estimate (4 characters a token) counts ~750 tokens
    # where the engine counts ~1,500, so routing takes the short replica to fit it.
    async with _mixed_fleet() as url, aiohttp.ClientSession() as http:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        for i in range(6):
            prompt = " ".join("abcdefghijklmnopqrstuvwxyz"[(i + n) % 26] for n in range(1500))
            answer = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=8
            )
            assert answer.choices[0].message.content
        counts = await _status_by_replica(http, url)
        retries = await _context_retries(http, url)
        await client.close()
    assert counts.get(("long", "200"), 0) == 6
    assert retries >= 1  # routing did try the short replica: the retry is what answered
    assert not any(status == "400" for _, status in counts)


async def test_a_request_that_fits_only_an_unavailable_replica_is_a_503_to_retry() -> None:
    # It fits the fleet (the long replica's context), only not now: a 503 with Retry-After,
    # not the short replica's 400, which the clients take as final (the re-check review).
    long = FakeUpstream(models=[MODEL], max_model_len=131_072, drop_completions=True)
    async with (
        start_sim_fleet(
            1, model=MODEL, kv_events=None, kv_replay=None, speed=1000,
            engine_overrides={"max_model_len": SHORT_CONTEXT},
        ) as short,
        serve(long.app()) as long_url,
    ):
        specs = [
            ReplicaSpec("short", short.urls[0], models=frozenset({MODEL})),
            ReplicaSpec("long", long_url, models=frozenset({MODEL})),
        ]
        app = create_app(GatewayConfig(), GatewayPolicy.default(specs))
        async with serve(app) as url, aiohttp.ClientSession() as http:
            registry = app[GATEWAY].registry
            while not all((s := registry.get(r.replica_id)) and s.max_model_len for r in specs):
                await asyncio.sleep(0.02)
            got = []
            for i in range(4):  # routing tries each replica first in turn
                prompt = " ".join("abcdefghijklmnopqrstuvwxyz"[(i + n) % 26] for n in range(1500))
                body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                        "max_tokens": 8}
                async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
                    got.append((resp.status, resp.headers.get("Retry-After"),
                                (await resp.json())["error"]["code"]))
            # Until its circuit opens (three failures): then routing offers only the short
            # replica, whose own 400 is the answer (docs/api.md).
            assert got[:3] == [(503, "1", "no_healthy_replica")] * 3, got
            assert got[3][0] == 400, got
