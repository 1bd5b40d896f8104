"""Benchmark: 40 LoRA fine-tunes of one 8B base on a shared fleet, adapter-aware vs blind routing.

The question an SRE asks before consolidating customer fine-tunes: *if forty fine-tunes share four
GPUs instead of getting a deployment each, how often do the replicas swap adapters, what happens
to p95 TTFT, and what does it save?* This script answers it in virtual time with the fleet
simulator (``planning/simulator``: the real ``routing/`` policies, ``replica/sim`` engine models
with ``max_loras`` GPU slots and a ``max_cpu_loras`` host cache) and rewrites
``docs/benchmarks/forty-tunes.md`` and ``docs/benchmarks/forty-tunes.png``.

Run from the repository root (a few minutes on 2 CPUs)::

    .venv/bin/python -m bench.forty_tunes

``--help`` lists the policies compared, the metrics, and how the dedicated baseline is sized.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import hashlib
import math
import multiprocessing
import os
import platform
import random
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from bench.workloads.arrivals import arrivals
from bench.workloads.blocks import BlockIdAllocator, prompt_length
from bench.workloads.shapes.base import Zipf
from bench.workloads.shapes.lora import ADAPTERS, ZIPF_EXPONENT, B2BLora, adapter_name
from planning.capacity import CapacityError, engine_model, replicas_needed
from planning.simulator import SimulationConfig, engine_config_for, prepare_requests
from planning.simulator import replica as sim_replica
from planning.simulator.loop import run_policy
from planning.simulator.prompts import PromptFactory
from planning.simulator.summary import PolicySummary, summarize
from replica.sim.engine import EngineConfig, EngineModel, StepResult
from routing.contracts import RoutingRequest
from routing.engine import PluginTerms, Profile
from routing.policies.expected_ttft import ExpectedTtftScorer
from routing.policies.max_score import MaxScorePicker
from routing.policies.registry import builtin_profile
from routing.state import ReplicaState
from routing.types import ReplicaId
from traces.format import DEFAULT_BLOCK_SIZE, TraceRecord

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DOC = REPO / "docs" / "benchmarks" / "forty-tunes.md"
DEFAULT_PNG = REPO / "docs" / "benchmarks" / "forty-tunes.png"

AWARE = "expected-ttft"
BLIND_TTFT = "expected-ttft/adapter-blind"
REGISTRY_TTFT = "expected-ttft/registry-defaults"
#: Compared policies, adapter-aware first. Only ``expected-ttft`` reads adapter residency.
POLICIES: tuple[str, ...] = (AWARE, BLIND_TTFT, "least-loaded", "round-robin")
POLICY_NOTES = {
    AWARE: "adapter-aware: cost = queue + uncached prefill + adapter cold load (0 in a GPU "
    "slot, 50 ms host-cached, else a learned estimate starting at 500 ms)",
    BLIND_TTFT: "the same scorer with every adapter cold-load estimate set to 0 (still "
    "prefix-aware, so it follows each customer's cached system prompt)",
    REGISTRY_TTFT: "the same scorer fed the adapter registry's default cold-load estimates, "
    "as the gateway feeds it before any load is measured (0 in a GPU slot, the host copy "
    "when host-cached, 50 ms + size / 2 GB/s otherwise; no thrash guard); not in the "
    "default list",
    "least-loaded": "fewest in-flight requests; blind to adapters and prefixes",
    "round-robin": "blind to adapters, prefixes and load",
}
#: Storage and host->GPU bandwidth of the "free loads" ablation: an 84 MB adapter in ~0.1 µs.
FREE_LOAD_GBPS = 1e6
#: Loads in the first this many virtual seconds are the fleet warming up (every replica starts
#: with empty LoRA slots); the steady-state rate is counted after it.
WARMUP_S = 60.0


# --------------------------------------------------------------------------- the workload


class _B2BLoraZipf(B2BLora):
    """``b2b-lora`` (40 customers, own system prompt each) with a chosen Zipf exponent."""

    def __init__(self, rng: random.Random, exponent: float) -> None:
        super().__init__(rng)
        # Zipf() draws nothing from rng and a pick draws once whatever the exponent: across
        # exponents, arrivals, request texts and output lengths stay the same; only the
        # customer of each request (and so its system prompt) changes.
        self.adapters = Zipf([adapter_name(rank) for rank in range(ADAPTERS)], exponent)


def forty_tunes_trace(
    requests: int,
    rate: float,
    exponent: float = ZIPF_EXPONENT,
    seed: int = 0,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> list[TraceRecord]:
    """A ``b2b-lora`` trace (Poisson arrivals) whose adapter popularity is Zipf(``exponent``).

    With ``exponent`` = 1.1 this is exactly ``python -m bench.workloads b2b-lora``'s trace.
    """
    times = arrivals("poisson", requests, rate, random.Random(f"{seed}:arrivals"))
    source = _B2BLoraZipf(random.Random(f"{seed}:content"), exponent)
    allocator = BlockIdAllocator(block_size)
    records = []
    for arrival_s in times:
        shaped = source.next_request()
        records.append(
            TraceRecord(
                timestamp=round(arrival_s * 1000),
                input_length=prompt_length(shaped.segments),
                output_length=shaped.output_length,
                hash_ids=tuple(allocator.hash_ids(shaped.segments)),
                adapter=shaped.adapter,
            )
        )
    return records


# --------------------------------------------------------------------------- policies


class _AdapterBlindScorer(ExpectedTtftScorer):
    """``expected-ttft`` told that no adapter ever costs anything to load or waits for a slot.

    It fills ``RoutingRequest.adapter_cold_load_ms`` with 0 for every replica (the field the
    gateway fills from the adapter registry). A given estimate wins over the scorer's own
    residency rule, and is never calibrated, so the scorer stays blind for the whole run; the
    load time it then observes inside TTFTs is folded into its prefill-speed estimate, as it
    would be for a router that knows nothing about adapters. Its LoRA-slot wait is 0 too.
    """

    def _slot_wait_ms(self, adapter: str, replica: ReplicaState) -> float:
        return 0.0

    def score_with_terms(
        self, request: RoutingRequest, replicas: Sequence[ReplicaState]
    ) -> tuple[dict[ReplicaId, float], PluginTerms]:
        if request.adapter:
            request.adapter_cold_load_ms = {r.replica_id: 0.0 for r in replicas}
        return super().score_with_terms(request, replicas)


class _RegistryDefaultsScorer(ExpectedTtftScorer):
    """``expected-ttft`` fed the cold-load estimates of ``adapters_registry``'s defaults.

    The gateway fills ``RoutingRequest.adapter_cold_load_ms`` from the registry; the simulator
    does not. This fills it with the registry's estimate before any load was measured (its
    ``LoadTimeModel`` defaults, the engine's adapter size), so the scorer's own 500 ms guess
    and its calibration are out of play.
    """

    def __init__(self, adapter_mb: float) -> None:
        super().__init__()
        from adapters_registry.cold_start import LoadTimeModel

        self._model = LoadTimeModel()
        self._adapter_mb = adapter_mb

    def score_with_terms(
        self, request: RoutingRequest, replicas: Sequence[ReplicaState]
    ) -> tuple[dict[ReplicaId, float], PluginTerms]:
        adapter = request.adapter
        if adapter:
            estimates = {}
            for replica in replicas:
                if adapter in replica.loaded_adapters:
                    estimates[replica.replica_id] = 0.0
                elif adapter in replica.cpu_cached_adapters:
                    estimates[replica.replica_id] = self._model.host_copy_ms(self._adapter_mb)
                else:
                    estimates[replica.replica_id] = self._model.load_ms(
                        adapter, replica.replica_id, self._adapter_mb
                    )
            request.adapter_cold_load_ms = estimates
        return super().score_with_terms(request, replicas)


def _registry_profile() -> Profile:
    # Every Llama-3-8B preset has the same adapter size; this benchmark serves an 8B base.
    adapter_mb = EngineConfig.from_profile("h100-llama3-8b").default_adapter_mb
    return Profile(
        name=REGISTRY_TTFT,
        filters=(),
        scorers=((_RegistryDefaultsScorer(adapter_mb), 1.0),),
        picker=MaxScorePicker(),
    )


def _blind_profile() -> Profile:
    return Profile(
        name=BLIND_TTFT,
        filters=(),
        scorers=((_AdapterBlindScorer(), 1.0),),
        picker=MaxScorePicker(),
    )


PROFILE_FACTORIES: dict[str, Callable[[], Profile]] = {
    BLIND_TTFT: _blind_profile,
    REGISTRY_TTFT: _registry_profile,
}


def profile_for(policy: str) -> Profile:
    """A fresh profile for one of ``POLICIES`` (or any built-in policy name)."""
    factory = PROFILE_FACTORIES.get(policy)
    return factory() if factory is not None else builtin_profile(policy)


# --------------------------------------------------------------------------- load counting


class _LoadCountingEngine(EngineModel):
    """An ``EngineModel`` that notes every adapter brought into a GPU slot, when, and its cost.

    Adapters in the GPU slots after a step that were not there before it are the step's loads
    (only the public ``stats()`` is read). This would miss an idle adapter evicted and brought
    back within one step; counting inside the LoRA slots instead gave identical totals on this
    benchmark's traces. A load costs the host->GPU copy, plus the storage read when the adapter
    was not in the host cache before the step.
    """

    def __init__(self, config: EngineConfig, seed: int = 0) -> None:
        super().__init__(config, seed=seed)
        #: Virtual start times of the steps that loaded an adapter, one entry per load.
        self.load_times: list[float] = []
        #: Modelled seconds the engine spent waiting for adapter loads.
        self.load_seconds = 0.0
        size_bytes = config.default_adapter_mb * 1e6
        self._h2d_s = size_bytes / (config.h2d_gbps * 1e9)
        self._storage_s = size_bytes / (config.lora_storage_gbps * 1e9)
        self._slots: frozenset[str] = frozenset()
        self._host: frozenset[str] = frozenset()

    def step(self, now_s: float) -> StepResult:
        result = super().step(now_s)
        stats = self.stats()
        slots = frozenset(stats.loaded_adapters)
        loaded = slots - self._slots
        if loaded:
            self.load_times.extend([now_s] * len(loaded))
            from_storage = len(loaded - self._host)
            self.load_seconds += len(loaded) * self._h2d_s + from_storage * self._storage_s
        self._slots = slots
        self._host = frozenset(stats.cpu_adapters)
        return result


@contextlib.contextmanager
def _counting_engines() -> Iterator[list[_LoadCountingEngine]]:
    """While active, the simulator's replicas run ``_LoadCountingEngine``s (listed as built)."""
    built: list[_LoadCountingEngine] = []

    def factory(config: EngineConfig, seed: int = 0) -> _LoadCountingEngine:
        engine = _LoadCountingEngine(config, seed=seed)
        built.append(engine)
        return engine

    original = sim_replica.EngineModel
    sim_replica.EngineModel = factory  # type: ignore[assignment,misc]
    try:
        yield built
    finally:
        sim_replica.EngineModel = original  # type: ignore[misc]


