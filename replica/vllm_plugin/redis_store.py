"""Synchronous Redis writes of the plugin (engine state and kernel-plugin reports).

Synchronous on purpose: the engine-state writes run on the publisher's own thread, and the
kernel-plugin report is written once at process start-up, before the engine serves anything. An
asyncio client would have to share vLLM's event loop, which is exactly what must not be delayed.
Every call is pipelined with a short socket timeout and no client-side retries (the publisher has
its own retry cadence; stacked retries would only stretch an outage).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from replica.vllm_plugin.kernels import aggregate_reports, pid_alive
from replica.vllm_plugin.keys import PluginKeys

__all__ = ["RedisStateStore", "connect"]


def connect(url: str, timeout_s: float) -> Any:
    """A ``redis.Redis`` client for ``url`` (``${NAME}`` expanded from the environment, so a
    password can come from a Secret; a Sentinel URL gives the primary its Sentinels name) with
    ``timeout_s`` socket timeouts, no retries."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from routing.redis_clients import expand_env
    from routing.redis_sentinel import is_sentinel_url, sentinel_sync_client

    url = expand_env(url)
    options: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 0,
    }
    if is_sentinel_url(url):
        return sentinel_sync_client(url, **options)
    return redis.Redis.from_url(url, **options)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisStateStore:
    """Writes one replica's plugin keys; ``client`` is a sync ``redis.Redis`` (or compatible)."""

    def __init__(self, client: Any, keys: PluginKeys, ttl_s: float) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 (got {ttl_s!r})")
        self._redis = client
        self.keys = keys
        self._ttl_ms = int(ttl_s * 1000)
        #: The other engine processes' kernel reports seen at earlier reconciles, by pid. Each
        #: process writes its report once, at start-up: after Redis lost them (a restart without
        #: persistence, a failover before replication) the aggregate held only this process's
        #: own, and a kernel that failed in the model worker read as loaded (the failover
        #: review). Re-asserted from here while their processes live.
        self._seen: dict[str, Mapping[str, Any]] = {}

    def write_engine(
        self,
        fields: Mapping[str, str] | None,
        engine_index: int = 0,
        kernel_report: Mapping[str, Any] | None = None,
        reconcile: bool = False,
        is_alive: Callable[[int], bool] = pid_alive,
    ) -> None:
        """Write one engine snapshot (None: keep the hash as is) and refresh every TTL.

        With ``reconcile`` (the caller asks every heartbeat period), the kernel keys are also
        rebuilt from ``kernel_procs``: entries of processes that no longer exist (an earlier
        incarnation of this replica) are dropped, this process's ``kernel_report`` is
        re-asserted (Redis may have lost it), and ``kernels``/``kernel_errors`` are recomputed
        from the live processes' reports — in one MULTI, so readers never see them half-built.
        """
        engine_key = self.keys.engine(engine_index)
        live = dead = None
        if reconcile:
            live, dead = self._live_reports(kernel_report, is_alive)
        pipe = self._redis.pipeline(transaction=reconcile)
        if fields:
            pipe.hset(engine_key, mapping=dict(fields))
        if live is not None and dead is not None:
            if dead:
                pipe.hdel(self.keys.kernel_procs, *dead)
            if live:  # this process's report, and those Redis lost of processes still alive
                pipe.hset(self.keys.kernel_procs, mapping={
                    str(report["pid"]): json.dumps(report, sort_keys=True) for report in live
                })
            loaded, errors = aggregate_reports(live)
            pipe.delete(self.keys.kernels, self.keys.kernel_errors)
            if loaded:
                pipe.hset(self.keys.kernels, mapping=loaded)
            if errors:
                pipe.hset(self.keys.kernel_errors, mapping=errors)
        for key in (engine_key, *self.keys.kernel_keys()):
            pipe.pexpire(key, self._ttl_ms)
        pipe.execute()

    def _live_reports(
        self, own: Mapping[str, Any] | None, is_alive: Callable[[int], bool]
    ) -> tuple[list[Mapping[str, Any]], list[str]]:
        """(reports of live processes, own included; fields of dead or unreadable entries)."""
        reports: dict[str, Mapping[str, Any]] = {}
        dead: list[str] = []
        for raw_pid, raw in self._redis.hgetall(self.keys.kernel_procs).items():
            pid = _text(raw_pid)
            try:
                report = json.loads(_text(raw))
                alive = is_alive(int(pid))
            except (ValueError, TypeError):
                alive = False  # not something this plugin wrote: drop it
            if alive:
                reports[pid] = report
            else:
                dead.append(pid)
        for pid, report in list(self._seen.items()):
            if pid in reports:
                continue
            if is_alive(int(pid)):
                reports[pid] = report  # lost by Redis, its process still running
            else:
                del self._seen[pid]
        if own is not None:
            reports[str(own["pid"])] = own
        self._seen.update(reports)
        return list(reports.values()), dead

    def write_kernel_report(self, report: Mapping[str, Any], ttl_s: float) -> None:
        """Record what one process's kernel-plugin loading did, at that process's start-up.

        Adds to ``kernels``/``kernel_errors`` (the API server's stat logger later rebuilds them
        from all live processes). ``ttl_s`` is long (``general.STARTUP_TTL_S``): start-up can
        take minutes before that stat logger takes over with the normal TTL, and if the engine
        never comes up the operator must still be able to read why.
        """
        loaded: Mapping[str, str] = report.get("loaded", {})
        failed: Mapping[str, str] = report.get("failed", {})
        pipe = self._redis.pipeline(transaction=False)
        pipe.hset(self.keys.kernel_procs, str(report["pid"]), json.dumps(report, sort_keys=True))
        if loaded:
            pipe.hset(self.keys.kernels, mapping=dict(loaded))
        if failed:
            process = report.get("process", "?")
            pipe.hset(self.keys.kernel_errors,
                      mapping={m: f"{process}: {e}" for m, e in failed.items()})
        for key in self.keys.kernel_keys():
            pipe.pexpire(key, int(ttl_s * 1000))
        pipe.execute()

    def close(self) -> None:
        """Release the connection pool."""
        self._redis.close()
