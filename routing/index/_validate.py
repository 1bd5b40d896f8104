"""Argument checks shared by every ``BlockIndex`` backend, so bad input fails the same way."""

from __future__ import annotations

import math
from collections.abc import Sequence

from routing.types import BlockHash, Epoch, ReplicaId

_MAX_U64 = 2**64 - 1


def check_replica(replica: ReplicaId) -> None:
    """A replica id is a non-empty string."""
    if not isinstance(replica, str) or not replica:
        raise ValueError(f"replica must be a non-empty string (got {replica!r})")


def check_epoch(epoch: Epoch) -> None:
    """An epoch is a non-negative int (bool refused: it is almost always a bug)."""
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"epoch must be a non-negative integer (got {epoch!r})")


def check_ttl(ttl_s: float | None, what: str = "ttl_s", *, optional: bool = True) -> None:
    """A TTL is a finite number of seconds > 0 (or ``None`` where that is allowed)."""
    if ttl_s is None and optional:
        return
    if (
        isinstance(ttl_s, bool)
        or not isinstance(ttl_s, int | float)
        or not math.isfinite(ttl_s)
        or ttl_s <= 0
    ):
        raise ValueError(f"{what} must be a finite number of seconds > 0 (got {ttl_s!r})")


def check_blocks(blocks: Sequence[BlockHash], what: str = "blocks") -> None:
    """Block hashes are ints in ``[0, 2**64)``, as ``routing.hashing`` makes them."""
    for position, block in enumerate(blocks):
        if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block <= _MAX_U64:
            raise ValueError(
                f"{what}[{position}] must be a block hash, an int in [0, 2**64) (got {block!r})"
            )
