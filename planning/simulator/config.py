"""Settings of one simulation and the trace requests it replays."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from planning.simulator.adapters import AdapterMix
from planning.simulator.flow import ClassMix
from routing.flow_control import FlowControlSettings
from traces.format import DEFAULT_BLOCK_SIZE, TraceRecord

__all__ = ["SimulationConfig", "TraceRequest", "parse_profile_mix", "prepare_requests"]


@dataclass(frozen=True)
class SimulationConfig:
    """Everything that shapes a simulated fleet and how it is judged; validated on construction."""

    replicas: int = 8
    #: Engine preset (``replica/sim/profiles/presets.yaml``), e.g. ``h100-llama3-8b``, or a
    #: mixed fleet ``NAME:COUNT,NAME:COUNT`` (``h100-llama3-8b:4,a100-llama3-8b:4``), whose
    #: counts add up to ``replicas``; each profile's replicas form a pool of their own.
    profile: str = "h100-llama3-8b"
    #: ``EngineConfig`` fields to override on every replica (e.g. ``num_gpu_blocks_override``).
    engine_overrides: Mapping[str, Any] = field(default_factory=dict)
    #: Prompt tokens per trace hash id.
    trace_block_size: int = DEFAULT_BLOCK_SIZE
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 50.0
    seed: int = 0
    #: Seconds between engine-stats polls (0: routing always sees fresh engine figures).
    stats_interval_s: float = 0.0
    #: Lifetime of the speculative index entries written after each routing decision.
    speculative_ttl_s: float = 30.0
    #: Model name the replicas serve and requests ask for.
    model: str = "sim-model"
    #: Block-index bound, in distinct trace blocks.
    index_max_entries: int = 1_000_000
    #: Request classes by conversation (``--classes``); None: every request is standard.
    classes: ClassMix | None = None
    #: Flow control at the simulated gateway (``--flow-control on``); None: off.
    flow_control: FlowControlSettings | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas: must be >= 1 (got {self.replicas})")
        mix = self.profile_mix()
        if sum(count for _, count in mix) != self.replicas:
            raise ValueError(
                f"profile {self.profile!r}: its counts add up to "
                f"{sum(count for _, count in mix)}, not replicas ({self.replicas})"
            )
        if self.trace_block_size < 1:
            raise ValueError(f"trace_block_size: must be >= 1 (got {self.trace_block_size})")
        for name in ("slo_ttft_ms", "slo_tpot_ms", "speculative_ttl_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name}: must be a positive number (got {value!r})")
        if not (self.stats_interval_s >= 0 and math.isfinite(self.stats_interval_s)):
            raise ValueError(f"stats_interval_s: must be >= 0 (got {self.stats_interval_s!r})")


    def profile_mix(self) -> list[tuple[str, int]]:
        """(profile, replicas) in fleet order: one entry, or a mixed fleet's."""
        return parse_profile_mix(self.profile, self.replicas)

    def replica_profiles(self) -> list[str]:
        """Each replica's profile, in fleet order."""
        return [name for name, count in self.profile_mix() for _ in range(count)]


def parse_profile_mix(spec: str, replicas: int) -> list[tuple[str, int]]:
    """``NAME`` (``replicas`` of it) or ``NAME:COUNT,NAME:COUNT``; ``ValueError`` says what is
    wrong with it."""
    if "," not in spec and not _has_count(spec):
        return [(spec, replicas)]
    mix = []
    for item in spec.split(","):
        name, sep, count = item.strip().rpartition(":")
        if not sep or not name or not count.isdigit() or int(count) < 1:
            raise ValueError(
                f"profile {spec!r}: a mixed fleet is NAME:COUNT,NAME:COUNT, e.g. "
                f"h100-llama3-8b:4,a100-llama3-8b:4 (bad item {item!r})"
            )
        mix.append((name, int(count)))
    return mix


def _has_count(spec: str) -> bool:
    _, sep, count = spec.rpartition(":")
    return bool(sep) and count.isdigit()


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request to replay: its trace record (adapter resolved) and arrival in seconds."""

    index: int
    arrival_s: float
    record: TraceRecord

    @property
    def adapter(self) -> str | None:
        """The LoRA adapter the request targets (None: the base model)."""
        return self.record.adapter


def prepare_requests(
    records: Sequence[TraceRecord],
    *,
    rate_scale: float = 1.0,
    limit: int | None = None,
    adapters: AdapterMix | None = None,
    seed: int = 0,
) -> list[TraceRequest]:
    """Trace records as requests: the first ``limit``, arrivals divided by ``rate_scale``.

    ``rate_scale`` 2 replays the trace twice as fast (twice the request rate). Records without an
    ``adapter`` get one from ``adapters`` when it is given.
    """
    if not (rate_scale > 0 and math.isfinite(rate_scale)):
        raise ValueError(f"rate_scale: must be a positive number (got {rate_scale!r})")
    if limit is not None and limit < 1:
        raise ValueError(f"limit: must be >= 1 (got {limit})")
    chosen = records[:limit] if limit is not None else records
    requests = []
    for index, record in enumerate(chosen):
        if adapters is not None and record.adapter is None and record.hash_ids:
            adapter = adapters.assign(record.hash_ids[0], seed)
            if adapter is not None:
                record = TraceRecord(
                    record.timestamp,
                    record.input_length,
                    record.output_length,
                    record.hash_ids,
                    adapter,
                )
        requests.append(TraceRequest(index, record.timestamp / 1000.0 / rate_scale, record))
    return requests
