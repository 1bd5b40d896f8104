"""vLLM's KV-event payload format: msgpack, byte-compatible with vLLM 0.32/0.33.

A payload is one ``EventBatch`` encoded as a msgpack *array* ``[ts, events, data_parallel_rank]``.
Each event is a msgpack *map* tagged by its class name under ``"type"``
(``{"type": "BlockStored", "block_hashes": [...], ...}``), with fields whose default is ``None``
left out (vLLM's ``omit_defaults=True``). Older vLLM encoded each event as an array whose first
element is the tag (``["BlockStored", hashes, parent, tokens, block_size, lora_id, medium]``), and
a later vLLM may drop the array form of the batch itself; ``decode_payload`` accepts all of them.

The structs below mirror ``vllm/distributed/kv_events.py`` field for field and in the same order,
so that ``encode_payload`` produces the bytes vLLM's own publisher would.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import msgspec

#: vLLM's ``ExternalBlockHash``: a 64-bit int by default, raw bytes in some hashing configs.
EngineHash: TypeAlias = int | bytes

#: vLLM's ``MEDIUM_GPU``: where a stored block lives.
MEDIUM_GPU = "GPU"


class KVEventDecodeError(ValueError):
    """A payload that is not a vLLM KV-event batch (truncated, garbage, wrong shape)."""


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Blocks entered the prefix cache. One event may cover several consecutive blocks.

    ``token_ids`` spans every block in ``block_hashes`` (``block_size`` tokens each);
    ``parent_block_hash`` is the hash of the block before the first one, ``None`` at the root.
    """

    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    #: Deprecated by vLLM in favour of ``lora_name``; still always sent.
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    #: One entry per block: the extra keys vLLM folded into the hash (adapter, salt, mm ids).
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Blocks were evicted from the prefix cache."""

    block_hashes: list[EngineHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """The engine dropped its whole prefix cache (reset): every block it held is gone."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published message: the events of one engine step, with the wall-clock time."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


# --------------------------------------------------------------------------- alternate shapes
# Decoding tries the current format first (one typed msgspec pass, the fast path), and only on a
# mismatch falls back to these shapes, event by event.


