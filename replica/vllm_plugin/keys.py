"""Redis key layout of the plugin: siblings of the fleet store's replica key.

``replica/fleet_store.py`` owns ``<prefix>replica:<id>`` (the agent's JSON ``ReplicaState``) and
``<prefix>replicas`` (the id set). The plugin never writes those: a second writer of one JSON
value would race the agent. It writes hashes beside it, which the agent/gateway merge by id:

* ``<prefix>replica:<id>:engine`` — engine-step scheduler state (``:engine:<n>`` for
  data-parallel engine ``n`` > 0), see ``snapshot.EngineSnapshot.to_fields``.
* ``<prefix>replica:<id>:kernels`` — kernel-plugin module -> version (loaded OK).
* ``<prefix>replica:<id>:kernel_errors`` — kernel-plugin module -> ``"ExcType: message"``.
* ``<prefix>replica:<id>:kernel_procs`` — pid -> JSON of what that engine process loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PluginKeys"]


@dataclass(frozen=True)
class PluginKeys:
    """The keys of one replica."""

    prefix: str
    replica_id: str

    @property
    def base(self) -> str:
        """The fleet store's key for this replica (read-only for the plugin)."""
        return f"{self.prefix}replica:{self.replica_id}"

    def engine(self, engine_index: int = 0) -> str:
        """Hash of engine-step state; engine 0 keeps the short name that most replicas use."""
        if engine_index < 0:
            raise ValueError(f"engine_index must be >= 0 (got {engine_index})")
        return f"{self.base}:engine" if engine_index == 0 else f"{self.base}:engine:{engine_index}"

    @property
    def kernels(self) -> str:
        """Hash module -> version of kernel plugins that imported cleanly."""
        return f"{self.base}:kernels"

    @property
    def kernel_errors(self) -> str:
        """Hash module -> error of kernel plugins that failed to import."""
        return f"{self.base}:kernel_errors"

    @property
    def kernel_procs(self) -> str:
        """Hash pid -> JSON report of one engine process's kernel-plugin loading."""
        return f"{self.base}:kernel_procs"

    def kernel_keys(self) -> tuple[str, str, str]:
        """Every kernel-plugin key (their TTLs are refreshed together)."""
        return (self.kernels, self.kernel_errors, self.kernel_procs)