# --------------------------------------------------------------------------- one run


@dataclass(frozen=True)
class Scenario:
    """The fleet and workload of one simulated point."""

    exponent: float
    rate: float
    requests: int
    replicas: int
    max_loras: int
    max_cpu_loras: int
    profile: str
    slo_ttft_ms: float
    slo_tpot_ms: float
    seed: int
    #: Make adapter loads (nearly) free: isolates what the loads' own time costs.
    free_loads: bool = False

    def config(self, replicas: int | None = None, lora: bool = True) -> SimulationConfig:
        """The simulator settings; ``lora=False`` for a fleet that serves no adapters."""
        overrides: dict[str, object] = {}
        if lora:
            overrides = {"max_loras": self.max_loras, "max_cpu_loras": self.max_cpu_loras}
            if self.free_loads:
                overrides.update(lora_storage_gbps=FREE_LOAD_GBPS, lora_h2d_gbps=FREE_LOAD_GBPS)
        return SimulationConfig(
            replicas=self.replicas if replicas is None else replicas,
            profile=self.profile,
            engine_overrides=overrides,
            slo_ttft_ms=self.slo_ttft_ms,
            slo_tpot_ms=self.slo_tpot_ms,
            seed=self.seed,
        )

    def trace(self) -> list[TraceRecord]:
        """The scenario's trace (deterministic; independent of the fleet size)."""
        return forty_tunes_trace(self.requests, self.rate, self.exponent, self.seed)

    def price_per_hour(self) -> float:
        """$ per replica-hour of the preset."""
        return engine_config_for(self.config()).replica_price_per_hour

    def offered_out_tok_per_h(self) -> float:
        """Output tokens per hour the trace offers (what either fleet must serve)."""
        records = self.trace()
        span_s = (records[-1].timestamp - records[0].timestamp) / 1000.0 or 1.0
        return sum(r.output_length for r in records) / span_s * 3600.0


@dataclass
class PolicyResult:
    """One policy on one scenario: the simulator's row plus adapter-load figures."""

    scenario: Scenario
    policy: str
    summary: PolicySummary
    loads: int
    loads_after_warmup: int
    #: Share of the fleet's engine time spent waiting for adapter loads (whole run).
    load_share: float
    #: Virtual seconds from the end of the warm-up to the last completion.
    steady_s: float
    makespan_s: float
    wall_s: float

    @property
    def loads_per_min(self) -> float:
        """Steady-state GPU-slot loads per minute, whole fleet (warm-up excluded)."""
        return self.loads_after_warmup / self.steady_s * 60.0 if self.steady_s > 0 else math.nan


