"""fleetgate's chained block hashes: one ``BlockHash`` per full block of a prompt.

A block's hash is ``xxh3_64(block_bytes, seed=parent_hash)``; the first block's parent is the
*chain seed*, which folds in the model, the LoRA adapter and the tenant's cache salt. So:

* equal hashes at position ``i`` mean equal content for blocks ``0..i`` (a prefix chain), exactly
  like vLLM's prefix cache, which only reuses a block if every block before it matches too;
* two adapters, or two tenants with different salts, never share a chain, just as vLLM never shares
  KV blocks across adapters or ``cache_salt`` values.

Token blocks are the little-endian ``uint32`` bytes of the token ids. Only *full* blocks are
hashed: vLLM only caches (and only emits ``BlockStored`` for) full blocks, so a partial tail could
never match anything.

Hashes are Python ints in ``[0, 2**64)`` (unsigned). Backends that need signed 64-bit integers
must convert at their edge; the Redis index stores them as decimal strings and needs no conversion.

These hashes are fleetgate's own and never equal vLLM's (which depend on vLLM's hash function
and configuration); the replica agent re-hashes the ``token_ids`` carried by ``BlockStored``
events with :func:`extend_chain` and maps engine hashes to these.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from typing import cast

import numpy as np
import xxhash

from routing.contracts import TokenizedPrompt
from routing.types import BlockHash

__all__ = [
    "CHARS_PER_TOKEN",
    "chain_seed",
    "extend_chain",
    "hash_text_blocks",
    "hash_token_blocks",
    "prompt_chain",
]

# Version tag folded into every seed: changing the hashing scheme changes every chain, so a
# gateway fleet mid-upgrade can never match entries written under the old scheme.
_SCHEME = b"fleetgate-chain-v1"
# Separates text-mode chains from token-mode chains with the same seed (a different domain).
_TEXT_DOMAIN = b"fleetgate-text-blocks"
# The largest token id a uint32 block can carry; real vocabularies are far below it.
_MAX_TOKEN_ID = 2**32 - 1
_MAX_U64 = 2**64 - 1
# The array typecode whose items are 4 bytes ("I" on every mainstream platform, "L" elsewhere).
_UINT32_CODE = next(code for code in "IL" if array.array(code).itemsize == 4)
_NEEDS_BYTESWAP = sys.byteorder != "little"

#: Characters per token assumed in text mode: about 4 for English with BPE vocabularies.
CHARS_PER_TOKEN = 4


def chain_seed(model: str, adapter: str | None = None, cache_salt: str | None = None) -> int:
    """Seed for the chains of one (model, adapter, tenant salt) combination.

    For ``adapter`` and ``cache_salt``, ``None`` and ``""`` give the same seed: both mean
    "no adapter" / "no salt". The result is an int in ``[0, 2**64)``.
    """
    if not isinstance(model, str) or not model:
        raise ValueError(f"chain_seed: model must be a non-empty string (got {model!r})")
    for name, value in (("adapter", adapter), ("cache_salt", cache_salt)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"chain_seed: {name} must be a string or None (got {value!r})")
    # Length-prefix every field so ("ab", "c") and ("a", "bc") can never collide.
    parts = (_SCHEME, model.encode(), (adapter or "").encode(), (cache_salt or "").encode())
    payload = b"".join(len(part).to_bytes(4, "little") + part for part in parts)
    return xxhash.xxh3_64_intdigest(payload)


def _check_block_size(block_size: int, what: str = "block_size") -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"{what} must be a positive integer (got {block_size!r})")


def _check_seed(seed: int, what: str = "seed") -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MAX_U64:
        raise ValueError(f"{what} must be an int in [0, 2**64) (got {seed!r})")


def _token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as contiguous little-endian uint32 bytes, validated once for the whole prompt."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1:
            raise ValueError(f"token_ids must be one-dimensional (got shape {token_ids.shape})")
        if token_ids.size == 0:
            return b""
        if not np.issubdtype(token_ids.dtype, np.integer):
            raise ValueError(f"token_ids must be integers (got dtype {token_ids.dtype})")
        low, high = int(token_ids.min()), int(token_ids.max())
        if low < 0 or high > _MAX_TOKEN_ID:
            raise ValueError(f"token ids must lie in [0, 2**32) (got min {low}, max {high})")
        return token_ids.astype("<u4", copy=False).tobytes()
    # array('I') converts a list about 3x faster than numpy and range-checks every id on the way.
    try:
        packed = array.array(_UINT32_CODE, token_ids)
    except OverflowError:
        raise ValueError("token ids must lie in [0, 2**32)") from None
    except TypeError as exc:
        raise ValueError(f"token_ids must be a flat sequence of integers: {exc}") from None
    if _NEEDS_BYTESWAP:
        packed.byteswap()
    return packed.tobytes()


def _chain_bytes(data: bytes, step: int, parent: int) -> list[BlockHash]:
    """Hash each full ``step``-byte slice of ``data``, seeding each with the previous hash."""
    hashes: list[int] = []
    digest = xxhash.xxh3_64_intdigest
    # The parent hash as the xxh3 seed chains the blocks without concatenating bytes; plain
    # bytes slices measured faster than memoryview slices for 64-byte blocks.
    for start in range(0, len(data) - step + 1, step):
        parent = digest(data[start : start + step], parent)
        hashes.append(parent)
    # BlockHash is a NewType of int: one cast instead of a wrapper call per block.
    return cast(list[BlockHash], hashes)


def hash_token_blocks(
    token_ids: Sequence[int] | np.ndarray, block_size: int, seed: int
) -> list[BlockHash]:
    """Chained hashes of the full ``block_size``-token blocks of ``token_ids``, from ``seed``."""
    _check_block_size(block_size)
    _check_seed(seed)
    return _chain_bytes(_token_bytes(token_ids), block_size * 4, seed)


def extend_chain(
    parent: BlockHash | None,
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    seed: int,
) -> list[BlockHash]:
    """Hashes of the blocks that follow ``parent`` (``None``: the chain starts at ``seed``).

    The replica agent uses this for one ``BlockStored`` event: ``token_ids`` spans one or more
    consecutive full blocks after the block whose fleetgate hash is ``parent``. Hashing the whole
    prompt and extending block by block give the same hashes::

        extend_chain(h[k - 1], tokens[k * bs:], bs, seed) == hash_token_blocks(tokens, bs, seed)[k:]
    """
    _check_seed(seed)
    if parent is None:
        return hash_token_blocks(token_ids, block_size, seed)
    _check_seed(parent, "parent")
    return hash_token_blocks(token_ids, block_size, parent)


def hash_text_blocks(text: str, block_chars: int, seed: int) -> list[BlockHash]:
    """Chained hashes of the full ``block_chars``-character blocks of ``text`` (approximate mode).

    Used when no tokenizer is configured: character blocks approximate token blocks, so prefix
    affinity still works, but the hashes never match engine events (which carry token ids).
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a string (got {type(text).__name__})")
    _check_block_size(block_chars, "block_chars")
    _check_seed(seed)
    # UTF-32 gives every character exactly 4 bytes, so character blocks are fixed-size byte
    # slices and one encode serves the whole prompt. "surrogatepass" accepts lone surrogates.
    data = text.encode("utf-32-le", "surrogatepass")
    text_seed = xxhash.xxh3_64_intdigest(_TEXT_DOMAIN, seed)
    return _chain_bytes(data, block_chars * 4, text_seed)


def prompt_chain(
    tokenized: TokenizedPrompt,
    block_size: int,
    seed: int,
    *,
    text_block_chars: int | None = None,
) -> list[BlockHash]:
    """The chain of a tokenized prompt: token blocks if it has token ids, else text blocks.

    In text mode a block is ``text_block_chars`` characters, by default ``block_size *
    CHARS_PER_TOKEN``, so that ``depth * block_size`` still estimates cached tokens.
    """
    if tokenized.token_ids is not None:
        return hash_token_blocks(tokenized.token_ids, block_size, seed)
    if tokenized.text is not None:
        _check_block_size(block_size)
        chars = block_size * CHARS_PER_TOKEN if text_block_chars is None else text_block_chars
        return hash_text_blocks(tokenized.text, chars, seed)
    raise ValueError("TokenizedPrompt has neither token_ids nor text")
