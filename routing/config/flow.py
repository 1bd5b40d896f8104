"""Flow control settings: the ``flow_control:`` section and each tenant's class and budgets."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from routing.config.base import (
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    StrictModel,
)
from routing.gone_keys import refuse_gone_keys

#: A request class as the YAML and the ``x-fleetgate-priority`` header name it.
PriorityName = Literal["critical", "standard", "sheddable"]


class TokenBudgetSpec(StrictModel):
    """A tenant's tokens per minute (one-minute windows, shared by every gateway via Redis)."""

    prompt_tokens_per_minute: PositiveInt | None = None
    completion_tokens_per_minute: PositiveInt | None = None

    @model_validator(mode="after")
    def _not_empty(self) -> TokenBudgetSpec:
        if self.prompt_tokens_per_minute is None and self.completion_tokens_per_minute is None:
            raise ValueError(
                "give prompt_tokens_per_minute and/or completion_tokens_per_minute "
                "(or drop 'token_budget')"
            )
        return self


class FlowControlSpec(StrictModel):
    """The gateway's flow control (docs/flow-control.md): off unless ``enabled``."""

    enabled: bool = False
    #: A replica is full when this many requests wait to start there (its engine's waiting
    #: queue, or this gateway's requests beyond what it reports running) ...
    saturation_backlog_requests: PositiveInt = 2
    #: ... or its KV cache usage is at least this fraction. Saturated = every replica full.
    saturation_kv_usage: float = Field(default=0.92, gt=0, le=1)
    #: Optional (null: off): also full when its predicted queue wait is over this ...
    saturation_queue_wait_ms: NonNegativeFloat | None = None
    #: ... or its decode interference is.
    saturation_decode_interference_ms: NonNegativeFloat | None = None
    #: ... or its engine's recent time between output tokens is over this fraction of the
    #: request's TPOT SLO (its decodes are already slowed by the prefills sharing their steps).
    saturation_itl_fraction: PositiveFloat | None = 0.8
    #: Share of requests (every class) that should meet their TPOT SLO: each one that misses it
    #: lowers that bound a step, each one that meets it raises it a smaller step, so new work
    #: is held sooner while decodes run slow, and not while they keep pace (null: the bound
    #: stays fixed).
    tpot_target: float | None = Field(default=0.97, gt=0, lt=1)
    #: The lowest the bound goes, as a fraction of the TPOT SLO ...
    min_itl_fraction: PositiveFloat = 0.5
    #: ... and the highest.
    max_itl_fraction: PositiveFloat = 1.0
    #: Requests the gateway queue holds, all classes together.
    max_queue_length: NonNegativeInt = 1000
    #: Longest wait in the queue; null: until the request can no longer meet its TTFT SLO.
    max_queue_wait_ms: PositiveFloat | None = None
    #: Optional (null: off): admit, saturated or not, a request whose predicted TTFT is at most
    #: this fraction of its SLO (docs/flow-control.md says when it helps and when it hurts).
    admit_within_slo_fraction: float | None = Field(default=None, gt=0, le=1)
    #: Once any replica is full, hold a standard or sheddable request whose prefill would push
    #: a critical request's decode on the replica it was routed to past its TPOT SLO. Off by
    #: default: it trades other classes' goodput for critical TPOT (docs/flow-control.md,
    #: *Protected critical decodes*, measures both).
    protect_critical_decodes: bool = False
    #: A critical request routed to a replica whose decodes run too slow for its TPOT SLO (and
    #: not already past its TTFT SLO there) is routed again among the replicas with room, and
    #: goes there when its expected TTFT is no worse (docs/flow-control.md, *Critical
    #: steering*).
    steer_critical: bool = True
    #: A standard or sheddable request that would be held because routing chose a replica
    #: decoding too slowly while most of the fleet is full is routed again among the replicas
    #: with room, and admitted there if its expected TTFT meets its SLO, while the fleet is
    #: calm: nothing queued and nothing held for ``calm_window_s`` (docs/flow-control.md, *Calm
    #: steering*).
    steer_when_calm: bool = True
    #: Seconds without a request held after which the fleet counts as calm again.
    calm_window_s: NonNegativeFloat = 5.0
    #: Once at least half the fleet is full, a queue head routed to a replica at the backlog
    #: bound is not released there; held for that alone, it goes to an idle replica if what it
    #: waited plus its expected TTFT there meets its SLO (docs/flow-control.md, *Releasing the
    #: queue*). False: released whenever any replica has room.
    hold_for_backlog: bool = True
    #: The engines run vLLM's ``--scheduling-policy priority``: each chat or completion request
    #: carries its class as vLLM's ``priority`` (critical -1, standard 0, sheddable 1; a
    #: client's own ``priority`` is replaced). Applies whether or not ``enabled`` is set.
    engine_priority: bool = False

    _gone = refuse_gone_keys(
        {
            "critical_tpot_target": (
                "critical_tpot_target was renamed tpot_target: every request's TPOT now moves "
                "the inter-token bound, not only critical ones' (default 0.97; see "
                "docs/flow-control.md)"
            )
        }
    )

    @model_validator(mode="after")
    def _itl_range(self) -> FlowControlSpec:
        if self.max_itl_fraction < self.min_itl_fraction:
            raise ValueError(
                f"max_itl_fraction ({self.max_itl_fraction:g}) must be at least "
                f"min_itl_fraction ({self.min_itl_fraction:g})"
            )
        return self
