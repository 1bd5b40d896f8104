"""LoRA adapter residency: GPU slots, a host-memory cache, and what each load costs.

Three tiers, as in vLLM: the *catalog* (adapters the engine knows, e.g. through
``/v1/load_lora_adapter``), the *host cache* (``--max-cpu-loras`` adapters held in CPU memory) and
the *GPU slots* (``--max-loras``). GPU-resident adapters are also in the host cache. Bringing an
adapter into a slot costs ``size / host->device bandwidth`` from the host cache, plus
``size / storage bandwidth`` first when it has to be read from storage.

Eviction is least recently used, and never touches an adapter that running requests use (the
caller passes the set of such adapters).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

MB = 1e6
GB = 1e9


class LoraSlots:
    """Which adapters are in GPU slots and in host memory, with load-time accounting."""

    def __init__(
        self,
        max_loras: int,
        max_cpu_loras: int,
        h2d_gbps: float,
        storage_gbps: float,
        default_size_mb: float,
    ) -> None:
        if max_loras < 0 or max_cpu_loras < max_loras:
            raise ValueError(
                f"need 0 <= max_loras ({max_loras}) <= max_cpu_loras ({max_cpu_loras})"
            )
        if h2d_gbps <= 0 or storage_gbps <= 0 or default_size_mb <= 0:
            raise ValueError("LoRA bandwidths and the default adapter size must be > 0")
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.h2d_gbps = h2d_gbps
        self.storage_gbps = storage_gbps
        self.default_size_mb = default_size_mb
        self._catalog: dict[str, float] = {}  # name -> size in MB
        # Unloaded while requests still used them: not served to new requests, but the
        # requests already queued can still bring them into a slot.
        self._retired: dict[str, float] = {}
        # OrderedDicts as LRU lists: first = least recently used.
        self._host: OrderedDict[str, None] = OrderedDict()
        self._gpu: OrderedDict[str, None] = OrderedDict()

    # ------------------------------------------------------------------ queries

    @property
    def enabled(self) -> bool:
        """False when the engine has no LoRA slots at all."""
        return self.max_loras > 0

    def known(self, name: str) -> bool:
        """True if ``name`` is in the catalog."""
        return name in self._catalog

    def catalog(self) -> list[str]:
        """Known adapter names, in registration order."""
        return list(self._catalog)

    def on_gpu(self) -> list[str]:
        """Adapters in GPU slots, least recently used first."""
        return list(self._gpu)

    def in_host(self) -> list[str]:
        """Adapters in the host cache (GPU-resident ones included), least recently used first."""
        return list(self._host)

    def is_active(self, name: str) -> bool:
        """True if ``name`` is in a GPU slot."""
        return name in self._gpu

    def is_retired(self, name: str) -> bool:
        """True if ``name`` was unloaded while requests still used it."""
        return name in self._retired

    def size_mb(self, name: str) -> float:
        """Size of a catalog (or retired) adapter."""
        size = self._catalog.get(name)
        return self._retired[name] if size is None else size

    def storage_load_s(self, name: str) -> float:
        """Seconds to read ``name`` from storage into host memory."""
        return self.size_mb(name) * MB / (self.storage_gbps * GB)

    def h2d_load_s(self, name: str) -> float:
        """Seconds to copy ``name`` from host memory into a GPU slot."""
        return self.size_mb(name) * MB / (self.h2d_gbps * GB)

    def can_activate(self, name: str, in_use: Collection[str]) -> bool:
        """True if ``name`` is in a slot or one can be freed (some slot's adapter is idle)."""
        if name in self._gpu or len(self._gpu) < self.max_loras:
            return True
        return any(other not in in_use for other in self._gpu)

    # ------------------------------------------------------------------ changes

    def register(self, name: str, size_mb: float | None = None) -> None:
        """Add ``name`` to the catalog (no load, no cost)."""
        if not self.enabled:
            raise ValueError("LoRA is disabled on this engine (max_loras = 0)")
        if not name:
            raise ValueError("adapter name must be non-empty")
        size = self.default_size_mb if size_mb is None else size_mb
        if size <= 0:
            raise ValueError(f"adapter {name!r}: size_mb must be > 0 (got {size})")
        self._catalog[name] = size
        self._retired.pop(name, None)

    def load(self, name: str, size_mb: float | None, in_use: Collection[str]) -> float:
        """Register ``name`` and bring it into host memory and, if one can be had, a GPU slot.

        Returns the modelled load time in seconds (0 for an adapter already in a slot).
        """
        if name not in self._catalog or size_mb is not None:
            self.register(name, size_mb)
        if self.can_activate(name, in_use):
            return self.activate(name, in_use)
        return self._to_host(name)

    def activate(self, name: str, in_use: Collection[str]) -> float:
        """Put a catalog adapter into a GPU slot; returns the load time (0 if already there).

        Raises ``RuntimeError`` if every slot holds an adapter in use (check ``can_activate``).
        """
        if name in self._gpu:
            self._gpu.move_to_end(name)
            self._host.move_to_end(name)
            return 0.0
        if len(self._gpu) >= self.max_loras:
            victim = next((a for a in self._gpu if a not in in_use), None)
            if victim is None:
                raise RuntimeError(f"no free LoRA slot for {name!r}: all {self.max_loras} in use")
            del self._gpu[victim]
        cost = self._to_host(name)
        self._gpu[name] = None
        return cost + self.h2d_load_s(name)

    def _to_host(self, name: str) -> float:
        if name in self._host:
            self._host.move_to_end(name)
            return 0.0
        if len(self._host) >= self.max_cpu_loras:
            # GPU-resident adapters must stay in host memory, so only others can go.
            victim = next((a for a in self._host if a not in self._gpu), None)
            if victim is None:
                raise RuntimeError(
                    f"no room for {name!r}: all {self.max_cpu_loras} host-cached adapters are "
                    "in GPU slots that running requests use"
                )
            del self._host[victim]
        self._host[name] = None
        return self.storage_load_s(name)

    def touch(self, name: str) -> None:
        """Mark a resident adapter as just used (it becomes the last to be evicted)."""
        if name in self._gpu:
            self._gpu.move_to_end(name)
        if name in self._host:
            self._host.move_to_end(name)

    def unregister(self, name: str) -> None:
        """Forget ``name`` everywhere. Raises ``KeyError`` if it is not in the catalog."""
        if name not in self._catalog:
            raise KeyError(f"adapter {name!r} is not loaded")
        del self._catalog[name]
        self.forget(name)

    def retire(self, name: str) -> None:
        """Take ``name`` out of the catalog but keep it usable by requests already queued."""
        if name not in self._catalog:
            raise KeyError(f"adapter {name!r} is not loaded")
        self._retired[name] = self._catalog.pop(name)

    def forget(self, name: str) -> None:
        """Drop a retired (or unregistered) adapter from host memory and its slot."""
        self._retired.pop(name, None)
        self._host.pop(name, None)
        self._gpu.pop(name, None)