def _run(
    policy: str,
    records: Sequence[TraceRecord],
    config: SimulationConfig,
    on_done: Callable[[int], None] | None,
) -> tuple[PolicySummary, list[_LoadCountingEngine], float]:
    engine_config = engine_config_for(config)
    prompts = PromptFactory(
        config.model,
        config.trace_block_size,
        engine_config.block_size,
        engine_config.model.vocab_size,
    )
    requests = prepare_requests(records)
    with _counting_engines() as engines:
        run = asyncio.run(
            run_policy(
                policy,
                requests,
                config,
                engine_config,
                prompts,
                on_done,
                lambda: profile_for(policy),
            )
        )
    summary = summarize(run, config.slo_ttft_ms, config.slo_tpot_ms)
    makespan = 0.0
    if run.outcomes:
        makespan = max(o.finish_s for o in run.outcomes) - min(o.arrival_s for o in run.outcomes)
    return summary, engines, makespan


class _Progress(Protocol):
    def add(self, n: int) -> None: ...


#: Where finished requests are counted (a shared counter in worker processes).
_PROGRESS: _Progress | None = None


class _SharedCounter:
    """A counter in shared memory: workers add, the parent's progress bar reads."""

    def __init__(self) -> None:
        self.value = multiprocessing.get_context("spawn").Value("q", 0)

    def add(self, n: int) -> None:
        with self.value.get_lock():
            self.value.value += n


class _BarCounter:
    """Counts straight into a tqdm bar (in-process runs, ``--jobs 1``)."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar

    def add(self, n: int) -> None:
        self.bar.update(n)


def _init_worker(counter: _Progress | None) -> None:
    global _PROGRESS
    _PROGRESS = counter


def _count_progress() -> Callable[[int], None] | None:
    counter = _PROGRESS
    if counter is None:
        return None
    pending = [0]

    def on_done(n: int) -> None:
        pending[0] += n
        if pending[0] >= 50:
            counter.add(pending[0])
            pending[0] = 0

    return on_done


def run_policy_on(scenario: Scenario, policy: str) -> PolicyResult:
    """Replay the scenario's trace through ``policy`` on the shared LoRA fleet."""
    started = time.perf_counter()
    summary, engines, makespan = _run(
        policy, scenario.trace(), scenario.config(), _count_progress()
    )
    times = [t for engine in engines for t in engine.load_times]
    return PolicyResult(
        scenario=scenario,
        policy=policy,
        summary=summary,
        loads=len(times),
        loads_after_warmup=sum(1 for t in times if t >= WARMUP_S),
        load_share=(
            sum(e.load_seconds for e in engines) / (len(engines) * makespan)
            if engines and makespan > 0
            else math.nan
        ),
        steady_s=max(0.0, makespan - WARMUP_S),
        makespan_s=makespan,
        wall_s=time.perf_counter() - started,
    )


# --------------------------------------------------------------------------- dedicated baseline


@dataclass
class TuneSizing:
    """Replicas one fine-tune needs on its own deployment (adapter merged, no LoRA slots)."""

    adapter: str
    share: float
    rate: float
    mean_uncached_tokens: float
    prefill_ms: float
    replicas: int


@dataclass
class DedicatedResult:
    """The one-deployment-per-fine-tune baseline of one scenario."""

    scenario: Scenario
    tunes: list[TuneSizing]
    #: The busiest fine-tune replayed alone on its dedicated replicas (the Erlang-C check).
    busiest: PolicySummary | None = None
    wall_s: float = 0.0

    @property
    def gpus(self) -> int:
        """Replicas of all the dedicated deployments together."""
        return sum(t.replicas for t in self.tunes)

    @property
    def top(self) -> TuneSizing:
        """The busiest fine-tune."""
        return max(self.tunes, key=lambda t: t.share)


def uncached_tokens(records: Sequence[TraceRecord], block_size: int) -> list[int]:
    """Per record, prompt tokens not cached on a replica that saw all earlier ``records``.

    Whole trace blocks of a previously seen chain hit (never the prompt's last token), as on a
    dedicated replica with KV memory enough for its one customer's system prompt.
    """
    seen: set[tuple[int, ...]] = set()
    out = []
    for record in records:
        ids = record.hash_ids
        matched = 0
        while matched < len(ids) and ids[: matched + 1] in seen:
            matched += 1
        for depth in range(matched + 1, len(ids) + 1):
            seen.add(ids[:depth])
        cached = min(matched * block_size, record.input_length - 1)
        out.append(record.input_length - max(0, cached))
    return out


def size_dedicated(scenario: Scenario, quantile: float = 0.95) -> DedicatedResult:
    """Per fine-tune: max(1, Erlang-C replicas for its own rate at the TTFT SLO's ``quantile``).

    Service time = roofline prefill time (``planning/capacity.py``, the same preset as the
    shared fleet) of the fine-tune's mean uncached prompt; then the busiest fine-tune's traffic
    is replayed alone on that many replicas with the simulator as a check (decode time, batching
    and TPOT included there, which Erlang-C leaves out).
    """
    started = time.perf_counter()
    records = scenario.trace()
    span_s = (records[-1].timestamp - records[0].timestamp) / 1000.0 or 1.0
    model = engine_model(scenario.profile)
    by_tune: dict[str, list[TraceRecord]] = {}
    for record in records:
        by_tune.setdefault(record.adapter or "base", []).append(record)
    tunes = []
    for rank in range(ADAPTERS):
        name = adapter_name(rank)
        own = by_tune.get(name, [])
        if not own:
            tunes.append(TuneSizing(name, 0.0, 0.0, 0.0, 0.0, 1))
            continue
        uncached = uncached_tokens(own, DEFAULT_BLOCK_SIZE)
        mean_uncached = sum(uncached) / len(uncached)
        prefill = model.prefill_ms(mean_uncached)
        rate = len(own) / span_s
        try:
            needed = replicas_needed(rate, scenario.slo_ttft_ms, prefill, quantile)
        except CapacityError:
            needed = 0  # prefill alone breaks the SLO; no size helps, the floor of 1 applies
        tunes.append(
            TuneSizing(name, len(own) / len(records), rate, mean_uncached, prefill, max(1, needed))
        )
    result = DedicatedResult(scenario, tunes)
    top = result.top
    alone = [
        TraceRecord(r.timestamp, r.input_length, r.output_length, r.hash_ids, None)
        for r in by_tune.get(top.adapter, [])
    ]
    if alone:
        config = scenario.config(replicas=top.replicas, lora=False)
        result.busiest, _, _ = _run("least-loaded", alone, config, None)
    result.wall_s = time.perf_counter() - started
    return result


# --------------------------------------------------------------------------- the sweep


