"""Make ``docs/dashboard.png``: ``/dashboard`` in headless Chromium while a fleet serves load.

    .venv/bin/python -m tests.support.dashboard_screenshot docs/dashboard.png

``fleetgate up``'s stack (two real-time simulated replicas, two demo adapters) serves a steady
mix of chat requests from three tenants' system prompts, some naming an adapter, some streamed,
16 at a time; after ``--seconds`` of it the page is captured mid-load, so its sparklines have a
history and the replicas show KV usage and running requests. The browser test
(tests/integration/test_dashboard_chromium.py) checks the page; this only takes the picture.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from pathlib import Path
from typing import Any

import aiohttp

from fleetgate.embedded import embedded_stack
from tests.support.chromium import headless_page

ADMIN_KEY = "screenshot-admin-key"
SYSTEM_PROMPTS = [f"You are assistant {n}. " + "Answer briefly and politely. " * 60 for n in "ABC"]


async def _client(url: str, models: list[str], seed: int, stop: asyncio.Event) -> None:
    rng = random.Random(seed)
    async with aiohttp.ClientSession() as http:
        while not stop.is_set():
            body: dict[str, Any] = {
                "model": models[1 + rng.randrange(len(models) - 1)] if rng.random() < 0.2
                else models[0],
                "messages": [
                    {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)},
                    {"role": "user", "content": f"Question {rng.randrange(1000)}?"},
                ],
                "max_tokens": rng.randint(16, 96),
                "stream": rng.random() < 0.5,
            }
            async with http.post(f"{url}/v1/chat/completions", json=body) as response:
                await response.read()


async def main(out: Path, seconds: float, clients: int) -> None:
    async with embedded_stack(2, admin_key=ADMIN_KEY, adapters=2, sim_speed=1.0) as stack:
        stop = asyncio.Event()
        models = [stack.model, *stack.adapters]
        load = [asyncio.create_task(_client(stack.url, models, n, stop)) for n in range(clients)]
        try:
            async with headless_page() as page:
                await page.navigate(f"{stack.url}/dashboard#key={ADMIN_KEY}")
                await asyncio.sleep(seconds)  # the picture's history: wall-clock time on purpose
                await page.screenshot(out, width=1500)
                if page.problems:
                    raise SystemExit(f"the page logged errors: {page.problems}")
        finally:
            stop.set()
            await asyncio.gather(*load, return_exceptions=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--clients", type=int, default=16)
    args = parser.parse_args()
    asyncio.run(main(args.out, args.seconds, args.clients))
