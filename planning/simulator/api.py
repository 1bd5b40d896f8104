"""``simulate()``: replay a trace through several policies and the two hit-rate ceilings."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from planning.simulator.ceilings import Ceilings, hit_rate_ceilings
from planning.simulator.config import SimulationConfig, TraceRequest
from planning.simulator.loop import PolicyRun, run_policy
from planning.simulator.prompts import PromptFactory
from planning.simulator.summary import PolicySummary, summarize
from replica.sim.engine import EngineConfig
from routing.engine import Profile

__all__ = ["SimulationReport", "engine_config_for", "simulate"]


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
    """The engine configuration every replica of the simulated fleet runs."""
    return EngineConfig.from_profile(config.profile, **dict(config.engine_overrides))


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
    factories = dict(profile_factories or {})
    if not policies:
        raise ValueError("policies: name at least one routing policy")
    engine_config = engine_config_for(config)
    capacity = config.replicas * engine_config.num_gpu_blocks * engine_config.block_size
    ceilings = hit_rate_ceilings(
        (r.record for r in requests), config.trace_block_size, engine_config.block_size, capacity
    )
    prompts = PromptFactory(
        config.model,
        config.trace_block_size,
        engine_config.block_size,
        engine_config.model.vocab_size,
    )
    report = SimulationReport([], ceilings)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests) * len(policies), unit="req", leave=False)
    try:
        for policy in policies:
            if bar is not None:
                bar.set_description(policy)
            started = time.perf_counter()
            run = asyncio.run(
                run_policy(
                    policy,
                    requests,
                    config,
                    engine_config,
                    prompts,
                    bar.update if bar is not None else None,
                    factories.get(policy),
                )
            )
            report.wall_s[policy] = time.perf_counter() - started
            report.runs[policy] = run
            report.summaries.append(summarize(run, config.slo_ttft_ms, config.slo_tpot_ms))
    finally:
        if bar is not None:
            bar.close()
    return report
