"""Flow control at the gateway: ``routing.flow_control`` driven by asyncio and the real clock.

The request path routes first (the estimate flow control judges by is that decision's), then
``FlowGate.admit``: admitted requests go on at once; refused ones get 429 with ``Retry-After``;
queued ones wait on a future. One pump task (started in the app's cleanup context) judges the
queue's head again on a fresh routing decision whenever a request finishes, and every
``PUMP_INTERVAL_S`` while anything waits, and refuses those whose wait ran out. It releases one
request at a time: the next is judged once the one before is in flight (``RELEASE_WAIT_S``). A
client that disconnects while queued cancels its handler, and the cancellation takes it out of
the queue at once: it never reaches an engine.

Token budgets are checked before flow control (a tenant over its budget is refused whatever the
load) and reserved at once; a request flow control then refuses gives its tokens back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from gateway import errors
from gateway.auth import unknown_key
from gateway.background import run_in_background
from gateway.errors import GatewayError
from gateway.metrics import GatewayMetrics
from routing.flow_control import (
    PRIORITY_HEADER,
    BudgetReservation,
    BudgetStore,
    Decision,
    FleetEstimate,
    FlowController,
    FlowControlSettings,
    FlowRequest,
    MemoryBudgetStore,
    RequestClass,
    TokenBudget,
    TokenBudgets,
    Verdict,
    estimate_from_decision,
    parse_request_class,
    steer_request,
)
from routing.policies.serves_model import fits

if TYPE_CHECKING:
    from routing.config import Policy
    from routing.contracts import RoutingDecision, RoutingRequest
    from routing.state import ReplicaState

__all__ = [
    "DEFAULT_TTFT_SLO_MS",
    "FlowGate",
    "TenantFlow",
    "build_flow_gate",
    "flow_finished",
    "settings_of",
    "tenant_flow",
]

log = logging.getLogger(__name__)

#: Seconds between judgements of the queue's head while requests wait (besides completions).
PUMP_INTERVAL_S = 0.02
#: After releasing a queued request, the pump waits this long at most for its handler to send it
#: (its in-flight count is then on the books) before judging the next one; see ``forwarding``.
RELEASE_WAIT_S = 0.25
#: Admitted requests remembered until they finish (their TPOT moves the inter-token bound);
#: past this many, the oldest are forgotten (a request whose finish never came).
MAX_TRACKED_ADMITTED = 65536
#: The TTFT a request is judged against when neither its tenant nor its route names one.
DEFAULT_TTFT_SLO_MS = 2000.0


class _Named(Protocol):
    @property
    def name(self) -> str: ...


class _WithSlos(Protocol):
    @property
    def ttft_slo_ms(self) -> float | None: ...

    @property
    def tpot_slo_ms(self) -> float | None: ...


class Routed(Protocol):
    """What flow control reads of a routed request (``gateway.request.route.RouteDecision``).

    A protocol, not that class: the request path imports this module, not the other way round.
    """

    @property
    def tenant(self) -> _Named: ...

    @property
    def route(self) -> _WithSlos: ...

    @property
    def routing_request(self) -> RoutingRequest: ...

    @property
    def prompt_counted(self) -> bool: ...

    @property
    def decision(self) -> RoutingDecision: ...

    @property
    def budget_prompt_tokens(self) -> int: ...


R = TypeVar("R", bound=Routed)
#: Routes a request again: on the fleet as it is now, or among the given replicas only.
Repick = Callable[..., Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class TenantFlow:
    """What flow control needs to know about one request's tenant and class."""

    request_class: RequestClass
    ttft_slo_ms: float
    weight: float
    budget: TokenBudget | None
    #: The tenant's TPOT objective, else the route's (None: neither has one).
    tpot_slo_ms: float | None = None
    #: The request carried the priority header, which its tenant may not set (so it was ignored).
    header_ignored: bool = False


@dataclass(frozen=True)
class EnginePriority:
    """What reaches the engine as vLLM's request ``priority`` field."""

    #: The gateway's value (the request's class), set on chat and completion bodies; None: the
    #: gateway sets none.
    value: int | None
    #: Where the gateway sets none, whether a client's own field passes (else it is dropped).
    client_may_set: bool


