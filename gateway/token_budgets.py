"""Tenants' token budgets shared by every gateway through Redis (``routing.flow_control.budgets``).

A reservation is one Lua script, so two gateways racing for the last tokens of a window cannot
both win. Redis down: budgets are not enforced for that request (degrade, don't fail), and the
failure is logged; the counters expire with their window.
"""

from __future__ import annotations

import logging

from routing.flow_control.budgets import BudgetStore

__all__ = ["RedisBudgetStore"]

log = logging.getLogger(__name__)

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

    def __init__(self, redis_url: str) -> None:
        from routing.redis_clients import bounded_client

        self._redis = bounded_client(redis_url, 0.5)
        self._reserve = self._redis.register_script(_RESERVE)
        self._add = self._redis.register_script(_ADD)

    async def reserve(self, key: str, amount: int, limit: int, ttl_s: int) -> bool:
        try:
            return bool(await self._reserve(keys=[key], args=[amount, limit, ttl_s]))
        except Exception as exc:  # Redis down or slow: admit rather than refuse everyone
            log.warning("token budget reservation through Redis failed (%s); not enforced", exc)
            return True

    async def used(self, key: str) -> int:
        try:
            value = await self._redis.get(key)
        except Exception as exc:
            log.warning("token budget read through Redis failed (%s); not enforced", exc)
            return 0
        return int(value) if value is not None else 0

    async def add(self, key: str, amount: int, ttl_s: int) -> None:
        try:
            await self._add(keys=[key], args=[amount, ttl_s])
        except Exception as exc:
            log.warning("token budget charge through Redis failed (%s)", exc)

    async def close(self) -> None:
        await self._redis.aclose()
