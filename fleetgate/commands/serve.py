"""``fleetgate serve``: the production gateway.

Examples::

    # with a policy file (routes, tenants, pools, prices)
    fleetgate serve --config policy.yaml
    # quick start without one: any API key, or none, is the default tenant, so keep it off
    # untrusted networks (--host 127.0.0.1, or behind an ingress: docs/operations.md)
    fleetgate serve --replica http://10.0.0.5:8000 --replica http://10.0.0.6:8000 \\
        [--redis redis://redis:6379/0] [--tokenizer /models/llama] [--port 8000]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

from aiohttp import web

from fleetgate.commands._args import (
    cannot_start,
    non_empty,
    non_negative_float,
    port,
    positive_float,
    positive_int,
    redis_url,
    replica_url,
    routing_profile,
)
from gateway.config import GatewayConfig
from gateway.logging_setup import configure_logging
from gateway.policy_view import GatewayPolicy, ReplicaSpec
from routing.policies.registry import DEFAULT_PROFILE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``fleetgate serve``."""
    parser.add_argument("--config", dest="policy", help="routing-policy YAML file")
    parser.add_argument(
        "--replica",
        type=replica_url,
        action="append",
        default=[],
        metavar="URL",
        help="a vLLM replica base URL (repeatable; quick start without --config)",
    )
    parser.add_argument(
        "--model",
        type=non_empty,
        action="append",
        default=[],
        help="model the --replica URLs serve (default: ask them)",
    )
    parser.add_argument(
        "--redis",
        type=redis_url,
        metavar="URL",
        help="Redis URL (redis://HOST:PORT/DB, or for Redis behind Sentinel "
        "redis+sentinel://SENTINEL:26379[,...]/SERVICE/DB): shared index, in-flight counts, agents",
    )
    parser.add_argument(
        "--index-mode",
        choices=("lookup", "mirror"),
        help="with --redis and no --config: lookup asks Redis per request, mirror keeps an "
        "in-process copy fed by Redis streams (agents must match; default: mirror)",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="a Hugging Face tokenizer directory (holding tokenizer.json) for every model; "
        "with --config it replaces each model's `tokenizer:` of the file (default: the file's, "
        "else text blocks)",
    )
    parser.add_argument(
        "--profile",
        type=routing_profile,
        default=DEFAULT_PROFILE,
        help=f"profile without --config (default: {DEFAULT_PROFILE})",
    )
    parser.add_argument(
        "--block-size", type=positive_int, default=16, help="the replicas' vLLM --block-size"
    )
    parser.add_argument(
        "--host",
        default="0.0.0.0",
        help="address to listen on (default: 0.0.0.0, every interface, as a pod needs; "
        "127.0.0.1 for this host only)",
    )
    parser.add_argument("--port", type=port, default=8000, help="port to listen on")
    parser.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        help="processes sharing the port (SO_REUSEPORT); more than 1 needs --no-metrics: "
        "scale with more pods (one worker each) to keep /metrics (docs/gateway.md)",
    )
    parser.add_argument(
        "--no-metrics",
        action="store_true",
        help="/metrics answers 404 (what --workers N > 1 requires: each worker process has its "
        "own counters, and a scrape would reach one of them at random)",
    )
    parser.add_argument(
        "--admin-key",
        default=os.environ.get("FLEETGATE_ADMIN_KEY"),
        help="admin API key (env FLEETGATE_ADMIN_KEY); without one the admin API is off",
    )
    parser.add_argument(
        "--otlp-endpoint",
        default=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
        help="OTLP/HTTP traces endpoint (tracing is off without one)",
    )
    parser.add_argument(
        "--stop-delay",
        type=non_negative_float,
        default=2.0,
        metavar="SECONDS",
        help="on SIGTERM, /ready answers 503 but requests are still accepted this long, for load "
        "balancers to stop sending (a preStop sleep); a second SIGTERM or Ctrl-C stops at once",
    )
    parser.add_argument(
        "--drain-timeout",
        type=positive_float,
        default=30.0,
        metavar="SECONDS",
        help="then the listener closes and requests in flight get this long to finish; what is "
        "left is cut. Size the pod's terminationGracePeriodSeconds above stop delay + drain + "
        "10 s of clean-up",
    )
    parser.add_argument(
        "--adapter-prewarm-interval",
        type=non_negative_float,
        default=30.0,
        metavar="SECONDS",
        help="seconds between LoRA pre-warming rounds (docs/adapters.md); 0 turns pre-warming "
        "off (default: 30)",
    )
    parser.add_argument(
        "--usd-per-hour",
        type=non_negative_float,
        help="price of a replica-hour for the cost metrics, without --config",
    )


def build_app(
    config: GatewayConfig, replicas: tuple[ReplicaSpec, ...], usd: float | None
) -> web.Application:
    """App factory for one worker (module-level so worker processes can import it)."""
    from gateway.app import create_app

    policy = None
    if config.policy_path is None:
        policy = GatewayPolicy.default(replicas, config.default_profile, usd)
    fleet_store = None
    if config.redis_url:
        from replica.fleet_store import RedisFleetStore

        fleet_store = RedisFleetStore(config.redis_url)
    return create_app(config, policy, fleet_store=fleet_store)


