"""``fleetgate replica run``: start a vLLM engine, keep it running, and run the agent beside it.

Everything after ``--`` goes to vLLM's OpenAI server unchanged; fleetgate only reads it to find
the engine's port, model and KV-event endpoint, and adds a KV-event config when there is none
(events on a free port, bound by the engine). Example::

    fleetgate replica run --replica-id pool-a/r0 --index-url redis://redis:6379/0 \\
        --listen 0.0.0.0:9100 -- \\
        --model /models/llama --served-model-name llama --port 8000 \\
        --enable-prefix-caching --block-size 32 --enable-lora --max-loras 4

The engine runs in its own process group, and gets SIGTERM if the supervisor dies (Linux).
SIGINT/SIGTERM stop it gracefully: the agent reports the engine down so that gateways send it
nothing new, the requests in flight finish (up to ``--drain-timeout``), then the engine gets
SIGTERM (SIGKILL after ``--stop-grace``) and the agent deregisters; a second signal skips the
drain. A crashed engine is restarted with exponential back-off and the agent starts a new epoch
for it; so is one that stops answering ``/health`` for ``--liveness-timeout`` seconds (hung).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from fleetgate.commands._args import (
    HelpFormatter,
    cannot_start,
    non_negative_float,
    non_negative_int,
    positive_float,
)
from fleetgate.commands.agent import add_agent_arguments, agent_config_from_args
from gateway.logging_setup import configure_logging
from replica.agent import ReplicaAgent
from replica.kv_events import subscriber_endpoint_for
from replica.launcher import (
    VLLM_SERVER_MODULE,
    EngineProcess,
    EngineSupervisor,
    engine_env,
    free_port,
    kv_events_config,
)
from replica.vllm_env import venv_python
from routing.hosts import url_host

logger = logging.getLogger("fleetgate.replica")

#: Environment variables of the operator that tune the engine and must win over our defaults.
_ENGINE_ENV_OVERRIDES = ("VLLM_CPU_KVCACHE_SPACE", "PYTHONHASHSEED")


@dataclass(frozen=True)
class EngineView:
    """What fleetgate needs to know from the operator's vLLM arguments."""

    args: list[str]
    url: str
    kv_events_endpoint: str | None
    replay_endpoint: str | None
    topic: str
    max_cpu_loras: int | None


