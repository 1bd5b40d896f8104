"""Flow control: request classes, the priority + weighted-fair gateway queue, SLO-aware
admission and token budgets. Pure logic with an injected clock, no I/O: the gateway drives it
with asyncio (``gateway/flow_control.py``), ``fleetgate simulate`` on its virtual clock.
See docs/flow-control.md.
"""

from routing.flow_control.budgets import (
    BudgetCheck,
    BudgetReservation,
    BudgetStore,
    MemoryBudgetStore,
    TokenBudget,
    TokenBudgets,
)
from routing.flow_control.classes import (
    PRIORITY_HEADER,
    FlowRequest,
    RequestClass,
    parse_request_class,
)
from routing.flow_control.controller import (
    Decision,
    FlowController,
    FlowControlSettings,
    ShedReason,
    Verdict,
)
from routing.flow_control.estimate import FleetEstimate, estimate_from_decision
from routing.flow_control.queue import FairQueue
from routing.flow_control.steer import Steering, steer_request

__all__ = [
    "PRIORITY_HEADER",
    "BudgetCheck",
    "BudgetReservation",
    "BudgetStore",
    "Decision",
    "FairQueue",
    "FleetEstimate",
    "FlowControlSettings",
    "FlowController",
    "FlowRequest",
    "MemoryBudgetStore",
    "RequestClass",
    "ShedReason",
    "Steering",
    "TokenBudget",
    "TokenBudgets",
    "Verdict",
    "estimate_from_decision",
    "parse_request_class",
    "steer_request",
]