@dataclass
class Sweep:
    """Everything one benchmark run measured."""

    #: (rate, exponent) grid on the base fleet size, each with a dedicated baseline.
    grid: list[Scenario]
    #: Other fleet sizes for one (rate, exponent): the fleet-size sweep.
    fleet: list[Scenario]
    policies: list[str]
    #: The fleet-size point again with adapter loads made free (what the loads' time costs).
    ablation: list[Scenario] = field(default_factory=list)
    results: list[PolicyResult] = field(default_factory=list)
    dedicated: list[DedicatedResult] = field(default_factory=list)
    wall_s: float = 0.0
    jobs: int = 1
    #: The code the run used (``code_state()``), and whether it was edited during the run.
    code: str = ""
    code_changed: bool = False

    def result(self, scenario: Scenario, policy: str) -> PolicyResult:
        """The run of ``policy`` on ``scenario``."""
        return next(r for r in self.results if r.scenario == scenario and r.policy == policy)

    def baseline(self, scenario: Scenario) -> DedicatedResult:
        """The dedicated baseline of a grid scenario."""
        return next(d for d in self.dedicated if d.scenario == scenario)

    def fleet_scenarios(self) -> list[Scenario]:
        """The fleet-size sweep including its point of the grid, smallest fleet first."""
        if not self.fleet:
            return []
        first = self.fleet[0]
        same = [s for s in self.grid if (s.rate, s.exponent) == (first.rate, first.exponent)]
        return sorted([*self.fleet, *same], key=lambda s: s.replicas)


def run_sweep(
    grid: Sequence[Scenario],
    fleet: Sequence[Scenario],
    policies: Sequence[str],
    jobs: int,
    progress: bool,
    ablation: Sequence[Scenario] = (),
) -> Sweep:
    """Every (scenario, policy) replay plus each grid scenario's dedicated baseline."""
    started = time.perf_counter()
    fingerprint = code_fingerprint()
    sweep = Sweep(list(grid), list(fleet), list(policies), list(ablation), jobs=jobs)
    sweep.code = code_state()
    tasks: list[tuple[Callable[..., object], tuple[object, ...]]] = []
    for scenario in [*grid, *fleet, *ablation]:
        tasks.extend((run_policy_on, (scenario, policy)) for policy in policies)
    tasks.extend((size_dedicated, (scenario,)) for scenario in grid)
    # Biggest traces and smallest fleets first (the slowest replays), so none is left alone
    # at the end while the other CPU idles.
    tasks.sort(key=lambda task: (-task[1][0].requests, task[1][0].replicas))  # type: ignore[attr-defined]
    total = sum(s.requests for s in [*grid, *fleet, *ablation]) * len(policies)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="req", desc="forty-tunes", leave=False)
    outputs: list[object] = []
    try:
        if jobs > 1:
            outputs = _run_parallel(tasks, jobs, bar, total)
        else:
            _init_worker(_BarCounter(bar) if bar is not None else None)
            try:
                outputs = [fn(*args) for fn, args in tasks]
            finally:
                _init_worker(None)
    finally:
        if bar is not None:
            bar.close()
    for output in outputs:
        if isinstance(output, PolicyResult):
            sweep.results.append(output)
        elif isinstance(output, DedicatedResult):
            sweep.dedicated.append(output)
    sweep.wall_s = time.perf_counter() - started
    sweep.code_changed = code_fingerprint() != fingerprint
    return sweep


def _run_parallel(
    tasks: Sequence[tuple[Callable[..., object], tuple[object, ...]]],
    jobs: int,
    bar: Any,
    total: int,
) -> list[object]:
    counter = _SharedCounter() if bar is not None else None
    stop = threading.Event()

    def pump() -> None:
        shown = 0
        while not stop.wait(0.5):
            assert counter is not None
            value = min(total, counter.value.value)
            bar.update(value - shown)
            shown = value

    watcher = threading.Thread(target=pump, daemon=True) if counter is not None else None
    if watcher is not None:
        watcher.start()
    try:
        with ProcessPoolExecutor(
            jobs, multiprocessing.get_context("spawn"), _init_worker, (counter,)
        ) as pool:
            futures = [pool.submit(fn, *args) for fn, args in tasks]
            return [future.result() for future in as_completed(futures)]
    finally:
        stop.set()
        if watcher is not None:
            watcher.join()


# --------------------------------------------------------------------------- code state

#: The code the results depend on: policies, simulator, engine model, this script.
CODE_PATHS = (
    "routing",
    "planning/simulator",
    "planning/capacity.py",
    "replica/sim",
    "adapters_registry/cold_start.py",
    "bench/workloads",
    "bench/forty_tunes.py",
)


