"""Tenants' token budgets shared by every gateway through Redis (``routing.flow_control.budgets``).

A reservation is one Lua script, so two gateways racing for the last tokens of a window cannot
both win. Redis down: budgets are not enforced (degrade, don't fail), and the counters expire with
their window. After a failed call the store leaves Redis alone for ``OUTAGE_S`` and logs once: a
Redis that hangs rather than refuses made every budgeted request wait out two timeouts (about 2 s
added to its TTFT, on every gateway), and logged it each time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from routing.flow_control.budgets import BudgetStore

__all__ = ["RedisBudgetStore"]

log = logging.getLogger(__name__)

#: Seconds the store leaves Redis alone after a failed call (budgets not enforced meanwhile).
OUTAGE_S = 5.0

_T = TypeVar("_T")

#: KEYS[1] counter; ARGV amount, limit, ttl_s. Returns 1 if reserved, 0 if it would not fit.
_RESERVE = """
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
if used + tonumber(ARGV[1]) > tonumber(ARGV[2]) then return 0 end
redis.call('INCRBY', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""

#: KEYS[1] counter; ARGV amount (negative: tokens given back), ttl_s. A counter never goes below
#: zero: a give-back whose reservation never reached Redis (it was down) must not bank credit.
_ADD = """
local value = redis.call('INCRBY', KEYS[1], ARGV[1])
if value < 0 then redis.call('SET', KEYS[1], 0) end
redis.call('EXPIRE', KEYS[1], ARGV[2])
return value
"""


class RedisBudgetStore(BudgetStore):
    """Budget counters in Redis; keys ``<prefix>budget:<tenant>:<kind>:<minute>``."""

    def __init__(self, redis_url: str, clock: Callable[[], float] = time.monotonic) -> None:
        from routing.redis_clients import bounded_client

        self._redis = bounded_client(redis_url, 0.5)
        self._reserve = self._redis.register_script(_RESERVE)
        self._add = self._redis.register_script(_ADD)
        self._clock = clock
        #: Until then (``clock``), Redis is left alone: a call has just failed.
        self._skip_until = 0.0

    async def _call(self, what: str, call: Callable[[], Awaitable[_T]], degraded: _T) -> _T:
        """``call``'s result, or ``degraded`` (budgets not enforced) while Redis is failing."""
        if self._clock() < self._skip_until:
            return degraded
        try:
            return await call()
        except Exception as exc:  # Redis down, slow or full: admit rather than refuse everyone
            if self._clock() >= self._skip_until:  # once per outage, not once per request
                log.warning(
                    "token budget %s through Redis failed (%s); budgets are not enforced for "
                    "the next %.0f s",
                    what,
                    exc,
                    OUTAGE_S,
                )
            self._skip_until = self._clock() + OUTAGE_S
            return degraded

    async def reserve(self, key: str, amount: int, limit: int, ttl_s: int) -> bool:
        async def run() -> bool:
            return bool(await self._reserve(keys=[key], args=[amount, limit, ttl_s]))

        return await self._call("reservation", run, True)

    async def used(self, key: str) -> int:
        async def run() -> int:
            value = await self._redis.get(key)
            return int(value) if value is not None else 0

        return await self._call("read", run, 0)

    async def add(self, key: str, amount: int, ttl_s: int) -> None:
        async def run() -> None:
            await self._add(keys=[key], args=[amount, ttl_s])

        await self._call("charge", run, None)

    async def close(self) -> None:
        await self._redis.aclose()
