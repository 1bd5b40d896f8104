"""``fleetgate agent``: run the replica agent beside an already running vLLM engine.

Examples::

    # engine started with --kv-events-config '{..."endpoint":"tcp://*:5557","topic":"kv"}'
    fleetgate agent --replica-id pool-a/r0 --engine-url http://127.0.0.1:8000 \\
        --kv-events tcp://127.0.0.1:5557 --index-url redis://redis:6379/0 --listen 0.0.0.0:9100

    # engine told to *connect* to tcp://agent-host:5557: the agent binds instead
    fleetgate agent ... --kv-events 'tcp://*:5557'
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal

import zmq

from fleetgate.commands._args import (
    cannot_start,
    log_level,
    non_empty,
    non_negative_float,
    positive_float,
    positive_int,
    replica_url,
    zmq_endpoint,
)
from gateway.logging_setup import configure_logging
from replica.agent import AgentConfig, ReplicaAgent
from routing.redis_env import expand_env
from routing.redis_urls import check_url_files


def add_agent_arguments(parser: argparse.ArgumentParser, engine_url_required: bool = True) -> None:
    """The agent's options; ``fleetgate replica run`` reuses them (and fills in the engine's)."""
    group = parser.add_argument_group("agent")
    group.add_argument(
        "--replica-id", type=non_empty, required=True, help="stable replica id, e.g. pool-a/r0"
    )
    group.add_argument(
        "--engine-url",
        type=replica_url,
        required=engine_url_required,
        help="the engine's HTTP base URL as the agent reaches it (its root; a trailing /v1 is "
        "dropped)",
    )
    group.add_argument(
        "--advertise-url",
        type=replica_url,
        help="URL gateways use for the engine (default: --engine-url)",
    )
    group.add_argument("--pool", default="default", help="replica pool name (default: default)")
    group.add_argument(
        "--model", help="served model name to hash under (default: the engine's first model)"
    )
    group.add_argument(
        "--kv-events",
        type=zmq_endpoint,
        help="subscriber endpoint of the engine's KV events: tcp://HOST:PORT connects to a "
        "binding engine, tcp://*:PORT binds for an engine that connects (default: none)",
    )
    group.add_argument("--kv-topic", default="kv", help="KV-event topic (default: kv)")
    group.add_argument(
        "--replay", type=zmq_endpoint, help="the engine's replay endpoint, tcp://HOST:PORT"
    )
    group.add_argument(
        "--index-url",
        default="memory",
        help="block index: redis://HOST:PORT/DB, Redis behind Sentinel as "
        "redis+sentinel://SENTINEL:26379[,...]/SERVICE/DB, a Redis Cluster as "
        "redis+cluster://NODE:PORT[,NODE:PORT...] (seed nodes, tried until one answers; "
        "mirror mode; then give --fleet-url too), or memory (default: memory)",
    )
    group.add_argument("--fleet-url", help="fleet store URL (default: --index-url)")
    group.add_argument(
        "--index-mode",
        choices=("lookup", "mirror"),
        help="Redis index layout to write; must equal the gateways' index.mode (default: mirror)",
    )
    group.add_argument(
        "--index-key-prefix",
        default="fleetgate:",
        help="index key prefix; must equal the gateways' index.key_prefix (default: fleetgate:)",
    )
    group.add_argument(
        "--fleet-key-prefix",
        default="fleetgate:",
        help="fleet store key prefix; must equal the gateways' (default: fleetgate:)",
    )
    group.add_argument(
        "--scrape-interval",
        type=positive_float,
        default=0.25,
        help="seconds between engine scrapes (default: 0.25)",
    )
    group.add_argument(
        "--heartbeat-ttl",
        type=positive_float,
        default=3.0,
        help="seconds a replica stays listed without a heartbeat (default: 3)",
    )
    group.add_argument(
        "--stall-timeout",
        type=non_negative_float,
        default=120.0,
        help="seconds an engine may hold requests without finishing an engine step before it "
        "is reported down as stalled (a hung EngineCore or GPU whose server still answers "
        "/health); 0: never (default: 120)",
    )
    group.add_argument("--max-cpu-loras", type=positive_int, help="the engine's --max-cpu-loras")
    group.add_argument(
        "--listen",
        type=listen_address,
        default="127.0.0.1:9100",
        help="HOST:PORT for the agent's /metrics and /health; 'off' disables (default: "
        "127.0.0.1:9100)",
    )
    group.add_argument(
        "--log-level", type=log_level, default="INFO", help="logging level (default: INFO)"
    )


def listen_address(value: str) -> str:
    """``--listen``: ``HOST:PORT`` (port 0 to 65535) or ``off``; refused at parse time (exit 2)
    rather than by a traceback when the agent binds (the CLI review: port 99999)."""
    if value == "off":
        return value
    _, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"HOST:PORT or 'off' (got {value!r})")
    if int(port) > 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 (any free one) to 65535 (got {port})")
    return value


def _listen(value: str) -> tuple[str, int | None]:
    if value == "off":
        return "127.0.0.1", None
    host, _, port = listen_address(value).rpartition(":")
    return host or "0.0.0.0", int(port)


def agent_config_from_args(args: argparse.Namespace, **overrides: object) -> AgentConfig:
    """Build an ``AgentConfig`` from parsed options; ``overrides`` win (e.g. the engine URL)."""
    host, port = _listen(args.listen)
    values: dict[str, object] = {
        "replica_id": args.replica_id,
        "engine_url": args.engine_url,
        "advertise_url": args.advertise_url,
        "pool": args.pool,
        "model": args.model,
        "kv_events_endpoint": args.kv_events,
        "kv_events_topic": args.kv_topic,
        "replay_endpoint": args.replay,
        "index_url": args.index_url,
        "fleet_url": args.fleet_url,
        "index_key_prefix": args.index_key_prefix,
        **({"index_mode": args.index_mode} if args.index_mode else {}),
        "fleet_key_prefix": args.fleet_key_prefix,
        "scrape_interval_s": args.scrape_interval,
        "heartbeat_ttl_s": args.heartbeat_ttl,
        "stall_after_s": args.stall_timeout or None,
        "max_cpu_loras": args.max_cpu_loras,
        "listen_host": host,
        "listen_port": port,
    }
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        config = AgentConfig(**values)  # type: ignore[arg-type]
        for name, url in (("--index-url", config.index_url), ("--fleet-url", config.fleet_url)):
            if url and url.startswith(("redis", "unix")):
                try:  # this process connects: its ${NAME}s and certificate files must be there
                    check_url_files(expand_env(url))
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from None
        return config
    except ValueError as exc:
        raise SystemExit(f"fleetgate agent: {exc}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``fleetgate agent``."""
    parser.epilog = __doc__.split("Examples::", 1)[1] if __doc__ else None
    add_agent_arguments(parser)


