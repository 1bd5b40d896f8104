"""The tests' private ``redis-server`` and free-port helpers: the ones in ``bench/local_redis.py``.

They live in ``bench`` because ``bench.routing_decision`` needs them from an installed wheel too;
nothing outside ``tests`` imports ``tests`` (tests/unit/test_layering.py).
"""

from bench.local_redis import RedisServer, free_port, free_port_block

__all__ = ["RedisServer", "free_port", "free_port_block"]
