"""From trace records to what the engines and the router see: token ids and block chains.

A trace only says *which* prompt blocks are equal (``hash_ids``), never what they contain. The
simulator makes content up, deterministically:

* **Tokens.** Trace block ``h`` (``trace_block_size`` tokens) gets token ``i`` =
  ``mix(h, i) mod vocab``. Equal ids give equal tokens, different ids different tokens (up to a
  negligible chance), so the engine model's own prefix cache (16-token blocks, say) sees exactly
  the sharing the trace describes, neither more nor less. A partial last block uses the first
  tokens of its id's block.
* **Routing chain.** The router's block index is keyed at *trace-block* granularity: one
  fleetgate ``BlockHash`` per full trace block, chained from a seed that folds in the model and
  adapter (as ``routing.hashing.chain_seed`` does for a live gateway). Hashing 12k-token prompts
  per 16 tokens for every routing decision would cost more than the rest of the simulation; the
  trace block is the finest granularity at which the trace carries information anyway.
* **Engine hash -> routing hash.** The engines publish KV events keyed by *their* block hashes,
  as vLLM does. The live agent maps them through the token ids the events carry; here the
  simulator knows the prompts, so it precomputes, per trace block, the engine hash of the last
  engine block inside it (the block whose ``BlockStored`` completes the trace block) with the
  engine's own public hashing functions, and maps that one hash back to the routing hash.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from replica.sim.kv_cache import chain_seed as engine_chain_seed
from replica.sim.kv_cache import extend_chain as engine_extend_chain
from replica.sim.kv_cache import token_bytes
from routing.hashing import chain_seed as routing_chain_seed
from routing.types import BlockHash

__all__ = ["PreparedPrompt", "PromptFactory"]

# splitmix64 constants: a cheap, well-mixed integer hash that numpy can vectorise.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
#: Trace ids are arbitrary JSON integers; they are folded to 64 bits before hashing.
_U64 = 2**64 - 1


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over a uint64 array (wrapping arithmetic, as intended)."""
    z = values + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    """One request's prompt as the engine and the router see it."""

    token_ids: list[int]
    #: Routing chain: one ``BlockHash`` per *full* trace block.
    chain: tuple[BlockHash, ...]


class PromptFactory:
    """Synthesises prompts for one simulated fleet and remembers engine->routing block hashes.

    ``engine_block_size`` must divide ``trace_block_size`` so that every trace block ends on an
    engine block boundary (the defaults, 16 and 512, do).
    """

    def __init__(
        self, model: str, trace_block_size: int, engine_block_size: int, vocab_size: int
    ) -> None:
        if trace_block_size < 1 or engine_block_size < 1:
            raise ValueError(
                f"block sizes must be >= 1 (trace_block_size={trace_block_size}, "
                f"engine block_size={engine_block_size})"
            )
        if trace_block_size % engine_block_size:
            raise ValueError(
                f"trace_block_size ({trace_block_size}) must be a multiple of the engine's "
                f"block_size ({engine_block_size}) so trace blocks end on engine block boundaries"
            )
        self.model = model
        self.trace_block_size = trace_block_size
        self.engine_block_size = engine_block_size
        self.vocab_size = vocab_size
        self._positions = np.arange(trace_block_size, dtype=np.uint64)
        #: Routing hash of a trace block -> engine hash of the last engine block inside it.
        self._engine_tail: dict[BlockHash, int] = {}
        #: The reverse map, consulted for every hash of every KV event.
        self.routing_hash_of: dict[int, BlockHash] = {}

    def tokens(self, hash_ids: tuple[int, ...], length: int) -> list[int]:
        """Token ids of a ``length``-token prompt made of the trace blocks ``hash_ids``."""
        block = self.trace_block_size
        if len(hash_ids) * block < length:
            raise ValueError(
                f"{len(hash_ids)} hash_ids cover {len(hash_ids) * block} tokens, fewer than "
                f"input_length {length} (is --trace-block-size {block} the trace's block size?)"
            )
        ids = np.array([h & _U64 for h in hash_ids], dtype=np.uint64)
        # Mix the id first so ids h and h+1 do not produce shifted copies of each other.
        keys = _splitmix64(ids)[:, None] ^ (self._positions[None, :] * _MIX2)
        tokens = _splitmix64(keys.reshape(-1)[:length]) % np.uint64(self.vocab_size)
        return tokens.tolist()

    def prepare(
        self, hash_ids: tuple[int, ...], length: int, adapter: str | None
    ) -> PreparedPrompt:
        """Tokens and routing chain of one request; registers its engine->routing hashes."""
        token_ids = self.tokens(hash_ids, length)
        full_blocks = length // self.trace_block_size
        chain: list[BlockHash] = []
        parent = routing_chain_seed(self.model, adapter)
        engine_parent = engine_chain_seed(adapter, None)
        for position in range(full_blocks):
            # Chaining on the parent keeps traces that reuse an id under another prefix honest.
            parent = xxhash.xxh3_64_intdigest(
                (hash_ids[position] & _U64).to_bytes(8, "little"), parent
            )
            routing_hash = BlockHash(parent)
            chain.append(routing_hash)
            tail = self._engine_tail.get(routing_hash)
            if tail is None:
                tail = self._engine_tail_hash(token_ids, position, engine_parent)
                self._engine_tail[routing_hash] = tail
                self.routing_hash_of[tail] = routing_hash
            engine_parent = tail
        return PreparedPrompt(token_ids, tuple(chain))

    def chain_only(
        self, hash_ids: tuple[int, ...], length: int, adapter: str | None
    ) -> PreparedPrompt:
        """The routing chain of a request no engine will take (over the context window), with
        no tokens: routing sees it as it would the prompt, and the replay never builds a prompt
        that may run to millions of tokens (a review's 200,000-block line took 5.7 GB)."""
        chain: list[BlockHash] = []
        parent = routing_chain_seed(self.model, adapter)
        for position in range(length // self.trace_block_size):
            parent = xxhash.xxh3_64_intdigest(
                (hash_ids[position] & _U64).to_bytes(8, "little"), parent
            )
            chain.append(BlockHash(parent))
        return PreparedPrompt([], tuple(chain))

    def _engine_tail_hash(self, token_ids: list[int], position: int, engine_parent: int) -> int:
        """The engine's hash of the last engine block of trace block ``position``."""
        start = position * self.trace_block_size
        data = token_bytes(token_ids[start : start + self.trace_block_size])
        per_trace_block = self.trace_block_size // self.engine_block_size
        # extend_chain hashes blocks len(hashes)..num_blocks-1, reading data from block
        # ``data_first_block``: a one-element list holding the parent starts the chain there.
        hashes = [engine_parent]
        engine_extend_chain(hashes, data, self.engine_block_size, per_trace_block + 1, 0, 1)
        return hashes[-1]
