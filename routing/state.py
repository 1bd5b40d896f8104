"""The replica model that routing policies read.

Every figure carries the time it was read, so a policy can see (and discount) stale data instead
of trusting a number that a dead agent stopped updating minutes ago.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from routing.types import Epoch, ReplicaId

#: More requests than any engine holds at once: a request count read past it (an unsigned -1
#: such as 18446744073709551615, a corrupt page) is a scrape glitch, not a figure to route on.
#: Taken in, one such figure overflowed the fleet's 64-bit arrays and failed every request.
MAX_REQUEST_COUNT = 10_000_000

#: Counters over an engine's life (preemptions, engine steps) stay below this: past it a float
#: sample no longer holds an exact integer, which no real engine reaches.
MAX_LIFETIME_COUNT = 2**53


@dataclass
class ReplicaState:
    """What fleetgate knows about one replica (one vLLM engine) at a moment."""

    replica_id: ReplicaId
    url: str
    pool: str = "default"
    #: Base models this engine serves (its ``--served-model-name`` values).
    models: frozenset[str] = frozenset()
    healthy: bool = True
    #: Its agent is stopping it on purpose (``fleetgate replica run`` got SIGTERM): it takes
    #: nothing new (``healthy`` is False) but the requests it holds finish there; a gateway
    #: does not move them elsewhere as it does for a replica reported down.
    draining: bool = False
    epoch: Epoch = Epoch(0)  # noqa: RUF009 - NewType is the identity at run time
    #: Tokens per KV block (vLLM ``--block-size``); the hashing granularity for this replica.
    block_size: int = 16
    #: Number of KV blocks the engine has (``cache_config_info.num_gpu_blocks``); None if unknown.
    kv_capacity_blocks: int | None = None
    #: Fraction of KV blocks in use, 0..1 (``vllm:kv_cache_usage_perc``).
    kv_usage: float = 0.0
    #: Blocks in the engine's prefix cache, by its KV events (stored minus removed), in use or
    #: not: vLLM's usage gauge counts only those running requests hold. None if unknown.
    cached_blocks: int | None = None
    #: Requests the engine is running / holding in its waiting queue (its own view).
    running: int = 0
    waiting: int = 0
    #: Monotonic counter of preemptions reported by the engine.
    preemptions_total: int = 0
    #: Adapters resident in GPU LoRA slots, and those cached in host memory.
    loaded_adapters: frozenset[str] = frozenset()
    cpu_cached_adapters: frozenset[str] = frozenset()
    #: Adapters of the requests the engine is running (``running_lora_adapters`` of vLLM's
    #: ``vllm:lora_requests_info``): each holds one of its ``max_loras`` GPU slots, and a
    #: request for any other adapter waits while all of them are held.
    running_adapters: frozenset[str] = frozenset()
    #: Adapters with requests waiting on the engine for a slot.
    waiting_adapters: frozenset[str] = frozenset()
    max_loras: int | None = None
    max_cpu_loras: int | None = None
    #: The longest prompt plus output the engine takes (vLLM's ``--max-model-len``), from its
    #: ``/v1/models`` cards; None: unknown. Replicas of one model may differ (a pool of
    #: smaller GPUs run with a shorter context): ``serves-model`` keeps a request off those
    #: it cannot fit, where another can take it.
    max_model_len: int | None = None
    #: Requests this gateway (or all gateways, when shared through Redis) has in flight there.
    inflight_requests: int = 0
    #: Prompt tokens of in-flight requests that the engine has not prefilled yet (gateway's view).
    inflight_prefill_tokens: int = 0
    #: In-flight requests whose first token has not arrived yet (gateway's view): the only ones
    #: that can still be waiting on the engine. None: not counted (then every in-flight request
    #: the ``running`` gauge does not show may be waiting).
    inflight_unprefilled: int | None = None
    #: Requests this gateway saw end on the replica since its engine figures were read: the
    #: ``running`` gauge may still count them.
    finished_since_read: int = 0
    #: Prefill throughput estimate in tokens/s; starts from configuration, calibrated online.
    prefill_tokens_per_s: float = 10_000.0
    #: Decode-step time estimate in ms; used to estimate queue wait behind running requests.
    decode_step_ms: float = 30.0
    #: Mean time between output tokens on the engine over the last few seconds (ms), from
    #: ``vllm:inter_token_latency_seconds`` (``routing/recent_itl.py``); None: unknown, or no
    #: tokens decoded lately.
    decode_itl_ms: float | None = None
    #: Custom kernel plugins loaded in the engine: module name -> version.
    kernel_plugins: dict[str, str] = field(default_factory=dict)
    #: Wall-clock time (``time.time()``) at which the engine-reported figures were read.
    metrics_read_at: float = field(default_factory=time.time)

    def staleness_s(self, now: float | None = None) -> float:
        """Seconds since the engine-reported figures were read."""
        return max(0.0, (time.time() if now is None else now) - self.metrics_read_at)

    def shown_staleness_s(self) -> float | None:
        """``staleness_s`` for people (admin answers, the dashboard), rounded to the ms; None
        when the engine's figures were never read (``metrics_read_at`` 0: an agent registers
        before its engine first answers), which would read as 56 years."""
        return round(self.staleness_s(), 3) if self.metrics_read_at > 0 else None

    @property
    def free_adapter_slots(self) -> int | None:
        """GPU LoRA slots still free, or None when the slot count is unknown."""
        if self.max_loras is None:
            return None
        return max(0, self.max_loras - len(self.loaded_adapters))

    @property
    def waiting_only_for_slots(self) -> bool:
        """True when every request waiting on the engine waits for a GPU LoRA slot: all its
        slots are held and no waiting request's adapter is among those running, so a request
        whose adapter is running starts ahead of them (vLLM skips them). vLLM reports adapter
        names, not counts, and base-model requests not at all: one waiting for KV space would
        be missed."""
        limit = self.max_loras
        return (
            limit is not None
            and limit > 0
            and bool(self.waiting_adapters)
            and len(self.running_adapters) >= limit
            and self.waiting_adapters.isdisjoint(self.running_adapters)
        )

    def serves(self, model: str) -> bool:
        """True if this replica serves ``model`` as a base model."""
        return model in self.models

    @property
    def running_now(self) -> int:
        """Requests running on the engine, as fresh as the gateway can know.

        The engine's ``running`` gauge is as old as its last poll; the gateway's own in-flight
        requests that the engine does not report waiting are running too (decoding, mostly),
        and that count is current. Take the larger: between polls a burst of requests would
        otherwise look like an idle replica. The gauge loses the requests the gateway has seen end
        since it was read: without that, a replica that has just finished a request looks busy
        for a whole scrape interval, and a burst of new work piles onto the others.
        """
        return max(self.running - self.finished_since_read, self.inflight_requests - self.waiting)

    @property
    def kv_usage_now(self) -> float:
        """The KV-cache usage gauge, less the blocks of the requests the gateway has seen end
        since it was read.

        vLLM counts a finished request's blocks as free at once (cached ones are only
        evictable), so the gauge of a replica that has just answered a burst stays high for a
        whole poll interval. Each request running at the reading is taken to hold an equal share
        of what was used. Without this, the real-vLLM prefix test's first round (four 26-block
        requests on an engine of 112 blocks, read at 93%) kept a 180 ms KV penalty on one engine
        for seconds after it had gone idle, and every later request for its prefixes was
        duplicated on the other engine, whose cache then overflowed.
        """
        running, ended = self.running, self.finished_since_read
        if running <= 0 or ended <= 0:
            return self.kv_usage
        return self.kv_usage * max(0, running - ended) / running

    @property
    def queued(self) -> int:
        """Requests waiting on the engine for their prefill to start.

        The engine's waiting queue, or, when the gateway's view is fresher, the requests it has
        in flight there beyond those the engine reports running, at most those still waiting
        for their first token.
        """
        beyond_gauge = self.inflight_requests - self.running
        if self.inflight_unprefilled is not None and self.inflight_unprefilled < beyond_gauge:
            # The gauge is as old as its poll (2 s by default): requests sent since that have
            # their first token are decoding, not queued. Counted as queued, two decodes sent
            # since the last poll made an engine with nothing queued look congested: that
            # switched off fleet-cost's eviction charge, and the real-vLLM prefix test's other
            # engine took more prefixes than its cache holds.
            beyond_gauge = self.inflight_unprefilled
        return max(self.waiting, beyond_gauge, 0)

    @property
    def load(self) -> int:
        """A single load figure in requests.

        The engine's queue (running + waiting) and the gateway's in-flight count are two views of
        the same work: the gateway's is fresher, the engine's also sees other clients. Take the
        larger rather than the sum, which would count each request twice.
        """
        return max(self.running + self.waiting, self.inflight_requests)
