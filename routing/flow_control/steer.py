"""Steering (critical, and on a calm fleet), driven the same way by the gateway and the simulator.

Ask the controller which replicas have room (``FlowController.steer_candidates``), route again
among them the driver's own way, and keep the new decision only if the controller takes it
(``takes_steer``); otherwise the request stays as routing first judged it. Routing again may
fail (those replicas went away meanwhile): routing's first choice then stands.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from routing.contracts import RoutingRequest
from routing.flow_control.classes import FlowRequest
from routing.flow_control.controller import FlowController
from routing.flow_control.estimate import FleetEstimate
from routing.types import ReplicaId

__all__ = ["Steering", "steer_request"]

log = logging.getLogger(__name__)

#: A driver's routed request: the gateway's ``RouteDecision``, the simulator's ``RoutingDecision``.
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Steering(Generic[T]):
    """Where the request goes, flow control's estimate of it there, and whether it moved."""

    routed: T
    estimate: FleetEstimate
    steered: bool


async def steer_request(
    controller: FlowController,
    request: FlowRequest,
    routed: T,
    routing_request: RoutingRequest,
    estimate_of: Callable[[T], FleetEstimate],
    route_among: Callable[[frozenset[ReplicaId]], Awaitable[T]],
    *,
    queued: bool = False,
) -> Steering[T]:
    """``routed`` as it stands, or routed again among the replicas with room when the
    controller steers ``request`` (docs/flow-control.md, *Critical steering* and *Calm
    steering*); ``queued``: ``request`` is the queue's head, about to be judged again, and
    the replicas offered are the idle ones (*Releasing the queue*)."""
    estimate = estimate_of(routed)
    if queued:
        room = controller.head_steer_candidates(request, estimate)
    else:
        room = controller.steer_candidates(request, estimate)
    if room is None:
        return Steering(routed, estimate, False)
    # Routing again judges the request afresh; kept only if the new decision is taken.
    judged = routing_request.overflow, routing_request.candidates
    try:
        again = await route_among(room)
    except Exception:  # e.g. those replicas went away meanwhile
        log.debug("routing request %s again failed", request.request_id, exc_info=True)
    else:
        again_estimate = estimate_of(again)
        if (
            controller.takes_head_steer(request, again_estimate)
            if queued
            else controller.takes_steer(request, estimate, again_estimate)
        ):
            return Steering(again, again_estimate, True)
    routing_request.overflow, routing_request.candidates = judged
    return Steering(routed, estimate, False)
