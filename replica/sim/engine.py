"""The engine model: one vLLM replica's scheduler, KV cache and LoRA slots, in modelled time.

Pure, deterministic and I/O-free: nothing here reads a clock or a file. Two drivers run it:
the simulated HTTP replica calls ``step(now)`` in real time and sleeps ``duration_s``; the fleet
simulator calls it in virtual time. One model, two drivers.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field, fields, replace
from itertools import islice
from typing import Any, Literal

import xxhash

from replica.sim.kv_cache import KVCache, KVEventRecord, chain_seed, extend_chain, token_bytes
from replica.sim.lora import LoraSlots
from replica.sim.profiles import (
    HardwareProfile,
    ModelProfile,
    load_hardware,
    load_model,
    load_preset,
)
from replica.sim.roofline import Roofline
from replica.sim.step_time import StepTimeModel

__all__ = [
    "EngineConfig",
    "EngineModel",
    "EngineStats",
    "KVEventRecord",
    "SimRequest",
    "StepResult",
]

# --------------------------------------------------------------------------- requests and results


@dataclass
class SimRequest:
    """One generation request as the engine sees it."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    #: LoRA adapter name, or None for the base model.
    adapter: str | None = None
    #: Per-tenant salt: folded into the block-hash seed, so tenants never share cached blocks.
    cache_salt: str | None = None
    arrival_s: float = 0.0
    #: The sim never samples EOS: every request emits exactly ``max_tokens`` tokens.
    ignore_eos: bool = True
    #: vLLM's request ``priority`` (lower first); non-zero only under priority scheduling.
    priority: int = 0


@dataclass
class StepResult:
    """The outcome of one engine step."""

    #: Modelled wall time of this step, seconds.
    duration_s: float
    #: request_id -> tokens emitted this step (0 or 1; the first token comes at prefill end).
    tokens: dict[str, int]
    #: Requests that emitted their first token this step.
    first_token: set[str]
    finished: list[str]
    kv_events: list[KVEventRecord]
    #: Requests preempted this step (recompute: back to the front of the waiting queue).
    preempted: list[str]


