"""The faults of the chaos benchmark: one class each, ``inject()`` then ``heal()``.

Each fault also says how its effect shows in the monitor's samples (``detected``), which replica
or gateway it takes down (streams on it may break; nothing else may), and what "recovered" needs
beyond the fleet being steady again (``recovered_extra``: e.g. the restarted replica serves).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.chaos_fleet import Fleet, flush_redis
from bench.chaos_observe import OK, AgentSample, EngineTruth, GatewaySample, RequestRecord
from bench.chaos_proxy import Mode

#: How much slower the "replica slow" fault makes one replica.
SLOW_FACTOR = 10.0
#: Added to every Redis reply by the "Redis slow" fault.
REDIS_DELAY_MS = 50.0


@dataclass
class FleetState:
    """The latest sample of every gateway and agent at one monitor tick."""

    t: float
    gateways: list[GatewaySample]
    agents: list[AgentSample]
    #: Per gateway: degraded decisions or index errors went up since its previous sample.
    index_trouble: list[bool] = field(default_factory=list)


@dataclass
class FaultContext:
    fleet: Fleet
    truths: list[EngineTruth]


class Fault:
    """A fault; subclasses set the class attributes and override what differs."""

    name = ""
    title = ""
    how = ""
    #: The replica this fault takes down (its in-flight streams may break), if any.
    target_replica: int | None = None
    #: The gateway this fault kills (requests in flight on it are lost with it), if any.
    target_gateway: int | None = None

    async def inject(self, ctx: FaultContext) -> None:
        raise NotImplementedError

    async def heal(self, ctx: FaultContext) -> None:
        raise NotImplementedError

    def detected(self, state: FleetState, fleet: Fleet) -> bool:
        """The fault's effect is visible in ``state`` (what "time to detect" waits for)."""
        return False

    def recovered_extra(self, records: list[RequestRecord], heal_t: float,
                        fleet: Fleet) -> float | None:
        """Earliest time after ``heal_t`` the fault-specific recovery condition held (None: never).
        The default has none: the fleet being steady is enough."""
        return heal_t


def _replica_missing(state: FleetState, replica_id: str) -> bool:
    """Some answering gateway does not route to ``replica_id`` (unlisted, unhealthy, open)."""
    for sample in state.gateways:
        if not sample.up:
            continue
        view = sample.replicas.get(replica_id)
        if view is None or not view.healthy or view.circuit != "closed":
            return True
    return False


def _first_served(records: list[RequestRecord], replica_id: str, after: float) -> float | None:
    times = [r.start for r in records
             if r.start >= after and r.outcome == OK and r.served_by == replica_id]
    return min(times) if times else None


class _ReplicaFault(Fault):
    def __init__(self, replica: int = 0) -> None:
        self.target_replica = replica

    def replica_id(self, fleet: Fleet) -> str:
        assert self.target_replica is not None
        return fleet.replicas[self.target_replica].replica_id

    def detected(self, state: FleetState, fleet: Fleet) -> bool:
        return _replica_missing(state, self.replica_id(fleet))

    def recovered_extra(self, records: list[RequestRecord], heal_t: float,
                        fleet: Fleet) -> float | None:
        return _first_served(records, self.replica_id(fleet), heal_t)


class ReplicaKilled(_ReplicaFault):
    name = "replica-killed"
    title = "replica killed and restarted"
    how = ("SIGKILL of one engine's process group (`fleetgate sim`, or vLLM's API server with "
           "its EngineCore); heal: the same command on the same ports")

    async def inject(self, ctx: FaultContext) -> None:
        assert self.target_replica is not None
        ctx.fleet.replicas[self.target_replica].kill_sim()
        await ctx.truths[self.target_replica].engine_gone()

    async def heal(self, ctx: FaultContext) -> None:
        assert self.target_replica is not None
        ctx.fleet.replicas[self.target_replica].start_sim()


class ReplicaHung(_ReplicaFault):
    name = "replica-hung"
    title = "replica hung (accepts, never answers)"
    how = ("SIGSTOP of one engine's process group (the kernel still accepts connections); "
           "heal: SIGCONT")

    async def inject(self, ctx: FaultContext) -> None:
        assert self.target_replica is not None
        ctx.fleet.replicas[self.target_replica].pause_sim()

    async def heal(self, ctx: FaultContext) -> None:
        assert self.target_replica is not None
        ctx.fleet.replicas[self.target_replica].resume_sim()


class ReplicaSlow(_ReplicaFault):
    """Nothing breaks: the question is whether routing moves load off the slow replica."""

    name = "replica-slow"
    title = f"replica slow ({SLOW_FACTOR:g}× latency)"
    how = (f"the replica's fault proxy delivers every answer byte {SLOW_FACTOR:g}× later "
           "after the request than the engine sent it; heal: pass-through")

    def __init__(self, replica: int = 0) -> None:
        super().__init__(replica)
        # Nothing is killed: no stream may break.
        self.slowed = replica
        self.target_replica = None
        self.baseline_share = 0.0

    def replica_id(self, fleet: Fleet) -> str:
        return fleet.replicas[self.slowed].replica_id

    async def inject(self, ctx: FaultContext) -> None:
        proxy = ctx.fleet.replicas[self.slowed].proxy
        assert proxy is not None
        await proxy.set_mode(Mode.SCALE, factor=SLOW_FACTOR)

    async def heal(self, ctx: FaultContext) -> None:
        proxy = ctx.fleet.replicas[self.slowed].proxy
        assert proxy is not None
        await proxy.heal()

    def detected(self, state: FleetState, fleet: Fleet) -> bool:
        return False  # detection is a routing shift, computed from the requests (chaos.py)


