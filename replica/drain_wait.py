"""Wait for a vLLM engine to finish what it holds: a Kubernetes ``preStop`` hook's drain.

In the shipped pool manifest (``deploy/pool/vllm-pool.yaml``) vLLM runs beside a ``fleetgate
agent`` sidecar. A pod deletion sends the agent SIGTERM at once: it removes the replica from the
fleet, and gateways send it nothing new while they leave it the requests it holds
(``gateway/replicas.py``). vLLM, sent SIGTERM, would abort those. Its container's ``preStop``
runs this first::

    python3 -m replica.drain_wait --engine http://127.0.0.1:8000 --settle 5 --timeout 30

It waits ``--settle`` seconds (gateways hear of the departure at their next fleet read, every
``health_check_interval_s``), then until the engine's ``/metrics`` count no request running or
waiting, the engine stops answering, or ``--timeout`` passes; it always exits 0, so a stuck
drain only delays the stop. The standard library only: the engine image installs fleetgate
without its dependencies. ``fleetgate replica run`` drains the same way in-process.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable

#: The two gauges a drain waits on, summed over their label sets (one per model or engine).
_GAUGES = re.compile(
    r"^vllm:num_requests_(running|waiting)(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.MULTILINE
)


def requests_in_engine(metrics_text: str) -> int | None:
    """Requests running or waiting by the engine's ``/metrics`` text; None without the gauges."""
    found = _GAUGES.findall(metrics_text)
    if not found:
        return None
    return round(sum(float(value) for _, value in found))


def _read(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read().decode("utf-8", "replace")


def wait_idle(
    engine_url: str,
    settle_s: float,
    timeout_s: float,
    poll_s: float = 0.5,
    say: Callable[[str], None] = print,
) -> str:
    """Wait as the module says; returns why it stopped: ``idle``, ``engine down`` or
    ``timeout``."""
    started = time.monotonic()
    deadline = started + settle_s + timeout_s
    time.sleep(settle_s)
    metrics_url = engine_url.rstrip("/") + "/metrics"
    while True:
        try:
            held = requests_in_engine(_read(metrics_url, timeout_s=min(5.0, timeout_s)))
        except (urllib.error.URLError, OSError, ValueError):
            reason = "engine down"
            break
        if held == 0:
            reason = "idle"
            break
        if time.monotonic() >= deadline:
            reason = f"timeout ({held} request(s) still held)"
            break
        time.sleep(poll_s)
    say(f"drain: {reason} after {time.monotonic() - started:.1f}s")
    return reason


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m replica.drain_wait",
        description="Wait for a vLLM engine to finish the requests it holds (a preStop hook). "
        "Always exits 0.",
    )
    parser.add_argument("--engine", default="http://127.0.0.1:8000",
                        help="the engine's base URL (default: http://127.0.0.1:8000)")
    parser.add_argument("--settle", type=float, default=5.0,
                        help="seconds for gateways to hear the replica left (default: 5)")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="most seconds to wait after the settle (default: 30); keep the "
                        "pod's terminationGracePeriodSeconds above settle + timeout + the "
                        "engine's own shutdown")
    args = parser.parse_args(argv)
    if args.settle < 0 or args.timeout < 0:
        parser.error("--settle and --timeout must be >= 0")
    wait_idle(args.engine, args.settle, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
