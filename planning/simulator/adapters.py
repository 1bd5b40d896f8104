"""``--adapters``: give trace requests LoRA adapters the trace itself does not name.

Spec forms:

* ``uniform:N`` — adapters ``ft-0`` … ``ft-{N-1}``, equally likely;
* ``zipf:N`` or ``zipf:N:S`` — the same adapters with Zipf(S) popularity (default S = 1.0), as
  B2B traffic usually is: a few big customers, a long tail;
* ``NAME=WEIGHT,NAME=WEIGHT,…`` — explicit shares; the name ``base`` means the base model.

A request is assigned by its *first* trace block, not at random: requests that start alike (one
conversation, one customer's system prompt) belong to one fine-tune, as in real multi-tenant
traffic. Records whose trace line carries ``adapter`` keep it.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass

import xxhash

__all__ = ["BASE_MODEL", "AdapterMix", "parse_adapter_spec"]

#: The name that stands for "no adapter" in an explicit mapping.
BASE_MODEL = "base"


@dataclass(frozen=True)
class AdapterMix:
    """Adapter names (``None`` = base model) with cumulative weights summing to 1."""

    names: tuple[str | None, ...]
    cumulative: tuple[float, ...]

    @property
    def adapters(self) -> list[str]:
        """The adapter names the mix can assign (base model excluded)."""
        return [name for name in self.names if name is not None]

    def assign(self, first_block: int, seed: int) -> str | None:
        """The adapter of a request whose first trace block id is ``first_block``."""
        key = (first_block & (2**64 - 1)).to_bytes(8, "little")
        draw = xxhash.xxh3_64_intdigest(key, seed & (2**64 - 1)) / 2.0**64
        index = bisect.bisect_right(self.cumulative, draw)
        return self.names[min(index, len(self.names) - 1)]


def _from_weights(pairs: list[tuple[str | None, float]], spec: str) -> AdapterMix:
    total = sum(weight for _, weight in pairs)
    if total <= 0:
        raise ValueError(f"--adapters {spec!r}: weights must add up to more than 0")
    cumulative = tuple(itertools.accumulate(weight / total for _, weight in pairs))
    return AdapterMix(tuple(name for name, _ in pairs), cumulative)


def parse_adapter_spec(spec: str) -> AdapterMix:
    """Parse an ``--adapters`` value; ``ValueError`` says what is wrong with it."""
    spec = spec.strip()
    kind, _, rest = spec.partition(":")
    if kind in ("uniform", "zipf"):
        parts = rest.split(":")
        try:
            count = int(parts[0])
            exponent = float(parts[1]) if kind == "zipf" and len(parts) > 1 else 1.0
        except (ValueError, IndexError):
            raise ValueError(
                f"--adapters {spec!r}: expected {kind}:N"
                + (" or zipf:N:S" if kind == "zipf" else "")
            ) from None
        if count < 1 or (kind == "uniform" and len(parts) > 1) or len(parts) > 2:
            raise ValueError(f"--adapters {spec!r}: N must be >= 1 (e.g. {kind}:40)")
        if not (exponent >= 0 and math.isfinite(exponent)):  # NaN sent every request to one
            raise ValueError(f"--adapters {spec!r}: the Zipf exponent must be a number >= 0")
        weights = [1.0 / (rank + 1) ** exponent if kind == "zipf" else 1.0 for rank in range(count)]
        return _from_weights([(f"ft-{rank}", w) for rank, w in enumerate(weights)], spec)
    pairs: list[tuple[str | None, float]] = []
    for item in spec.split(","):
        name, sep, weight_text = item.partition("=")
        name = name.strip()
        try:
            weight = float(weight_text)
        except ValueError:
            weight = -1.0
        if not sep or not name or not (weight >= 0 and math.isfinite(weight)):
            raise ValueError(
                f"--adapters {spec!r}: expected uniform:N, zipf:N[:S] or NAME=WEIGHT,… "
                f"(bad item {item!r})"
            )
        pairs.append((None if name == BASE_MODEL else name, weight))
    return _from_weights(pairs, spec)
