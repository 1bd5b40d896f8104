"""Chaos benchmark: faults injected into a running fleet under steady open-loop load.

Two gateways (``fleetgate serve --config``, Redis index, two tenants) share one Redis in front of
simulated replicas (one ``fleetgate sim`` process each, its own ``fleetgate agent``); every link
a fault needs to act on goes through a fault proxy run by this process (``bench/chaos_proxy.py``).
A Poisson load (half streamed, two tenants, both gateways) runs the whole time. For each fault:
warm-up, inject, hold, heal, observe; then the requests, detection and recovery times and stale
index entries are computed (definitions in ``bench/chaos_report.py`` and on the page).

Run from the repository root::

    .venv/bin/python -m bench.chaos                                   # every fault
    .venv/bin/python -m bench.chaos --faults replica-killed,redis-flushed --duration 4

and it rewrites ``docs/benchmarks/chaos.md`` and the timelines under ``docs/benchmarks/chaos/``.
Exit status 1 when an invariant failed (a request failed before its first byte while a replica
was up, a stream broke off a replica that was not killed, stale entries stayed, no recovery).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shlex
import signal
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from bench._bench_common import drop_option, machine_line, write_page
from bench.chaos_faults import ALL_FAULTS, Fault, FaultContext
from bench.chaos_fleet import HEALTH_INTERVAL_S, SIM, EngineKind, Fleet, vllm_kind
from bench.chaos_observe import (
    Clock,
    EngineTruth,
    IndexSnapshot,
    LoadConfig,
    Monitor,
    OpenLoopLoad,
    index_snapshot,
)
from bench.chaos_report import (
    FaultResult,
    FaultWindow,
    analyse,
    fleet_states,
    plot_window,
    render,
    steady,
)

DEFAULT_OUTPUT = Path("docs/benchmarks/chaos.md")
MONITOR_INTERVAL_S = 0.5
#: After the observation window, how long stale entries may take to reach 0 before we give up.
STALE_WAIT_S = 15.0
STEADY_WAIT_S = 30.0


@dataclass
class ChaosConfig:
    faults: list[str]
    duration_s: float
    rate: float
    replicas: int
    speed: float
    seed: int
    plots_dir: Path | None
    engines: str = "sim"

    @property
    def warmup_s(self) -> float:
        return self.duration_s

    @property
    def hold_s(self) -> float:
        return self.duration_s

    @property
    def restart_allowance_s(self) -> float:
        """Extra observation and settling time: a vLLM CPU engine takes minutes to restart."""
        return 180.0 if self.engines == "vllm" else 0.0

    @property
    def observe_s(self) -> float:
        return 2 * self.duration_s


@dataclass
class ShutdownProbe:
    """SIGTERM to one gateway under load, after the faults."""

    sent_at: float
    exit_s: float | None
    bound_s: float
    returncode: int | None
    #: Requests of that gateway in flight at the signal or sent after it, by outcome.
    outcomes: dict[str, int] = dataclasses.field(default_factory=dict)

    def line(self) -> str:
        took = (f"exited in {self.exit_s:.1f} s (status {self.returncode})"
                if self.exit_s is not None else f"had not exited after {self.bound_s:g} s")
        counts = ", ".join(f"{n} {k}" for k, n in sorted(self.outcomes.items())) or "none"
        return (f"SIGTERM to gateway 1 under load, after the faults: it {took}; its requests in "
                f"flight at the signal or sent after it: {counts}.")


@dataclass
class ChaosRun:
    windows: list[FaultWindow]
    results: list[FaultResult]
    plots: dict[str, Path]
    log_dir: Path
    shutdown: ShutdownProbe | None = None


class Chaos:
    """One fleet, one load, the faults in turn."""

    def __init__(self, config: ChaosConfig, log_dir: Path) -> None:
        self.config = config
        self.clock = Clock()
        self.fleet = Fleet(log_dir, config.replicas, config.speed, engine_kind(config.engines))
        self.truths: list[EngineTruth] = []
        self.load = OpenLoopLoad(self.fleet, LoadConfig(rate=config.rate, seed=config.seed),
                                 self.clock)
        self.monitor = Monitor(self.fleet, self.clock, MONITOR_INTERVAL_S)
        self.windows: list[FaultWindow] = []
        self.shutdown: ShutdownProbe | None = None

    @property
    def ctx(self) -> FaultContext:
        return FaultContext(self.fleet, self.truths)

    def _budget_s(self) -> float:
        """An upper bound on the whole run, for the load and monitor loops."""
        per_fault = (self.config.warmup_s + self.config.hold_s + self.config.observe_s
                     + STALE_WAIT_S + STEADY_WAIT_S + self.config.restart_allowance_s + 10)
        return 60 + per_fault * len(self.config.faults)

    async def run(self) -> ChaosRun:
        await self.fleet.start()
        tasks: list[asyncio.Task[None]] = []
        try:
            for replica in self.fleet.replicas:
                truth = EngineTruth(replica.replica_id, replica.kv_events, self.fleet.engine.model)
                await truth.start()
                self.truths.append(truth)
            tasks.append(asyncio.create_task(self.monitor.run(self._budget_s())))
            tasks.append(asyncio.create_task(self.load.run(self._budget_s())))
            for name in self.config.faults:
                await self._one(ALL_FAULTS[name]())
            self.shutdown = await self._sigterm_under_load()
        finally:
            self.load.stop()
            self.monitor.stop()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.gather(*tasks), 60)
            for truth in self.truths:
                await truth.stop()
            await self.fleet.stop()
        return self._results()

    async def _sigterm_under_load(self, bound_s: float = 60.0) -> ShutdownProbe:
        """SIGTERM to gateway 1 while the load runs: how long until it exits (bounded), and what
        became of the requests in flight on it (the load balancer stops sending once ``/ready``
        turns 503)."""
        gateway = self.fleet.gateways[1]
        assert gateway.proc is not None and gateway.proc.popen is not None
        # A quiet second first: requests the last fault's window counted end before the signal
        # (one still in flight on gateway 1 was counted as that fault's failure).
        await asyncio.sleep(1.0)
        sent_at = self.clock()
        gateway.proc.popen.send_signal(signal.SIGTERM)
        exited = None
        while self.clock() - sent_at < bound_s:
            if gateway.proc.popen.poll() is not None:
                exited = self.clock() - sent_at
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(2.0)  # let the last answers of the other gateway come in
        return ShutdownProbe(sent_at=sent_at, exit_s=exited, bound_s=bound_s,
                             returncode=gateway.proc.popen.poll())

    def _steady_now(self) -> bool:
        now = self.clock()
        states = fleet_states(self.monitor.gateway_samples, self.monitor.agent_samples,
                              now - 2.0, now, MONITOR_INTERVAL_S)
        return bool(states) and steady(states[-1], self.fleet)

    async def _wait_steady(self) -> bool:
        """Until the last monitor tick shows a steady fleet (bounded by ``STEADY_WAIT_S``)."""
        deadline = self.clock() + STEADY_WAIT_S + self.config.restart_allowance_s
        while self.clock() < deadline:
            if self._steady_now():
                return True
            await asyncio.sleep(MONITOR_INTERVAL_S)
        return False

    async def _one(self, fault: Fault) -> None:
        print(f"chaos: {fault.name}", file=sys.stderr, flush=True)
        is_steady = await self._wait_steady()
        window = FaultWindow(fault=fault, start=self.clock(), steady_before=is_steady)
        self.windows.append(window)
        await asyncio.sleep(self.config.warmup_s)
        _count, before = await self._persistent_stale()
        window.missing_before = None if before is None else before.missing
        window.inject = self.clock()
        await fault.inject(self.ctx)
        await self._watch_stale(window, until=window.inject + self.config.hold_s, during=True)
        window.heal = self.clock()
        await fault.heal(self.ctx)
        await self._watch_stale(window, until=window.heal + self.config.observe_s)
        # A real engine may still be restarting: observe on (bounded) until the fleet is steady.
        allowance_until = self.clock() + self.config.restart_allowance_s
        waited = False
        while self.clock() < allowance_until and not self._steady_now():
            waited = True
            await self._watch_stale(window, until=self.clock() + 1.0)
        if waited and self._steady_now():
            # Steady only now (the engine just restarted): recovery also needs the restarted
            # replica to serve requests, so observe a while longer (it ended here, before any).
            await self._watch_stale(window, until=self.clock() + self.config.observe_s)
        # Stale entries must reach 0: keep reading (bounded) while any persist.
        extra_until = self.clock() + STALE_WAIT_S
        while window.stale_reads and window.stale_reads[-1][1] and self.clock() < extra_until:
            await self._watch_stale(window, until=self.clock() + 1.0)
        window.end = self.clock()

    async def _watch_stale(self, window: FaultWindow, until: float, during: bool = False) -> None:
        """Read the index against the truth about once a second until ``until``."""
        while self.clock() < until:
            count, snap = await self._persistent_stale()
            if snap is not None:
                if during:
                    window.stale_max_during = max(window.stale_max_during, count)
                else:
                    window.stale_reads.append((snap.t, count, snap))
            await asyncio.sleep(max(0.0, min(0.5, until - self.clock())))

    async def _persistent_stale(self) -> tuple[int, IndexSnapshot | None]:
        """Entries stale in two reads 0.5 s apart (an event in flight is not stale)."""
        try:
            first = await index_snapshot(self.fleet.redis.port, self.truths, self.clock)
            await asyncio.sleep(0.5)
            second = await index_snapshot(self.fleet.redis.port, self.truths, self.clock)
        except Exception:  # Redis is down (a fault): nothing to read
            return 0, None
        return len(first.stale & second.stale), second

    def _results(self) -> ChaosRun:
        served = self.monitor.served_by
        for record in self.load.records:
            record.served_by = served.get(record.request_id)
        self._dump_raw()
        results = [
            analyse(w, self.fleet, self.load.records, self.monitor.gateway_samples,
                    self.monitor.agent_samples, MONITOR_INTERVAL_S)
            for w in self.windows
        ]
        plots: dict[str, Path] = {}
        if self.config.plots_dir is not None:
            for window in self.windows:
                path = self.config.plots_dir / f"{window.fault.name}.png"
                plot_window(window, self.load.records, path)
                plots[window.fault.name] = path
        if self.shutdown is not None:
            probe = self.shutdown
            for record in self.load.records:
                if record.gateway == 1 and (record.end or probe.sent_at) >= probe.sent_at:
                    probe.outcomes[record.outcome] = probe.outcomes.get(record.outcome, 0) + 1
        return ChaosRun(self.windows, results, plots, self.fleet.log_dir, self.shutdown)


    def _dump_raw(self) -> None:
        """Every record and sample as JSON beside the logs, to re-read a surprising result."""
        raw = {
            "windows": [{"fault": w.fault.name, "start": w.start, "inject": w.inject,
                         "heal": w.heal, "end": w.end,
                         "stale_reads": [(t, n, s.missing) for t, n, s in w.stale_reads]}
                        for w in self.windows],
            "records": [dataclasses.asdict(r) for r in self.load.records],
            "gateway_samples": [dataclasses.asdict(s) for s in self.monitor.gateway_samples],
            "agent_samples": [dataclasses.asdict(s) for s in self.monitor.agent_samples],
        }
        (self.fleet.log_dir / "raw.json").write_text(json.dumps(raw))


def engine_kind(engines: str) -> EngineKind:
    """The sims, or vLLM with the tiny model (built once, cached where the e2e tier keeps it)."""
    if engines == "sim":
        return SIM
    from replica.tiny_model import RECIPE_VERSION, ensure_tiny_model

    cache = Path(tempfile.gettempdir()) / f"fleetgate-tiny-model-r{RECIPE_VERSION}"
    return vllm_kind(ensure_tiny_model(cache, adapters=3).model_dir)


def _allowance_text(config: ChaosConfig) -> str:
    if not config.restart_allowance_s:
        return ""
    return (f", and up to {config.restart_allowance_s:g} s more until the fleet is steady: "
            "an engine restart takes minutes")


def _engines_text(config: ChaosConfig) -> str:
    if config.engines == "vllm":
        return (f"{config.replicas} real vLLM CPU engines (`.venv-vllm`, the tiny generated "
                "model of the e2e tier, block size 32, exact tokenizer)")
    return f"{config.replicas} simulated replicas (`fleetgate sim --speed {config.speed:g}`)"


def page_header(config: ChaosConfig, shown_argv: Sequence[str],
                load_before: Sequence[float]) -> list[str]:
    command = " ".join(["python -m bench.chaos", *map(shlex.quote, shown_argv)])
    load = " / ".join(f"{x:.1f}" for x in load_before) + " before, " + " / ".join(
        f"{x:.1f}" for x in os.getloadavg()) + " after (1 / 5 / 15 min)"
    return [
        "# Chaos benchmark",
        "",
        f"Command: `{command}` — {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {machine_line()}, "
        f"load average {load}: the machine is shared, so latencies and index-budget misses "
        "include other work.",
        "Rewritten by the benchmark; notes below the marker are kept.",
        "",
        f"Setup: two gateways (`fleetgate serve --config`, Redis index, two tenants, health "
        f"polls every {HEALTH_INTERVAL_S:g} s) in front of {_engines_text(config)} (each its "
        "own process and its own `fleetgate agent`, discovery through Redis), one private "
        "`redis-server`. Gateways reach the replicas and "
        "Redis, and agents reach Redis, through fault proxies run by the benchmark. Load: "
        f"open loop, Poisson at {config.rate:g} req/s, half streamed, two tenants, chat "
        "completions of 24 tokens (each tenant's four shared system prompts, and "
        f"{LoadConfig.novel_share:.0%} new conversations whose system prompt no replica has "
        "seen), spread over the gateways the load balancer sees ready "
        "(`/ready` every 0.5 s; a refused connection is resent to the other gateway). Each "
        f"fault: {config.warmup_s:g} s warm-up, {config.hold_s:g} s held, healed, "
        f"{config.observe_s:g} s observed (longer while stale entries remain, up to "
        f"{STALE_WAIT_S:g} s{_allowance_text(config)}). Requests are counted by start time "
        "over the whole window.",
        "",
        "Definitions: *failed before 1st byte* — no `200` reached the client (must be 0: every "
        "fault leaves a replica up); *broken mid-stream* — `200`, then the body ended early "
        "(allowed only on the killed replica); *lost with gateway* — in flight on the gateway "
        "that was killed; *detect* — from injection to the first monitor sample (every "
        f"{MONITOR_INTERVAL_S:g} s) showing the fault (replica unrouted by a gateway, ≥ 80 % "
        "of a gateway's decisions over 1 s made on load alone, gateway not answering; for the "
        "slow replica: its share of requests below half its warm-up share); *recover* — from "
        "the heal to the "
        "fleet being steady again (both gateways route to every replica, under 80 % degraded, "
        "agents clean), the fault's own condition (the restarted replica or gateway serves) "
        "and no later failure; *stale* — index entries a lookup would return for a replica "
        "whose engine does not hold the block (checked against a second KV-event subscriber "
        "per engine, persisting over two reads 0.5 s apart).",
    ]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", default=",".join(ALL_FAULTS),
                        help=f"comma-separated subset of: {', '.join(ALL_FAULTS)}")
    parser.add_argument("--duration", type=float, default=8.0,
                        help="seconds of warm-up and of fault held (observed twice as long)")
    parser.add_argument("--rate", type=float,
                        help="requests per second (default: 20 on sims, 2 on vLLM CPU engines)")
    parser.add_argument("--replicas", type=int, help="default: 3 sims, 2 vLLM engines")
    parser.add_argument("--speed", type=float, default=1.0, help="sim --speed")
    parser.add_argument("--engines", choices=("sim", "vllm"), default="sim",
                        help="simulated replicas, or real vLLM CPU engines (.venv-vllm) serving "
                             "the tiny generated model (the e2e tier)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--plots", type=Path,
                        help="timeline PNG folder (default: chaos/ beside --out); 'off' for none")
    parser.add_argument("--log-dir", type=Path, help="process logs (default: a temp dir)")
    args = parser.parse_args(argv)
    vllm = args.engines == "vllm"
    args.rate = args.rate or (2.0 if vllm else 20.0)
    args.replicas = args.replicas or (2 if vllm else 3)
    unknown = [f for f in args.faults.split(",") if f not in ALL_FAULTS]
    if unknown:
        parser.error(f"unknown fault(s) {', '.join(unknown)}; known: {', '.join(ALL_FAULTS)}")
    if args.replicas < 2:
        parser.error("--replicas must be >= 2: every fault must leave a replica up")
    return args


def config_of(args: argparse.Namespace) -> ChaosConfig:
    if args.plots is None:
        plots: Path | None = args.out.parent / args.out.stem
    else:
        plots = None if str(args.plots) == "off" else args.plots
    return ChaosConfig(faults=args.faults.split(","), duration_s=args.duration, rate=args.rate,
                       replicas=args.replicas, speed=args.speed, seed=args.seed,
                       plots_dir=plots, engines=args.engines)


def run_chaos(config: ChaosConfig, log_dir: Path | None = None) -> ChaosRun:
    """Run the faults of ``config``; logs in ``log_dir`` (else a temp dir, kept on failure)."""
    if log_dir is None:
        log_dir = Path(tempfile.mkdtemp(prefix="fg-chaos-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    return asyncio.run(Chaos(config, log_dir).run())


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    config = config_of(args)
    load_before = os.getloadavg()
    run = run_chaos(config, args.log_dir)
    shown = argv
    for option in ("--log-dir", "--out", "--plots"):
        shown = drop_option(shown, option)
    header = page_header(config, shown, load_before)
    if run.shutdown is not None:
        header += ["", run.shutdown.line()]
    page = render(run.results, header, run.plots, args.out)
    write_page(args.out, page)
    print(page)
    print(f"logs: {run.log_dir}", file=sys.stderr)
    return 0 if all(r.invariants_hold for r in run.results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
