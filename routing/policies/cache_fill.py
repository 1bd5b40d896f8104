"""How full each replica's prefix cache is, as far as routing can tell: the blocks a new prefix
written there pushes out.

vLLM's KV usage gauge counts only the blocks that running requests hold. A cached prefix whose
requests have ended sits in the free queue, still cached, until a new block evicts it: an engine
that has just finished its requests reads 0% used however many prefixes it keeps. So a router that
spreads new prefixes by load alone can send most of them to whichever engine happens to be idle at
each decision, more than its cache holds, and the next requests on those prefixes find them
evicted (the real-vLLM e2e prefix test did this on a busy machine).

The fill estimate is the larger of two counts, at most the engine's ``kv_capacity_blocks``
(in tokens: blocks x the engine's ``block_size``):

* ``ReplicaState.cached_blocks``: the prefix-cache blocks the engine holds by its own KV events
  (stored minus removed, as the replica agent or the simulator counts them), as of the last
  reading. Covers every gateway's requests, but is as old as the reading.
* the prompt tokens this scorer itself sent there that were not cached there, since the
  engine's epoch began (a restart or a cleared cache starts a new epoch, and the count with it).
  Current to the last decision, but blind to other gateways and to output blocks.

A prefix cache is LRU: once full it stays full, so neither count ever needs to go down.
"""

from __future__ import annotations

from routing.state import ReplicaState
from routing.types import Epoch, ReplicaId

__all__ = ["CacheFill"]


class CacheFill:
    """Per replica, the prefix-cache tokens written there (see the module docstring).

    Counted in tokens: the engine counts its cache in its own blocks (``block_size``), while a
    request's prefix matches may come in another unit (a trace's 512-token hash blocks).
    """

    def __init__(self) -> None:
        #: replica -> (the epoch counted, prompt tokens this scorer wrote there in it).
        self._written: dict[ReplicaId, tuple[Epoch, int]] = {}

    def _count(self, replica: ReplicaState) -> int:
        entry = self._written.get(replica.replica_id)
        if entry is None or entry[0] != replica.epoch:
            # A new incarnation holds none of what was written to the old one.
            self._written[replica.replica_id] = (replica.epoch, 0)
            return 0
        return entry[1]

    def add(self, replica: ReplicaId, tokens: int) -> None:
        """``tokens`` new prompt tokens were sent to ``replica`` to prefill (in the epoch last
        seen by ``room_tokens``; nothing is counted for a replica never seen)."""
        entry = self._written.get(replica)
        if entry is not None and tokens > 0:
            self._written[replica] = (entry[0], entry[1] + tokens)

    def room_tokens(self, replica: ReplicaState) -> int | None:
        """Tokens ``replica``'s prefix cache can still take without evicting; None when its
        capacity is unknown."""
        written = self._count(replica)
        if not replica.kv_capacity_blocks:
            return None
        size = replica.block_size
        held = max(written, (replica.cached_blocks or 0) * size)
        return max(0, replica.kv_capacity_blocks * size - held)