class AgentKilled(_ReplicaFault):
    name = "agent-killed"
    title = "agent killed"
    how = "SIGKILL of one replica's `fleetgate agent`; heal: the same command again"

    def __init__(self, replica: int = 0) -> None:
        super().__init__(replica)
        self.agent_of = replica
        self.target_replica = None  # the engine keeps serving: no stream may break

    def replica_id(self, fleet: Fleet) -> str:
        return fleet.replicas[self.agent_of].replica_id

    def detected(self, state: FleetState, fleet: Fleet) -> bool:
        rid = self.replica_id(fleet)
        return any(s.up and rid not in s.replicas for s in state.gateways)

    async def inject(self, ctx: FaultContext) -> None:
        ctx.fleet.replicas[self.agent_of].kill_agent()

    async def heal(self, ctx: FaultContext) -> None:
        ctx.fleet.replicas[self.agent_of].start_agent(ctx.fleet.agent_redis_url)


class _RedisFault(Fault):
    def detected(self, state: FleetState, fleet: Fleet) -> bool:
        return any(state.index_trouble)


class RedisKilled(_RedisFault):
    name = "redis-killed"
    title = "Redis killed and restarted"
    how = "SIGKILL of redis-server (no persistence: it comes back empty); heal: restart, same port"

    async def inject(self, ctx: FaultContext) -> None:
        ctx.fleet.redis.kill()

    async def heal(self, ctx: FaultContext) -> None:
        ctx.fleet.redis.start()
        await ctx.fleet.redis.wait_ready()


class RedisFlushed(_RedisFault):
    name = "redis-flushed"
    title = "Redis flushed"
    how = "FLUSHALL (index, epochs, registrations, in-flight counts gone at once); no heal step"

    def detected(self, state: FleetState, fleet: Fleet) -> bool:
        """A gateway losing replicas (registrations flushed). No index call fails on an empty
        Redis, so degraded decisions are no sign of a flush (only of the machine's load)."""
        ids = {r.replica_id for r in fleet.replicas}
        return any(s.up and not ids <= set(s.replicas) for s in state.gateways)

    async def inject(self, ctx: FaultContext) -> None:
        await flush_redis(ctx.fleet.redis.port)

    async def heal(self, ctx: FaultContext) -> None:
        return None


class RedisSlow(_RedisFault):
    name = "redis-slow"
    title = f"Redis slow ({REDIS_DELAY_MS:g} ms per call)"
    how = (f"both Redis proxies (gateways', agents') hold every reply {REDIS_DELAY_MS:g} ms; "
           "heal: pass-through")

    async def inject(self, ctx: FaultContext) -> None:
        for proxy in (ctx.fleet.gw_redis_proxy, ctx.fleet.agent_redis_proxy):
            assert proxy is not None
            await proxy.set_mode(Mode.DELAY, delay_ms=REDIS_DELAY_MS)

    async def heal(self, ctx: FaultContext) -> None:
        for proxy in (ctx.fleet.gw_redis_proxy, ctx.fleet.agent_redis_proxy):
            assert proxy is not None
            await proxy.heal()


class RedisStall(_RedisFault):
    name = "redis-stall"
    title = "network stall gateway ↔ Redis"
    how = ("the gateways' Redis proxy holds every byte both ways (connections stay open, "
           "nothing moves; agents unaffected); heal: held bytes delivered, pass-through")

    async def inject(self, ctx: FaultContext) -> None:
        assert ctx.fleet.gw_redis_proxy is not None
        await ctx.fleet.gw_redis_proxy.set_mode(Mode.STALL)

    async def heal(self, ctx: FaultContext) -> None:
        assert ctx.fleet.gw_redis_proxy is not None
        await ctx.fleet.gw_redis_proxy.heal()


class GatewayKilled(Fault):
    name = "gateway-killed"
    title = "one gateway killed (the other carries on)"
    how = ("SIGKILL of gateway 1; the client's load balancer sends to ready gateways only and "
           "retries a refused connection on the other; heal: the same command, same port")

    def __init__(self, gateway: int = 1) -> None:
        self.target_gateway = gateway

    def detected(self, state: FleetState, fleet: Fleet) -> bool:
        return any(not s.up for s in state.gateways if s.gateway == self.target_gateway)

    async def inject(self, ctx: FaultContext) -> None:
        assert self.target_gateway is not None
        ctx.fleet.gateways[self.target_gateway].kill()

    async def heal(self, ctx: FaultContext) -> None:
        assert self.target_gateway is not None
        ctx.fleet.gateways[self.target_gateway].start()

    def recovered_extra(self, records: list[RequestRecord], heal_t: float,
                        fleet: Fleet) -> float | None:
        times = [r.start for r in records if r.start >= heal_t and r.outcome == OK
                 and r.gateway == self.target_gateway and not r.failover]
        return min(times) if times else None


ALL_FAULTS: dict[str, type[Fault]] = {
    cls.name: cls
    for cls in (ReplicaKilled, ReplicaHung, ReplicaSlow, AgentKilled, RedisKilled, RedisFlushed,
                RedisSlow, RedisStall, GatewayKilled)
}
