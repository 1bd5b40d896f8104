"""``fleetgate up``: the whole stack in one process — gateway, N simulated replicas, memory index.

Examples::

    fleetgate up                     # 2 simulated replicas, gateway on :8000
    fleetgate up --sim 4 --port 9000 --profile cache-aware
    fleetgate up --adapters 3        # plus 3 demo LoRA adapters, loaded on first use
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys

from fleetgate.commands._args import (
    cannot_start,
    non_empty,
    non_negative_float,
    port,
    positive_float,
    positive_int,
    routing_profile,
)
from fleetgate.embedded import EmbeddedStack, embedded_stack
from gateway.logging_setup import configure_logging
from gateway.server import StopSignals, run_event_loop
from routing.policies.registry import DEFAULT_PROFILE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``fleetgate up``."""
    parser.add_argument(
        "--sim", type=positive_int, default=2, metavar="N", help="simulated replicas"
    )
    parser.add_argument("--port", type=port, default=8000, help="gateway port (0: any free)")
    parser.add_argument("--host", default="127.0.0.1", help="gateway bind address")
    parser.add_argument(
        "--model", type=non_empty, default="sim-model", help="model name the sims serve"
    )
    parser.add_argument(
        "--profile",
        type=routing_profile,
        default=DEFAULT_PROFILE,
        help=f"routing profile (default: {DEFAULT_PROFILE})",
    )
    parser.add_argument(
        "--sim-speed",
        type=positive_float,
        default=1.0,
        help="simulated engine speed-up (1 = real time)",
    )
    parser.add_argument(
        "--usd-per-hour",
        type=non_negative_float,
        default=None,
        help="price per replica-hour for the cost metric (default: the sim profile's, $3.00)",
    )
    parser.add_argument("--admin-key", default=None, help="admin API key (default: generated)")
    parser.add_argument(
        "--adapters",
        type=int,
        default=0,
        metavar="N",
        help="demo LoRA adapters (demo-lora-0..N-1) served through the adapter registry",
    )
    parser.add_argument(
        "--max-loras",
        type=positive_int,
        default=None,
        help="the sims' --max-loras (GPU LoRA slots)",
    )


def banner(stack: EmbeddedStack, admin_key: str) -> str:
    """What to print once the stack is up: URL, an example curl and an ``openai`` snippet."""
    count = len(stack.replica_urls)
    replicas = f"{count} simulated replica{'s' if count != 1 else ''}"
    return f"""fleetgate is up: {stack.url}  ({replicas})

  curl {stack.url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{stack.model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  from openai import OpenAI
  client = OpenAI(base_url="{stack.url}/v1", api_key="unused")
  reply = client.chat.completions.create(
      model="{stack.model}", messages=[{{"role": "user", "content": "Hello!"}}])
  print(reply.choices[0].message.content)
{_adapter_example(stack, admin_key)}
  dashboard: {stack.url}/dashboard#key={admin_key}
  metrics:   {stack.url}/metrics
{_scrape_targets(stack)}
  admin API: curl -H 'Authorization: Bearer {admin_key}' {stack.url}/admin/decisions
Press Ctrl-C to stop."""


def _scrape_targets(stack: EmbeddedStack) -> str:
    """The other /metrics a Prometheus should scrape: each sim's (vLLM's names) and agent's."""
    lines = [f"  replica:   {url}/metrics" for url in stack.replica_urls]
    lines += [f"  agent:     {url}/metrics" for url in stack.agent_urls]
    return "\n".join(lines)


def _adapter_example(stack: EmbeddedStack, admin_key: str) -> str:
    """The LoRA part of the banner: a request naming an adapter, and where to watch it load."""
    if not stack.adapters:
        return ""
    names = ", ".join(stack.adapters)
    return f"""
  LoRA adapters ({names}): name one as the model; the first request loads it
  curl {stack.url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{stack.adapters[0]}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'
  placement: curl -H 'Authorization: Bearer {admin_key}' {stack.url}/admin/adapters
"""


def run(args: argparse.Namespace) -> int:
    """Run until Ctrl-C."""
    configure_logging()
    if args.sim < 1:
        print("fleetgate up: --sim must be >= 1", file=sys.stderr)
        return 2
    if args.adapters < 0:
        print("fleetgate up: --adapters must be >= 0", file=sys.stderr)
        return 2
    admin_key = args.admin_key or secrets.token_urlsafe(16)

    async def main() -> None:
        signals = StopSignals(on_second=_exit_now)
        async with embedded_stack(
            args.sim,
            host=args.host,
            port=args.port,
            model=args.model,
            profile=args.profile,
            usd_per_hour=args.usd_per_hour,
            admin_key=admin_key,
            sim_speed=args.sim_speed,
            adapters=args.adapters,
            max_loras=args.max_loras,
        ) as stack:
            print(banner(stack, admin_key), flush=True)
            await signals.wait()

    import zmq

    try:
        run_event_loop(main())
    except (OSError, ValueError, zmq.ZMQError) as exc:  # a port in use, a setting that cannot work
        return cannot_start("up", exc, f"{args.host}:{args.port}")
    return 0


def _exit_now() -> None:
    """A second Ctrl-C: stop without waiting for the requests in flight to finish (the simulated
    replicas drain theirs on a clean stop: a long stream held it 20 s, the diff review). Nothing
    here outlives the process."""
    print("fleetgate up: stopped at once (second stop signal)", file=sys.stderr, flush=True)
    os._exit(130)