class _MapBatch(msgspec.Struct, gc=False):
    """A batch encoded as a map (a vLLM that dropped ``array_like`` on the batch)."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _LegacyBlockStored(
    msgspec.Struct, array_like=True, tag="BlockStored", gc=False
):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class _LegacyBlockRemoved(
    msgspec.Struct, array_like=True, tag="BlockRemoved", gc=False
):
    block_hashes: list[EngineHash]
    medium: str | None = None


class _LegacyAllBlocksCleared(
    msgspec.Struct, array_like=True, tag="AllBlocksCleared", gc=False
):
    pass


_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(EventBatch)
_raw_batch_decoder = msgspec.msgpack.Decoder(_RawBatch)
_map_batch_decoder = msgspec.msgpack.Decoder(_MapBatch)
_event_decoder = msgspec.msgpack.Decoder(KVEvent)
_legacy_event_decoder = msgspec.msgpack.Decoder(
    _LegacyBlockStored | _LegacyBlockRemoved | _LegacyAllBlocksCleared
)
_any_decoder = msgspec.msgpack.Decoder()


def _is_msgpack_map(raw: bytes | msgspec.Raw) -> bool:
    """Whether the first msgpack value in ``raw`` is a map (fixmap, map16 or map32)."""
    view = memoryview(raw)
    if not view:
        return False
    first = view[0]
    return 0x80 <= first <= 0x8F or first in (0xDE, 0xDF)


def _from_legacy(event: Any) -> KVEvent:
    if isinstance(event, _LegacyBlockStored):
        return BlockStored(
            block_hashes=event.block_hashes,
            parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=event.lora_name,
        )
    if isinstance(event, _LegacyBlockRemoved):
        return BlockRemoved(block_hashes=event.block_hashes, medium=event.medium)
    return AllBlocksCleared()


def _from_partial_map(raw: msgspec.Raw) -> KVEvent:
    """A map event missing fields that vLLM 0.32 always sends (an older map-format vLLM)."""
    obj = _any_decoder.decode(raw)
    if not isinstance(obj, dict):
        raise KVEventDecodeError(f"event is a {type(obj).__name__}, not a map")
    kind = obj.get("type")
    defaults: dict[str, Any]
    if kind == "BlockStored":
        defaults = {"lora_id": None, "medium": None, "lora_name": None}
    elif kind == "BlockRemoved":
        defaults = {"medium": None}
    else:
        defaults = {}
    try:
        return msgspec.convert({**defaults, **obj}, KVEvent)
    except msgspec.ValidationError as exc:
        raise KVEventDecodeError(f"invalid {kind or 'untagged'} event: {exc}") from exc


def _decode_event(raw: msgspec.Raw) -> KVEvent:
    try:
        if _is_msgpack_map(raw):
            try:
                return _event_decoder.decode(raw)
            except msgspec.ValidationError:
                return _from_partial_map(raw)
        return _from_legacy(_legacy_event_decoder.decode(raw))
    except msgspec.DecodeError as exc:
        raise KVEventDecodeError(f"invalid KV event: {exc}") from exc


def decode_payload(payload: bytes | bytearray | memoryview) -> EventBatch:
    """Decode the msgpack payload frame of one KV-event message.

    Accepts vLLM 0.32/0.33's format, the older array-encoded events and a map-encoded batch.
    Unknown extra fields are ignored. Raises ``KVEventDecodeError`` on anything else.
    """
    # msgspec reports two kinds of garbage outside ``DecodeError``; they must not take the ingest
    # loop down any more than the others.
    try:
        return _decode_batch(payload)
    except RecursionError:  # values nested ~1,000 deep, even in a field the decoder skips
        raise KVEventDecodeError("not a KV-event batch: nested too deeply") from None
    except UnicodeDecodeError as exc:  # a msgpack str that is not UTF-8
        raise KVEventDecodeError(f"not a KV-event batch: a string is not UTF-8: {exc}") from None


def _decode_batch(payload: bytes | bytearray | memoryview) -> EventBatch:
    try:
        return _batch_decoder.decode(payload)
    except msgspec.DecodeError:
        pass  # not the current format: try the others below, and say why if none fits
    try:
        shell: _RawBatch | _MapBatch
        if _is_msgpack_map(bytes(payload[:1])):
            shell = _map_batch_decoder.decode(payload)
        else:
            shell = _raw_batch_decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise KVEventDecodeError(f"not a KV-event batch: {exc}") from exc
    events = [_decode_event(raw) for raw in shell.events]
    return EventBatch(ts=shell.ts, events=events, data_parallel_rank=shell.data_parallel_rank)


def _legacy_event(event: KVEvent) -> list[Any]:
    if isinstance(event, BlockStored):
        return [
            "BlockStored",
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, event.medium]
    return ["AllBlocksCleared"]


def encode_payload(batch: EventBatch, legacy_array_format: bool = False) -> bytes:
    """Encode ``batch`` exactly as vLLM's ZMQ publisher does.

    ``legacy_array_format=True`` writes each event as an array (older vLLM); it has no room for
    ``lora_name`` or the optional fields, which are dropped.
    """
    if not legacy_array_format:
        return _encoder.encode(batch)
    shell: list[Any] = [batch.ts, [_legacy_event(e) for e in batch.events]]
    if batch.data_parallel_rank is not None:
        shell.append(batch.data_parallel_rank)
    return _encoder.encode(shell)


def make_batch(
    events: Sequence[KVEvent], ts: float, data_parallel_rank: int | None = None
) -> EventBatch:
    """An ``EventBatch`` of ``events`` (copied into a list, as the struct requires)."""
    return EventBatch(ts=ts, events=list(events), data_parallel_rank=data_parallel_rank)
