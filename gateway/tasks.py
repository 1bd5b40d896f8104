"""Background loops of a running gateway: replica health, shared in-flight counts, policy polling.

Each is started and cancelled in the app's ``cleanup_ctx`` (see ``gateway/app.py``).
"""

from __future__ import annotations

import asyncio
import logging

from gateway.reload import policy_file_changed, reload_policy
from gateway.state import GatewayState

log = logging.getLogger(__name__)


async def health_loop(gw: GatewayState) -> None:
    """Poll replicas (health, models, engine metrics) and merge agent-registered replicas."""
    while True:
        # One bad merge or poll must not end the loop: nothing would poll replicas again.
        if gw.fleet_store is not None:
            try:
                await merge_fleet_store(gw)
            except Exception:
                log.exception("taking in the replicas agents registered failed")
        try:
            await gw.registry.poll_once(gw.http(), timeout_s=max(2.0, gw.config.health_interval_s))
        except Exception:
            log.exception("replica health poll failed")
        if gw.upstream is not None:
            gw.upstream.close_idle()  # idle keep-alive connections past their timeout
        await asyncio.sleep(gw.config.health_interval_s)


async def merge_fleet_store(gw: GatewayState) -> None:
    """Take in the replicas agents registered (Redis or in-memory fleet store)."""
    registry = gw.registry
    try:
        states = await gw.fleet_store.list_replicas()
        departed = await gw.fleet_store.departed()
    except Exception as exc:  # Redis down: keep the replicas we know
        # Once per outage (it was every health interval: thousands of lines an hour).
        level = logging.DEBUG if registry.discovery_error is not None else logging.WARNING
        log.log(level, "fleet store unavailable: %s; keeping the replicas known", exc)
        registry.discovery_error = f"{type(exc).__name__}: {exc}"
        return
    if registry.discovery_error is not None:
        log.info("fleet store readable again")
        registry.discovery_error = None
    registry.sync_discovered(states, departed)


async def inflight_loop(gw: GatewayState, interval_s: float = 0.25) -> None:
    """Share in-flight counts with the other gateways (a no-op for the memory tracker)."""
    while True:
        await gw.inflight.sync()
        gw.meter.refresh()  # replica time is shared at the counts just read
        await asyncio.sleep(interval_s)


async def policy_poll_loop(gw: GatewayState) -> None:
    """Reload the policy when its file changes on disk."""
    while True:
        await asyncio.sleep(gw.config.policy_poll_s)
        try:  # one bad read must not end the loop: no change on disk would be taken in again
            if policy_file_changed(gw):
                reload_policy(gw)
        except Exception:
            log.exception("policy file poll failed")
