"""Request classes: what a request may cost others when the fleet is saturated.

``critical`` is never held or refused while a replica is up; ``standard`` waits in the gateway
queue; ``sheddable`` is refused at once (429) when its predicted TTFT cannot meet its SLO.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["PRIORITY_HEADER", "FlowRequest", "RequestClass", "parse_request_class"]

#: The request header that overrides a tenant's class, where the tenant allows it.
PRIORITY_HEADER = "x-fleetgate-priority"


class RequestClass(enum.StrEnum):
    """A request's class; ``rank`` orders them (0 is served first)."""

    CRITICAL = "critical"
    STANDARD = "standard"
    SHEDDABLE = "sheddable"

    @property
    def rank(self) -> int:
        """Strict priority: a lower rank is always dequeued first."""
        return _RANKS[self]

    @property
    def engine_priority(self) -> int:
        """vLLM's request ``priority`` under ``--scheduling-policy priority`` (lower first):
        standard is vLLM's default 0, so a request that reached the engine some other way
        counts as standard."""
        return _RANKS[self] - 1


_RANKS = {RequestClass.CRITICAL: 0, RequestClass.STANDARD: 1, RequestClass.SHEDDABLE: 2}


def parse_request_class(value: str) -> RequestClass:
    """A class from its name (case-insensitive); ``ValueError`` names the accepted values."""
    try:
        return RequestClass(value.strip().lower())
    except ValueError:
        names = ", ".join(c.value for c in RequestClass)
        raise ValueError(f"must be one of {names} (got {value!r})") from None


@dataclass(frozen=True, slots=True)
class FlowRequest:
    """What flow control knows about one request: who sent it, its class, SLO and arrival."""

    request_id: str
    #: A policy tenant name (server-controlled: fine as a metric label).
    tenant: str
    request_class: RequestClass
    #: The TTFT the request is judged against (its tenant's, else its route's, else the default).
    ttft_slo_ms: float
    #: The tenant's share inside its class (weighted fair queuing).
    weight: float
    #: Seconds on the controller's clock.
    arrival_s: float
    #: The TPOT the request is judged against (ms; None: it has none).
    tpot_slo_ms: float | None = None
    #: The most tokens it asked for (``max_tokens``; None: not given): a critical request's
    #: decode is protected from stalls in proportion (``DecodeGuard``).
    max_output_tokens: int | None = None
    #: The replicas it can go to, by name (the gateway's base model): it queues only behind
    #: requests of its own pool, so a saturated model never holds up an idle one.
    pool: str = ""
    #: No replica's context holds its prompt and the output it asked for: the engine refuses
    #: it at once (vLLM's 400), so flow control lets it through rather than hold or shed it.
    fits_no_replica: bool = False
