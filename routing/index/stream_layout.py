"""Redis key layout of the mirrored index (``index.mode: mirror``), spread over Cluster slots.

The shared truth is kept **per replica**, and each replica belongs to one of ``shards`` *stream
shards* (``crc32(replica) % shards``). Every key of a shard carries the hash tag
``{<prefix>:s<shard>}``, so one shard is one Redis Cluster slot and different shards land on
different slots (and, on a Cluster, on different primaries): writes scale out with the shards.

* ``{p:sK}:events`` STREAM: block events of the shard's replicas, capped (``MAXLEN ~``);
* ``{p:sK}:replicas`` SET: the shard's replica ids (what a new gateway reads at bootstrap);
* ``{p:sK}:r:<replica>`` HASH: ``e`` live epoch (``~<epoch>`` retired), ``q`` last sequence
  number, ``i`` incarnation of this hash, ``a`` heartbeat deadline (server ms);
* ``{p:sK}:blk:<replica>`` SET: the live epoch's engine-confirmed blocks, 8 bytes each;
* ``{p}:gen`` STRING: a token written once; gone means Redis lost its data (flush, restart).

A write touches one replica's keys and its shard's stream: one slot, one script. Nothing is
global except ``gen``, which a gateway reads once per check interval.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from routing.types import ReplicaId

__all__ = ["DEFAULT_SHARDS", "ReplicaKeys", "StreamLayout"]

#: Shards of the stream layout. Gateways and agents must agree on it (it picks each replica's
#: keys); 16 spreads a fleet over 16 Cluster slots, more than the primaries of most clusters.
DEFAULT_SHARDS = 16

_FORBIDDEN_PREFIX_CHARS = frozenset("{}:* ?[]\\")


@dataclass(frozen=True)
class ReplicaKeys:
    """The keys one replica's writes touch, all in its shard's slot (the write script's KEYS)."""

    state: str
    blocks: str
    events: str
    replicas: str

    def as_list(self) -> list[str]:
        """In the order the write script reads ``KEYS``."""
        return [self.state, self.blocks, self.events, self.replicas]


class StreamLayout:
    """Key names of the mirrored index under ``key_prefix`` with ``shards`` stream shards."""

    def __init__(self, key_prefix: str = "fleetgate:", shards: int = DEFAULT_SHARDS) -> None:
        if not isinstance(key_prefix, str) or not key_prefix.rstrip(":"):
            raise ValueError(f"key_prefix must be a non-empty string (got {key_prefix!r})")
        prefix = key_prefix.rstrip(":")
        bad = sorted(set(prefix) & _FORBIDDEN_PREFIX_CHARS)
        if bad:
            raise ValueError(
                f"key_prefix must not contain {''.join(bad)!r}: it becomes a Redis hash tag "
                f"(got {key_prefix!r})"
            )
        if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= 4096:
            raise ValueError(f"shards must be an integer in [1, 4096] (got {shards!r})")
        self.key_prefix = prefix
        self.shards = shards
        self.generation_key = "{" + prefix + "}:gen"

    def shard_of(self, replica: ReplicaId) -> int:
        """The replica's shard: stable across processes and Python versions (CRC-32)."""
        return zlib.crc32(replica.encode()) % self.shards

    def _tag(self, shard: int) -> str:
        return "{" + f"{self.key_prefix}:s{shard}" + "}"

    def events_key(self, shard: int) -> str:
        """The shard's event stream."""
        return f"{self._tag(shard)}:events"

    def replicas_key(self, shard: int) -> str:
        """The set of the shard's replica ids."""
        return f"{self._tag(shard)}:replicas"

    def replica_keys(self, replica: ReplicaId) -> ReplicaKeys:
        """Every key a write for ``replica`` touches, all under its shard's hash tag."""
        shard = self.shard_of(replica)
        tag = self._tag(shard)
        return ReplicaKeys(
            state=f"{tag}:r:{replica}",
            blocks=f"{tag}:blk:{replica}",
            events=self.events_key(shard),
            replicas=self.replicas_key(shard),
        )

    def all_events_keys(self) -> list[str]:
        """Every shard's stream, shard 0 first."""
        return [self.events_key(shard) for shard in range(self.shards)]
