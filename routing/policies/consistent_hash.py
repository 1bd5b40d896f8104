"""``consistent-hash`` policy: consistent hashing with bounded loads on the prompt's prefix.

The key is the chained hash of the first ``prefix_blocks`` blocks (a chained hash already covers
every block before it), so requests that share that prefix map to the same point on a ring of
virtual nodes, and their KV cache stays on one replica. To stop a hot prefix from overloading its
owner, a replica accepts a request only while ``load + 1 <= ceil((1 + load_epsilon) * average)``,
where the average counts this request; otherwise the walk continues clockwise (Mirrokni, Thorup
and Zadimoghaddam, "Consistent Hashing with Bounded Loads", as used by KubeAI's prefix hash).
Adding or removing a replica moves only the keys of its own virtual nodes.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from typing import ClassVar

import xxhash
from pydantic import Field

from routing.contracts import RoutingRequest
from routing.engine import PluginTerms, Profile
from routing.policies.base import ExplainingPicker, PluginKind, PluginParams
from routing.state import ReplicaState
from routing.types import ReplicaId


class ConsistentHashPicker(ExplainingPicker):
    """Prefix-keyed consistent hashing; a bounded-load walk of the ring decides the owner."""

    type_name: ClassVar[str] = "consistent-hash"
    kind: ClassVar[PluginKind] = "picker"

    class Params(PluginParams):
        """Parameters of ``consistent-hash``."""

        #: Blocks of the prompt chain that form the key (longer: finer-grained groups).
        prefix_blocks: int = Field(default=8, ge=1, le=10_000)
        #: Virtual nodes per replica on the ring (more: smoother spread, bigger ring).
        virtual_nodes: int = Field(default=100, ge=1, le=10_000)
        #: Allowed overload: a replica takes a request while at most (1 + epsilon) x average.
        load_epsilon: float = Field(default=0.25, ge=0.0, le=100.0)

    params: Params

    def __init__(self, params: PluginParams | None = None, *, name: str | None = None) -> None:
        super().__init__(params, name=name)
        # The ring is rebuilt only when the candidate set changes, not per request.
        self._ring_members: tuple[ReplicaId, ...] = ()
        self._ring_points: list[int] = []
        self._ring_owners: list[ReplicaId] = []

    def _ring(self, ids: tuple[ReplicaId, ...]) -> tuple[list[int], list[ReplicaId]]:
        if ids != self._ring_members:
            points = sorted(
                (xxhash.xxh3_64_intdigest(f"{rid}#{vnode}".encode()), rid)
                for rid in ids
                for vnode in range(self.params.virtual_nodes)
            )
            self._ring_points = [point for point, _ in points]
            self._ring_owners = [rid for _, rid in points]
            self._ring_members = ids
        return self._ring_points, self._ring_owners

    def key(self, request: RoutingRequest) -> int:
        """The ring position of ``request``: its prefix hash, or its id when it has no full block.

        A prompt shorter than one block has nothing to reuse, so it is spread by request id.
        """
        if request.chain:
            block = int(request.chain[min(self.params.prefix_blocks, len(request.chain)) - 1])
            # Re-hashed so keys spread over the ring even if a chain's hashes are not uniform.
            return xxhash.xxh3_64_intdigest(block.to_bytes(8, "little", signed=block < 0))
        return xxhash.xxh3_64_intdigest(request.request_id.encode())

    def pick_with_terms(
        self,
        request: RoutingRequest,
        replicas: Sequence[ReplicaState],
        scores: Mapping[ReplicaId, float],
    ) -> tuple[list[ReplicaId], PluginTerms]:
        """``pick`` plus, per replica, its ring rank and whether the load bound skipped it."""
        if not replicas:
            return [], {}
        by_id = {r.replica_id: r for r in replicas}
        points, owners = self._ring(tuple(sorted(by_id)))
        average = (sum(r.load for r in replicas) + 1) / len(replicas)
        bound = math.ceil((1.0 + self.params.load_epsilon) * average)

        walk: list[ReplicaId] = []
        seen: set[ReplicaId] = set()
        start = bisect.bisect_left(points, self.key(request))
        # Stop once every replica has appeared: about n ln n steps, not n x virtual_nodes.
        for step in range(len(owners)):
            rid = owners[(start + step) % len(owners)]
            if rid not in seen:
                seen.add(rid)
                walk.append(rid)
                if len(walk) == len(by_id):
                    break
        # The minimum load is at most the average, so some replica always passes the bound.
        chosen = next(rid for rid in walk if by_id[rid].load + 1 <= bound)
        order = [chosen, *(rid for rid in walk if rid != chosen)]
        terms: dict[ReplicaId, dict[str, float]] = {
            rid: {
                "ring_rank": float(rank),
                "over_load_bound": float(by_id[rid].load + 1 > bound),
            }
            for rank, rid in enumerate(walk)
        }
        return order, terms


def profile() -> Profile:
    """The built-in ``consistent-hash`` profile."""
    return Profile(name="consistent-hash", filters=(), scorers=(), picker=ConsistentHashPicker())