def code_fingerprint() -> str:
    """A hash of every ``.py`` file under ``CODE_PATHS`` (to notice edits during a run)."""
    digest = hashlib.sha256()
    for root in CODE_PATHS:
        path = REPO / root
        files = [path] if path.is_file() else sorted(path.rglob("*.py"))
        for file in files:
            digest.update(str(file.relative_to(REPO)).encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()[:12]


def code_state() -> str:
    """``commit abc1234`` plus the files under ``CODE_PATHS`` that differ from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "--no-optional-locks", "diff", "--name-only", "HEAD", "--", *CODE_PATHS],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    if not changed:
        return f"commit {head}"
    return f"commit {head} with uncommitted changes to " + ", ".join(f"`{c}`" for c in changed)


# --------------------------------------------------------------------------- rendering


def _fmt(value: float | None, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return fmt.format(value)


def _ratio(base: float | None, other: float | None) -> str:
    """``other / base`` as "3.2×", or "–" when either is missing."""
    if base is None or other is None or not (base > 0 and math.isfinite(other)):
        return "–"
    return f"{other / base:.1f}×"


def meets_slo(summary: PolicySummary) -> bool:
    """The fleet-size criterion: at least ``GOODPUT_TARGET`` of requests within both SLOs."""
    return summary.goodput is not None and summary.goodput >= GOODPUT_TARGET


#: Share of requests within both SLOs that a fleet must reach to count as "serves the load".
GOODPUT_TARGET = 0.99


def headline_table(sweep: Sweep) -> list[str]:
    """Markdown rows: per load and exponent, each policy and the dedicated baseline."""
    lines = [
        "| load | Zipf s | routing | adapter loads/min | GPU time in loads | TTFT p50 | TTFT p95 "
        "| TTFT p99 | queue p95 | goodput | prefix hit | GPUs | $/hour | $/1M out tok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for scenario in sweep.grid:
        price = scenario.price_per_hour()
        out_per_h = scenario.offered_out_tok_per_h()
        head = f"| {scenario.rate:g} req/s | {scenario.exponent:g}"
        for policy in sweep.policies:
            r = sweep.result(scenario, policy)
            row = r.summary
            cost = scenario.replicas * price
            name = f"**{policy}**" if policy == AWARE else policy
            lines.append(
                f"{head} | {name} | {_fmt(r.loads_per_min, '{:.0f}')} "
                f"| {_fmt(r.load_share, '{:.1%}')} "
                f"| {_fmt(row.ttft_p50_ms, '{:.0f}')} | {_fmt(row.ttft_p95_ms, '{:.0f}')} "
                f"| {_fmt(row.ttft_p99_ms, '{:.0f}')} | {_fmt(row.queue_p95_ms, '{:.0f}')} "
                f"| {_fmt(row.goodput, '{:.1%}')} | {_fmt(row.prefix_hit_rate, '{:.1%}')} "
                f"| {scenario.replicas} | {cost:,.2f} | {cost / out_per_h * 1e6:.3f} |"
            )
        d = sweep.baseline(scenario)
        check = d.busiest
        cost = d.gpus * price

        def cell(attr: str, fmt: str, check: PolicySummary | None = check) -> str:
            return _fmt(getattr(check, attr) if check else None, fmt) + "†"

        lines.append(
            f"{head} | *dedicated (one deployment per fine-tune)* | 0 | 0 "
            f"| {cell('ttft_p50_ms', '{:.0f}')} | {cell('ttft_p95_ms', '{:.0f}')} "
            f"| {cell('ttft_p99_ms', '{:.0f}')} | {cell('queue_p95_ms', '{:.0f}')} "
            f"| {cell('goodput', '{:.1%}')} | {cell('prefix_hit_rate', '{:.1%}')} "
            f"| {d.gpus} | {cost:,.2f} | {cost / out_per_h * 1e6:.3f} |"
        )
    return lines


def fleet_table(sweep: Sweep) -> list[str]:
    """Markdown rows of the fleet-size sweep: p95 TTFT / goodput per policy and size."""
    scenarios = sweep.fleet_scenarios()
    if not scenarios:
        return []
    lines = [
        "| GPUs | $/hour | "
        + " | ".join(f"{p}: p95 TTFT / goodput" for p in sweep.policies)
        + " |",
        "|---|---|" + "---|" * len(sweep.policies),
    ]
    for scenario in scenarios:
        cells = []
        for policy in sweep.policies:
            row = sweep.result(scenario, policy).summary
            mark = "" if meets_slo(row) else " ✗"
            cells.append(
                f"{_fmt(row.ttft_p95_ms, '{:,.0f}')} ms / {_fmt(row.goodput, '{:.1%}')}{mark}"
            )
        cost = scenario.replicas * scenario.price_per_hour()
        lines.append(f"| {scenario.replicas} | {cost:,.2f} | " + " | ".join(cells) + " |")
    return lines


def ablation_pairs(sweep: Sweep) -> list[tuple[PolicyResult, PolicyResult]]:
    """Per policy: (modelled loads, free loads) at the ablation point."""
    pairs = []
    for free in sweep.ablation:
        real = dataclasses.replace(free, free_loads=False)
        for policy in sweep.policies:
            pairs.append((sweep.result(real, policy), sweep.result(free, policy)))
    return pairs


def ablation_table(sweep: Sweep) -> list[str]:
    """Markdown rows: each policy with modelled and with free adapter loads."""
    pairs = ablation_pairs(sweep)
    if not pairs:
        return []
    lines = [
        "| routing | loads/min | GPU time in loads | TTFT p95 | queue p95 | TTFT p95, free loads "
        "| queue p95, free loads | loads/min, free loads |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for real, free in pairs:
        lines.append(
            f"| {real.policy} | {_fmt(real.loads_per_min, '{:.0f}')} "
            f"| {_fmt(real.load_share, '{:.1%}')} | {_fmt(real.summary.ttft_p95_ms, '{:,.0f}')} "
            f"| {_fmt(real.summary.queue_p95_ms, '{:,.0f}')} "
            f"| {_fmt(free.summary.ttft_p95_ms, '{:,.0f}')} "
            f"| {_fmt(free.summary.queue_p95_ms, '{:,.0f}')} "
            f"| {_fmt(free.loads_per_min, '{:.0f}')} |"
        )
    return lines


def smallest_fleets(sweep: Sweep) -> dict[str, int | None]:
    """Per policy, the smallest swept fleet meeting ``GOODPUT_TARGET`` (None: none did)."""
    out: dict[str, int | None] = {}
    for policy in sweep.policies:
        sizes = [
            s.replicas
            for s in sweep.fleet_scenarios()
            if meets_slo(sweep.result(s, policy).summary)
        ]
        out[policy] = min(sizes) if sizes else None
    return out


def findings(sweep: Sweep) -> list[str]:
    """Computed findings (ratios from this run), one line per grid point, then fleet sizes."""
    out = []
    for scenario in sweep.grid:
        aware = sweep.result(scenario, AWARE)
        others = [sweep.result(scenario, p) for p in sweep.policies if p != AWARE]
        d = sweep.baseline(scenario)
        parts = [
            f"`{o.policy}` {_ratio(aware.loads_per_min, o.loads_per_min)} the loads/min and "
            f"{_ratio(aware.summary.ttft_p95_ms, o.summary.ttft_p95_ms)} the p95 TTFT "
            f"(goodput {_fmt(o.summary.goodput, '{:.1%}')})"
            for o in others
        ]
        out.append(
            f"- **{scenario.rate:g} req/s, s = {scenario.exponent:g}**: `{AWARE}` "
            f"{aware.loads_per_min:.0f} loads/min, p95 TTFT "
            f"{_fmt(aware.summary.ttft_p95_ms, '{:.0f}')} ms, goodput "
            f"{_fmt(aware.summary.goodput, '{:.1%}')}; against it " + "; ".join(parts) + ". "
            f"{scenario.replicas} shared GPUs vs {d.gpus} dedicated "
            f"({d.gpus / scenario.replicas:.0f}× the $/hour)."
        )
    if sweep.fleet:
        first = sweep.fleet[0]
        smallest = smallest_fleets(sweep)
        sizes = ", ".join(str(s.replicas) for s in sweep.fleet_scenarios())
        parts = [f"`{p}` {n if n is not None else 'none of ' + sizes}" for p, n in smallest.items()]
        out.append(
            f"- **Fleet size** ({first.rate:g} req/s, s = {first.exponent:g}; fleets of {sizes} "
            f"GPUs): smallest fleet with goodput ≥ {GOODPUT_TARGET:.0%} — " + ", ".join(parts) + "."
        )
    pairs = ablation_pairs(sweep)
    if pairs:
        point = sweep.ablation[0]
        aware_free = next(free for real, free in pairs if real.policy == AWARE)
        parts = [
            f"`{real.policy}` {_fmt(real.summary.ttft_p95_ms, '{:,.0f}')} → "
            f"{_fmt(free.summary.ttft_p95_ms, '{:,.0f}')} ms"
            f" ({_ratio(aware_free.summary.ttft_p95_ms, free.summary.ttft_p95_ms)} "
            f"`{AWARE}`'s)"
            for real, free in pairs
        ]
        out.append(
            f"- **Free loads** ({point.rate:g} req/s, s = {point.exponent:g}): with adapter "
            "loads made instantaneous, p95 TTFT goes " + "; ".join(parts) + ". What disappears "
            "was engine time lost to loads; what is left is waiting for a LoRA slot (and, for "
            "the prefix-blind policies, fewer prefix hits and cruder load balancing)."
        )
    return out


def render_page(sweep: Sweep, command: str, png_rel: str) -> str:
    """The whole ``forty-tunes.md`` page."""
    first = sweep.grid[0]
    engine = engine_config_for(first.config())
    adapter_mb = engine.default_adapter_mb
    storage_ms = adapter_mb / engine.lora_storage_gbps
    h2d_ms = adapter_mb / engine.h2d_gbps
    price = engine.replica_price_per_hour
    rates = sorted({s.rate for s in sweep.grid})
    exps = sorted({s.exponent for s in sweep.grid})
    minutes = first.requests / first.rate / 60.0
    lines = [
        "# Forty fine-tunes on four GPUs: adapter-aware vs adapter-blind routing",
        "",
        "*Generated by `bench/forty_tunes.py` — everything above the notes marker is rewritten "
        "by each run.*",
        "",
        f"40 LoRA fine-tunes of one Llama-3-8B base with Zipf-skewed traffic, served by "
        f"{first.replicas} simulated H100s with `max_loras` {first.max_loras}, routed with and "
        "without knowledge of which adapters each replica holds — and against one deployment "
        "per fine-tune. Virtual time in the fleet simulator ([simulate.md](../simulate.md)): "
        "the real `routing/` policies, `replica/sim` engine models "
        "([simulator.md](../simulator.md)).",
        "",
        "## Command",
        "",
        "```",
        command,
        "```",
        "",
        f"{sweep.wall_s:.0f} s wall on {platform.machine()}, {os.cpu_count()} CPUs (shared), "
        f"`--jobs {sweep.jobs}`, Python {platform.python_version()}, "
        f"{datetime.date.today().isoformat()}; code: {sweep.code}."
        + (
            " **Warning: routing/simulator code changed during this run; rerun it.**"
            if sweep.code_changed
            else ""
        ),
        "",
        "## Setup",
        "",
        "- **Traffic**: the `b2b-lora` shape of `bench/workloads` — each of 40 customers has its "
        "own system prompt (median ~1,000 tokens) before a unique request (median ~300), and "
        "gets ~150 output tokens — with Poisson arrivals at "
        + " and ".join(f"{r:g}" for r in rates)
        + f" req/s for {minutes:.0f} minutes of virtual time each, seed {first.seed}. Adapter "
        "popularity is Zipf(s) with s = " + ", ".join(f"{s:g}" for s in exps) + " (1.1 is the "
        "shape's own); changing s changes only which customer (and so which system prompt) a "
        "request carries, not arrivals, request texts or output lengths.",
        f"- **Shared fleet**: {first.replicas} × `{first.profile}` (${price:.2f}/GPU-hour), "
        f"`max_loras` {first.max_loras} (GPU adapter slots; also the most distinct adapters one "
        f"batch can run), `max_cpu_loras` {first.max_cpu_loras} (host cache; vLLM's default "
        f"equals `max_loras`). A rank-16 adapter is ≈ {adapter_mb:.0f} MB: loading it costs ≈ "
        f"{storage_ms + h2d_ms:.0f} ms from storage, {h2d_ms:.1f} ms from host memory, and the "
        "whole engine step it happens in waits for it. A request whose adapter cannot get a "
        "slot (all slots serve running requests) waits, as in vLLM. Every replica can serve "
        "every adapter; none starts with any loaded.",
        f"- **SLOs**: TTFT ≤ {first.slo_ttft_ms:g} ms and TPOT ≤ {first.slo_tpot_ms:g} ms "
        "per request; *goodput* = the share of requests meeting both.",
        f"- **Adapter loads/min**: adapters brought into a GPU slot, whole fleet, per minute of "
        f"virtual time after the first {WARMUP_S:.0f} s (the warm-up, in which every replica "
        "loads from empty, is left out).",
        "- **$/1M out tok**: the fleet's $/hour ÷ the trace's offered output tokens per hour "
        "(both fleets serve the same traffic).",
        "",
        "Routing policies (only `expected-ttft` reads adapter residency):",
        "",
        *[f"- `{p}` — {POLICY_NOTES.get(p, 'built-in policy')}." for p in sweep.policies],
        "",
        "## Results",
        "",
        *headline_table(sweep),
        "",
        "Times in ms. † The dedicated rows' latencies are those of the busiest fine-tune "
        "replayed alone on its own dedicated replicas — a check of the sizing below, not a "
        "whole-fleet figure.",
        "",
        f"![adapter loads per minute, p95 TTFT, and p95 TTFT by fleet size, per policy]({png_rel})",
        "",
        "### Findings (computed by this run)",
        "",
        *findings(sweep),
        "",
    ]
    if sweep.fleet:
        f0 = sweep.fleet[0]
        lines += [
            f"## How small can the shared fleet be? ({f0.rate:g} req/s, s = {f0.exponent:g})",
            "",
            f"The same trace on fleets of other sizes. ✗: goodput below {GOODPUT_TARGET:.0%}.",
            "",
            *fleet_table(sweep),
            "",
        ]
    if sweep.ablation:
        a0 = sweep.ablation[0]
        lines += [
            f"## Where the TTFT goes: loads vs slot waits ({a0.rate:g} req/s, s = {a0.exponent:g})",
            "",
            "The same trace again with adapter loads made (nearly) instantaneous — storage and "
            "host->GPU bandwidth set to 1 PB/s — so that the only adapter effect left is the "
            f"`max_loras` limit: a request waits while all {a0.max_loras} slots of its replica "
            "serve running requests of other adapters. *GPU time in loads* = modelled "
            "seconds the engines waited for loads ÷ (replicas × run length); every request "
            "batched in a loading step waits too.",
            "",
            *ablation_table(sweep),
            "",
        ]
    lines += [
        "## How the dedicated baseline is sized",
        "",
        "Each fine-tune gets its own deployment (adapter merged into the base, so no LoRA "
        "slots and no loads), sized as `fleetgate plan capacity` sizes a pool "
        "(`planning/capacity.py`): an M/M/c Erlang-C queue with the fine-tune's own arrival "
        "rate (its share of the trace), a service time equal to the roofline prefill time of "
        "its mean *uncached* prompt (its system prompt stays cached on its own replicas) on "
        "the same preset, and the smallest replica count whose p95 TTFT meets the SLO — "
        "floored at 1, since a deployment cannot have zero replicas. Then the busiest "
        "fine-tune's requests are replayed alone through the simulator on that many replicas "
        "(`least-loaded`), which adds what Erlang-C leaves out (batching, decode, TPOT): the "
        "† figures.",
        "",
        "| load | Zipf s | busiest fine-tune | its share | its rate | mean uncached tokens "
        "| Erlang-C replicas | check: p95 TTFT | check: goodput | fine-tunes needing > 1 "
        "| dedicated GPUs |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for scenario in sweep.grid:
        d = sweep.baseline(scenario)
        top = d.top
        many = sum(1 for t in d.tunes if t.replicas > 1)
        check = d.busiest
        lines.append(
            f"| {scenario.rate:g} req/s | {scenario.exponent:g} | {top.adapter} "
            f"| {top.share:.1%} | {top.rate:.2f} req/s | {top.mean_uncached_tokens:.0f} "
            f"| {top.replicas} | {_fmt(check.ttft_p95_ms if check else None, '{:.0f}')} ms "
            f"| {_fmt(check.goodput if check else None, '{:.1%}')} | {many} | {d.gpus} |"
        )
    lines += [
        "",
        "## Limits",
        "",
        "- Engine figures come from a roofline model, not a GPU: trust the differences between "
        "policies more than absolute milliseconds ([simulator.md](../simulator.md)). The model "
        "charges no per-step LoRA compute overhead, only load time, and its load time is "
        "bandwidth only (none of the Python/HTTP overhead of vLLM's runtime "
        "`load_lora_adapter`), so real loads cost more than modelled here.",
        "- The simulator does not fill `RoutingRequest.adapter_cold_load_ms` (the gateway "
        "fills it from `adapters_registry`), so `expected-ttft` runs on its own fallback: 0 for "
        "an adapter in a GPU slot, 50 ms host-cached, otherwise a per-adapter estimate that "
        "starts at 500 ms and is calibrated from observed TTFTs. The registry's pre-warming and "
        "thrash guard are not simulated.",
        "- One deployment per fine-tune is the simplest alternative; an operator could also "
        "pool the tail. Idle dedicated replicas cost as much as busy ones; scale-to-zero is "
        "not modelled.",
        "- One seed, one trace per point: differences of a few percent are noise.",
        "",
        NOTES_MARKER,
    ]
    return "\n".join(lines) + "\n"


NOTES_MARKER = "<!-- notes: kept as written when the benchmark rewrites this page -->"


def write_page(path: Path, page: str) -> None:
    """Write the page, keeping whatever follows ``NOTES_MARKER`` in the old one."""
    notes = ""
    if path.exists():
        old = path.read_text()
        if NOTES_MARKER in old:
            notes = old[old.index(NOTES_MARKER) + len(NOTES_MARKER) :]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page.rstrip("\n") + notes.rstrip("\n") + "\n")


def write_png(sweep: Sweep, path: Path) -> None:
    """Loads/min and p95 TTFT per policy and grid point; p95 TTFT by fleet size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if sweep.fleet else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.8))
    width = 0.8 / len(sweep.policies)
    labels = [f"{s.rate:g} req/s\ns={s.exponent:g}" for s in sweep.grid]
    for i, policy in enumerate(sweep.policies):
        offset = (i - (len(sweep.policies) - 1) / 2) * width
        xs = [j + offset for j in range(len(sweep.grid))]
        runs = [sweep.result(s, policy) for s in sweep.grid]
        axes[0].bar(xs, [r.loads_per_min for r in runs], width, label=policy)
        axes[1].bar(xs, [r.summary.ttft_p95_ms or math.nan for r in runs], width, label=policy)
    slo = sweep.grid[0].slo_ttft_ms
    for ax, title in (
        (axes[0], "adapter loads / min (fleet, after warm-up)"),
        (axes[1], "p95 TTFT (ms, log scale)"),
    ):
        ax.set_xticks(range(len(sweep.grid)), labels, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[1].set_yscale("log")
    axes[1].axhline(slo, color="black", linestyle="--", linewidth=1)
    axes[1].text(-0.4, slo * 1.1, f"TTFT SLO {slo:g} ms", fontsize=8)
    axes[0].legend(fontsize=8)
    if sweep.fleet:
        scenarios = sweep.fleet_scenarios()
        sizes = [s.replicas for s in scenarios]
        for policy in sweep.policies:
            p95 = [sweep.result(s, policy).summary.ttft_p95_ms or math.nan for s in scenarios]
            axes[2].plot(sizes, p95, marker="o", label=policy)
        axes[2].axhline(slo, color="black", linestyle="--", linewidth=1)
        axes[2].text(sizes[0], slo * 1.1, f"TTFT SLO {slo:g} ms", fontsize=8)
        axes[2].set_yscale("log")
        axes[2].set_xticks(sizes)
        axes[2].set_xlabel("shared GPUs")
        f0 = scenarios[0]
        axes[2].set_title(
            f"p95 TTFT by fleet size ({f0.rate:g} req/s, s={f0.exponent:g})", fontsize=10
        )
        axes[2].grid(alpha=0.3)
    first = sweep.grid[0]
    gpus = sorted({d.gpus for d in sweep.dedicated})
    fig.suptitle(
        f"40 LoRA fine-tunes of Llama-3-8B on {first.replicas} × H100 (max_loras "
        f"{first.max_loras}); one deployment per fine-tune would need "
        f"{'/'.join(str(g) for g in gpus)} GPUs",
        fontsize=11,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_summary(sweep: Sweep) -> None:
    """The tables and findings on stdout."""
    print("\n".join(headline_table(sweep)))
    if sweep.fleet:
        print()
        print("\n".join(fleet_table(sweep)))
    if sweep.ablation:
        print()
        print("\n".join(ablation_table(sweep)))
    print()
    print("\n".join(findings(sweep)))
    print(f"\n({sweep.wall_s:.0f} s wall; code: {sweep.code})")
    if sweep.code_changed:
        print("warning: routing/simulator code changed during the run; rerun it", file=sys.stderr)


# --------------------------------------------------------------------------- CLI

DESCRIPTION = """\
Forty LoRA fine-tunes on a small shared fleet: does adapter-aware routing pay off?

Generates b2b-lora traces (40 customer fine-tunes of one 8B base, each with its own system
prompt, Zipf-skewed popularity), replays each through the routing policies on a simulated
fleet of H100s with --max-loras GPU adapter slots (planning/simulator: real routing/ code,
replica/sim engine models, virtual time), and compares with one deployment per fine-tune.

What is compared:
  expected-ttft                adapter-aware: its cost adds the adapter's cold-load time on
                               each replica (0 when resident in a GPU slot), so a customer's
                               traffic stays where its adapter is, unless that replica is busy
  expected-ttft/adapter-blind  the same scorer with the cold-load term zeroed (a bench-local
                               wrapper): what adapter awareness adds on top of prefix affinity
  least-loaded, round-robin    blind to adapters (and to prefixes) entirely
optional (--policies):
  expected-ttft/registry-defaults  the scorer fed the adapter registry's default cold-load
                               estimates, as the gateway feeds it (the simulator does not)

What is reported, per load level, Zipf exponent and policy:
  adapter loads/min   adapters brought into GPU slots, fleet-wide, per virtual minute after a
                      60 s warm-up; each load stalls an engine step
  TTFT p50/p95/p99    arrival to first token; queue p95 = arrival to first scheduling
  goodput             share of requests within both --slo-ttft-ms and --slo-tpot-ms
  GPUs, $/hour        the shared fleet vs one deployment per fine-tune
and, for --fleet-sizes, how many shared GPUs each policy needs for goodput >= 99%, and, at the
same point, a replay with adapter loads made free (load time vs waiting for a LoRA slot).

The dedicated baseline: per fine-tune, max(1, Erlang-C replicas) for its own arrival rate and
its mean uncached prompt's roofline prefill time, at p95 TTFT <= the SLO (as planning/capacity.py
sizes a pool); the busiest fine-tune is then replayed alone on that many simulated replicas as
a check that includes decode and batching.
"""

EPILOG = """\
examples:
  # the committed results (rewrites docs/benchmarks/forty-tunes.md and .png; ~3-5 min on 2 CPUs)
  .venv/bin/python -m bench.forty_tunes
  # a quick look, nothing written: one point, two minutes of traffic, no fleet-size sweep
  .venv/bin/python -m bench.forty_tunes --rates 20 --zipf 1.1 --minutes 2 --fleet-sizes '' \\
      --no-write
  # does a host cache big enough for all 40 adapters (no storage reads) change the picture?
  .venv/bin/python -m bench.forty_tunes --max-cpu-loras 40 --no-write

Reading the result: fewer loads/min means adapters stay put. The TTFT gap between policies
grows with load. Every load stalls a whole engine step (all requests batched in it wait), so a
few hundred loads a minute take a few percent of each GPU's time and push a busy fleet past
its queueing knee sooner; and a request waits while every LoRA slot of its replica serves other
adapters. The free-loads replay (skip with --no-ablation) tells the two apart.
"""


def _floats(text: str, flag: str, parser: argparse.ArgumentParser) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        parser.error(f"{flag}: expected comma-separated numbers (got {text!r})")
    if any(not math.isfinite(v) for v in values):
        parser.error(f"{flag}: numbers must be finite (got {text!r})")
    return values


def build_parser() -> argparse.ArgumentParser:
    """The CLI parser."""
    p = argparse.ArgumentParser(
        prog="python -m bench.forty_tunes",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    w = p.add_argument_group("workload")
    w.add_argument(
        "--rates",
        default="12,20",
        help="comma-separated mean arrival rates, req/s (default: 12,20: moderate and high "
        "load for 4 replicas)",
    )
    w.add_argument(
        "--zipf",
        default="0.8,1.1,1.4",
        help="comma-separated Zipf exponents of adapter popularity; higher = more skewed, "
        "1.1 is the b2b-lora shape's own (default: 0.8,1.1,1.4)",
    )
    w.add_argument(
        "--minutes",
        type=float,
        default=3.0,
        help="virtual minutes of traffic per trace; requests = rate x 60 x minutes (default: 3)",
    )
    w.add_argument("--seed", type=int, default=0, help="trace and routing seed (default: 0)")
    f = p.add_argument_group("fleet")
    f.add_argument("--replicas", type=int, default=4, help="shared fleet size (default: 4)")
    f.add_argument(
        "--max-loras", type=int, default=8, help="GPU LoRA slots per replica (default: 8)"
    )
    f.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="host-memory adapter cache per replica (default: --max-loras, as vLLM)",
    )
    f.add_argument(
        "--profile",
        default="h100-llama3-8b",
        help="engine preset of replica/sim/profiles/presets.yaml (default: h100-llama3-8b)",
    )
    f.add_argument(
        "--fleet-sizes",
        default="3,5",
        help="other shared fleet sizes to try at the highest rate and the Zipf exponent "
        "closest to 1.1 ('' for none; default: 3,5)",
    )
    r = p.add_argument_group("routing and judging")
    r.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated policies, {AWARE} first (default: {','.join(POLICIES)}); "
        "any built-in policy name works",
    )
    r.add_argument(
        "--no-ablation",
        action="store_true",
        help="skip the replay with free adapter loads (which separates load time from slot waits)",
    )
    r.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="TTFT SLO (default: 2000)")
    r.add_argument("--slo-tpot-ms", type=float, default=50.0, help="TPOT SLO (default: 50)")
    o = p.add_argument_group("running and output")
    o.add_argument(
        "--jobs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="replays run in this many processes (default: min(2, CPUs))",
    )
    o.add_argument("--out", type=Path, default=DEFAULT_DOC, help="Markdown page to rewrite")
    o.add_argument("--png", type=Path, default=DEFAULT_PNG, help="figure to rewrite")
    o.add_argument("--no-write", action="store_true", help="print the tables; write no files")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def scenarios_from(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> tuple[list[Scenario], list[Scenario], list[Scenario]]:
    """Validate the arguments; the (rate, exponent) grid, fleet-size sweep and ablation."""
    rates = _floats(args.rates, "--rates", parser)
    exponents = _floats(args.zipf, "--zipf", parser)
    sizes = [int(v) for v in _floats(args.fleet_sizes, "--fleet-sizes", parser)]
    if not rates or any(r <= 0 for r in rates):
        parser.error(f"--rates: need at least one rate > 0 (got {args.rates!r})")
    if not exponents or any(s < 0 for s in exponents):
        parser.error(f"--zipf: need at least one exponent >= 0 (got {args.zipf!r})")
    if not (args.minutes > 0 and math.isfinite(args.minutes)):
        parser.error(f"--minutes must be a positive number (got {args.minutes})")
    if args.replicas < 1 or args.max_loras < 1 or args.jobs < 1 or any(n < 1 for n in sizes):
        parser.error("--replicas, --max-loras, --jobs and --fleet-sizes must be >= 1")
    cpu = args.max_loras if args.max_cpu_loras is None else args.max_cpu_loras
    if cpu < args.max_loras:
        parser.error(f"--max-cpu-loras ({cpu}) must be >= --max-loras ({args.max_loras})")

    def scenario(rate: float, exponent: float, replicas: int) -> Scenario:
        requests = max(10, round(rate * 60.0 * args.minutes))
        return Scenario(
            exponent,
            rate,
            requests,
            replicas,
            args.max_loras,
            cpu,
            args.profile,
            args.slo_ttft_ms,
            args.slo_tpot_ms,
            args.seed,
        )

    grid = [scenario(r, s, args.replicas) for r in rates for s in exponents]
    try:
        engine_config_for(grid[0].config())
        grid[0].config(replicas=1)
    except ValueError as exc:
        parser.error(str(exc))
    fleet_exponent = min(exponents, key=lambda s: abs(s - ZIPF_EXPONENT))
    fleet = [
        scenario(max(rates), fleet_exponent, n) for n in sorted(set(sizes)) if n != args.replicas
    ]
    ablation = (
        []
        if args.no_ablation
        else [
            dataclasses.replace(
                scenario(max(rates), fleet_exponent, args.replicas), free_loads=True
            )
        ]
    )
    return grid, fleet, ablation


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    grid, fleet, ablation = scenarios_from(args, parser)
    policies = list(dict.fromkeys(p.strip() for p in args.policies.split(",") if p.strip()))
    for policy in policies:
        try:
            profile_for(policy)
        except ValueError as exc:
            parser.error(f"--policies: {exc}")
    if AWARE not in policies:
        parser.error(f"--policies must include {AWARE} (the findings compare against it)")
    policies.remove(AWARE)
    policies.insert(0, AWARE)
    progress = not args.no_progress and sys.stderr.isatty()
    sweep = run_sweep(grid, fleet, policies, args.jobs, progress, ablation)
    print_summary(sweep)
    if not args.no_write:
        given = list(argv) if argv is not None else sys.argv[1:]
        shown = [a for a in given if a not in ("--no-progress",)]
        command = shlex.join([".venv/bin/python", "-m", "bench.forty_tunes", *shown])
        png_rel = os.path.relpath(args.png.resolve(), args.out.resolve().parent)
        write_page(args.out, render_page(sweep, command, png_rel))
        write_png(sweep, args.png)
        print(f"wrote {args.out} and {args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