def _option(args: Sequence[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` (the last one wins, as in argparse)."""
    found = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(name + "="):
            found = arg.split("=", 1)[1]
    return found


def _connect_host(host: str | None) -> str:
    if host in (None, "", "0.0.0.0", "::", "[::]"):
        return "127.0.0.1"
    return url_host(host)


def inspect_vllm_args(args: Sequence[str], add_kv_events: bool = True) -> EngineView:
    """Read the engine's URL and event endpoints from ``args``; add KV events if missing."""
    out = list(args)
    host = _connect_host(_option(out, "--host"))
    port = _option(out, "--port") or "8000"
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        # Exit 2 (a usage error) before starting anything: an engine given port 99999 failed
        # to bind and was restarted for ever (the CLI review).
        print(f"fleetgate replica run: vLLM --port must be 1 to 65535 (got {port!r})",
              file=sys.stderr)
        raise SystemExit(2)
    raw = _option(out, "--kv-events-config")
    if raw is None and add_kv_events:
        # With a replay socket: an agent that starts beside a running engine, or an engine
        # that was unreachable for a while, learns what the engine holds from it.
        raw = kv_events_config(
            f"tcp://*:{free_port()}", "kv", replay_endpoint=f"tcp://*:{free_port()}"
        )
        out += ["--kv-events-config", raw]
    endpoint = replay = None
    topic = "kv"
    if raw is not None:
        try:
            config = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise SystemExit(
                f"fleetgate replica run: --kv-events-config is not JSON: {exc}"
            ) from None
        if not isinstance(config, dict):
            raise SystemExit(
                "fleetgate replica run: --kv-events-config must be a JSON object, e.g. "
                '\'{"enable_kv_cache_events": true, "publisher": "zmq"}\''
            )
        if config.get("enable_kv_cache_events"):
            # The engine runs on this host, and vLLM binds ``tcp://*:PORT`` on IPv4 only (it
            # never sets ZeroMQ's IPV6 option): its HTTP host, an IPv6 one included, is no
            # address for its events. An endpoint bound to one address is connected to as is.
            endpoint = subscriber_endpoint_for(config.get("endpoint", "tcp://*:5557"))
            topic = config.get("topic", "")
            if config.get("replay_endpoint"):
                replay = subscriber_endpoint_for(config["replay_endpoint"])
    max_cpu = _option(out, "--max-cpu-loras")
    return EngineView(
        args=out,
        url=f"http://{host}:{port}",
        kv_events_endpoint=endpoint,
        replay_endpoint=replay,
        topic=topic,
        max_cpu_loras=int(max_cpu) if max_cpu and max_cpu.isdigit() else None,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``fleetgate replica run [agent options] -- <vLLM args>``."""
    parser.epilog = __doc__
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    run_parser = sub.add_parser(
        "run", help="start and supervise a vLLM engine with its agent",
        formatter_class=HelpFormatter, epilog=__doc__,
    )
    add_agent_arguments(run_parser, engine_url_required=False)
    group = run_parser.add_argument_group("engine supervision")
    group.add_argument(
        "--vllm-python",
        help="interpreter with vLLM installed (default: .venv-vllm/bin/python)",
    )
    group.add_argument("--engine-log", type=Path, help="engine log file (default: a temp file)")
    group.add_argument("--health-timeout", type=positive_float, default=600.0,
                       help="seconds a starting engine gets to first answer /health, else it "
                       "is stopped and restarted (default: 600)")
    group.add_argument("--liveness-timeout", type=non_negative_float, default=60.0,
                       help="seconds a running engine may go without answering /health before "
                       "it is taken for hung, stopped and restarted; 0: never (default: 60)")
    group.add_argument("--drain-timeout", type=non_negative_float, default=30.0,
                       help="on SIGINT/SIGTERM, seconds the requests in flight get to finish "
                       "(gateways send nothing new meanwhile) before the engine is stopped; "
                       "0: stop at once (default: 30)")
    group.add_argument("--drain-settle", type=non_negative_float, default=5.0,
                       help="seconds a drain waits at least, for the gateways to hear that the "
                       "replica is leaving: more than their health_check_interval_s plus a "
                       "health poll (default: 5)")
    group.add_argument("--backoff-min", type=positive_float, default=1.0,
                       help="first restart delay (s)")
    group.add_argument("--backoff-max", type=positive_float, default=60.0,
                       help="largest restart delay (s)")
    group.add_argument("--max-restarts", type=non_negative_int,
                       help="give up after this many restarts in a row; an engine that ran two "
                       "minutes starts the count again (default: never give up)")
    group.add_argument("--stop-grace", type=non_negative_float, default=20.0,
                       help="seconds between SIGTERM and SIGKILL on stop (default: 20)")
    group.add_argument("--no-kv-events", action="store_true",
                       help="do not add a --kv-events-config when the vLLM args lack one")
    run_parser.add_argument("vllm_args", nargs=argparse.REMAINDER,
                            help="-- then the arguments for vLLM's OpenAI server")


def _interpreter(given: str) -> str:
    """``--vllm-python`` as the engine is started with it: a path resolved against the caller's
    folder (the engine runs from the repository's, where ``./x`` named another file, or none:
    the CLI review), a bare name looked up on ``PATH``."""
    if os.sep in given:
        return os.path.abspath(given)
    return shutil.which(given) or given


async def _supervise(args: argparse.Namespace, view: EngineView) -> int:
    python = _interpreter(args.vllm_python) if args.vllm_python else venv_python()
    if not (Path(python).is_file() and os.access(python, os.X_OK)):
        print(
            f"fleetgate replica run: no vLLM interpreter at {python} (a runnable file); "
            "install one with `bash replica/vllm_env/install.sh` or pass --vllm-python",
            file=sys.stderr,
        )
        return 2
    extra_env = {k: os.environ[k] for k in _ENGINE_ENV_OVERRIDES if k in os.environ}
    env = engine_env(extra=extra_env)
    config = agent_config_from_args(
        args,
        engine_url=args.engine_url or view.url,
        kv_events_endpoint=args.kv_events or view.kv_events_endpoint,
        replay_endpoint=args.replay or view.replay_endpoint,
        max_cpu_loras=args.max_cpu_loras or view.max_cpu_loras,
        # The engine's own topic, unless the operator named one for the agent explicitly.
        kv_events_topic=view.topic if args.kv_topic == "kv" else args.kv_topic,
    )
    agent = ReplicaAgent(config)
    # One log for every incarnation (appended to): a temp file each would leave them behind.
    log_path = args.engine_log or Path(
        tempfile.mkstemp(prefix=f"vllm-{config.replica_id.replace('/', '-')}-", suffix=".log")[1]
    )
    stop, force = asyncio.Event(), asyncio.Event()

    async def drain(engine: EngineProcess) -> None:
        await _drain(agent, engine, args.drain_timeout, force, args.drain_settle)

    supervisor = EngineSupervisor(
        lambda: EngineProcess(
            [str(python), "-m", VLLM_SERVER_MODULE, *view.args],
            url=view.url, env=env, log_path=log_path, die_with_parent=True,
        ),
        on_restart=agent.engine_restarted,
        backoff_min_s=args.backoff_min,
        backoff_max_s=args.backoff_max,
        max_restarts=args.max_restarts,
        health_timeout_s=args.health_timeout,
        liveness_timeout_s=args.liveness_timeout or None,
        stop_grace_s=args.stop_grace,
        before_stop=drain if args.drain_timeout > 0 else None,
        stalled=(lambda: agent.stalled) if args.liveness_timeout else None,
    )
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():
            force.set()  # a second signal: stop without waiting for the drain
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    await agent.start()
    logger.info(
        "replica %s: engine %s, events %s, agent port %s",
        config.replica_id, view.url, config.kv_events_endpoint, agent.listen_port,
    )
    try:
        return await supervisor.run(stop)
    finally:
        await agent.stop()


async def _drain(
    agent: ReplicaAgent,
    engine: EngineProcess,
    timeout_s: float,
    force: asyncio.Event,
    settle_s: float = 5.0,
) -> None:
    """Report the engine down, give the gateways ``settle_s`` to hear it, then wait until the
    engine holds no request (or ``timeout_s`` passes, or a second signal comes, or the engine
    is down): a stop that signalled the engine at once cut every stream in flight after
    ``--stop-grace`` of silence (vLLM aborts them on SIGTERM). Gateways re-read the fleet
    every ``health_check_interval_s`` (2 s by default) and poll after it: an engine stopped
    before they had heard refused the requests they still sent it (live re-check, 1.5 s).
    """
    loop = asyncio.get_running_loop()
    started = loop.time()
    await agent.leave()
    logger.info(
        "stopping: gateways send this replica nothing new; draining (at least %.0fs, at most "
        "%.0fs)", min(settle_s, timeout_s), timeout_s,
    )
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(force.wait(), min(settle_s, timeout_s))
    settled_at = time.time()
    while not force.is_set():
        if engine.poll() is not None or not agent.engine_up:
            logger.warning("drain: the engine is down; stopping it")
            return
        # A reading made after the gateways stopped sending: what it holds is all there is.
        left = agent.requests_in_engine(read_after=settled_at)
        if left == 0:
            logger.info("drain: the engine is idle after %.1fs; stopping it", loop.time() - started)
            return
        if loop.time() - started >= timeout_s:
            logger.warning(
                "drain: %s request(s) still in the engine after %.0fs (--drain-timeout); "
                "stopping it", "some" if left is None else left, timeout_s,
            )
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(force.wait(), 0.25)
    logger.warning("second signal: stopping the engine without waiting for the drain")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fleetgate replica``."""
    configure_logging(args.log_level.upper())  # the gateways' and agents' format
    vllm_args = list(args.vllm_args)
    if vllm_args and vllm_args[0] == "--":
        vllm_args = vllm_args[1:]
    if not vllm_args:
        print("fleetgate replica run: give vLLM's arguments after `--`", file=sys.stderr)
        return 2
    if not 0 < args.backoff_min <= args.backoff_max:
        print(
            f"fleetgate replica run: need 0 < --backoff-min ({args.backoff_min:g}) <= "
            f"--backoff-max ({args.backoff_max:g})",
            file=sys.stderr,
        )
        return 2
    for name in ("liveness_timeout", "drain_timeout", "drain_settle", "stop_grace",
                 "health_timeout"):
        if getattr(args, name) < 0:
            flag = "--" + name.replace("_", "-")
            print(f"fleetgate replica run: {flag} must be >= 0", file=sys.stderr)
            return 2
    view = inspect_vllm_args(vllm_args, add_kv_events=not args.no_kv_events)
    try:
        return asyncio.run(_supervise(args, view))
    except (OSError, httpx.InvalidURL) as exc:
        # A port in use, a missing interpreter, an engine address httpx cannot use (an IPv6
        # host without brackets).
        return cannot_start("replica run", exc)
