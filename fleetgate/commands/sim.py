"""``fleetgate sim``: simulated vLLM replicas that speak vLLM's HTTP API, metrics and KV events.

Examples::

    # two replicas on 8001-8002, KV events bound on 5557-5558 (subscribers connect)
    fleetgate sim --replicas 2 --port 8001 --kv-events 'tcp://*:5557'

    # a small engine with KV pressure, ten times faster than real time
    fleetgate sim --profile tiny --speed 10

    # fit a profile to a live vLLM engine, then simulate it
    fleetgate sim calibrate --engine http://127.0.0.1:8000 --output cpu.yaml
    fleetgate sim --profile cpu.yaml

Point any OpenAI client at ``http://HOST:PORT/v1``; ``model`` is ``--model`` or a LoRA adapter
loaded with ``POST /v1/load_lora_adapter``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Callable
from typing import Any

from fleetgate.commands import sim_calibrate
from fleetgate.commands._args import (
    cannot_start,
    log_level,
    non_empty,
    non_negative_int,
    port,
    positive_float,
    positive_int,
    zmq_endpoint,
)
from gateway.logging_setup import configure_logging
from replica.sim.fleet import SimFleet, start_sim_fleet


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``fleetgate sim``."""
    parser.epilog = __doc__.split("Examples::", 1)[1] if __doc__ else None
    parser.add_argument(
        "action",
        nargs="?",
        choices=["calibrate"],
        help="calibrate: fit a profile YAML to a live engine (see the calibrate options)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on")
    parser.add_argument(
        "--port",
        type=port,
        default=8001,
        help="HTTP port of the first replica; replica i uses PORT+i (0: any free ports)",
    )
    parser.add_argument(
        "--replicas", type=positive_int, default=1, help="number of replicas (default 1)"
    )
    parser.add_argument(
        "--profile",
        default="h100-llama3-8b",
        help="engine preset from replica/sim/profiles/presets.yaml, or a profile YAML file "
        "(e.g. from `fleetgate sim calibrate`) (default: h100-llama3-8b)",
    )
    parser.add_argument("--model", type=non_empty, default="sim-model", help="served model name")
    parser.add_argument(
        "--kv-events",
        type=zmq_endpoint,
        help="KV-event endpoint of the first replica, vLLM's rule: tcp://*:Q binds (replica i "
        "on Q+i), tcp://HOST:Q connects to a subscriber that binds; default: off",
    )
    parser.add_argument(
        "--kv-replay",
        type=zmq_endpoint,
        help="ROUTER replay endpoint of the first replica (replica i on port+i); default: off",
    )
    parser.add_argument("--kv-topic", default="kv", help="KV-event topic (default: kv)")
    parser.add_argument(
        "--speed",
        type=positive_float,
        default=1.0,
        help="modelled seconds per wall second (default 1: real time)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of replica 0 (replica i: +i)")
    parser.add_argument(
        "--max-loras",
        type=non_negative_int,
        help="GPU LoRA slots (vLLM's --max-loras); 0: LoRA off, as vLLM without --enable-lora "
        "(adapter loads are refused)",
    )
    parser.add_argument("--block-size", type=positive_int, help="KV block size in tokens")
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json); "
        "default: a built-in deterministic word-hash tokenizer",
    )
    parser.add_argument(
        "--max-waiting",
        type=positive_int,
        default=1024,
        help="waiting requests beyond which a replica answers 503 (default 1024)",
    )
    parser.add_argument(
        "--log-level", type=log_level, default="INFO", help="logging level (default: INFO)"
    )
    sim_calibrate.add_arguments(parser)


def fleet_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``start_sim_fleet`` keyword arguments from parsed options."""
    return {
        "n": args.replicas,
        "host": args.host,
        "port": args.port,
        "model": args.model,
        "profile": args.profile,
        "kv_events": args.kv_events,
        "kv_replay": args.kv_replay,
        "kv_topic": args.kv_topic,
        "speed": args.speed,
        "seed": args.seed,
        "max_loras": args.max_loras,
        "block_size": args.block_size,
        "tokenizer_dir": args.tokenizer,
        "max_waiting": args.max_waiting,
    }


def describe(fleet: SimFleet) -> str:
    """One line per replica: its URL (the engine's root, as ``fleetgate serve --replica`` and a
    policy's ``replicas`` take it; OpenAI clients add ``/v1``) and event endpoints."""
    lines = []
    for handle in fleet.replicas:
        line = f"replica {handle.index}: {handle.url}"
        if handle.kv_events_endpoint:
            line += f"  kv-events {handle.kv_events_endpoint}"
        if handle.kv_replay_endpoint:
            line += f"  replay {handle.kv_replay_endpoint}"
        lines.append(line)
    return "\n".join(lines)


async def serve(
    args: argparse.Namespace,
    stop: asyncio.Event,
    on_ready: Callable[[SimFleet], None] | None = None,
) -> None:
    """Run the fleet until ``stop`` is set; ``on_ready`` sees it once every replica serves."""
    async with start_sim_fleet(**fleet_kwargs(args)) as fleet:
        print(f"fleetgate sim: {len(fleet.replicas)} replica(s) of {fleet.model!r}", flush=True)
        print(describe(fleet), flush=True)
        if on_ready is not None:
            on_ready(fleet)
        await stop.wait()


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fleetgate sim``."""
    configure_logging(args.log_level.upper())
    if args.action == "calibrate":
        return sim_calibrate.run(args)
    if args.replicas < 1:
        print("fleetgate sim: --replicas must be >= 1", file=sys.stderr)
        return 2
    if args.port and args.port + args.replicas - 1 > 65535:
        print(
            f"fleetgate sim: replica i listens on --port + i, and {args.port} + "
            f"{args.replicas - 1} is past 65535: choose a lower --port (or 0: any free ports)",
            file=sys.stderr,
        )
        return 2

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await serve(args, stop)

    import zmq

    try:
        asyncio.run(main())
    except (OSError, ValueError, zmq.ZMQError) as exc:  # a port in use, a bad profile, address
        # Replica i listens on --port + i: the busy port may be any of them.
        last = args.port + args.replicas - 1
        ports = str(args.port) if args.port == 0 or last == args.port else f"{args.port}-{last}"
        return cannot_start("sim", exc, f"{args.host}:{ports}")
    return 0
