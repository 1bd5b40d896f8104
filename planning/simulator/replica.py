"""One simulated replica as the gateway sees it: an engine model plus the gateway's view of it.

The gateway knows a replica through two feeds of different freshness, and so does this class:

* its own in-flight counts (requests sent, prompt tokens not yet prefilled) — always current;
* the engine's gauges (running, waiting, KV usage, adapters) — polled, so possibly stale
  (``stats_interval_s``); a poll is exact because the engine only changes at events.
"""

from __future__ import annotations

from replica.sim.engine import EngineConfig, EngineModel, SimRequest, StepResult
from routing.recent_itl import RecentItl
from routing.state import ReplicaState
from routing.types import Epoch, ReplicaId

__all__ = ["SimulatedReplica"]


class SimulatedReplica:
    """An ``EngineModel`` driven in virtual time, with the ``ReplicaState`` routing reads."""

    def __init__(
        self,
        index: int,
        config: EngineConfig,
        model: str,
        seed: int,
        stats_interval_s: float,
        pool: str = "default",
    ) -> None:
        self.index = index
        self.replica_id = ReplicaId(f"sim-{index}")
        self.engine = EngineModel(config, seed=seed)
        self.epoch = Epoch(1)
        self.state = ReplicaState(
            replica_id=self.replica_id,
            url=f"sim://{index}",
            pool=pool,
            models=frozenset({model}),
            max_model_len=config.model_len,
            epoch=self.epoch,
            block_size=config.block_size,
            kv_capacity_blocks=config.num_gpu_blocks,
            # The simulated gateway counts its requests awaiting their first token, as the real one.
            inflight_unprefilled=0,
            max_loras=config.max_loras,
            max_cpu_loras=config.max_cpu_loras,
            # What an operator would configure; expected-ttft calibrates from there.
            prefill_tokens_per_s=config.configured_prefill_tokens_per_s,
            decode_step_ms=config.configured_decode_step_ms,
        )
        self._stats_interval_s = stats_interval_s
        self._itl = RecentItl()
        self._stats_read_at = -1.0
        #: The step in progress: its start time and result (delivered when it ends).
        self.step_started_at = 0.0
        self.step_result: StepResult | None = None
        #: Requests routed here, for the load-imbalance figure.
        self.routed = 0

    @property
    def busy(self) -> bool:
        """True while an engine step is in progress."""
        return self.step_result is not None

    def new_epoch(self) -> Epoch:
        """Start a new incarnation of the index entries (after ``AllBlocksCleared``)."""
        self.epoch = Epoch(self.epoch + 1)
        self.state.epoch = self.epoch
        return self.epoch

    def start_step(self, now: float) -> float:
        """Run the engine's next step from ``now``; returns when it ends."""
        if self._stats_interval_s > 0:
            self.poll(now)  # a snapshot due before this step must not see its effects
        self.step_started_at = now
        self.step_result = self.engine.step(now)
        return now + self.step_result.duration_s

    def take_step(self) -> tuple[float, StepResult]:
        """The finished step's start time and result."""
        result = self.step_result
        if result is None:
            raise RuntimeError(f"{self.replica_id}: no step in progress")
        self.step_result = None
        return self.step_started_at, result

    def poll(self, now: float) -> None:
        """Take the engine-stats snapshot the gateway would hold at ``now``.

        Call it before every change to the engine (a step, a submit) and before routing: the
        engine changes only at those moments, so the state at the last poll time due is exactly
        the state right before the change.
        """
        interval = self._stats_interval_s
        if interval > 0:
            due = now - (now % interval)
            if due <= self._stats_read_at:
                return
            self._stats_read_at = due
        else:
            self._stats_read_at = now
        stats = self.engine.stats()
        state = self.state
        state.running = stats.running
        state.waiting = stats.waiting
        state.kv_usage = stats.kv_usage
        state.cached_blocks = stats.cached_blocks
        state.preemptions_total = stats.preemptions
        state.loaded_adapters = frozenset(stats.loaded_adapters)
        state.cpu_cached_adapters = frozenset(stats.cpu_adapters)
        state.running_adapters = frozenset(stats.running_adapters)
        state.waiting_adapters = frozenset(stats.waiting_adapters)
        state.decode_itl_ms = self._itl.observe(
            self._stats_read_at, stats.itl_sum_s, stats.itl_count
        )

    def routing_view(self, now: float, wall_now: float) -> ReplicaState:
        """The state as of ``now``; ``wall_now`` is the policies' wall clock at this moment
        (the replay's, ``_Simulation.wall``), and the engine figures were read as long before it
        as the last poll was before ``now``."""
        self.poll(now)
        self.state.metrics_read_at = wall_now - (now - self._stats_read_at)
        return self.state

    def submit(self, request: SimRequest, now: float) -> None:
        """Hand ``request`` to the engine (``ValueError`` if it can never run there)."""
        if self._stats_interval_s > 0:
            self.poll(now)
        self.engine.submit(request)

    def inflight_start(self, uncached_tokens: int) -> None:
        """The gateway sent a request here."""
        self.state.inflight_requests += 1
        self.state.inflight_prefill_tokens += uncached_tokens
        self.state.inflight_unprefilled += 1
        self.routed += 1

    def inflight_prefilled(self, uncached_tokens: int) -> None:
        """The request's first token arrived: its prompt is prefilled."""
        self.state.inflight_prefill_tokens = max(
            0, self.state.inflight_prefill_tokens - uncached_tokens
        )
        # Every simulated request has its first token before it finishes.
        self.state.inflight_unprefilled = max(0, self.state.inflight_unprefilled - 1)

    def inflight_finish(self) -> None:
        """The request completed."""
        self.state.inflight_requests = max(0, self.state.inflight_requests - 1)
