"""Python function calls per request through the gateway (cProfile counts: load-independent).

    cd TREE && PYTHONPATH=TREE /work/main/.venv/bin/python -P calls_per_request.py 300
    cd TREE && PYTHONPATH=TREE /work/main/.venv/bin/python -P calls_per_request.py 1000 cpu

Runs in whichever tree PYTHONPATH points at (``-P``: not the current directory first): a
policy-less text-mode gateway in front of a minimal OpenAI-shaped upstream, both in this process;
50 warm-up requests, then N profiled ones (non-streaming chat, 1,000-word prompts from 8 shared
system prompts, like bench.gateway_overhead); ``cpu``: CPU seconds instead of a profile.
"""
import asyncio
import contextlib
import cProfile
import os
import pstats
import random
import sys

import aiohttp
from aiohttp import web

import gateway
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.policy_view import GatewayPolicy, ReplicaSpec

ANSWER = {
    "id": "x",
    "object": "chat.completion",
    "model": "base-model",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
    "usage": {"prompt_tokens": 1000, "completion_tokens": 4, "total_tokens": 1004},
}


def upstream_app() -> web.Application:
    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "base-model"}]})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(ANSWER)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/chat/completions", chat)
    return app


@contextlib.asynccontextmanager
async def serve(app: web.Application):
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()

WORDS = [f"w{i}" for i in range(500)]
def prompt(rng, i):
    system = " ".join(random.Random(i % 8).choice(WORDS) for _ in range(800))
    user = " ".join(rng.choice(WORDS) for _ in range(200))
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]

async def main(n: int) -> None:
    rng = random.Random(0)
    async with serve(upstream_app()) as up:
        spec = ReplicaSpec("r0", up, models=frozenset(["base-model"]))
        policy = GatewayPolicy.default([spec], profile="expected-ttft")
        app = create_app(GatewayConfig(health_interval_s=3600), policy)
        async with serve(app) as url, aiohttp.ClientSession() as http:
            bodies = [
                {"model": "base-model", "messages": prompt(rng, i), "max_tokens": 4}
                for i in range(50 + n)
            ]
            async def one(body):
                async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    await resp.read()
            for body in bodies[:50]:
                await one(body)
            if CPU:
                import time
                start = time.process_time()
                for body in bodies[50:]:
                    await one(body)
                await asyncio.sleep(0)
                used = time.process_time() - start
                print(
                    f"tree {gateway.__path__[0]}: {used * 1e6 / n:.0f} us CPU/request "
                    "(client, gateway and fake upstream in one process)"
                )
                return
            prof = cProfile.Profile()
            prof.enable()
            for body in bodies[50:]:
                await one(body)
            await asyncio.sleep(0)  # the last request's accounting callback
            prof.disable()
    stats = pstats.Stats(prof).stats
    total = sum(v[1] for v in stats.values())
    root = os.path.dirname(gateway.__path__[0]) + "/"
    ours = {
        k: v
        for k, v in stats.items()
        if k[0].startswith((root + "gateway/", root + "routing/"))
    }
    mine = sum(v[1] for v in ours.values())
    print(f"tree {root}: {total / n:.0f} calls/request, {mine / n:.0f} in gateway/ + routing/")
    top = sorted(ours.items(), key=lambda kv: -kv[1][1])[:25]
    for (f, _line, name), v in top:
        print(f"  {v[1] / n:6.2f}  {f.replace(root, '')}:{name}")

CPU = len(sys.argv) > 2 and sys.argv[2] == 'cpu'
asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 300))
