"""Multi-LoRA serving: the adapter catalog, placement, ensure-loaded, thrash guard, pre-warming.

The gateway holds one ``AdapterRegistry``; see docs/adapters.md.
"""

from adapters_registry.catalog import AdapterCatalog
from adapters_registry.errors import (
    AdapterError,
    AdapterLoadFailed,
    AdapterNotFound,
    AdapterUnloadFailed,
    InvalidAdapter,
    NoAdapterSlot,
    ThrashGuardTripped,
)
from adapters_registry.loader import AdapterLoader, LoaderSettings, LoadResult
from adapters_registry.paths import StorageRoots
from adapters_registry.placement import PlacementStore, PlacementUnavailable
from adapters_registry.placement_memory import MemoryPlacementStore
from adapters_registry.placement_redis import RedisPlacementStore
from adapters_registry.registry import AdapterRegistry, RegistrySettings

__all__ = [
    "AdapterCatalog",
    "AdapterError",
    "AdapterLoadFailed",
    "AdapterLoader",
    "AdapterNotFound",
    "AdapterRegistry",
    "AdapterUnloadFailed",
    "InvalidAdapter",
    "LoadResult",
    "LoaderSettings",
    "MemoryPlacementStore",
    "NoAdapterSlot",
    "PlacementStore",
    "PlacementUnavailable",
    "RedisPlacementStore",
    "RegistrySettings",
    "StorageRoots",
    "ThrashGuardTripped",
]
