"""Two open-loop herds: A -> gateway A for acme-x/acme-y, B -> gateway B for globex-z/globex-w.

Poisson arrivals at RATE req/s per herd (seeded), /v1/completions, max_tokens 8, short prompts.
Writes one JSONL line per request: herd, adapter, start (s since run start), status, latency,
fleetgate error code. usage: herds.py GW_A GW_B DURATION_S RATE SEED OUT.jsonl
"""

import asyncio
import json
import random
import sys
import time

import aiohttp

gw_a, gw_b, duration, rate, seed, out = (
    sys.argv[1],
    sys.argv[2],
    float(sys.argv[3]),
    float(sys.argv[4]),
    int(sys.argv[5]),
    sys.argv[6],
)
HERDS = {
    "A": (gw_a, "sk-acme-1", ["acme-x", "acme-y"]),
    "B": (gw_b, "sk-globex-1", ["globex-z", "globex-w"]),
}
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
]


async def one(session, herd, url, key, adapter, prompt, t_run0, fh):
    t0 = time.monotonic()
    rec = {"herd": herd, "adapter": adapter, "start": round(t0 - t_run0, 3)}
    try:
        async with session.post(
            f"{url}/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": adapter, "prompt": prompt, "max_tokens": 8},
        ) as r:
            body = await r.read()
            rec["status"] = r.status
            if r.status != 200:
                try:
                    err = json.loads(body).get("error", {})
                    rec["code"] = err.get("code") or err.get("type")
                    rec["msg"] = str(err.get("message"))[:200]
                except Exception:
                    rec["code"] = body[:200].decode(errors="replace")
    except Exception as exc:
        rec["status"] = 0
        rec["code"] = type(exc).__name__
        rec["msg"] = str(exc)[:200]
    rec["latency"] = round(time.monotonic() - t0, 4)
    fh.write(json.dumps(rec) + "\n")


async def herd_loop(session, herd, rng, t_run0, fh, tasks):
    url, key, adapters = HERDS[herd]
    t = 0.0
    i = 0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return
        delay = t_run0 + t - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        adapter = adapters[i % len(adapters)]
        i += 1
        prompt = " ".join(rng.choice(WORDS) for _ in range(24))
        tasks.append(asyncio.create_task(one(session, herd, url, key, adapter, prompt, t_run0, fh)))


async def main():
    timeout = aiohttp.ClientTimeout(total=120)
    with open(out, "w", buffering=1) as fh:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            tasks: list[asyncio.Task] = []
            t_run0 = time.monotonic()
            await asyncio.gather(
                herd_loop(session, "A", random.Random(seed), t_run0, fh, tasks),
                herd_loop(session, "B", random.Random(seed + 1), t_run0, fh, tasks),
            )
            await asyncio.gather(*tasks)
            print(f"herds: {len(tasks)} requests in {time.monotonic() - t_run0:.1f} s", flush=True)


asyncio.run(main())
