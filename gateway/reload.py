"""Policy reload without a restart: SIGHUP, file-change polling and ``POST /admin/policy/reload``.

A new file is validated in full before anything changes; if it is refused, its errors are kept
for the admin API and logged, and the running policy stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass, field

from gateway.auth import warn_if_admin_key_is_a_tenants
from gateway.background import run_in_background
from gateway.policy_view import from_policy, policy_digest
from gateway.routing_glue import build_profiles
from gateway.state import GatewayState

log = logging.getLogger(__name__)


@dataclass
class ReloadResult:
    """Outcome of one reload attempt."""

    ok: bool
    errors: list[str] = field(default_factory=list)
    summary: str | None = None
    #: Settings of an applied file that take effect only on a restart (the running ones stay).
    restart_needed: list[str] = field(default_factory=list)


def reload_policy(gw: GatewayState) -> ReloadResult:
    """Load, validate and swap in the policy file; keep the running policy if it is invalid."""
    from routing.config import PolicyError, load_policy

    path = gw.config.policy_path
    if path is None:
        return ReloadResult(False, ["no policy file configured (running policy-less)"])
    try:
        seen = file_identity(path)
        policy = load_policy(path)
        view = from_policy(policy)
        profiles = build_profiles(view)
        stale: list[str] = []
        if gw.adapters is not None:
            # Last check before the swap: it refuses (changing nothing) or takes the new catalog.
            stale = gw.adapters.update_policy(policy)  # logs the runtime additions it drops
    except PolicyError as exc:
        return _refused(gw, [str(e) for e in exc.errors], path)
    except (OSError, ValueError, TypeError) as exc:  # InvalidAdapter is a ValueError
        return _refused(gw, [f"{path}: {exc}"], path)
    except Exception as exc:  # a reader's bug must not cost the running policy, nor the poller
        log.exception("reading the policy file %s failed", path)
        return _refused(gw, [f"{path}: could not be read ({type(exc).__name__}: {exc})"], path)
    kept = gw.config.needs_restart(policy)
    gw.engine.replace_profiles(profiles)
    gw.config.apply_policy(policy)
    gw.max_retries = gw.config.max_retries
    gw.policy = view
    warn_if_admin_key_is_a_tenants(gw.config.admin_key, view)
    gw.registry.set_static(view.replicas)
    gw.registry.set_pool_speeds(view.pool_speeds)
    gw.policy_file_seen = seen
    gw.policy_errors = []
    gw.restart_needed = kept
    if stale and gw.adapters is not None:
        _unload_in_background(gw, stale)
    gw.metrics.policy_reloads.labels("ok").inc()
    gw.metrics.set_policy(policy_digest(policy), view.routes)
    summary = policy.summary() if hasattr(policy, "summary") else None
    log.info("policy reloaded from %s: %s", path, summary)
    for warning in getattr(policy, "warnings", list)():
        log.warning("policy %s: %s", path, warning)
    if kept:
        # Everything else of the file is in force; these need the process to start again.
        log.warning(
            "policy %s: reloaded, but these settings apply only on a restart (the running ones "
            "are kept): %s",
            path,
            "; ".join(kept),
        )
    return ReloadResult(True, [], summary, kept)


def _refused(gw: GatewayState, problems: list[str], path: str) -> ReloadResult:
    gw.policy_errors = problems
    # Remember the refused file's mtime so polling does not retry it every interval.
    with contextlib.suppress(OSError):
        gw.policy_file_seen = file_identity(path)
    gw.metrics.policy_reloads.labels("rejected").inc()
    log.error("policy reload refused, keeping the running policy:\n  %s", "\n  ".join(problems))
    return ReloadResult(False, problems)


def file_identity(path: str) -> tuple[float, int]:
    """A policy file's modification time and inode (following a symlink, as kubelet's swap of a
    ConfigMap's ``..data`` is): a new file with the same time and size (``rsync -t``) is still
    noticed. ``OSError`` if it cannot be read."""
    stat = os.stat(path)
    return stat.st_mtime, stat.st_ino


def policy_file_changed(gw: GatewayState) -> bool:
    """True if the policy file's mtime or inode differs from the one last loaded (or refused),
    and the file has stayed as it is since the previous poll (its mtime and size).

    A file written in place is read only once it settles: a poll that caught it half-written,
    still valid YAML, applied the half (the reload review: two adapters unloaded fleet-wide, one
    mid-stream, until the rest arrived). A file that cannot be read (deleted, a broken mount) is
    said once, and once again when it is back: the running policy stays either way.
    """
    path = gw.config.policy_path
    if path is None:
        return False
    try:
        stat = os.stat(path)
    except OSError as exc:
        if not gw.policy_file_missing:
            gw.policy_file_missing = True
            log.warning(
                "policy file %s cannot be read (%s); the running policy stays until it is back",
                path, exc.strerror or exc,
            )
        return False
    if gw.policy_file_missing:
        gw.policy_file_missing = False
        log.warning("policy file %s can be read again", path)
    if (stat.st_mtime, stat.st_ino) == gw.policy_file_seen:
        gw.policy_settling = None
        return False
    stamp = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
    if stamp != gw.policy_settling:  # changed since the last poll: perhaps still being written
        gw.policy_settling = stamp
        return False
    gw.policy_settling = None
    return True


#: How long a reload's unload of a removed (or re-sourced) adapter waits, on each replica, for
#: the requests using it there to end; then it goes anyway.
UNLOAD_WAIT_IDLE_S = 300.0


def _unload_in_background(gw: GatewayState, names: list[str]) -> None:
    """Unload adapters the reload removed or pointed at other weights, from every replica that
    holds them, each once the requests using it there have ended (at most
    ``UNLOAD_WAIT_IDLE_S``): a tracked background task, so the reload itself stays synchronous.
    Until then a re-sourced adapter still answers with its old weights there."""
    registry = gw.adapters
    assert registry is not None

    async def unload_one(name: str) -> None:
        failures = await registry.unload_everywhere(
            name, gw.registry.adapter_states(), reason="replaced", wait_idle_s=UNLOAD_WAIT_IDLE_S,
            only_replaced=True,
        )
        for failure in failures:
            log.warning("after the policy reload, unloading %s failed: %s", name, failure)

    async def unload() -> None:
        # At once, not at the next pre-warm round (30 s): a gateway still on the old policy
        # would pre-warm a removed adapter from the counts this one published for it.
        await registry.share_traffic()
        await asyncio.gather(*(unload_one(name) for name in names))

    work = unload()
    try:
        run_in_background(gw.background, work, "fleetgate-adapter-unload")
    except RuntimeError:  # reloaded outside the gateway's loop (a script): nothing to drive it
        work.close()
        log.warning("adapters %s changed; unload them from the replicas", ", ".join(names))
