"""Per-tenant token budgets: prompt and completion tokens per minute, in fixed one-minute windows.

A request is admitted if its prompt tokens fit in what is left of the tenant's prompt budget
(they are reserved at once, atomically, so two gateways cannot both spend the last tokens) and
the completion budget is not yet spent; its completion tokens are charged when it finishes.
A refusal is a 429 like any shed request, ``Retry-After`` the seconds to the next window.

The store is a protocol: ``MemoryBudgetStore`` here (one gateway, the simulator, tests), a Redis
store in the gateway (shared by every gateway: ``gateway/token_budgets.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "WINDOW_S",
    "BudgetCheck",
    "BudgetReservation",
    "BudgetStore",
    "MemoryBudgetStore",
    "TokenBudget",
    "TokenBudgets",
]

#: Budgets are per minute: one fixed window.
WINDOW_S = 60


@dataclass(frozen=True, slots=True)
class TokenBudget:
    """A tenant's tokens per minute (None: unlimited)."""

    prompt_tokens_per_minute: int | None = None
    completion_tokens_per_minute: int | None = None


@dataclass(frozen=True, slots=True)
class BudgetReservation:
    """Prompt tokens reserved for one request, and the window they went into."""

    tokens: int
    window: int


@dataclass(frozen=True, slots=True)
class BudgetCheck:
    """The answer for one request: admitted, or which budget is spent and when it refills."""

    admitted: bool
    #: ``prompt`` or ``completion`` when refused.
    exhausted: str | None = None
    retry_after_s: float = 0.0
    #: The window the prompt tokens were reserved in (``release`` gives them back there).
    window: int | None = None
    #: False when the prompt alone is over the tenant's prompt budget: no window can admit it,
    #: so retrying cannot help (the gateway answers 400, not 429).
    can_fit: bool = True


class BudgetStore(Protocol):
    """Counters per (tenant, kind, window); the Redis store shares them between gateways."""

    async def reserve(self, key: str, amount: int, limit: int, ttl_s: int) -> bool:
        """Add ``amount`` to ``key`` if the total stays <= ``limit``; True if it was added."""
        ...

    async def used(self, key: str) -> int:
        """The counter's value (0 if absent)."""
        ...

    async def add(self, key: str, amount: int, ttl_s: int) -> None:
        """Add ``amount`` unconditionally (completion tokens, charged after the fact; negative:
        prompt tokens given back), never taking the counter below zero."""
        ...


class MemoryBudgetStore:
    """Counters in this process; old windows are dropped as new ones start."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._window_of_key: dict[str, str] = {}

    async def reserve(self, key: str, amount: int, limit: int, ttl_s: int) -> bool:
        used = self._counts.get(key, 0)
        if used + amount > limit:
            return False
        self._counts[key] = used + amount
        return True

    async def used(self, key: str) -> int:
        return self._counts.get(key, 0)

    async def add(self, key: str, amount: int, ttl_s: int) -> None:
        self._counts[key] = max(0, self._counts.get(key, 0) + amount)

    def drop_windows_before(self, window: int) -> None:
        """Forget counters of windows older than ``window`` (memory stays bounded)."""
        for key in [k for k in self._counts if int(k.rsplit(":", 1)[1]) < window]:
            del self._counts[key]


class TokenBudgets:
    """Checks and charges tenants' token budgets against a store, on an injected clock."""

    def __init__(
        self, store: BudgetStore, clock: Callable[[], float], key_prefix: str = "fleetgate:"
    ) -> None:
        self.store = store
        self._clock = clock
        self._prefix = key_prefix

    def _window(self) -> tuple[int, float]:
        now = self._clock()
        window = int(now // WINDOW_S)
        return window, (window + 1) * WINDOW_S - now

    def _key(self, tenant: str, kind: str, window: int) -> str:
        return f"{self._prefix}budget:{tenant}:{kind}:{window}"

    async def admit(self, tenant: str, budget: TokenBudget, prompt_tokens: int) -> BudgetCheck:
        """Reserve the prompt tokens if they fit; refuse if either budget is spent."""
        window, left_s = self._window()
        retry = float(max(1, math.ceil(left_s)))
        limit = budget.completion_tokens_per_minute
        if limit is not None:
            used = await self.store.used(self._key(tenant, "completion", window))
            if used >= limit:
                return BudgetCheck(False, "completion", retry)
        limit = budget.prompt_tokens_per_minute
        if limit is not None:
            if prompt_tokens > limit:
                return BudgetCheck(False, "prompt", retry, can_fit=False)
            key = self._key(tenant, "prompt", window)
            if not await self.store.reserve(key, prompt_tokens, limit, 2 * WINDOW_S):
                return BudgetCheck(False, "prompt", retry)
        if isinstance(self.store, MemoryBudgetStore):
            self.store.drop_windows_before(window)
        return BudgetCheck(True, window=window)

    async def release(
        self, tenant: str, budget: TokenBudget, prompt_tokens: int, window: int | None
    ) -> None:
        """Give back the prompt tokens ``admit`` reserved in ``window`` (the request was refused
        after all). Into that window, not the current one: a request queued across a minute
        boundary must not drive the new minute's counter below zero. A window already over
        takes nothing back (its tokens are forgotten with it)."""
        if budget.prompt_tokens_per_minute is None or prompt_tokens <= 0 or window is None:
            return
        if window < self._window()[0]:
            return
        await self.store.add(self._key(tenant, "prompt", window), -prompt_tokens, 2 * WINDOW_S)

    async def settle_prompt(
        self, tenant: str, budget: TokenBudget, reserved: BudgetReservation, engine_tokens: int
    ) -> None:
        """A finished request's prompt as the engine counted it, against what ``admit``
        reserved (the gateway's tokenizer, or an estimate without one): more is charged to the
        current window, less given back to the reservation's (``release``)."""
        if budget.prompt_tokens_per_minute is None:
            return
        more = engine_tokens - reserved.tokens
        if more > 0:
            window, _ = self._window()
            await self.store.add(self._key(tenant, "prompt", window), more, 2 * WINDOW_S)
        elif more < 0:
            await self.release(tenant, budget, -more, reserved.window)

    async def charge_completion(self, tenant: str, budget: TokenBudget, tokens: int) -> None:
        """Count a finished request's completion tokens against the current window."""
        if budget.completion_tokens_per_minute is None or tokens <= 0:
            return
        window, _ = self._window()
        await self.store.add(self._key(tenant, "completion", window), tokens, 2 * WINDOW_S)
