"""``advise --verify``: replay the pool's traffic shape through the simulator twice.

Once with today's flags and once with the advised ones, same trace, same seed, same routing
policy (the gateway's default), so the two rows differ only in the flags. The trace is a given
file (``--trace``) or synthesised from what was measured: prompt and output lengths log-normal
with the measured mean and p99 (capped at the longest seen), a shared prefix of the measured
share, the measured arrival rate (Poisson), and the adapter working set spread evenly.

The simulated engine starts from the block count the real one reported (when it did), and the
advised flags scale it by the ratio the simulator's memory model gives (FP8 KV: exactly 2x), so
the comparison is about the change, not about how well the roofline guesses today's memory.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from planning.advise.model import Advice, AdviceError, EngineFlags, PoolSnapshot
from planning.advise.sizing import (
    UNKNOWN_DTYPE,
    flags_with_defaults,
    kv_dtype_of,
    weight_dtype_of,
)
from planning.simulator import SimulationConfig, prepare_requests, simulate
from planning.simulator.summary import PolicySummary, default_policy
from replica.sim.engine import EngineConfig
from traces.format import TraceRecord

#: z of the 99th percentile of a standard normal.
_Z99 = 2.3263
TRACE_BLOCK = 512


@dataclass(frozen=True)
class VerifyRow:
    """One simulated run: which flags, and the four figures the advice should move."""

    flags: str
    requests: int
    goodput: float | None
    ttft_p95_ms: float | None
    preemptions: int | None
    cost_per_1m_usd: float | None

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` shape."""
        return {
            "flags": self.flags,
            "requests": self.requests,
            "goodput": self.goodput,
            "ttft_p95_ms": self.ttft_p95_ms,
            "preemptions": self.preemptions,
            "cost_per_1m_usd": self.cost_per_1m_usd,
        }


def _lognormal(mean: float, p99: float) -> tuple[float, float]:
    """(mu, sigma) of a log-normal with this mean and 99th percentile (sigma 0 if p99 <= mean)."""
    ratio = math.log(max(p99, mean) / mean)
    # ln p99 - ln mean = z sigma - sigma^2 / 2; take the smaller root.
    disc = _Z99**2 - 2 * ratio
    sigma = _Z99 - math.sqrt(disc) if disc > 0 else _Z99
    return math.log(mean) - sigma**2 / 2, sigma


