"""Distinct types for distinct things, shared by every layer of fleetgate."""

from __future__ import annotations

from typing import NewType

#: fleetgate's own chained block hash (xxh3_64 of parent hash + block content), never vLLM's.
BlockHash = NewType("BlockHash", int)

#: vLLM's hash of a block as it appears in KV events; mapped to a ``BlockHash`` on ingest.
EngineBlockHash = NewType("EngineBlockHash", int)

#: Stable identifier of one replica (one vLLM engine process), e.g. ``"pool-a/replica-0"``.
ReplicaId = NewType("ReplicaId", str)

#: Incarnation number of a replica; a restart gets a new one and retires every entry of the old.
Epoch = NewType("Epoch", int)