def run(args: argparse.Namespace) -> int:
    """Validate options, then serve until SIGTERM."""
    from gateway.server import serve_forever

    configure_logging()
    if not args.policy and not args.replica and not args.redis:
        print(
            "fleetgate serve: give --config FILE, or --replica URL (and/or --redis URL)",
            file=sys.stderr,
        )
        return 2
    if args.workers > 1 and not args.no_metrics:
        print(
            f"fleetgate serve: --workers {args.workers} would serve a different worker's counters "
            "at each /metrics scrape (each process has its own), which Prometheus reads as "
            "counter resets. Run one worker per pod and scale pods (the shipped Deployment "
            "does), or add --no-metrics to run workers without /metrics.",
            file=sys.stderr,
        )
        return 2
    if args.tokenizer and not (Path(args.tokenizer) / "tokenizer.json").is_file():
        print(
            f"fleetgate serve: --tokenizer {args.tokenizer}: no tokenizer.json there (give a "
            "Hugging Face tokenizer directory, e.g. the model's own)",
            file=sys.stderr,
        )
        return 2
    if args.redis:
        from routing.redis_clients import expand_env, redacted
        from routing.redis_urls import check_url_files

        try:  # this process connects: its ${NAME}s and certificate files must be there
            check_url_files(expand_env(args.redis))
        except ValueError as exc:
            print(f"fleetgate serve: --redis {redacted(args.redis)}: {exc}", file=sys.stderr)
            return 2
    if args.policy:
        ignored = [
            flag for flag, given in (
                ("--replica", args.replica), ("--model", args.model),
                ("--profile", args.profile != DEFAULT_PROFILE),
                ("--usd-per-hour", args.usd_per_hour is not None),
                ("--index-mode", args.index_mode),
            ) if given
        ]
        if ignored:
            print(
                f"fleetgate serve: warning: {', '.join(ignored)} ignored with --config (the "
                "policy file sets replicas, models, profiles, prices and the index)",
                file=sys.stderr,
            )
        if args.tokenizer:
            print(
                f"fleetgate serve: warning: --tokenizer {args.tokenizer} replaces the tokenizer "
                f"of every model in {args.policy}",
                file=sys.stderr,
            )
        from routing.config import PolicyError, load_policy
        from routing.redis_clients import expand_env
        from routing.redis_urls import check_url_files

        try:
            policy = load_policy(args.policy)  # refuse to start on an invalid file
        except PolicyError as exc:
            print(f"fleetgate serve: {args.policy} is invalid:", file=sys.stderr)
            for error in exc.errors:
                print(f"  {error}", file=sys.stderr)
            return 2
        try:  # here, once, not in each --workers process
            for url in policy.redis_urls().values():
                check_url_files(expand_env(url))
        except ValueError as exc:
            print(f"fleetgate serve: {args.policy}: {exc}", file=sys.stderr)
            return 2
    try:
        config = GatewayConfig(
            policy_path=args.policy,
            default_profile=args.profile,
            redis_url=args.redis,
            **({"index_mode": args.index_mode} if args.index_mode else {}),
            tokenizer_dir=args.tokenizer,
            block_size=args.block_size,
            admin_key=args.admin_key,
            otlp_endpoint=args.otlp_endpoint,
            metrics_enabled=not args.no_metrics,
            adapter_prewarm_interval_s=args.adapter_prewarm_interval or None,
            stop_delay_s=args.stop_delay,
            drain_timeout_s=args.drain_timeout,
        )
    except ValueError as exc:
        print(f"fleetgate serve: {exc}", file=sys.stderr)
        return 2
    replicas = tuple(
        ReplicaSpec(
            f"replica-{i}",
            url,  # replica_url normalised it
            models=frozenset(args.model),
            block_size=args.block_size,
        )
        for i, url in enumerate(args.replica)
    )
    factory = functools.partial(build_app, replicas=replicas, usd=args.usd_per_hour)
    if args.workers > 1:
        where = f"http://{args.host}:{args.port}"
        print(f"fleetgate serve: {args.workers} workers listening on {where}", flush=True)
    try:
        announce = functools.partial(_announce, every_interface=args.host in _WILDCARDS)
        return serve_forever(factory, config, args.host, args.port, args.workers, announce)
    except (OSError, ValueError) as exc:  # a port in use; a Redis URL naming an unset ${VAR}
        return cannot_start("serve", exc, f"{args.host}:{args.port}")


#: ``--host`` values that listen on every interface.
_WILDCARDS = ("0.0.0.0", "::", "")


async def _announce(url: str, every_interface: bool = False) -> None:
    if every_interface:  # the URL below is this host's view of it
        print("fleetgate serve: bound to every interface (--host 127.0.0.1: this host only)")
    print(f"fleetgate serve: listening on {url}", flush=True)
