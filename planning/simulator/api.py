"""``simulate()``: replay a trace through several policies and the two hit-rate ceilings.

``simulate_sweep()`` does it at several rate scales (a load sweep), under one progress bar.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from planning.simulator.adapters import AdapterMix
from planning.simulator.ceilings import Ceilings, hit_rate_ceilings
from planning.simulator.config import SimulationConfig, TraceRequest, prepare_requests
from planning.simulator.loop import PolicyRun, run_policy
from planning.simulator.prompts import PromptFactory
from planning.simulator.summary import PolicySummary, summarize
from replica.sim.engine import EngineConfig
from routing.engine import Profile
from traces.format import TraceRecord

if TYPE_CHECKING:
    from tqdm import tqdm

__all__ = [
    "SimulationReport",
    "SweepPoint",
    "engine_config_for",
    "engine_configs_for",
    "mean_rate",
    "simulate",
    "simulate_sweep",
]


@dataclass
class SimulationReport:
    """Everything one ``simulate`` call measured."""

    summaries: list[PolicySummary]
    ceilings: Ceilings
    runs: dict[str, PolicyRun] = field(default_factory=dict)
    #: Wall-clock seconds each policy's replay took (not the virtual time it covered).
    wall_s: dict[str, float] = field(default_factory=dict)

    def rows(self) -> list[PolicySummary]:
        """Policy rows, then the ``unbounded`` and ``pooled`` ceiling rows."""
        return [
            *self.summaries,
            PolicySummary("unbounded", None, self.ceilings.unbounded),
            PolicySummary("pooled", None, self.ceilings.pooled),
        ]


def engine_config_for(config: SimulationConfig) -> EngineConfig:
    """The engine configuration every replica of the simulated fleet runs (a mixed fleet's
    first profile's)."""
    return engine_configs_for(config)[0]


def engine_configs_for(config: SimulationConfig) -> list[EngineConfig]:
    """Each replica's engine configuration, in fleet order. A mixed fleet's profiles must hash
    prompts alike (one KV block size): routing's block index is one for the fleet."""
    overrides = dict(config.engine_overrides)
    built = {name: EngineConfig.from_profile(name, **overrides) for name, _ in config.profile_mix()}
    sizes = {c.block_size for c in built.values()}
    if len(sizes) > 1:
        raise ValueError(
            f"profile {config.profile!r}: a mixed fleet's engines need one KV block size "
            f"(got {', '.join(f'{n}: {c.block_size}' for n, c in built.items())})"
        )
    return [built[name] for name in config.replica_profiles()]


def simulate(
    requests: Sequence[TraceRequest],
    policies: Sequence[str],
    config: SimulationConfig,
    *,
    progress: bool = False,
    profile_factories: Mapping[str, Callable[[], Profile]] | None = None,
) -> SimulationReport:
    """Replay ``requests`` through each policy on a fresh fleet; compute both ceilings.

    Each policy starts from empty caches with fresh plugin state, so runs are independent and
    deterministic for a given ``config.seed``. A policy is a built-in profile name, or a name in
    ``profile_factories`` (experimental variants: a factory returns a fresh ``Profile``).
    """
    if not policies:
        raise ValueError("policies: name at least one routing policy")
    bar = _progress_bar(len(requests) * len(policies)) if progress else None
    try:
        return _simulate(requests, policies, config, bar, profile_factories or {})
    finally:
        if bar is not None:
            bar.close()


@dataclass(frozen=True)
class SweepPoint:
    """One point of a load sweep: every policy replayed at one rate scale with one seed."""

    rate_scale: float
    seed: int
    #: Requests replayed (refused ones included).
    requests: int
    #: Mean arrival rate of the replayed requests, requests/s (nan for a single request).
    rate: float
    report: SimulationReport


def simulate_sweep(
    records: Sequence[TraceRecord],
    rate_scales: Sequence[float],
    policies: Sequence[str],
    config: SimulationConfig,
    *,
    limit: int | None = None,
    adapters: AdapterMix | None = None,
    progress: bool = False,
    jobs: int = 1,
    profile_factories: Mapping[str, Callable[[], Profile]] | None = None,
) -> list[SweepPoint]:
    """``simulate`` at each of ``rate_scales`` (in the order given), one progress bar for all.

    The same records are replayed at each scale (arrivals divided by it), so the points differ
    only in load. ``jobs`` > 1 replays the (scale, policy) runs in that many worker processes:
    each run is independent (a fresh fleet) and deterministic, so the results are the same
    (``profile_factories`` must then pickle: ``planning.simulator.policy_file``'s do).
    """
    if not rate_scales:
        raise ValueError("rate_scales: name at least one rate scale")
    if not policies:
        raise ValueError("policies: name at least one routing policy")
    batches = [
        prepare_requests(records, rate_scale=x, limit=limit, adapters=adapters, seed=config.seed)
        for x in rate_scales
    ]
    total = sum(len(batch) for batch in batches) * len(policies)
    bar = _progress_bar(total) if progress else None
    try:
        factories = profile_factories or {}
        if jobs > 1:
            reports = _simulate_in_workers(batches, policies, config, bar, jobs, factories)
        else:
            reports = [_simulate(batch, policies, config, bar, factories) for batch in batches]
    finally:
        if bar is not None:
            bar.close()
    return [
        SweepPoint(scale, config.seed, len(batch), mean_rate(batch), report)
        for scale, batch, report in zip(rate_scales, batches, reports, strict=True)
    ]


def _simulate_in_workers(
    batches: Sequence[Sequence[TraceRequest]],
    policies: Sequence[str],
    config: SimulationConfig,
    bar: tqdm | None,
    jobs: int,
    factories: Mapping[str, Callable[[], Profile]],
) -> list[SimulationReport]:
    """One report per batch, each (batch, policy) run in a worker process, merged in order."""
    from concurrent.futures import ProcessPoolExecutor, as_completed

    parts: dict[tuple[int, int], SimulationReport] = {}
    runs = len(batches) * len(policies)
    # Workers ignore Ctrl-C: the parent alone stops the sweep, and stops it at once. A SIGTERM
    # to the parent alone (``kill PID``, a supervisor) stops them the same way: without it the
    # parent died and its workers hung for ever, writing results to a pipe nobody read.
    pool = ProcessPoolExecutor(max_workers=jobs, initializer=_worker_signals)
    restore = _exit_on_sigterm()
    try:
        futures = {
            pool.submit(
                _simulate, batch, [policy], config, None,
                {policy: factories[policy]} if policy in factories else {},
            ): (b, p)
            for b, batch in enumerate(batches)
            for p, policy in enumerate(policies)
        }
        for future in as_completed(futures):
            b, p = futures[future]
            parts[b, p] = future.result()
            if bar is not None:
                bar.set_description(f"{len(parts)}/{runs} runs")
                bar.update(len(batches[b]))
    except BaseException:
        # A failed run or Ctrl-C: drop the runs not started and stop the ones running, rather
        # than wait for every remaining replay (minutes on a large trace).
        processes = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.terminate()
        raise
    finally:
        restore()
    pool.shutdown()
    reports = []
    for b in range(len(batches)):
        report = SimulationReport([], parts[b, 0].ceilings)
        for p, policy in enumerate(policies):
            part = parts[b, p]
            report.summaries.extend(part.summaries)
            report.runs[policy] = part.runs[policy]
            report.wall_s[policy] = part.wall_s[policy]
        reports.append(report)
    return reports


def _worker_signals() -> None:
    """A worker's signals: Ctrl-C is the parent's to handle, and SIGTERM kills at once.

    The parent's SIGTERM handler (``_exit_on_sigterm``) is in place when the workers fork, and
    raises ``SystemExit``, which the pool's worker loop takes for one task's failure: a worker
    the parent stopped mid-run went on to the next queued run (two such were found still
    running when a test session ended)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _exit_on_sigterm() -> Callable[[], None]:
    """Make SIGTERM exit (status 143) by raising ``SystemExit`` in the main thread, so that the
    caller's cleanup runs; returns what restores the previous handler."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # only the main thread may set handlers; its own stays

    def terminate(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    return lambda: signal.signal(signal.SIGTERM, previous)


def mean_rate(requests: Sequence[TraceRequest]) -> float:
    """Requests per second between the first and the last arrival (nan when they coincide)."""
    span_s = requests[-1].arrival_s - requests[0].arrival_s if requests else 0.0
    return len(requests) / span_s if span_s > 0 else float("nan")


def _progress_bar(total: int) -> tqdm:
    from tqdm import tqdm

    return tqdm(total=total, unit="req", leave=False)


def _accepted(record: TraceRecord, engine: EngineConfig) -> bool:
    """An engine takes the request (``SimEngine.check``'s length tests): the ceilings count only
    those, as the policies' hit rates do; a refused request never reaches any cache."""
    total = record.input_length + record.output_length
    return total <= engine.model_len and -(-total // engine.block_size) <= engine.num_gpu_blocks


def _simulate(
    requests: Sequence[TraceRequest],
    policies: Sequence[str],
    config: SimulationConfig,
    bar: tqdm | None,
    factories: Mapping[str, Callable[[], Profile]],
) -> SimulationReport:
    """``simulate``'s work; completions tick ``bar``, which the caller owns (and closes)."""
    engine_configs = engine_configs_for(config)
    engine_config = engine_configs[0]
    capacity = sum(c.num_gpu_blocks * c.block_size for c in engine_configs)
    kinds = list({id(c): c for c in engine_configs}.values())
    ceilings = hit_rate_ceilings(
        (r.record for r in requests if any(_accepted(r.record, c) for c in kinds)),
        config.trace_block_size,
        engine_config.block_size,
        capacity,
    )
    prompts = PromptFactory(
        config.model,
        config.trace_block_size,
        engine_config.block_size,
        engine_config.model.vocab_size,
    )
    report = SimulationReport([], ceilings)
    for policy in policies:
        if bar is not None:
            bar.set_description(policy)
        started = time.perf_counter()
        run = asyncio.run(
            run_policy(
                policy,
                requests,
                config,
                engine_configs,
                prompts,
                bar.update if bar is not None else None,
                factories.get(policy),
            )
        )
        report.wall_s[policy] = time.perf_counter() - started
        report.runs[policy] = run
        report.summaries.append(summarize(run, config.slo_ttft_ms, config.slo_tpot_ms))
    return report