async def _serve(config: AgentConfig) -> None:
    agent = ReplicaAgent(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await agent.start()
    log = logging.getLogger("fleetgate.agent")
    log.info(
        "agent for %s on engine %s; %s",
        config.replica_id,
        config.engine_url,
        "no /metrics or /health (--listen off)"
        if agent.listen_port is None
        else f"/metrics and /health on port {agent.listen_port}",
    )
    waiter = asyncio.create_task(stop.wait())
    loops = asyncio.create_task(agent.wait())
    try:
        done, _ = await asyncio.wait([waiter, loops], return_when=asyncio.FIRST_COMPLETED)
        if loops in done:
            loops.result()  # a loop died: surface its exception
    finally:
        for task in (waiter, loops):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loops
        if stop.is_set():  # said, so the log tells why the replica left the gateways
            log.info("agent for %s stopping: leaving the fleet", config.replica_id)
        await agent.stop()


def run(args: argparse.Namespace) -> int:
    """Run the agent until SIGINT/SIGTERM."""
    configure_logging(args.log_level.upper())  # the gateways' format: their lines line up
    try:
        asyncio.run(_serve(agent_config_from_args(args)))
    except (OSError, ValueError, zmq.ZMQError) as exc:  # a port in use, a bad URL or setting
        return cannot_start("agent", exc, str(args.listen), port_flag="--listen")
    return 0
