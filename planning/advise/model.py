"""What ``advise`` reads (``PoolSnapshot``: engine flags + measurements) and answers (``Advice``).

Every flag value carries where it came from, because a recommendation is only as good as the
value it is compared with: a ``--max-model-len`` the engine reported is a fact, one assumed from
vLLM's defaults is a guess, and the output says which.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

#: Where a value came from. ``measured``: from traffic or gauges; ``engine-reported``: the
#: engine's own metrics or model card; ``given``: a flags file, the snapshot or the command line;
#: ``assumed default``: vLLM's default, nothing said otherwise.
Source = Literal["measured", "engine-reported", "given", "assumed default"]
SOURCES: tuple[str, ...] = get_args(Source)


class AdviceError(ValueError):
    """An input (snapshot, flags file, option) that is missing, mistyped or out of range."""


#: vLLM's defaults (V1 engine), used when nothing reports a flag. ``max_model_len`` has no
#: default here: vLLM takes the model's own limit, which only the model card knows. The batch
#: limits depend on the GPU: see ``batch_defaults``.
VLLM_DEFAULTS: dict[str, Any] = {
    "gpu_memory_utilization": 0.9,
    "kv_cache_dtype": "auto",
    "quantization": None,
    "enable_prefix_caching": True,
    "enable_chunked_prefill": True,
    "tensor_parallel_size": 1,
    "enable_lora": False,
    "max_loras": 1,
    "max_cpu_loras": None,
    "block_size": 16,
}

#: vLLM's batch defaults for the OpenAI API server (``vllm serve``), by GPU. From
#: ``EngineArgs.get_batch_defaults`` in vllm/engine/arg_utils.py (V1): a device with at least
#: 70 GiB whose name does not contain "a100" gets ``max_num_batched_tokens`` 8192 and
#: ``max_num_seqs`` 1024 ("For GPUs like H100 and MI300x, use larger default values"; A100 is
#: excluded because the large token budget lowered its throughput, vLLM PR #17885); every other
#: GPU gets 2048 and 256. (The offline ``LLM`` class uses 16384/1024 and 8192/256.)
LARGE_GPU_BATCH_DEFAULTS = {"max_num_seqs": 1024, "max_num_batched_tokens": 8192}
OTHER_GPU_BATCH_DEFAULTS = {"max_num_seqs": 256, "max_num_batched_tokens": 2048}
#: vLLM's threshold, in GiB; a profile's ``memory_gb`` is the marketed size (80 for an H100,
#: about 79.6 GiB as the driver reports it), so the comparison holds either way.
LARGE_GPU_GIB = 70


def batch_defaults(hardware_name: str | None, memory_gb: float | None) -> dict[str, int]:
    """vLLM's default ``max_num_seqs`` / ``max_num_batched_tokens`` on this GPU.

    An unknown GPU gets the smaller pair; ``advise`` then treats a running level above the
    assumed cap as proof that the engine runs with another one.
    """
    if memory_gb is None or hardware_name is None:
        return dict(OTHER_GPU_BATCH_DEFAULTS)
    if memory_gb >= LARGE_GPU_GIB and "a100" not in hardware_name.lower():
        return dict(LARGE_GPU_BATCH_DEFAULTS)
    return dict(OTHER_GPU_BATCH_DEFAULTS)


def default_batched_tokens(
    gpu_default: int,
    max_model_len: int | None,
    chunked_prefill: bool | None,
    max_num_seqs: int | None,
) -> int:
    """vLLM's ``max_num_batched_tokens`` when the flag is not given, from the GPU's default.

    As ``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args`` (vllm/engine/arg_utils.py)
    does: with chunked prefill off a whole prompt must fit one step, so the default is raised to
    ``max(default, max_model_len)``; then it is capped at ``max_num_seqs × max_model_len``.
    """
    value = gpu_default
    if max_model_len is not None:
        if chunked_prefill is False:
            value = max(value, max_model_len)
        if max_num_seqs is not None:
            value = min(value, max_num_seqs * max_model_len)
    return value


@dataclass(frozen=True)
class EngineFlags:
    """One pool's engine flags (vLLM's names with ``_``), each with its source in ``sources``.

    ``None`` is unknown. ``num_gpu_blocks`` is not a flag but what the flags bought; vLLM reports
    it in ``vllm:cache_config_info``. ``enable_lora`` false means ``--max-loras`` does not apply.
    """

    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_dtype: str | None = None
    quantization: str | None = None
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    tensor_parallel_size: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_lora: bool | None = None
    max_loras: int | None = None
    max_cpu_loras: int | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in (
            "max_model_len",
            "tensor_parallel_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "num_gpu_blocks",
        ):
            _check_int(name, getattr(self, name), low=1)
        for name in ("max_loras", "max_cpu_loras"):
            _check_int(name, getattr(self, name), low=0)
        _check_number("gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0)
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "enable_lora"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise AdviceError(f"{name}: must be true or false (got {value!r})")
        for name, source in self.sources.items():
            if source not in SOURCES:
                raise AdviceError(f"sources.{name}: must be one of {', '.join(SOURCES)}")

    def source(self, name: str) -> str:
        """Where ``name``'s value came from (``assumed default`` when nothing said)."""
        return self.sources.get(name, "assumed default")

    def with_defaults(
        self, hardware_name: str | None = None, memory_gb: float | None = None
    ) -> EngineFlags:
        """Unknown flags filled with vLLM's defaults, marked ``assumed default``.

        The batch limits' defaults depend on the GPU (``batch_defaults``); without one named,
        the smaller pair is assumed. An assumed ``max_num_batched_tokens`` follows vLLM's rule
        (``default_batched_tokens``): at least ``max_model_len`` with chunked prefill off.
        """
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "sources"}
        sources = dict(self.sources)
        defaults = VLLM_DEFAULTS | batch_defaults(hardware_name, memory_gb)
        for name, default in defaults.items():
            if values[name] is None and default is not None:
                values[name] = default
                sources[name] = "assumed default"
        if self.max_num_batched_tokens is None:
            values["max_num_batched_tokens"] = default_batched_tokens(
                values["max_num_batched_tokens"],
                values["max_model_len"],
                values["enable_chunked_prefill"],
                values["max_num_seqs"],
            )
        if values["max_cpu_loras"] is None and values["max_loras"] is not None:
            values["max_cpu_loras"] = values["max_loras"]  # vLLM: defaults to max_loras
            sources["max_cpu_loras"] = "assumed default"
        return EngineFlags(**values, sources=sources)

    def overlay(self, other: EngineFlags) -> EngineFlags:
        """These flags with ``other``'s known values (and sources) on top."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "sources"}
        sources = dict(self.sources)
        for name in values:
            value = getattr(other, name)
            if value is not None:
                values[name] = value
                sources[name] = other.source(name)
        return EngineFlags(**values, sources=sources)

    @classmethod
    def from_mapping(cls, data: Any, source: str, where: str) -> EngineFlags:
        """From a YAML/JSON mapping of flag -> value (``-`` or ``_``, with or without ``--``)."""
        if not isinstance(data, dict):
            raise AdviceError(f"{where}: expected a mapping of flag -> value")
        known = FLAG_FIELDS
        values: dict[str, Any] = {}
        for key, value in data.items():
            name = str(key).lstrip("-").replace("-", "_")
            if name not in known:
                raise AdviceError(
                    f"{where}.{key}: unknown flag; expected some of: {', '.join(sorted(known))}"
                )
            values[name] = value
        if values.get("kv_cache_dtype") is not None:
            values["kv_cache_dtype"] = str(values["kv_cache_dtype"])
        try:
            return cls(**values, sources={name: source for name in values})
        except (AdviceError, TypeError) as exc:
            raise AdviceError(f"{where}.{exc}") from None


FLAG_FIELDS = frozenset(f.name for f in fields(EngineFlags)) - {"sources"}


@dataclass(frozen=True)
class Percentiles:
    """p50/p95/p99 of one timer, in milliseconds (``None`` where unknown)."""

    p50_ms: float | None = None
    p95_ms: float | None = None
    p99_ms: float | None = None
    #: Fields (``"p50_ms"`` ...) that are only upper bounds: the quantile fell in a histogram's
    #: first bucket, whose bound is all the histogram says (vLLM's queue and prefill timers
    #: start with 0-300 ms, where interpolating made up 150 ms on an idle fleet).
    at_most: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "at_most", tuple(self.at_most))  # a list, read from a file
        wrong = set(self.at_most) - {"p50_ms", "p95_ms", "p99_ms"}
        if wrong:
            raise AdviceError(
                f"at_most: unknown field {sorted(wrong)[0]!r} (p50_ms, p95_ms, p99_ms)"
            )


#: The four timers every pool and route is watched on.
TIMERS = ("queue", "prefill", "ttft", "itl")


@dataclass(frozen=True)
class Measurements:
    """What the pool actually served and how its engines behaved. ``None`` is unknown.

    Lengths are tokens per request; ``context_*`` is prompt + output, the figure that
    ``--max-model-len`` bounds. Gauges are over the observation window: ``kv_usage`` is the
    fullest replica's mean, ``waiting_growth_per_min`` the slope of the summed queue.
    """

    requests: int | None = None
    #: Requests per second over the window (the whole pool); ``--verify`` replays at this rate.
    request_rate_per_s: float | None = None
    context_p99: float | None = None
    #: Upper bound of the longest request seen (the top non-empty histogram bucket).
    context_max: float | None = None
    #: Upper bound of the longest prompt + *requested* output budget (``max_tokens`` and its
    #: kin) among requests that state one: vLLM refuses a request when this exceeds
    #: ``--max-model-len``, however little it generates. ``None``: not measured.
    requested_context_max: float | None = None
    prompt_p99: float | None = None
    output_p99: float | None = None
    prompt_mean: float | None = None
    output_mean: float | None = None
    kv_usage: float | None = None
    waiting_mean: float | None = None
    waiting_growth_per_min: float | None = None
    preemptions_per_min: float | None = None
    #: Lowest per-replica ``running`` level at which a preemption was seen.
    running_at_preemption: int | None = None
    running_peak: int | None = None
    #: Distinct adapters requested in the window, and runtime loads/unloads per minute.
    adapter_working_set: int | None = None
    adapter_loads_per_min: float | None = None
    adapter_unloads_per_min: float | None = None
    prefix_hit_rate: float | None = None
    shared_prefix_fraction: float | None = None
    timers: dict[str, Percentiles] = field(default_factory=dict, compare=False)
    #: Seconds the gauges were watched over (0: one scrape).
    window_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("kv_usage", "prefix_hit_rate", "shared_prefix_fraction"):
            _check_number(name, getattr(self, name), 0.0, 1.0)
        for name in (
            "context_p99",
            "context_max",
            "requested_context_max",
            "prompt_p99",
            "output_p99",
            "prompt_mean",
            "output_mean",
            "waiting_mean",
            "preemptions_per_min",
            "adapter_loads_per_min",
            "adapter_unloads_per_min",
            "window_s",
            "request_rate_per_s",
        ):
            _check_number(name, getattr(self, name), 0.0, None)
        _check_number("waiting_growth_per_min", self.waiting_growth_per_min, None, None)
        for name in ("requests", "running_at_preemption", "running_peak", "adapter_working_set"):
            _check_int(name, getattr(self, name), low=0)
        unknown = sorted(set(self.timers) - set(TIMERS))
        if unknown:
            raise AdviceError(f"timers.{unknown[0]}: unknown timer; expected {', '.join(TIMERS)}")


MEASUREMENT_FIELDS = frozenset(f.name for f in fields(Measurements))


@dataclass(frozen=True)
class PoolSnapshot:
    """One pool: its replicas' flags, what they served, and (optionally) the hardware and model.

    ``hardware`` and ``model`` are profile names (``replica/sim/profiles``); without them the
    sizing rules (TP, weight quantization, FP8 capability) say "not checked" instead of guessing.
    """

    pool: str
    flags: EngineFlags
    measured: Measurements
    replicas: int = 1
    hardware: str | None = None
    model: str | None = None
    #: Simulator preset for ``--verify`` (defaults to one built from hardware and model).
    sim_profile: str | None = None


AdviceKind = Literal["change", "no change", "not checked"]


@dataclass(frozen=True)
class Advice:
    """One flag of one pool: its value now, the advised value, and the evidence.

    ``kind`` is ``change`` when ``advised`` differs from ``current``, ``no change`` when the
    evidence supports today's value, ``not checked`` when an input it needs is unknown.
    """

    flag: str
    kind: AdviceKind
    current: Any
    current_source: str
    advised: Any
    evidence: str
    #: What the change buys, in the units the flag moves (blocks, sequences, GB); may be empty.
    effect: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` shape of one advice row."""
        return {
            "flag": self.flag,
            "advice": self.kind,
            "current": self.current,
            "current_source": self.current_source,
            "advised": self.advised,
            "evidence": self.evidence,
            "effect": self.effect,
        }


def _check_number(name: str, value: Any, low: float | None, high: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise AdviceError(f"{name}: must be a finite number (got {value!r})")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"[{low:g}, {high:g}]" if high is not None else f">= {low:g}"
        raise AdviceError(f"{name}: must be {bounds} (got {value!r})")


def _check_int(name: str, value: Any, low: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise AdviceError(f"{name}: must be an integer >= {low} (got {value!r})")