@dataclass
class EngineStats:
    """A snapshot of the engine's gauges and counters, named after vLLM's metrics."""

    running: int
    waiting: int
    #: Fraction of KV blocks not free (``vllm:kv_cache_usage_perc``).
    kv_usage: float
    num_blocks: int
    #: Blocks in the prefix cache (what BlockStored minus BlockRemoved events add up to).
    cached_blocks: int
    block_size: int
    #: Counters in tokens (``vllm:prefix_cache_queries_total`` / ``..._hits_total``).
    prefix_queries_tokens: int
    prefix_hits_tokens: int
    preemptions: int
    #: Adapters in GPU LoRA slots, in the host-memory cache, and wanted by waiting requests.
    loaded_adapters: list[str]
    cpu_adapters: list[str]
    waiting_adapters: list[str]
    max_loras: int
    #: Adapters of running requests (``running_lora_adapters`` of ``vllm:lora_requests_info``).
    running_adapters: list[str] = field(default_factory=list)
    #: ``vllm:inter_token_latency_seconds`` ``_sum`` and ``_count``: every output token after a
    #: request's first, timed as the step that produced it.
    itl_sum_s: float = 0.0
    itl_count: int = 0


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes one simulated replica; validated on construction."""

    hardware: HardwareProfile
    model: ModelProfile
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    #: Fraction of peak HBM bandwidth decode achieves, and model-FLOPs utilisation of prefill.
    efficiency: float = 0.7
    mfu: float = 0.4
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    #: Token budget of one step (prefill chunks + one token per decode).
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    block_size: int = 16
    enable_prefix_caching: bool = True
    #: Pin the number of KV blocks instead of deriving it from memory (vLLM's
    #: ``--num-gpu-blocks-override``); small values make KV pressure easy to test.
    num_gpu_blocks_override: int | None = None
    #: Longest prompt + output accepted; None means the model profile's.
    max_model_len: int | None = None
    #: GPU LoRA slots (``--max-loras``) and host-memory adapter cache (``--max-cpu-loras``).
    max_loras: int = 4
    max_cpu_loras: int = 8
    #: Host->device GB/s for adapter loads from host memory; None means the hardware's.
    lora_h2d_gbps: float | None = None
    #: GB/s for adapter loads from storage (adapter not in the host cache).
    lora_storage_gbps: float = 2.0
    #: Size of an adapter loaded without an explicit size; None means the model profile's.
    adapter_default_size_mb: float | None = None
    #: USD per hour for the whole replica; None means hardware price × tensor_parallel_size.
    price_per_hour: float | None = None
    #: Fixed CPU-side cost of every step (scheduling, sampling, detokenising), seconds.
    step_overhead_s: float = 0.0
    #: A measured step-time model (``fleetgate sim calibrate``); when set it replaces the
    #: roofline's step time. Profiles give it as a ``step_time`` mapping.
    step_time: StepTimeModel | None = None
    #: vLLM's ``--scheduling-policy``: ``fcfs`` (arrival order; preempt the newest running
    #: request) or ``priority`` (by each request's ``priority``, lower first, then arrival;
    #: preempt the lowest-priority, newest running request).
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"

    def __post_init__(self) -> None:
        if not isinstance(self.hardware, HardwareProfile) or not isinstance(
            self.model, ModelProfile
        ):
            raise TypeError(
                "hardware and model must be profile objects; to use profile names, build the "
                "config with EngineConfig.from_profile(preset, hardware=NAME, model=NAME)"
            )
        # Building the roofline validates dtypes, efficiency, MFU and TP size.
        roofline = self.roofline()
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "max_cpu_loras",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1 (got {value!r})")
        if self.max_loras < 0:
            raise ValueError(f"max_loras: must be >= 0 (got {self.max_loras})")
        if self.max_loras > self.max_cpu_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization: must be in (0, 1] (got {self.gpu_memory_utilization})"
            )
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy: must be 'fcfs' or 'priority' (got {self.scheduling_policy!r})"
            )
        for name in ("lora_h2d_gbps", "adapter_default_size_mb", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name}: must be > 0 (got {value})")
        if self.lora_storage_gbps <= 0:
            raise ValueError(f"lora_storage_gbps: must be > 0 (got {self.lora_storage_gbps})")
        if self.price_per_hour is not None and self.price_per_hour < 0:
            raise ValueError(f"price_per_hour: must be >= 0 (got {self.price_per_hour})")
        if self.step_overhead_s < 0:
            raise ValueError(f"step_overhead_s: must be >= 0 (got {self.step_overhead_s})")
        if self.num_gpu_blocks_override is not None:
            if self.num_gpu_blocks_override < 1:
                raise ValueError(
                    f"num_gpu_blocks_override: must be >= 1 (got {self.num_gpu_blocks_override})"
                )
        elif roofline.kv_capacity_bytes(self.gpu_memory_utilization) < self.block_bytes:
            raise ValueError(
                f"no room for the KV cache: weights ({roofline.weight_bytes / 1e9:.1f} GB at "
                f"weight_dtype={self.weight_dtype}) exceed gpu_memory_utilization="
                f"{self.gpu_memory_utilization} × {roofline.hbm_bytes / 1e9:.0f} GB HBM"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.model_len}) when enable_chunked_prefill is off"
            )

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_profile(cls, name: str = "h100-llama3-8b", **overrides: Any) -> EngineConfig:
        """Build a config from a named preset in ``profiles/presets.yaml``, then ``overrides``.

        ``hardware`` and ``model`` may be given as profile names or profile objects.
        """
        settings = load_preset(name)
        settings.update(overrides)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ValueError(f"EngineConfig: unknown setting {unknown[0]!r}")
        if isinstance(settings["hardware"], str):
            settings["hardware"] = load_hardware(settings["hardware"])
        if isinstance(settings["model"], str):
            settings["model"] = load_model(settings["model"])
        if settings.get("step_time") is not None:
            settings["step_time"] = StepTimeModel.from_mapping(settings["step_time"])
        return cls(**settings)

    def with_overrides(self, **overrides: Any) -> EngineConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **overrides)

    # ------------------------------------------------------------------ derived figures

    def roofline(self) -> Roofline:
        """The step-timing model for this configuration."""
        return Roofline(
            hardware=self.hardware,
            model=self.model,
            weight_dtype=self.weight_dtype,
            kv_dtype=self.kv_dtype,
            efficiency=self.efficiency,
            mfu=self.mfu,
            tensor_parallel_size=self.tensor_parallel_size,
        )

    @property
    def block_bytes(self) -> float:
        """KV bytes of one block."""
        return self.roofline().kv_bytes_per_token * self.block_size

    @property
    def num_gpu_blocks(self) -> int:
        """KV blocks: the override, else ``(HBM × utilisation − weights) / bytes per block``."""
        if self.num_gpu_blocks_override is not None:
            return self.num_gpu_blocks_override
        capacity = self.roofline().kv_capacity_bytes(self.gpu_memory_utilization)
        return int(capacity // self.block_bytes)

    @property
    def model_len(self) -> int:
        """Longest prompt + output accepted."""
        return self.max_model_len if self.max_model_len is not None else self.model.max_model_len

    @property
    def configured_prefill_tokens_per_s(self) -> float:
        """The prefill speed an operator would configure for this engine: the roofline's for a
        full prefill chunk (routing calibrates from there)."""
        budget = self.max_num_batched_tokens
        return budget / self.roofline().prefill_s(budget)

    @property
    def configured_decode_step_ms(self) -> float:
        """The decode step an operator would configure: the roofline's, empty context."""
        return self.roofline().decode_s(0) * 1000.0

    @property
    def replica_price_per_hour(self) -> float:
        """USD per hour of this replica."""
        if self.price_per_hour is not None:
            return self.price_per_hour
        return self.hardware.price_per_hour * self.tensor_parallel_size

    @property
    def h2d_gbps(self) -> float:
        """Host->device bandwidth for adapter loads."""
        return self.lora_h2d_gbps if self.lora_h2d_gbps is not None else self.hardware.h2d_gbps

    @property
    def default_adapter_mb(self) -> float:
        """Size of an adapter loaded without an explicit size."""
        if self.adapter_default_size_mb is not None:
            return self.adapter_default_size_mb
        return self.model.lora_adapter_mb


