"""Background Responses (``"background": true``): accounted when they end, not when they start.

vLLM answers such a request at once (``status: "queued"``, no usage) and generates in the
background; the client polls ``GET /v1/responses/{id}``. Accounted at that first answer, the
request would be charged nothing: no tokens in the metrics or the cost, nothing against the
tenant's token budget, an end-to-end time of a few milliseconds. So the gateway watches each one
it forwarded: it asks the replica that holds it for its state (every ``interval_s``, a bounded
number at a time) until a terminal status (completed, incomplete, failed, cancelled), then settles
the request with the usage the engine reports, once.

Kept in memory by the gateway that forwarded the request: a gateway that restarts, or a response
the replica no longer knows, is settled with what is known (no usage: nothing charged), and so is
one still running after ``give_up_s``. The gateway's in-flight count does not include a background
response while it runs; the engine's own gauges (``running``, ``waiting``) do.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from gateway.background import run_in_background
from routing.types import ReplicaId

log = logging.getLogger(__name__)

__all__ = ["TERMINAL_STATUSES", "BackgroundResponses", "is_background_start"]

#: A Responses ``status`` after which the engine generates nothing more.
TERMINAL_STATUSES = frozenset({"completed", "incomplete", "failed", "cancelled"})
#: Called once with the finished response's ``usage`` (the Responses shape; None: unknown) and
#: its final ``status`` (None: unknown, the response was lost or given up on).
Settle = Callable[[Mapping[str, Any] | None, str | None], None]


def is_background_start(body: Mapping[str, Any], answer: Mapping[str, Any] | None) -> bool:
    """The engine accepted a background request and is still generating it."""
    return (
        body.get("background") is True
        and isinstance(answer, Mapping)
        and answer.get("status") not in TERMINAL_STATUSES
    )


@dataclass
class _Watched:
    replica: ReplicaId
    settle: Settle
    since: float


class BackgroundResponses:
    """The background responses this gateway forwarded, watched until they end."""

    def __init__(
        self,
        replica_url: Callable[[ReplicaId], str | None],
        http: Callable[[], aiohttp.ClientSession],
        background: set[asyncio.Task[Any]],
        *,
        interval_s: float = 1.0,
        give_up_s: float = 3600.0,
        max_watched: int = 10_000,
        concurrency: int = 16,
    ) -> None:
        self._replica_url = replica_url
        self._http = http
        self._background = background
        self.interval_s = interval_s
        self.give_up_s = give_up_s
        self.max_watched = max_watched
        self._concurrency = concurrency
        self._watched: dict[str, _Watched] = {}
        self._loop: asyncio.Task[Any] | None = None

    def __len__(self) -> int:
        return len(self._watched)

    def watch(self, response_id: str, replica: ReplicaId, settle: Settle) -> None:
        """Settle ``response_id`` (held by ``replica``) once it ends."""
        if len(self._watched) >= self.max_watched:
            log.warning(
                "%d background responses watched already; %s is accounted without its usage",
                len(self._watched),
                response_id,
            )
            _settle(settle, None, None, response_id)
            return
        self._watched[response_id] = _Watched(replica, settle, time.monotonic())
        if self._loop is None or self._loop.done():
            self._loop = run_in_background(
                self._background, self._run(), "fleetgate-background-responses"
            )

    async def _run(self) -> None:
        limit = asyncio.Semaphore(self._concurrency)
        while self._watched:
            await asyncio.sleep(self.interval_s)
            await asyncio.gather(*(self._check(rid, limit) for rid in list(self._watched)))

    async def _check(self, response_id: str, limit: asyncio.Semaphore) -> None:
        watched = self._watched.get(response_id)
        if watched is None:
            return
        url = self._replica_url(watched.replica)
        if url is None:  # the replica left the fleet, and the response with it
            self._finish(response_id, None, "its replica left the fleet")
            return
        async with limit:
            answer = await self._read(f"{url}/v1/responses/{response_id}")
        if answer == "gone":
            self._finish(response_id, None, None, "its replica no longer knows it")
        elif isinstance(answer, Mapping) and answer.get("status") in TERMINAL_STATUSES:
            usage = answer.get("usage")
            usage = usage if isinstance(usage, Mapping) else None
            self._finish(response_id, usage, str(answer["status"]), None)
        elif time.monotonic() - watched.since > self.give_up_s:
            self._finish(response_id, None, None, f"still running after {self.give_up_s:.0f} s")

    async def _read(self, url: str) -> Mapping[str, Any] | str | None:
        """The response's state; "gone" when the replica answers 404; None when unknown now."""
        timeout = aiohttp.ClientTimeout(total=max(1.0, self.interval_s * 5))
        try:
            async with self._http().get(url, timeout=timeout) as resp:
                if resp.status == 404:
                    return "gone"
                if resp.status != 200:
                    return None
                answer = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("background response read %s failed: %s", url, exc)
            return None
        return answer if isinstance(answer, Mapping) else None

    def _finish(
        self,
        response_id: str,
        usage: Mapping[str, Any] | None,
        status: str | None,
        why: str | None,
    ) -> None:
        watched = self._watched.pop(response_id, None)
        if watched is None:
            return
        if why is not None:
            log.warning(
                "background response %s is accounted without its usage: %s", response_id, why
            )
        _settle(watched.settle, usage, status, response_id)


def _settle(
    settle: Settle, usage: Mapping[str, Any] | None, status: str | None, response_id: str
) -> None:
    try:
        settle(usage, status)
    except Exception:  # accounting must never stop the watch of the others
        log.exception("settling background response %s failed", response_id)
