"""How full each replica's prefix cache is, as far as routing can tell: the blocks a new prefix
written there pushes out.

vLLM's KV usage gauge counts only the blocks that running requests hold. A cached prefix whose
requests have ended sits in the free queue, still cached, until a new block evicts it: an engine
that has just finished its requests reads 0% used however many prefixes it keeps. So a router that
spreads new prefixes by load alone can send most of them to whichever engine happens to be idle at
each decision, more than its cache holds, and the next requests on those prefixes find them
evicted (the real-vLLM e2e prefix test did this on a busy machine).

The fill estimate, in tokens (blocks x the engine's ``block_size``), at most the engine's
``kv_capacity_blocks``:

* where the engine reports it, ``ReplicaState.cached_blocks`` (the blocks its prefix cache holds
  by its own KV events, stored minus removed, as the replica agent or the simulator counts them)
  plus the uncached prompt tokens this scorer has sent there since that reading. The reading
  covers every gateway's requests; the writes since cover the gap to the next one (on the e2e
  machine, the requests that ended between two agent readings). Requests sent before the
  reading and not yet prefilled are in neither: the estimate errs low.
* where it does not, the uncached prompt tokens this scorer has sent there since the engine's
  epoch began (a restart or a cleared cache starts a new epoch). That count errs high: two
  requests that share a new prefix and arrive before either is prefilled both count it.

A prefix cache is LRU: once full, it stays full, and a new write evicts its oldest content. The
**tail age** dates that content: how long ago the oldest of this scorer's writes that still fit
in the cache was made (a cache turning over within seconds evicts prefixes just paid for).
"""

from __future__ import annotations

from collections import deque

from routing.state import ReplicaState
from routing.types import Epoch, ReplicaId

__all__ = ["CacheFill"]


class CacheFill:
    """Per replica, the prefix-cache tokens written there (see the module docstring).

    Counted in tokens: the engine counts its cache in its own blocks (``block_size``), while a
    request's prefix matches may come in another unit (a trace's 512-token hash blocks).
    """

    def __init__(self, max_writes: int = 4096) -> None:
        #: replica -> (the epoch counted, prompt tokens this scorer wrote there in it).
        self._written: dict[ReplicaId, tuple[Epoch, int]] = {}
        #: replica -> (wall time, tokens) of the writes not yet older than its last reading;
        #: at most ``max_writes`` (a replica whose readings stopped keeps only the latest).
        self._recent: dict[ReplicaId, deque[tuple[float, int]]] = {}
        self._max_writes = max_writes
        #: replica -> (elapsed time, tokens) of the latest writes that add up to its capacity
        #: (the oldest of them dates the blocks a new write evicts), and their sum.
        self._log: dict[ReplicaId, deque[tuple[float, int]]] = {}
        self._log_sum: dict[ReplicaId, int] = {}
        #: replica -> its capacity in tokens, as last seen.
        self._capacity: dict[ReplicaId, int] = {}

    def _count(self, replica: ReplicaState) -> int:
        entry = self._written.get(replica.replica_id)
        if entry is None or entry[0] != replica.epoch:
            # A new incarnation holds none of what was written to the old one.
            self._written[replica.replica_id] = (replica.epoch, 0)
            self._recent.pop(replica.replica_id, None)
            self._log.pop(replica.replica_id, None)
            self._log_sum.pop(replica.replica_id, None)
            return 0
        return entry[1]

    def add(self, replica: ReplicaId, tokens: int, at: float, elapsed: float) -> None:
        """``tokens`` new prompt tokens were sent to ``replica`` to prefill at wall time ``at``
        (``elapsed`` on the elapsed-time clock), in the epoch last seen by ``room_tokens``;
        nothing is counted for a replica never seen."""
        entry = self._written.get(replica)
        if entry is None or tokens <= 0:
            return
        self._written[replica] = (entry[0], entry[1] + tokens)
        recent = self._recent.get(replica)
        if recent is None:
            recent = self._recent[replica] = deque(maxlen=self._max_writes)
        recent.append((at, tokens))
        log = self._log.setdefault(replica, deque())
        log.append((elapsed, tokens))
        total = self._log_sum.get(replica, 0) + tokens
        capacity = self._capacity.get(replica, 0)
        # Keep the latest writes that fill the cache once, no more: the oldest kept is the
        # oldest content a new write would evict.
        while len(log) > 1 and (total - log[0][1] >= capacity or len(log) > self._max_writes):
            total -= log.popleft()[1]
        self._log_sum[replica] = total

    def tail_age_s(self, replica: ReplicaId, elapsed_now: float) -> float | None:
        """How long ago (elapsed seconds) the oldest content still in ``replica``'s cache was
        written, by this scorer's writes: what a new write there evicts first (LRU). None
        before any write."""
        log = self._log.get(replica)
        if not log:
            return None
        return max(0.0, elapsed_now - log[0][0])

    def _since_reading(self, replica: ReplicaState) -> int:
        recent = self._recent.get(replica.replica_id)
        if not recent:
            return 0
        while recent and recent[0][0] < replica.metrics_read_at:
            recent.popleft()
        return sum(tokens for _, tokens in recent)

    def room_tokens(self, replica: ReplicaState) -> int | None:
        """Tokens ``replica``'s prefix cache can still take without evicting; None when its
        capacity is unknown."""
        written = self._count(replica)
        if not replica.kv_capacity_blocks:
            return None
        size = replica.block_size
        self._capacity[replica.replica_id] = replica.kv_capacity_blocks * size
        if replica.cached_blocks is None:
            held = written
        else:
            held = replica.cached_blocks * size + self._since_reading(replica)
        return max(0, replica.kv_capacity_blocks * size - held)