# --------------------------------------------------------------------------- the engine


class UnknownAdapterError(ValueError):
    """A request names an adapter this engine does not know (vLLM answers 404)."""


class _Request:
    """The engine's bookkeeping for one request."""

    __slots__ = (
        "adapter",
        "block_hashes",
        "cached_tokens",
        "hashed_full_blocks",
        "lora_seed",
        "max_tokens",
        "num_computed",
        "num_output",
        "out_base",
        "prompt",
        "prompt_bytes",
        "prompt_len",
        "queue_key",
        "request_id",
        "sim",
    )

    def __init__(self, sim: SimRequest, prompt_bytes: bytes, out_base: int) -> None:
        self.sim = sim
        self.request_id = sim.request_id
        self.prompt = sim.prompt_token_ids
        self.prompt_len = len(sim.prompt_token_ids)
        self.prompt_bytes = prompt_bytes
        self.max_tokens = sim.max_tokens
        self.adapter = sim.adapter
        self.lora_seed = chain_seed(sim.adapter, sim.cache_salt)
        #: Order under priority scheduling: priority, then arrival (then submission order).
        self.queue_key = (sim.priority, sim.arrival_s)
        self.out_base = out_base
        self.num_output = 0
        #: Tokens whose KV is in the cache (computed or served by prefix hits).
        self.num_computed = 0
        self.block_hashes: list[int] = []
        #: Full blocks already handed to the cache (saves a call per decode step).
        self.hashed_full_blocks = 0
        #: Prompt tokens served from the prefix cache at first scheduling; None until then.
        self.cached_tokens: int | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus the tokens generated so far."""
        return self.prompt_len + self.num_output


class EngineModel:
    """One vLLM replica: continuous batching, a prefix-cached paged KV cache, LoRA slots.

    Each ``step`` follows vLLM's v1 scheduler: running requests first (one token per decode,
    the rest of the budget to unfinished prefills), preempting the newest running request by
    recompute when KV blocks run out; then waiting requests in FCFS order while the token budget,
    ``max_num_seqs`` and free blocks allow, skipping (not blocking on) requests whose adapter
    cannot get a GPU slot. Under ``scheduling_policy: priority`` the waiting queue is ordered by
    (priority, arrival) and the victim of a preemption is the running request with the largest
    (priority, arrival), as vLLM's priority policy does. The step's duration comes from the
    roofline plus any adapter loads it had to wait for.
    """

    #: How many finished requests keep their ``cached_tokens`` answer.
    FINISHED_MEMORY = 100_000

    def __init__(self, config: EngineConfig, seed: int = 0) -> None:
        self.config = config
        self.seed = seed
        self._roofline = config.roofline()
        self._block_size = config.block_size
        self._num_blocks = config.num_gpu_blocks
        self._model_len = config.model_len
        self._kv = KVCache(self._num_blocks, config.block_size, config.enable_prefix_caching)
        self._lora = LoraSlots(
            max_loras=config.max_loras,
            max_cpu_loras=config.max_cpu_loras,
            h2d_gbps=config.h2d_gbps,
            storage_gbps=config.lora_storage_gbps,
            default_size_mb=config.default_adapter_mb,
        )
        self._requests: dict[str, _Request] = {}
        self._by_priority = config.scheduling_policy == "priority"
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        #: adapter -> running requests that use it (these adapters' slots cannot be evicted).
        self._adapter_running: dict[str, int] = {}
        self._finished_cached: OrderedDict[str, int] = OrderedDict()
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._preemptions = 0
        self._itl_sum_s = 0.0
        self._itl_count = 0
        self.now_s = 0.0

    # ------------------------------------------------------------------ requests

    def submit(self, req: SimRequest) -> None:
        """Queue ``req`` (by arrival, or by priority then arrival). Raises ``ValueError`` if it
        can never run here."""
        self.check(req)
        out_base = xxhash.xxh3_64_intdigest(req.request_id.encode(), self.seed)
        request = _Request(req, token_bytes(req.prompt_token_ids), out_base)
        self._requests[req.request_id] = request
        if self._by_priority:
            self._enqueue_by_priority(request)
        else:
            self._waiting.append(request)

    def _enqueue_by_priority(self, request: _Request) -> None:
        """Insert after every waiting request with a (priority, arrival) not above its own;
        scanning from the back, since newcomers mostly go there."""
        key = request.queue_key
        waiting = self._waiting
        index = len(waiting)
        while index > 0 and waiting[index - 1].queue_key > key:
            index -= 1
        waiting.insert(index, request)

    def length_problem(self, rid: str, prompt_len: int, max_tokens: int) -> str | None:
        """Why a ``prompt_len``-token prompt asking for ``max_tokens`` can never run here
        (vLLM's 400), or None: told without the prompt, so a replay need not build one that
        no engine takes."""
        total = prompt_len + max_tokens
        if total > self._model_len:
            return (
                f"request {rid!r}: this model's maximum context length is {self._model_len} "
                f"tokens; you requested {total} ({prompt_len} in the prompt, "
                f"{max_tokens} in the completion)"
            )
        if -(-total // self._block_size) > self._num_blocks:
            return (
                f"request {rid!r}: {total} tokens need more than the engine's "
                f"{self._num_blocks} KV blocks of {self._block_size} tokens"
            )
        return None

    def check(self, req: SimRequest) -> None:
        """Raise ``ValueError`` (vLLM's 400) if ``req`` can never run here."""
        rid = req.request_id
        if rid in self._requests:
            raise ValueError(f"request {rid!r}: id already in use")
        prompt_len = len(req.prompt_token_ids)
        if prompt_len == 0:
            raise ValueError(f"request {rid!r}: the prompt is empty")
        if isinstance(req.max_tokens, bool) or not isinstance(req.max_tokens, int):
            raise ValueError(f"request {rid!r}: max_tokens must be an integer")
        if req.max_tokens < 1:
            raise ValueError(f"request {rid!r}: max_tokens must be >= 1 (got {req.max_tokens})")
        problem = self.length_problem(rid, prompt_len, req.max_tokens)
        if problem is not None:
            raise ValueError(problem)
        if req.adapter is not None and not self._lora.known(req.adapter):
            raise UnknownAdapterError(f"request {rid!r}: adapter {req.adapter!r} is not loaded")
        if isinstance(req.priority, bool) or not isinstance(req.priority, int):
            raise ValueError(f"request {rid!r}: priority must be an integer")
        if req.priority != 0 and not self._by_priority:
            # vLLM's own refusal: a priority means nothing to a first-come-first-served engine.
            raise ValueError(
                f"Got priority {req.priority} but Priority scheduling is not enabled."
            )

    def abort(self, request_id: str) -> None:
        """Drop a waiting or running request and free its blocks; unknown ids are ignored."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        if request in self._running:
            self._running.remove(request)
            self._release_adapter(request)
        else:
            self._waiting.remove(request)
        self._kv.free(request_id)
        self._forget_if_retired(request.adapter)

    def has_work(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._requests)

    def cached_tokens(self, request_id: str) -> int:
        """Prompt tokens served from the prefix cache (known once the request is scheduled).

        0 before scheduling; finished requests keep their answer for a while. Raises
        ``KeyError`` for an id the engine never saw (or long forgot).
        """
        request = self._requests.get(request_id)
        if request is not None:
            return request.cached_tokens or 0
        return self._finished_cached[request_id]

    # ------------------------------------------------------------------ the step

    def step(self, now_s: float) -> StepResult:
        """Run one engine step starting at ``now_s``: schedule, time it, advance every request."""
        self.now_s = now_s
        if not self._requests:
            return StepResult(0.0, {}, set(), [], self._kv.take_events(), [])
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[_Request, int]] = []
        preempted: list[str] = []
        budget = self._schedule_running(budget, scheduled, preempted)
        load_s = 0.0
        if not preempted:
            load_s = self._schedule_waiting(budget, scheduled)

        duration = self._step_duration(scheduled) + load_s + self.config.step_overhead_s

        tokens: dict[str, int] = {}
        first_token: set[str] = set()
        finished: list[str] = []
        decode_tokens = 0
        for request, count in scheduled:
            request.num_computed += count
            emitted = 0
            if request.num_computed == request.num_tokens:
                # The whole known sequence is in the KV cache: the step samples one token.
                request.num_output += 1
                emitted = 1
                if request.num_output == 1:
                    first_token.add(request.request_id)
                else:
                    decode_tokens += 1
            tokens[request.request_id] = emitted
            if request.num_output >= request.max_tokens:
                finished.append(request.request_id)
                self._finish(request)
        self._itl_sum_s += decode_tokens * duration
        self._itl_count += decode_tokens
        events = self._kv.take_events()
        return StepResult(duration, tokens, first_token, finished, events, preempted)

    def _step_duration(self, scheduled: list[tuple[_Request, int]]) -> float:
        """Modelled time of a step computing ``scheduled``: the measured model or the roofline."""
        step_time = self.config.step_time
        scheduled_tokens = 0
        prefill_tokens = 0
        decode_seqs = 0
        context_tokens = 0
        for request, count in scheduled:
            scheduled_tokens += count
            context_tokens += request.num_computed
            # A decode computes the one token sampled last step; anything else (a prompt chunk,
            # a recompute after preemption) is prefill work.
            if count == 1 and request.num_computed >= request.prompt_len:
                decode_seqs += 1
            else:
                prefill_tokens += count
        if not scheduled:  # defensive: never spin at zero cost if nothing could be scheduled
            return self._roofline.decode_s(0)
        if step_time is not None:
            return step_time.step_s(prefill_tokens, decode_seqs, context_tokens)
        return self._roofline.step_s(scheduled_tokens, context_tokens)

    def _schedule_running(
        self, budget: int, scheduled: list[tuple[_Request, int]], preempted: list[str]
    ) -> int:
        """Give running requests their tokens, preempting from the tail when blocks run out."""
        index = 0
        while index < len(self._running) and budget > 0:
            request = self._running[index]
            count = min(request.num_tokens - request.num_computed, budget)
            while not self._kv.allocate(request.request_id, request.num_computed + count):
                victim_index = self._victim_index()
                victim = self._running.pop(victim_index)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    return budget
                if victim_index < index:
                    # Under priority scheduling the victim may have been given tokens earlier in
                    # this step: take them back, as vLLM does.
                    index -= 1
                    for position, (done, tokens) in enumerate(scheduled):
                        if done is victim:
                            del scheduled[position]
                            budget += tokens
                            break
            scheduled.append((request, count))
            self._cache_blocks(request, request.num_computed + count)
            budget -= count
            index += 1
        return budget

    def _schedule_waiting(self, budget: int, scheduled: list[tuple[_Request, int]]) -> float:
        """Admit waiting requests FCFS; returns the adapter load time the step waits for."""
        config = self.config
        skipped: list[_Request] = []
        load_s = 0.0
        while self._waiting and budget > 0 and len(self._running) < config.max_num_seqs:
            request = self._waiting[0]
            adapter = request.adapter
            if adapter is not None and not self._lora.can_activate(adapter, self._adapter_running):
                # Every slot serves running requests: skip it, as vLLM does, and try the next.
                skipped.append(self._waiting.popleft())
                continue
            hit_blocks = self._prefix_lookup(request)
            cached = len(hit_blocks) * self._block_size
            count = request.num_tokens - cached
            if count > budget:
                if not config.enable_chunked_prefill:
                    break
                count = budget
            if not self._kv.allocate(request.request_id, cached + count, hit_blocks):
                break
            self._waiting.popleft()
            if adapter is not None:
                load_s += self._lora.activate(adapter, self._adapter_running)
                self._adapter_running[adapter] = self._adapter_running.get(adapter, 0) + 1
            if request.cached_tokens is None:
                request.cached_tokens = cached
                if config.enable_prefix_caching:
                    self._prefix_queries += request.prompt_len
                    self._prefix_hits += cached
            request.num_computed = cached
            self._running.append(request)
            scheduled.append((request, count))
            self._cache_blocks(request, cached + count)
            budget -= count
        self._waiting.extendleft(reversed(skipped))
        return load_s

    def _prefix_lookup(self, request: _Request) -> list[int]:
        """Cached blocks of the request's prefix; the last token is always recomputed."""
        if not self.config.enable_prefix_caching:
            return []
        usable = (request.num_tokens - 1) // self._block_size
        self._extend_hashes(request, usable)
        return self._kv.lookup(islice(request.block_hashes, usable))

    def _cache_blocks(self, request: _Request, tokens: int) -> None:
        """Register the request's newly full blocks in the prefix cache, up to ``tokens``.

        The scheduler calls it with the tokens a step is about to compute, as vLLM does: its
        ``allocate_slots`` commits the blocks of the tokens scheduled this step when it
        allocates them, so a request scheduled after them, in the same step or while a long
        prompt is still being prefilled in chunks, already hits them.
        """
        if not self.config.enable_prefix_caching:
            return
        full = min(tokens, request.num_tokens) // self._block_size
        if full == request.hashed_full_blocks:
            return  # the common decode step: no block filled up
        request.hashed_full_blocks = full
        self._extend_hashes(request, full)
        self._kv.cache_full_blocks(
            request.request_id,
            request.block_hashes,
            full,
            lambda start, stop: self._token_ids(request, start, stop),
            request.adapter,
        )

    def _extend_hashes(self, request: _Request, num_blocks: int) -> None:
        hashes = request.block_hashes
        if len(hashes) >= num_blocks:
            return
        bs = self._block_size
        prompt_blocks = min(num_blocks, request.prompt_len // bs)
        if len(hashes) < prompt_blocks:
            extend_chain(hashes, request.prompt_bytes, bs, prompt_blocks, request.lora_seed)
        if len(hashes) < num_blocks:
            # Blocks that reach into the output: hash only their own tokens, never the prefix.
            first = len(hashes)
            data = token_bytes(self._token_ids(request, first * bs, num_blocks * bs))
            extend_chain(hashes, data, bs, num_blocks, request.lora_seed, first)

    def _token_ids(self, request: _Request, start: int, stop: int) -> list[int]:
        """Tokens ``[start, stop)`` of prompt + output; output tokens are a deterministic
        function of (seed, request id, position), so a recompute reproduces them."""
        prompt_len = request.prompt_len
        tokens = request.prompt[start:stop] if start < prompt_len else []
        if stop > prompt_len:
            vocab = self.config.model.vocab_size
            base = request.out_base
            tokens = list(tokens)
            tokens.extend(
                (base + i * 7919) % vocab
                for i in range(max(start, prompt_len) - prompt_len, stop - prompt_len)
            )
        return list(tokens)

    def _victim_index(self) -> int:
        """The running request to preempt: the newest, or under priority scheduling the one with
        the largest (priority, arrival)."""
        running = self._running
        if not self._by_priority:
            return len(running) - 1
        return max(range(len(running)), key=lambda i: running[i].queue_key)

    def _preempt(self, request: _Request) -> None:
        """Recompute preemption: free the blocks, back to the front of the waiting queue (under
        priority scheduling, to its place by priority and arrival)."""
        self._kv.free(request.request_id)
        self._release_adapter(request)
        request.num_computed = 0
        request.hashed_full_blocks = 0
        if self._by_priority:
            self._enqueue_by_priority(request)
        else:
            self._waiting.appendleft(request)
        self._preemptions += 1

    def _finish(self, request: _Request) -> None:
        self._running.remove(request)
        self._release_adapter(request)
        self._kv.free(request.request_id)
        del self._requests[request.request_id]
        self._finished_cached[request.request_id] = request.cached_tokens or 0
        if len(self._finished_cached) > self.FINISHED_MEMORY:
            self._finished_cached.popitem(last=False)
        self._forget_if_retired(request.adapter)

    def _release_adapter(self, request: _Request) -> None:
        """Count one running request off its adapter's slot."""
        adapter = request.adapter
        if adapter is None:
            return
        remaining = self._adapter_running[adapter] - 1
        if remaining:
            self._adapter_running[adapter] = remaining
        else:
            del self._adapter_running[adapter]
            self._lora.touch(adapter)

    def _forget_if_retired(self, adapter: str | None) -> None:
        """Drop an unloaded adapter once no request uses it any more."""
        if adapter is None or not self._lora.is_retired(adapter):
            return
        if not any(r.adapter == adapter for r in self._requests.values()):
            self._lora.forget(adapter)

    # ------------------------------------------------------------------ observation

    def stats(self) -> EngineStats:
        """Current gauges and counters."""
        waiting_adapters = sorted({r.adapter for r in self._waiting if r.adapter is not None})
        return EngineStats(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_usage=self._kv.usage,
            num_blocks=self._num_blocks,
            cached_blocks=self._kv.num_cached_blocks,
            block_size=self._block_size,
            prefix_queries_tokens=self._prefix_queries,
            prefix_hits_tokens=self._prefix_hits,
            preemptions=self._preemptions,
            loaded_adapters=self._lora.on_gpu(),
            cpu_adapters=self._lora.in_host(),
            waiting_adapters=waiting_adapters,
            max_loras=self.config.max_loras,
            running_adapters=sorted(self._adapter_running),
            itl_sum_s=self._itl_sum_s,
            itl_count=self._itl_count,
        )

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (vLLM's ``/reset_prefix_cache``); False while any is in use.

        The ``AllBlocksCleared`` record comes out with the next step's events.
        """
        return self._kv.reset()

    # ------------------------------------------------------------------ adapters

    def load_adapter(self, name: str, size_mb: float | None = None) -> float:
        """Register ``name`` and load it into host memory and, if a slot can be had, the GPU.

        Returns the modelled load time in seconds (0 when already in a slot). Raises
        ``ValueError`` when LoRA is disabled or the size is invalid, ``RuntimeError`` when every
        host-cache entry is pinned by running requests.
        """
        return self._lora.load(name, size_mb, self._adapter_running)

    def register_adapter(self, name: str, size_mb: float | None = None) -> None:
        """Make ``name`` known without loading it: the first request pays the storage load."""
        self._lora.register(name, size_mb)

    def unload_adapter(self, name: str) -> None:
        """Stop serving ``name``. Raises ``KeyError`` if it is not loaded.

        As in vLLM, requests already queued on it still complete (reloading it if they must);
        it leaves host memory and its slot when the last of them is done.
        """
        if any(r.adapter == name for r in self._requests.values()):
            self._lora.retire(name)
        else:
            self._lora.unregister(name)

    def adapters(self) -> list[str]:
        """Names of known adapters, in load order."""
        return self._lora.catalog()

    def adapter_cold_load_s(self, name: str) -> float:
        """Seconds a request for ``name`` would wait for its adapter before it could run.

        0 when the adapter sits in a GPU slot, the host-to-device copy when it is in the host
        cache, storage read plus copy otherwise: what a router should charge for sending an
        adapter request here (the gateway's adapter registry estimates the same from outside).
        """
        if not self._lora.enabled or name in self._lora.on_gpu():
            return 0.0
        if not self._lora.known(name):
            return 0.0  # unknown here: submit() refuses it, so no load cost applies
        if name in self._lora.in_host():
            return self._lora.h2d_load_s(name)
        return self._lora.storage_load_s(name) + self._lora.h2d_load_s(name)
