"""Block index backends: which replicas hold which prefix blocks (see docs/index.md).

``MemoryBlockIndex`` serves one process (the embedded gateway, the simulator, tests);
``RedisBlockIndex`` is shared by every gateway and replica agent of a fleet (``index.mode:
lookup``: one Redis script per lookup); ``MirrorBlockIndex`` keeps each gateway's copy in process,
fed by Redis streams that agents write through ``StreamIndexWriter`` (``index.mode: mirror``).
All implement ``routing.contracts.BlockIndex``; ``build_index`` picks one from a URL and mode.
"""

from routing.contracts import BlockIndex, IndexStats, IndexUnavailable
from routing.index.factory import build_index
from routing.index.memory import MemoryBlockIndex
from routing.index.mirror import MirrorBlockIndex
from routing.index.redis_backend import RedisBlockIndex

__all__ = [
    "BlockIndex",
    "IndexStats",
    "IndexUnavailable",
    "MemoryBlockIndex",
    "MirrorBlockIndex",
    "RedisBlockIndex",
    "build_index",
]
