"""The plugin's configuration, read from environment variables of the vLLM process.

vLLM gives plugins no configuration channel of their own, and general plugins run in every engine
process (API server, EngineCore, workers), which all inherit the launcher's environment: so the
environment is the one place every process sees the same settings.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ENV_PREFIX", "PluginConfig", "PluginConfigError"]

ENV_PREFIX = "FLEETGATE_"


class PluginConfigError(ValueError):
    """An environment variable has a value the plugin cannot use; the message names it."""


def _positive_float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise PluginConfigError(f"{name}={raw!r} is not a number") from None
    if not value > 0:
        raise PluginConfigError(f"{name}={raw!r} must be > 0")
    return value


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise PluginConfigError(f"{name}={raw!r} must be one of 1/0, true/false, yes/no, on/off")


def parse_module_list(raw: str | None) -> tuple[str, ...]:
    """``"a.b, c"`` -> ``("a.b", "c")``: blanks dropped, duplicates kept once, order kept."""
    if not raw:
        return ()
    seen: dict[str, None] = {}
    for part in raw.split(","):
        name = part.strip()
        if name:
            seen.setdefault(name, None)
    return tuple(seen)


@dataclass(frozen=True)
class PluginConfig:
    """Everything the stat logger and the kernel-plugin hook need."""

    #: ``redis://…``; None: nothing is published (kernel plugins are still imported).
    redis_url: str | None
    #: The replica's id, shared with its agent (``FLEETGATE_REPLICA_ID``; default: host name,
    #: which is the pod name on Kubernetes, where agent and engine share the pod).
    replica_id: str
    #: Prefix of every key, as for the fleet store (``fleetgate:``).
    key_prefix: str = "fleetgate:"
    #: Import paths of kernel-plugin modules, imported in every engine process.
    kernel_plugins: tuple[str, ...] = ()
    #: True: a kernel plugin that fails to import aborts the engine (after recording why).
    kernel_plugins_strict: bool = True
    #: Engine state is written at most once per this many seconds (trailing edge kept).
    min_interval_s: float = 0.05
    #: TTL of every key the plugin writes; refreshed every ``ttl_s / 3`` while the engine lives.
    ttl_s: float = 10.0
    #: Socket connect/read timeout of the Redis client. It runs off the engine's thread, so this
    #: bounds how stale a write can get, not the engine; 200 ms proved too tight on a loaded host.
    redis_timeout_s: float = 0.5

    def __post_init__(self) -> None:
        if not self.replica_id:
            raise PluginConfigError("the replica id is empty (set FLEETGATE_REPLICA_ID)")
        if self.heartbeat_s < self.min_interval_s:
            # A heartbeat more often than the throttle would break "at most one write per
            # interval"; a TTL this short is a typo (ms given as s) rather than a wish.
            raise PluginConfigError(
                f"FLEETGATE_ENGINE_STATE_TTL_S ({self.ttl_s:g} s) must be at least three times "
                f"FLEETGATE_ENGINE_STATE_INTERVAL_MS ({self.min_interval_s * 1000:g} ms)"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PluginConfig:
        """Read ``FLEETGATE_*`` variables (``env`` defaults to ``os.environ``).

        Raises ``PluginConfigError`` naming the variable on a bad value: a misconfigured plugin
        should stop the engine at start-up, not publish nonsense for weeks.
        """
        env = os.environ if env is None else env
        url = (env.get("FLEETGATE_REDIS_URL") or "").strip() or None
        if url is not None:
            from routing.redis_clients import expand_env, redacted
            from routing.redis_sentinel import check_primary_url
            from routing.redis_urls import PRIMARY_URL_PREFIXES, check_url_files

            if not url.startswith(PRIMARY_URL_PREFIXES):
                raise PluginConfigError(
                    f"FLEETGATE_REDIS_URL={redacted(url)!r} must be a redis://, rediss:// or "
                    "unix:// URL, or a Sentinel group's redis+sentinel://HOST:26379/SERVICE/DB"
                )
            try:  # ${NAME} is expanded on connecting (redis_store.connect); refuse an unset one now
                expanded = expand_env(url, env)
                check_primary_url(url)
                check_url_files(expanded)  # this is the process that connects
            except ValueError as exc:
                raise PluginConfigError(f"FLEETGATE_REDIS_URL: {exc}") from exc
        replica_id = (env.get("FLEETGATE_REPLICA_ID") or "").strip() or socket.gethostname()
        prefix = env.get("FLEETGATE_KEY_PREFIX", "fleetgate:")
        return cls(
            redis_url=url,
            replica_id=replica_id,
            key_prefix=prefix,
            kernel_plugins=parse_module_list(env.get("FLEETGATE_KERNEL_PLUGINS")),
            kernel_plugins_strict=_flag(env, "FLEETGATE_KERNEL_PLUGINS_STRICT", True),
            min_interval_s=_positive_float(env, "FLEETGATE_ENGINE_STATE_INTERVAL_MS", 50.0)
            / 1000.0,
            ttl_s=_positive_float(env, "FLEETGATE_ENGINE_STATE_TTL_S", 10.0),
            redis_timeout_s=_positive_float(env, "FLEETGATE_REDIS_TIMEOUT_MS", 500.0) / 1000.0,
        )

    @property
    def heartbeat_s(self) -> float:
        """How often keys are re-written while nothing changes, so they outlive an idle engine."""
        return self.ttl_s / 3.0
