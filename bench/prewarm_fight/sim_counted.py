"""Start N simulated vLLM replicas (fleetgate's sim, this repo's code) and log every engine-side
runtime LoRA load/unload call (time, replica port, adapter, HTTP status, seconds) as JSONL.

Same as `fleetgate sim --replicas N --port P --profile tiny --max-loras L` (kv events off), plus
the handler wrappers; the sim is not what changed between the two commits under test.
Engine loads are modelled at ~0.8 s (160 MB at 0.2 GB/s).
usage: sim_counted.py N PORT MAX_LORAS EVENTS.jsonl
"""

import asyncio
import json
import signal
import sys
import time

import replica.sim.server as srv
from replica.sim.fleet import start_sim_fleet

n, port, max_loras, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
# Modelled adapter: 160 MB read at 0.2 GB/s = ~0.8 s per engine load (a realistic cold load).
OVERRIDES = {"adapter_default_size_mb": 160.0, "lora_storage_gbps": 0.2}
fh = open(out, "a", buffering=1)  # noqa: SIM115 -- open for the process's life


def wrap(kind, handler):
    async def wrapped(request):
        t0 = time.time()
        try:
            body = await request.json()
        except Exception:
            body = {}
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except Exception as exc:  # ApiError etc.
            status = getattr(exc, "status", None) or getattr(exc, "status_code", None) or repr(exc)
            raise
        finally:
            fh.write(
                json.dumps(
                    {
                        "t": t0,
                        "kind": kind,
                        "port": request.url.port,
                        "adapter": body.get("lora_name"),
                        "status": status,
                        "secs": round(time.time() - t0, 4),
                    }
                )
                + "\n"
            )

    return wrapped


srv.load_lora_adapter = wrap("load", srv.load_lora_adapter)
srv.unload_lora_adapter = wrap("unload", srv.unload_lora_adapter)


async def main():
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for s in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(s, stop.set)
    async with start_sim_fleet(
        n,
        port=port,
        model="sim-model",
        profile="tiny",
        max_loras=max_loras,
        kv_events=None,
        kv_replay=None,
        engine_overrides=OVERRIDES,
    ) as fleet:
        for i, h in enumerate(fleet.replicas):
            e = h.replica.engine_config
            print(
                f"replica {i}: {h.url} max_loras={e.max_loras} max_cpu_loras={e.max_cpu_loras}",
                flush=True,
            )
        await stop.wait()


asyncio.run(main())
