"""Flow control settings: the ``flow_control:`` section and each tenant's class and budgets."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from routing.config.base import (
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    StrictModel,
)

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
    #: A replica is full when its predicted queue wait is over this ...
    saturation_queue_wait_ms: NonNegativeFloat = 30.0
    #: ... or its decode interference is (null: judge by queue wait alone).
    saturation_decode_interference_ms: NonNegativeFloat | None = 50.0
    #: Requests the gateway queue holds, all classes together.
    max_queue_length: NonNegativeInt = 1000
    #: Longest wait in the queue; null: until the request can no longer meet its TTFT SLO.
    max_queue_wait_ms: PositiveFloat | None = None