def engine_priority(
    routed: Routed, headers: Mapping[str, str], policy: Policy | None
) -> EnginePriority:
    """vLLM's ``priority`` for ``routed``: its class's where the policy says the engines
    schedule by priority (``flow_control.engine_priority``); otherwise none from the gateway,
    and the client's own only where its tenant may choose its priority
    (``allow_priority_header``), as for the header, or where the policy declares no tenants."""
    if policy is not None and policy.flow_control.engine_priority:
        route = routed.route
        flow = tenant_flow(
            policy, routed.tenant.name, route.ttft_slo_ms, headers, route.tpot_slo_ms
        )
        return EnginePriority(flow.request_class.engine_priority, client_may_set=False)
    if policy is None or not policy.tenants:
        # No tenants to keep apart: the field is the client's, as vLLM's own server takes it.
        return EnginePriority(None, client_may_set=True)
    spec = policy.tenant(routed.tenant.name)
    return EnginePriority(None, client_may_set=spec is not None and spec.allow_priority_header)


def tenant_flow(
    policy: Policy | None,
    tenant: str,
    route_ttft_slo_ms: float | None,
    headers: Mapping[str, str],
    route_tpot_slo_ms: float | None = None,
) -> TenantFlow:
    """The request's class (tenant's, or the header's where the tenant allows it), SLO, budget.

    Raises a 400 ``GatewayError`` for a header value that is not a class, when the tenant may set
    it; a tenant that may not has the header ignored (its class is the policy's to choose).
    """
    spec = policy.tenant(tenant) if policy is not None else None
    request_class = RequestClass(spec.priority) if spec is not None else RequestClass.STANDARD
    asked = headers.get(PRIORITY_HEADER)
    allowed = spec is not None and spec.allow_priority_header
    if asked is not None and allowed:
        getall = getattr(headers, "getall", None)
        if getall is not None and len(getall(PRIORITY_HEADER)) > 1:
            raise GatewayError(
                400, errors.INVALID_REQUEST, f"{PRIORITY_HEADER}: send it once", PRIORITY_HEADER
            )
        try:
            request_class = parse_request_class(asked)
        except ValueError as exc:
            raise GatewayError(
                400, errors.INVALID_REQUEST, f"{PRIORITY_HEADER}: {exc}", PRIORITY_HEADER
            ) from None
    slo = spec.ttft_slo_ms if spec is not None and spec.ttft_slo_ms is not None else None
    if slo is None:
        slo = route_ttft_slo_ms if route_ttft_slo_ms is not None else DEFAULT_TTFT_SLO_MS
    tpot = spec.tpot_slo_ms if spec is not None and spec.tpot_slo_ms is not None else None
    if tpot is None:
        tpot = route_tpot_slo_ms
    budget = None
    if spec is not None and spec.token_budget is not None:
        budget = TokenBudget(
            spec.token_budget.prompt_tokens_per_minute,
            spec.token_budget.completion_tokens_per_minute,
        )
    weight = spec.weight if spec is not None else 1.0
    return TenantFlow(
        request_class, slo, weight, budget, tpot, header_ignored=asked is not None and not allowed
    )


def settings_of(policy: Policy | None) -> FlowControlSettings:
    """The policy's ``flow_control:`` section as the controller's settings (off without one)."""
    if policy is None:
        return FlowControlSettings(enabled=False)
    spec = policy.flow_control
    return FlowControlSettings(
        enabled=spec.enabled,
        saturation_backlog_requests=spec.saturation_backlog_requests,
        saturation_kv_usage=spec.saturation_kv_usage,
        saturation_queue_wait_ms=spec.saturation_queue_wait_ms,
        saturation_decode_interference_ms=spec.saturation_decode_interference_ms,
        saturation_itl_fraction=spec.saturation_itl_fraction,
        tpot_target=spec.tpot_target,
        min_itl_fraction=spec.min_itl_fraction,
        max_itl_fraction=spec.max_itl_fraction,
        max_queue_length=spec.max_queue_length,
        max_queue_wait_ms=spec.max_queue_wait_ms,
        admit_within_slo_fraction=spec.admit_within_slo_fraction,
        protect_critical_decodes=spec.protect_critical_decodes,
        steer_critical=spec.steer_critical,
        steer_when_calm=spec.steer_when_calm,
        calm_window_s=spec.calm_window_s,
        hold_for_backlog=spec.hold_for_backlog,
    )


