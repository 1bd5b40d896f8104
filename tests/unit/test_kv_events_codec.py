"""The KV-event codec against vLLM 0.32's wire shapes, written out by hand (no vLLM import)."""

from __future__ import annotations

import msgspec
import pytest

from replica.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventDecodeError,
    decode_payload,
    encode_payload,
)
from replica.kv_events.endpoints import offset_port, subscriber_binds, subscriber_endpoint_for

generic = msgspec.msgpack.encode


def _stored(**overrides: object) -> BlockStored:
    fields: dict[str, object] = {
        "block_hashes": [11, 12],
        "parent_block_hash": 10,
        "token_ids": list(range(8)),
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    fields.update(overrides)
    return BlockStored(**fields)  # type: ignore[arg-type]


def _sample_batch() -> EventBatch:
    return EventBatch(
        ts=1700000000.25,
        events=[
            _stored(),
            _stored(block_hashes=[2**64 - 1], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                    lora_id=3, lora_name="tenant-a"),
            BlockRemoved(block_hashes=[11], medium="GPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )


def test_current_format_is_vllm_bytes() -> None:
    """Array batch, map events in vLLM's field order, None-default fields left out."""
    batch = EventBatch(ts=1.5, events=[_stored(), BlockRemoved([11], "GPU"), AllBlocksCleared()],
                       data_parallel_rank=0)
    expected = generic([
        1.5,
        [
            {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": 10,
             "token_ids": list(range(8)), "block_size": 4, "lora_id": None, "medium": "GPU",
             "lora_name": None},
            {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
        ],
        0,
    ])
    assert encode_payload(batch) == expected


@pytest.mark.parametrize("legacy", [False, True], ids=["map-events", "array-events"])
def test_round_trip(legacy: bool) -> None:
    batch = _sample_batch()
    decoded = decode_payload(encode_payload(batch, legacy_array_format=legacy))
    if legacy:
        # The array form has no lora_name field; everything else survives.
        batch.events[1].lora_name = None  # type: ignore[union-attr]
    assert decoded == batch


def test_legacy_array_events_as_old_vllm_wrote_them() -> None:
    payload = generic([
        2.0,
        [
            ["BlockStored", [5, 6], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU"],
            ["BlockStored", [7], 6, [9, 9, 9, 9], 4, None],  # before `medium` existed
            ["BlockRemoved", [5]],
            ["AllBlocksCleared"],
        ],
    ])
    batch = decode_payload(payload)
    assert batch.ts == 2.0
    assert batch.data_parallel_rank is None
    assert batch.events == [
        _stored(block_hashes=[5, 6], parent_block_hash=None, token_ids=[1, 2, 3, 4, 5, 6, 7, 8]),
        _stored(block_hashes=[7], parent_block_hash=6, token_ids=[9, 9, 9, 9], medium=None),
        BlockRemoved(block_hashes=[5], medium=None),
        AllBlocksCleared(),
    ]


def test_unknown_fields_are_ignored_and_optional_fields_kept() -> None:
    event = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
             "token_ids": [4, 4], "block_size": 2, "lora_id": None, "medium": "GPU",
             "lora_name": "ad", "extra_keys": [["ad", "salt"]], "group_idx": 1,
             "field_from_the_future": {"x": 1}}
    batch = decode_payload(generic([3.0, [event], 1, "trailing-future-field"]))
    (stored,) = batch.events
    assert isinstance(stored, BlockStored)
    assert (stored.lora_name, stored.group_idx, stored.extra_keys) == ("ad", 1, [("ad", "salt")])
    assert batch.data_parallel_rank == 1


def test_map_event_missing_lora_fields_decodes() -> None:
    event = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
             "token_ids": [4, 4], "block_size": 2}
    (stored,) = decode_payload(generic([3.0, [event]])).events
    assert stored == _stored(block_hashes=[1], parent_block_hash=None, token_ids=[4, 4],
                             block_size=2, medium=None)


def test_map_encoded_batch_decodes() -> None:
    payload = generic({"ts": 4.0, "events": [{"type": "AllBlocksCleared"}],
                       "data_parallel_rank": 2})
    assert decode_payload(payload) == EventBatch(4.0, [AllBlocksCleared()], 2)


def test_bytes_block_hashes() -> None:
    batch = EventBatch(ts=1.0, events=[_stored(block_hashes=[b"\x01" * 32],
                                               parent_block_hash=b"\x00" * 32)])
    assert decode_payload(encode_payload(batch)) == batch


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # a byte msgpack never uses
        b"not msgpack at all",
        generic({"hello": "world"}),
        generic([1.0, [{"type": "NoSuchEvent"}]]),
        generic([1.0, [["BlockStored", "not-a-list"]]]),
        generic([1.0, [{"type": "BlockRemoved", "block_hashes": "nope"}]]),
        generic([1.0, "events"]),
        generic("just a string"),
        generic([1.0, [42]]),
        encode_payload(EventBatch(1.0, [AllBlocksCleared()]))[:-1],  # truncated
    ],
)
def test_garbage_raises_decode_error(payload: bytes) -> None:
    with pytest.raises(KVEventDecodeError):
        decode_payload(payload)


@pytest.mark.parametrize(
    ("publisher", "subscriber"),
    [
        ("tcp://*:5557", "tcp://127.0.0.1:5557"),
        ("tcp://gateway:5557", "tcp://*:5557"),
        ("ipc:///tmp/kv", "ipc:///tmp/kv"),
        # vLLM binds any address with "::": connect to that address, not to the host given.
        ("tcp://[fd00::5]:5557", "tcp://[fd00::5]:5557"),
        ("tcp://[::]:5557", "tcp://127.0.0.1:5557"),
    ],
)
def test_subscriber_endpoint_for(publisher: str, subscriber: str) -> None:
    assert subscriber_endpoint_for(publisher) == subscriber


def test_an_ipv6_host_is_bracketed_and_only_wildcards_are_bound() -> None:
    assert subscriber_endpoint_for("tcp://*:5557", host="fd00::7") == "tcp://[fd00::7]:5557"
    assert [
        subscriber_binds(e)
        for e in ("tcp://*:1", "tcp://[::]:1", "tcp://0.0.0.0:1", "tcp://[fd00::5]:1",
                  "tcp://[::1]:1", "tcp://gw:1")
    ] == [True, True, True, False, False, False]


def test_offset_port() -> None:
    assert offset_port("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_port("ipc:///tmp/kv", 3) == "ipc:///tmp/kv"


def test_the_shared_zmq_context_takes_as_many_sockets_as_the_process_may_open_files() -> None:
    # ZeroMQ's default cap of 1,023 sockets stopped `fleetgate up --sim 400` (three sockets per
    # simulated replica and its agent) with "Too many open files" (the CLI review).
    import resource

    import zmq

    from replica.kv_events.publisher import shared_context

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 1 << 16 if soft == resource.RLIM_INFINITY else min(soft, 1 << 16)
    assert shared_context().get(zmq.MAX_SOCKETS) >= wanted
