"""Flow control in the simulator: request classes for trace requests, and the shared controller.

``--classes critical=0.2,standard=0.5,sheddable=0.3`` assigns a class per *conversation*, so
every turn of a chat keeps its class. Traces do not name conversations; a request's conversation
is its first hash id that is not common to the whole trace (a shared system prompt or a popular
RAG chunk is common: it appears in more than ``COMMON_SHARE`` of the records, or in more than
``COMMON_MIN`` of them, whichever is larger). Every turn of a conversation starts with that
conversation's own first message, so they share that id; a request with no such id keys on its
last hash id. The key is hashed with the seed onto [0, 1) and the shares cut that range.

The decisions themselves are ``routing.flow_control``'s: the loop calls the same
``FlowController`` as the gateway, on the virtual clock.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from routing.flow_control import RequestClass, parse_request_class
from traces.format import TraceRecord

__all__ = ["ClassMix", "assign_classes", "conversation_keys", "parse_class_mix"]

COMMON_SHARE = 0.02
COMMON_MIN = 50


@dataclass(frozen=True)
class ClassMix:
    """The share of conversations in each class (sums to 1)."""

    shares: Mapping[RequestClass, float]

    def __post_init__(self) -> None:
        if any(not (0 <= s <= 1) for s in self.shares.values()):
            given = ", ".join(f"{c.value}={s:g}" for c, s in self.shares.items())
            raise ValueError(f"class shares must be in [0, 1] (got {given})")
        total = sum(self.shares.values())
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"class shares must sum to 1 (got {total:g})")

    def pick(self, unit: float) -> RequestClass:
        """The class of a conversation whose key hashes to ``unit`` in [0, 1)."""
        edge = 0.0
        chosen = RequestClass.STANDARD
        for request_class in RequestClass:
            share = self.shares.get(request_class, 0.0)
            if share <= 0:
                continue
            chosen = request_class
            edge += share
            if unit < edge:
                return request_class
        return chosen

    def spec(self) -> str:
        """The mix as the flag writes it."""
        return ",".join(f"{c.value}={self.shares[c]:g}" for c in RequestClass if c in self.shares)


def parse_class_mix(text: str) -> ClassMix:
    """``critical=0.2,standard=0.5,sheddable=0.3`` -> a ``ClassMix`` (``ValueError`` says why)."""
    shares: dict[RequestClass, float] = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"expected CLASS=SHARE, e.g. critical=0.2 (got {part!r})")
        request_class = parse_request_class(name)
        if request_class in shares:
            raise ValueError(f"{request_class.value} is given twice")
        try:
            shares[request_class] = float(value)
        except ValueError:
            raise ValueError(f"{name}: share must be a number (got {value!r})") from None
    return ClassMix(shares)


def conversation_keys(records: Sequence[TraceRecord]) -> list[int]:
    """Per record, the hash id that names its conversation (see the module docstring)."""
    counts: Counter[int] = Counter()
    for record in records:
        counts.update(set(record.hash_ids))
    common = max(COMMON_MIN, COMMON_SHARE * len(records))
    keys = []
    for index, record in enumerate(records):
        own = next((h for h in record.hash_ids if counts[h] <= common), None)
        if own is None:
            own = record.hash_ids[-1] if record.hash_ids else -1 - index
        keys.append(own)
    return keys


def assign_classes(records: Sequence[TraceRecord], mix: ClassMix, seed: int) -> list[RequestClass]:
    """The class of each record: its conversation's, drawn by ``mix``."""
    classes = []
    for key in conversation_keys(records):
        digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
        classes.append(mix.pick(int.from_bytes(digest, "big") / 2**64))
    return classes