#: The verdict for queued requests released because a reload turned flow control off.
_RELEASED = Verdict(Decision.ADMIT, "flow_control_off")


@dataclass(slots=True)
class _Waiter:
    routed: Routed
    repick: Repick
    answer: asyncio.Future[tuple[Verdict, Routed]]
    #: Released where the pump steered it: counted once its handler takes the release.
    steered: bool = False


class FlowGate:
    """One gateway's flow control: the controller, its waiters, the pump, the token budgets."""

    def __init__(
        self,
        metrics: GatewayMetrics | None = None,
        budget_store: BudgetStore | None = None,
        key_prefix: str = "fleetgate:",
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        replica_states: Callable[[], Iterable[ReplicaState]] = tuple,
        policy: Callable[[], Policy | None] | None = None,
    ) -> None:
        self.metrics = metrics
        #: The policy in force now (reloads swap it), read by the pump on each pass so that a
        #: reload reaches requests already queued; None: only arrivals bring new settings.
        self.policy = policy
        #: The replicas as last polled (engine queue, KV usage, this gateway's in-flight counts):
        #: what flow control judges saturation by. Without them it judges by the optional
        #: predicted-wait bounds alone.
        self.replica_states = replica_states
        self.controller = FlowController(FlowControlSettings(enabled=False), clock)
        self.budget_store = budget_store if budget_store is not None else MemoryBudgetStore()
        # Budget windows are wall-clock minutes, so that every gateway agrees on them.
        self.budgets = TokenBudgets(self.budget_store, wall_clock, key_prefix)
        self._waiters: dict[str, _Waiter] = {}
        #: Released requests the pump waits on until their handler has sent them (``_sent``),
        #: and how many times it gave up waiting.
        self._releasing: dict[str, asyncio.Event] = {}
        self.release_timeouts = 0
        #: Requests admitted with a TPOT SLO and not yet finished -> that SLO: their outcomes
        #: move the inter-token bound (``FlowController.observe_finished``).
        self._admitted: OrderedDict[str, float] = OrderedDict()
        self._wake = asyncio.Event()
        self._settings_source: Policy | None = None
        #: True while ``run`` judges the queue: without it a queued request would wait forever
        #: (expiry is the pump's too), so requests are admitted rather than queued.
        self.pumping = False

    # ------------------------------------------------------------------ the request path

    async def admit(
        self,
        routed: R,
        headers: Mapping[str, str],
        policy: Policy | None,
        repick: Callable[..., Awaitable[R]],
    ) -> R:
        """Admit ``routed`` (maybe after a wait, maybe re-routed by ``repick``), or raise a 429.
        ``repick(routed)`` routes it again on the fleet as it is now, ``repick(routed, only)``
        among those replicas only."""
        flow = self._flow_of(routed, headers, policy)
        reserved = await self._reserve_budget(routed, flow)
        try:
            admitted = await self._admit(routed, flow, policy, repick)
        except BaseException:
            if reserved is not None and flow.budget is not None:
                await self.budgets.release(
                    routed.tenant.name, flow.budget, reserved.tokens, reserved.window
                )
            raise
        return cast(R, _with_reservation(admitted, reserved))

    async def admit_pinned(self, routed: R, headers: Mapping[str, str], policy: Policy | None) -> R:
        """A request only one replica can serve (a stored conversation's follow-up): flow
        control cannot move or hold it usefully, but the tenant's token budget still holds."""
        flow = self._flow_of(routed, headers, policy)
        return _with_reservation(routed, await self._reserve_budget(routed, flow))

    def _flow_of(
        self, routed: Routed, headers: Mapping[str, str], policy: Policy | None
    ) -> TenantFlow:
        """The request's ``tenant_flow``, counting a priority header its tenant may not set."""
        route = routed.route
        flow = tenant_flow(
            policy, routed.tenant.name, route.ttft_slo_ms, headers, route.tpot_slo_ms
        )
        if flow.header_ignored and self.metrics is not None:
            self.metrics.flow_priority_header_ignored.labels(routed.tenant.name).inc()
        return flow

    async def _reserve_budget(self, routed: Routed, flow: TenantFlow) -> BudgetReservation | None:
        """Check the tenant's budgets and reserve the prompt tokens (``budget_prompt_tokens``:
        every prompt of a batch, the whole input of an API the gateway does not tokenize); what
        was reserved, and in which window (None: nothing). Raises 429 when a budget is spent,
        400 when the prompt alone is over the whole prompt budget."""
        if flow.budget is None:
            return None
        tenant = routed.tenant.name
        prompt_tokens = routed.budget_prompt_tokens
        check = await self.budgets.admit(tenant, flow.budget, prompt_tokens)
        if not check.admitted:
            if not check.can_fit:  # a 400 (fix the request), not a shed: counted as the 400 alone
                raise GatewayError(
                    400,
                    errors.INVALID_REQUEST,
                    f"This request's {prompt_tokens} prompt tokens are more than this "
                    f"tenant's whole prompt budget "
                    f"({flow.budget.prompt_tokens_per_minute} tokens per minute): no "
                    "minute can admit it. Shorten the prompt, or raise the tenant's "
                    "token_budget.prompt_tokens_per_minute.",
                    "messages",
                )
            self._count(tenant, flow.request_class, Decision.SHED, "token_budget")
            raise _too_many(
                f"Token budget exceeded: this tenant's {check.exhausted} tokens per minute "
                "are spent.",
                check.retry_after_s,
            )
        if flow.budget.prompt_tokens_per_minute is None or check.window is None:
            return None
        return BudgetReservation(prompt_tokens, check.window)

    async def _admit(
        self, routed: Routed, flow: TenantFlow, policy: Policy | None, repick: Repick
    ) -> Routed:
        # The policy in force now, not the one the request arrived under: a reload may have
        # come during its budget's Redis round trip, and reading the older one then put the
        # old settings back and refused the queued requests of tenants the reload added (the
        # flow-control review of session 46).
        self._read_settings(self.policy() if self.policy is not None else policy)
        if not self.controller.settings.enabled:
            return routed  # off: not even the estimate is built (explanations cost at scale)
        request_id = routed.routing_request.request_id
        request = FlowRequest(
            request_id,
            routed.tenant.name,
            flow.request_class,
            flow.ttft_slo_ms,
            flow.weight,
            self.controller.now(),
            flow.tpot_slo_ms,
            routed.routing_request.max_output_tokens,
            pool=routed.routing_request.model,
            fits_no_replica=self._fits_no_replica(routed),
        )
        routed, estimate, steered = await self._steer(request, routed, repick)
        verdict = self.controller.admit(request, estimate)
        self._count(request.tenant, request.request_class, verdict.decision, verdict.reason)
        if verdict.decision is Decision.ADMIT:
            if steered:
                self._count_steered(request)
            self._track(request)
            return routed
        if verdict.decision is Decision.SHED:
            raise _refusal(verdict)
        if not self.pumping:  # nothing would ever judge it again: degrade, never hang
            self.controller.cancel(request_id)
            log.error("flow-control queue is not running; admitting %s unqueued", request_id)
            if steered:
                self._count_steered(request)
            self._track(request)
            return routed
        answer: asyncio.Future[tuple[Verdict, Routed]] = asyncio.get_running_loop().create_future()
        waiter = self._waiters[request_id] = _Waiter(routed, repick, answer)
        self._queue_gauges()
        self._wake.set()
        # How it left the queue, where no verdict says so: so that queued = admitted + shed +
        # abandoned + failed, whatever happens to it.
        left: tuple[str, str] | None = ("abandoned", "client_gone")
        try:
            verdict, routed = await answer
            left = None
        except GatewayError as err:  # routed again and failed, or the gateway shutting down
            left = ("failed", err.code)
            raise
        except Exception:
            left = ("failed", errors.INTERNAL_ERROR)
            raise
        finally:
            # Cancelled (the client went away, even as it was released): out of the queue now,
            # before anything else runs.
            self.controller.cancel(request_id)
            self._waiters.pop(request_id, None)
            self._queue_gauges()
            if left is not None:
                self._left_queue(request, *left)
        self._count(request.tenant, request.request_class, verdict.decision, verdict.reason)
        if self.metrics is not None:
            # Its own wait, not the verdict's: a reload that turns flow control off releases
            # the whole queue with one verdict, and its waits read as 0 s.
            self.metrics.flow_queue_wait.labels(request.request_class.value).observe(
                max(0.0, self.controller.now() - request.arrival_s)
            )
        if verdict.decision is Decision.SHED:
            raise _refusal(verdict)
        if waiter.steered:  # here, not in the pump: its client may have gone meanwhile
            self._count_steered(request)
        self._track(request)
        return routed

    def _fits_no_replica(self, routed: Routed) -> bool:
        """True when the replicas serving the request's model all report a context too short
        for it, by a count of its prompt's tokens. Not by text mode's estimate from characters:
        a padded prompt (a long run of one character is few tokens) would pass for too long and
        skip flow control."""
        request = routed.routing_request
        if not routed.prompt_counted:
            return False
        serving = False
        for state in self.replica_states():  # per request: stops at the first that fits
            if state.healthy and request.model in state.models:
                if fits(request, state):
                    return False
                serving = True
        return serving

    async def _steer(
        self, request: FlowRequest, routed: Routed, repick: Repick, queued: bool = False
    ) -> tuple[Routed, FleetEstimate, bool]:
        """A request routed to a replica decoding too slowly for it, critical or (on a calm
        fleet) about to be held, or a queue head held for its replica's backlog (``queued``):
        routed again among the replicas with room (idle ones, for a head), and sent there if
        the controller takes the new decision (``routing.flow_control.steer_request``, as in the
        simulator). The request path forwards what this returns; whether it moved is counted
        once it is admitted there (``_count_steered``)."""
        steering = await steer_request(
            self.controller,
            request,
            routed,
            routed.routing_request,
            self._estimate,
            lambda room: repick(routed, room),
            queued=queued,
        )
        if not steering.steered:
            return routed, steering.estimate, False
        # The rest of the first decision's order stays behind the new one's, to retry on.
        first_order = [routed.decision.replica, *routed.decision.fallbacks]
        steered = dataclasses.replace(
            cast(Any, steering.routed),
            decision=steering.routed.decision.with_fallbacks(first_order),
        )
        return steered, steering.estimate, True

    def _count_steered(self, request: FlowRequest) -> None:
        """Counted when the request is admitted where it was steered, by its own handler: one
        that is queued anyway, or whose client leaves before it is sent, did not move."""
        if self.metrics is not None:
            self.metrics.flow_steered.labels(request.tenant, request.request_class.value).inc()

    def _track(self, request: FlowRequest) -> None:
        """Remember an admitted request until it finishes: its TPOT moves the bound."""
        if request.tpot_slo_ms is None:
            return
        self._admitted[request.request_id] = request.tpot_slo_ms
        while len(self._admitted) > MAX_TRACKED_ADMITTED:  # a finish never reported
            self._admitted.popitem(last=False)

    def request_finished(
        self,
        policy: Policy | None,
        tenant: str,
        usage: Any,
        request_id: str | None = None,
        tpot_ms: float | None = None,
        reserved: BudgetReservation | None = None,
    ) -> Coroutine[Any, Any, None] | None:
        """A request ended: capacity may be free (wake the pump); its TPOT moves the
        inter-token bound. Returns the charge of its completion tokens to the tenant's budget,
        if it has one, for the caller to run, and the settling of the prompt tokens
        ``reserved`` for it against the engine's count (a tokenizer's or an estimate's error,
        a stored conversation's follow-up that reserved only its new input)."""
        self._wake.set()
        if request_id is not None:
            self.controller.request_finished(request_id)
            if request_id in self._admitted:
                slo = self._admitted.pop(request_id)
                self.controller.observe_finished(tpot_ms, slo)
                self._bound_gauge()
        spec = policy.tenant(tenant) if policy is not None else None
        budget = spec.token_budget if spec is not None else None
        if budget is None or not isinstance(usage, Mapping):
            return None
        completion = usage.get("completion_tokens")
        prompt = usage.get("prompt_tokens")
        settle = reserved if _counted(prompt) else None
        if not _counted(completion) and settle is None:
            return None
        return self._charge(
            tenant,
            TokenBudget(budget.prompt_tokens_per_minute, budget.completion_tokens_per_minute),
            completion if _counted(completion) else 0,
            settle,
            prompt if _counted(prompt) else 0,
        )

    def not_sent(
        self, policy: Policy | None, routed: Routed
    ) -> Coroutine[Any, Any, None] | None:
        """A request admitted that its handler never sent (its client left as it was released,
        its key revoked while it queued): forgotten, and the prompt tokens reserved for it given
        back to its tenant's budget by the returned coroutine, for the caller to run."""
        request_id = routed.routing_request.request_id
        self._admitted.pop(request_id, None)
        reserved = routed.budget_reserved
        spec = policy.tenant(routed.tenant.name) if policy is not None else None
        budget = spec.token_budget if spec is not None else None
        if reserved is None or budget is None:
            return None
        return self.budgets.release(
            routed.tenant.name,
            TokenBudget(budget.prompt_tokens_per_minute, budget.completion_tokens_per_minute),
            reserved.tokens,
            reserved.window,
        )

    async def _charge(
        self,
        tenant: str,
        budget: TokenBudget,
        completion_tokens: int,
        reserved: BudgetReservation | None,
        prompt_tokens: int,
    ) -> None:
        await self.budgets.charge_completion(tenant, budget, completion_tokens)
        if reserved is not None:
            await self.budgets.settle_prompt(tenant, budget, reserved, prompt_tokens)

    # ------------------------------------------------------------------ the pump

    async def run(self) -> None:
        """Judge the queue until cancelled (the app's cleanup context owns this task)."""
        self.pumping = True
        try:
            while True:
                timeout = PUMP_INTERVAL_S if self._waiters else None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)
                self._wake.clear()
                try:
                    await self._pump()
                except Exception:  # never let one bad judgement stop the queue for everyone
                    log.exception("flow-control pump failed; retrying")
        finally:
            self.pumping = False
            for waiter in list(self._waiters.values()):
                if not waiter.answer.done():
                    waiter.answer.set_exception(
                        errors.shutting_down()
                    )
            close = getattr(self.budget_store, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    await close()

    async def _pump(self) -> None:
        flow = self.controller
        if self.policy is not None:
            self._read_settings(self.policy())
        if not flow.settings.enabled:  # turned off by a reload: nothing waits any more
            self._release_all()
            return
        for request, verdict in flow.expire():
            self._answer(request.request_id, verdict, None)
        # Each pool (base model) on its own: a saturated one never holds up the others.
        for pool in flow.pools():
            while (head := flow.head(pool)) is not None:
                waiter = self._waiters.get(head.request_id)
                if waiter is None:  # its handler is gone; cancellation removes it: a guard
                    flow.cancel(head.request_id)
                    continue
                try:
                    routed = await waiter.repick(waiter.routed)
                    routed, estimate, steered = await self._steer(
                        head, routed, waiter.repick, queued=True
                    )
                except Exception as exc:  # this request's own failure: the rest still move
                    self._fail(head.request_id, waiter, exc)
                    continue
                current = flow.head(pool)
                if current is None or current.request_id != head.request_id:
                    continue  # it left (disconnect, expiry) while it was being routed
                verdict = flow.judge_head(estimate, pool)
                if verdict.decision is Decision.QUEUE:
                    break
                waiter.steered = steered and verdict.decision is Decision.ADMIT
                if self._answer(head.request_id, verdict, routed) and (
                    verdict.decision is Decision.ADMIT
                ):
                    # The next head is judged on a fleet that counts this one: released on the
                    # same reading, one freed slot let the whole queue into the engines.
                    await self._sent(head.request_id)

    def _read_settings(self, policy: Policy | None) -> None:
        """The controller's settings from ``policy``, read again only when it changed."""
        if policy is not self._settings_source:  # once per policy (re)load
            self.controller.settings = settings_of(policy)
            self._settings_source = policy
            self._bound_gauge()
            self._refuse_gone_tenants(policy)

    def _refuse_gone_tenants(self, policy: Policy | None) -> None:
        """Queued requests of tenants a reload removed get the 401 of an unknown key now: they
        waited until their SLO ran out, then got a 429 saying to retry (the flow-control
        review). (A key revoked from a tenant that remains is caught when the request leaves
        the queue: the gate does not hold keys.)"""
        if policy is None or not policy.tenants:
            return
        for request_id, waiter in list(self._waiters.items()):
            if policy.tenant(waiter.routed.tenant.name) is None and not waiter.answer.done():
                self.controller.cancel(request_id)
                waiter.answer.set_exception(unknown_key())

    def _release_all(self) -> None:
        """Flow control is off: every queued request goes on as routed when it was queued."""
        for request_id, waiter in list(self._waiters.items()):
            self.controller.cancel(request_id)
            if not waiter.answer.done():
                waiter.answer.set_result((_RELEASED, waiter.routed))

    def _fail(self, request_id: str, waiter: _Waiter, exc: Exception) -> None:
        """Routing a queued request again failed: it leaves the queue with that error (its own
        ``GatewayError``, e.g. no replica left; anything else is a 503 to retry)."""
        self.controller.cancel(request_id)
        if isinstance(exc, GatewayError):
            err = exc
        else:
            log.exception("routing queued request %s again failed", request_id)
            err = GatewayError(
                503,
                errors.INTERNAL_ERROR,
                "This request could not be routed again after waiting in the gateway queue "
                "(the routing policy may have changed meanwhile); retry it.",
            )
        if not waiter.answer.done():
            waiter.answer.set_exception(err)

    def _estimate(self, routed: Routed) -> FleetEstimate:
        return estimate_from_decision(routed.decision, self.replica_states())

    def _answer(self, request_id: str, verdict: Verdict, routed: Routed | None) -> bool:
        """Tell a waiter its verdict; False when it is gone (nothing to wait for)."""
        waiter = self._waiters.get(request_id)
        if waiter is None or waiter.answer.done():
            return False
        waiter.answer.set_result((verdict, routed if routed is not None else waiter.routed))
        return True

    async def _sent(self, request_id: str) -> None:
        """Wait (at most ``RELEASE_WAIT_S``) until the released request's handler has sent it
        to its replica, or given up on it (``forwarding``)."""
        event = self._releasing[request_id] = asyncio.Event()
        try:
            await asyncio.wait_for(event.wait(), RELEASE_WAIT_S)
        except TimeoutError:
            self.release_timeouts += 1  # its handler is slow to send it (an adapter load)
        finally:
            self._releasing.pop(request_id, None)

    def forwarding(self, request_id: str) -> None:
        """The request's handler has sent it to a replica (counted in flight there), or will
        not: the pump may judge the next queued request. Called for every request; a no-op for
        those the pump is not waiting on."""
        event = self._releasing.get(request_id)
        if event is not None:
            event.set()

    # ------------------------------------------------------------------ metrics

    def _count(
        self, tenant: str, request_class: RequestClass, decision: Decision, reason: str
    ) -> None:
        if self.metrics is not None:
            self.metrics.flow_decisions.labels(
                tenant, request_class.value, decision.value, reason
            ).inc()

    def _left_queue(self, request: FlowRequest, decision: str, reason: str) -> None:
        """A queued request left without a verdict: its client went away (``abandoned``), or
        routing it again failed or the gateway stopped (``failed``, with the error's code).
        Counted, with its wait, so that queued = admitted + shed + abandoned + failed (else it
        looks like a leak)."""
        if self.metrics is None:
            return
        self.metrics.flow_decisions.labels(
            request.tenant, request.request_class.value, decision, reason
        ).inc()
        self.metrics.flow_queue_wait.labels(request.request_class.value).observe(
            max(0.0, self.controller.now() - request.arrival_s)
        )

    def _bound_gauge(self) -> None:
        if self.metrics is None:
            return
        fraction = self.controller.itl_fraction
        if self.controller.settings.enabled and fraction is not None:
            self.metrics.flow_itl_bound.set(fraction)
        else:  # off (or turned off by a reload): no bound is in force
            self.metrics.flow_itl_bound.clear()

    def _queue_gauges(self) -> None:
        if self.metrics is None:
            return
        for request_class in RequestClass:
            self.metrics.flow_queue_length.labels(request_class.value).set(
                self.controller.queue.length(request_class)
            )


def _with_reservation(routed: Any, reserved: BudgetReservation | None) -> Any:
    """``routed`` carrying what its admission reserved of the prompt budget, to settle when
    the request ends."""
    if reserved is None:
        return routed
    return dataclasses.replace(routed, budget_reserved=reserved)


def _counted(tokens: object) -> bool:
    """A usage figure worth charging: a positive int (``True`` is not a count)."""
    return isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0


def _too_many(message: str, retry_after_s: float) -> GatewayError:
    return GatewayError(
        429,
        errors.RATE_LIMITED,
        message,
        headers={"Retry-After": str(max(1, round(retry_after_s)))},
    )


_MESSAGES = {
    "predicted_ttft_over_slo": "The fleet is saturated and this request's predicted time to "
    "first token is over its SLO; it was not queued (sheddable class).",
    "slo_unreachable": "The fleet is saturated: this request waited in the gateway queue until "
    "it could no longer meet its time-to-first-token SLO.",
    "queue_wait_exceeded": "The fleet is saturated: this request waited in the gateway queue "
    "for the longest wait allowed (flow_control.max_queue_wait_ms).",
    "queue_full": "The fleet is saturated and the gateway queue is full.",
}


def _refusal(verdict: Verdict) -> GatewayError:
    message = _MESSAGES.get(verdict.reason, "The fleet is saturated.")
    return _too_many(f"{message} Retry after the time in Retry-After.", verdict.retry_after_s)


class _FlowDeps(Protocol):
    """What ``flow_finished`` and ``flow_not_sent`` read from the gateway (``GatewayState`` is
    one)."""

    @property
    def flow(self) -> FlowGate | None: ...
    @property
    def background(self) -> set[asyncio.Task[Any]]: ...


def flow_finished(
    gw: _FlowDeps,
    policy: Policy | None,
    tenant: str,
    usage: Any,
    request_id: str | None = None,
    tpot_ms: float | None = None,
    reserved: BudgetReservation | None = None,
) -> None:
    """Tell flow control a request ended (with its TPOT, when it streamed two tokens or more);
    its budget charge runs as a tracked background task."""
    if gw.flow is None:
        return
    charge = gw.flow.request_finished(policy, tenant, usage, request_id, tpot_ms, reserved)
    if charge is not None:
        run_in_background(gw.background, charge, "fleetgate-token-budget")


def flow_not_sent(gw: _FlowDeps, policy: Policy | None, routed: Routed) -> None:
    """Tell flow control a request it admitted was never sent; what was reserved for it in
    its tenant's budget is given back as a tracked background task."""
    if gw.flow is None:
        return
    give_back = gw.flow.not_sent(policy, routed)
    if give_back is not None:
        run_in_background(gw.background, give_back, "fleetgate-token-budget")


def build_flow_gate(
    redis_url: str | None,
    key_prefix: str | None,
    metrics: GatewayMetrics | None,
    replica_states: Callable[[], Iterable[ReplicaState]] = tuple,
    policy: Callable[[], Policy | None] | None = None,
) -> FlowGate:
    """The gateway's flow gate: token budgets in Redis when the gateway has Redis, else memory;
    saturation judged on ``replica_states`` (the registry's replicas)."""
    store: BudgetStore
    if redis_url:
        from gateway.token_budgets import RedisBudgetStore

        store = RedisBudgetStore(redis_url)
    else:
        store = MemoryBudgetStore()
    return FlowGate(
        metrics, store, key_prefix or "fleetgate:", replica_states=replica_states, policy=policy
    )