def synthetic_trace(pool: PoolSnapshot, requests: int, seed: int = 0) -> list[TraceRecord]:
    """A trace with the pool's measured length distribution, sharing and rate."""
    m = pool.measured
    if m.prompt_mean is None or m.output_mean is None:
        raise AdviceError(f"pool {pool.pool}: --verify needs mean prompt and output lengths")
    if not m.request_rate_per_s:
        raise AdviceError(f"pool {pool.pool}: --verify needs the request rate (or give --rate)")
    rng = random.Random(seed)
    prompt_mu, prompt_sigma = _lognormal(m.prompt_mean, m.prompt_p99 or m.prompt_mean)
    output_mu, output_sigma = _lognormal(m.output_mean, m.output_p99 or m.output_mean)
    limit = int(m.context_max or m.context_p99 or 1e9)
    shared = m.shared_prefix_fraction or m.prefix_hit_rate or 0.0
    shared_blocks = int(m.prompt_mean * shared // TRACE_BLOCK)
    working = m.adapter_working_set if pool.flags.enable_lora and m.adapter_working_set else 0
    records, now_ms, next_id = [], 0.0, 1_000_000
    for i in range(requests):
        now_ms += rng.expovariate(m.request_rate_per_s) * 1000
        output = max(1, round(rng.lognormvariate(output_mu, output_sigma)))
        prompt = max(1, round(rng.lognormvariate(prompt_mu, prompt_sigma)))
        prompt = max(1, min(prompt, limit - output))
        blocks = math.ceil(prompt / TRACE_BLOCK)
        ids = list(range(min(shared_blocks, blocks)))
        ids += list(range(next_id, next_id + blocks - len(ids)))
        next_id += blocks
        adapter = f"ft-{i % working}" if working else None
        records.append(TraceRecord(int(now_ms), prompt, output, tuple(ids), adapter))
    return records


def engine_overrides(flags: EngineFlags) -> dict[str, Any]:
    """``EngineConfig`` fields for these vLLM flags (unknown flags keep the preset's)."""
    mapping = {
        "max_model_len": flags.max_model_len,
        "gpu_memory_utilization": flags.gpu_memory_utilization,
        "enable_prefix_caching": flags.enable_prefix_caching,
        "enable_chunked_prefill": flags.enable_chunked_prefill,
        "tensor_parallel_size": flags.tensor_parallel_size,
        "max_num_seqs": flags.max_num_seqs,
        "max_num_batched_tokens": flags.max_num_batched_tokens,
        "block_size": flags.block_size,
        "kv_dtype": kv_dtype_of(flags.kv_cache_dtype),
        "weight_dtype": weight_dtype_of(flags.quantization),
    }
    if mapping["weight_dtype"] == UNKNOWN_DTYPE:
        mapping["weight_dtype"] = None  # the preset's: the method's width is not known
    if flags.enable_lora:
        mapping["max_loras"] = flags.max_loras
        mapping["max_cpu_loras"] = max(flags.max_cpu_loras or 0, flags.max_loras or 0)
    return {k: v for k, v in mapping.items() if v is not None}


def advised_flags(flags: EngineFlags, advice: Sequence[Advice]) -> EngineFlags:
    """``flags`` with every ``change`` row applied."""
    values = {}
    for row in advice:
        if row.kind == "change":
            values[row.flag.lstrip("-").replace("-", "_")] = row.advised
    return replace(flags, **values)


def _preset(pool: PoolSnapshot) -> tuple[str, dict[str, Any]]:
    if pool.sim_profile:
        return pool.sim_profile, {}
    if pool.hardware and pool.model:
        return "h100-llama3-8b", {"hardware": pool.hardware, "model": pool.model}
    raise AdviceError(
        f"pool {pool.pool}: --verify needs a simulator profile (--sim-profile) or "
        "--hardware and --model"
    )


def _engine(pool: PoolSnapshot, name: str, preset: str, overrides: dict) -> EngineConfig:
    """The simulated engine for these flags; a combination it refuses is bad input."""
    try:
        return EngineConfig.from_profile(preset, **overrides)
    except (ValueError, KeyError) as exc:
        raise AdviceError(f"pool {pool.pool}: {name} flags: {exc}") from exc


def _configs(pool: PoolSnapshot, advice: Sequence[Advice]) -> tuple[dict, dict, str]:
    preset, base = _preset(pool)
    today = flags_with_defaults(pool)
    # The advised flags on top of what was given, then vLLM's defaults: an assumed default
    # that depends on a changed flag (max_num_batched_tokens on max_model_len) moves with it.
    advised = flags_with_defaults(replace(pool, flags=advised_flags(pool.flags, advice)))
    now = {**base, **engine_overrides(today)}
    new = {**base, **engine_overrides(advised)}
    reported = today.num_gpu_blocks
    if reported:
        # Start where the real engine is; move by the simulator's ratio for the change.
        # (From memory, not from a preset's pinned block count, which would make it 1.)
        free = {"num_gpu_blocks_override": None}
        ratio = (
            _engine(pool, "advised", preset, {**new, **free}).num_gpu_blocks
            / _engine(pool, "today", preset, {**now, **free}).num_gpu_blocks
        )
        now["num_gpu_blocks_override"] = reported
        new["num_gpu_blocks_override"] = max(1, int(reported * ratio))
    return now, new, preset


def verify(
    pool: PoolSnapshot,
    advice: Sequence[Advice],
    records: Sequence[TraceRecord],
    *,
    slo_ttft_ms: float = 2000.0,
    slo_tpot_ms: float = 50.0,
    seed: int = 0,
) -> list[VerifyRow]:
    """Rows ``today`` and ``advised`` for one pool."""
    now, new, preset = _configs(pool, advice)
    policy = default_policy()
    rows = []
    for name, overrides in (("today", now), ("advised", new)):
        try:
            config = SimulationConfig(
                replicas=pool.replicas,
                profile=preset,
                engine_overrides=overrides,
                slo_ttft_ms=slo_ttft_ms,
                slo_tpot_ms=slo_tpot_ms,
                seed=seed,
                trace_block_size=TRACE_BLOCK,
            )
            report = simulate(prepare_requests(records, seed=seed), [policy], config)
        except ValueError as exc:
            raise AdviceError(f"pool {pool.pool}: {name} flags: {exc}") from exc
        rows.append(_row(name, report.summaries[0]))
    return rows


def _row(name: str, summary: PolicySummary) -> VerifyRow:
    return VerifyRow(
        flags=name,
        requests=summary.requests or 0,
        goodput=summary.goodput,
        ttft_p95_ms=summary.ttft_p95_ms,
        preemptions=summary.preemptions,
        cost_per_1m_usd=summary.cost_per_1m_usd,
    )


def format_rows(rows: Sequence[VerifyRow]) -> str:
    """The two rows as a small table."""
    lines = [
        f"  {'flags':<10}{'requests':>9}{'goodput':>9}{'TTFT p95':>10}{'preempt':>9}"
        f"{'$/1M out':>10}"
    ]
    for r in rows:
        goodput = "-" if r.goodput is None else f"{r.goodput:.1%}"
        ttft = "-" if r.ttft_p95_ms is None else f"{r.ttft_p95_ms:,.0f}"
        cost = "-" if r.cost_per_1m_usd is None else f"{r.cost_per_1m_usd:.3f}"
        lines.append(
            f"  {r.flags:<10}{r.requests:>9,}{goodput:>9}{ttft:>10}"
            f"{r.preemptions if r.preemptions is not None else '-':>9}{cost:>10}"
        )
    return "\n".join(lines)
