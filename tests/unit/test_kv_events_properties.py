"""Property tests: any KV-event message gives decoded events or a counted, logged decode error.

Three layers, each fed what hypothesis draws: ``decode_payload`` (any bytes, any msgpack value,
batches of loosely shaped events), ``EventApplier.apply_batch`` (whatever decodes must apply or be
skipped, never raise), and the agent's ingest loop itself (any frames, any number of them).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from typing import Any
from unittest import mock

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from replica.agent import AgentConfig, AgentMetrics, EventApplier, ReplicaAgent
from replica.fleet_store import MemoryFleetStore
from replica.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventDecodeError,
    KVEventSubscriber,
    decode_payload,
    encode_payload,
)
from routing.index import MemoryBlockIndex
from routing.types import Epoch, ReplicaId

#: Deterministic and bounded for CI: the same examples every run, no timing assertions, and no
#: example database written into the working tree.
PROPERTY = settings(
    derandomize=True,
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

encode = msgspec.msgpack.encode
TOPIC = b"kv"
#: msgpack's 0x91 is "an array of one element": this many of them nest past msgspec's stack guard.
DEEP = b"\x91" * 5_000 + b"\xc0"


# --------------------------------------------------------------------------- strategies

#: Every msgpack integer width, so out-of-range token ids and hashes come up.
INTS = st.integers(-(2**63), 2**64 - 1)

MSGPACK_VALUES = st.recursive(
    st.none() | st.booleans() | INTS | st.floats() | st.text(max_size=10) | st.binary(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=6) | st.integers(-5, 5), inner, max_size=4)
    ),
    max_leaves=15,
)


@st.composite
def loose(draw: st.DrawFn, right: st.SearchStrategy[Any]) -> Any:
    """Mostly a value of the right type; one time in ten any msgpack value."""
    return draw(MSGPACK_VALUES if draw(st.integers(0, 9)) == 0 else right)


#: A small pool of engine hashes, so parents resolve and removals hit stored blocks.
HASHES = st.integers(0, 5) | st.binary(min_size=1, max_size=2)
#: In vLLM's range mostly, then any msgpack int (negative, past 2**32).
TOKENS = loose(st.integers(0, 50)).filter(lambda t: not isinstance(t, bool)) | INTS
KINDS = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"])


@st.composite
def stored_fields(draw: st.DrawFn) -> dict[str, Any]:
    """BlockStored's fields in vLLM's order; token ids usually fill the blocks exactly."""
    hashes = draw(loose(st.lists(HASHES, max_size=3)))
    block_size = draw(loose(st.integers(-1, 3)))
    blocks = len(hashes) if isinstance(hashes, list) else 1
    fits = isinstance(block_size, int) and draw(st.integers(0, 3)) > 0
    size = blocks * block_size if fits else draw(st.integers(0, 9))
    return {
        "block_hashes": hashes,
        "parent_block_hash": draw(loose(st.none() | HASHES)),
        "token_ids": draw(loose(st.lists(TOKENS, min_size=max(0, size), max_size=max(0, size)))),
        "block_size": block_size,
        "lora_id": draw(loose(st.none() | st.integers(0, 3))),
        "medium": draw(loose(st.sampled_from([None, "GPU", "CPU"]))),
        "lora_name": draw(loose(st.none() | st.sampled_from(["ad", ""]))),
    }


OPTIONAL_FIELDS = st.fixed_dictionaries({}, optional={
    "extra_keys": loose(st.lists(st.none() | st.lists(MSGPACK_VALUES, max_size=3).map(tuple))),
    "group_idx": loose(st.sampled_from([None, 0, 1])),
    "field_from_the_future": MSGPACK_VALUES,
})


@st.composite
def map_events(draw: st.DrawFn) -> dict[Any, Any]:
    """A map event: all fields but a few dropped, each mostly of the right type."""
    fields = {"type": draw(loose(KINDS)), **draw(stored_fields()), **draw(OPTIONAL_FIELDS)}
    for name in draw(st.sets(st.sampled_from(sorted(fields)), max_size=2)):
        del fields[name]
    return fields


@st.composite
def array_events(draw: st.DrawFn) -> list[Any]:
    """An older vLLM's array event: the tag, then the first few fields in order."""
    values = list(draw(stored_fields()).values())
    return [draw(loose(KINDS)), *values[: draw(st.integers(0, len(values) + 1))]]


EVENTS = map_events() | array_events() | MSGPACK_VALUES


@st.composite
def batch_shells(draw: st.DrawFn) -> Any:
    """A batch as an array (vLLM) or a map (a later vLLM), of loose events and extra members."""
    ts = draw(loose(st.floats() | st.integers(0, 2**40)))
    events = draw(st.lists(EVENTS, max_size=5))
    rank = draw(st.none() | loose(st.integers(0, 3)))
    if draw(st.booleans()):
        return {"ts": ts, "events": events, "data_parallel_rank": rank}
    return [ts, events, rank, *draw(st.lists(MSGPACK_VALUES, max_size=2))]


@st.composite
def vllm_batches(draw: st.DrawFn) -> EventBatch:
    """A batch vLLM could send: blocks filled exactly, token ids in range."""
    stored = st.integers(1, 3).flatmap(
        lambda block_size: st.lists(HASHES, min_size=1, max_size=3).flatmap(
            lambda hashes: st.builds(
                BlockStored,
                block_hashes=st.just(hashes),
                parent_block_hash=st.none() | HASHES,
                token_ids=st.lists(
                    st.integers(0, 2**32 - 1),
                    min_size=len(hashes) * block_size,
                    max_size=len(hashes) * block_size,
                ),
                block_size=st.just(block_size),
                lora_id=st.none(),
                medium=st.sampled_from([None, "GPU"]),
                lora_name=st.none(),
            )
        )
    )
    removed = st.builds(BlockRemoved, block_hashes=st.lists(HASHES, max_size=3), medium=st.none())
    events = draw(st.lists(stored | removed | st.just(AllBlocksCleared()), max_size=4))
    return EventBatch(ts=draw(st.floats(0, 2e9)), events=events)


@st.composite
def valid_batches(draw: st.DrawFn) -> bytes:
    """A vLLM batch in the current or the array-event encoding."""
    return encode_payload(draw(vllm_batches()), legacy_array_format=draw(st.booleans()))


def _near(value: Any) -> st.SearchStrategy[Any]:
    """Values shaped like ``value`` but of any content: same-length lists of any ints, any int."""
    if isinstance(value, list):
        ints = all(isinstance(v, int) for v in value)
        return st.lists(INTS if ints else INTS | HASHES, min_size=len(value), max_size=len(value))
    if isinstance(value, int):
        return INTS
    return MSGPACK_VALUES


@st.composite
def one_field_off(draw: st.DrawFn) -> bytes:
    """A vLLM batch with one field of one event replaced by a value shaped like it."""
    shell = msgspec.to_builtins(draw(vllm_batches()))
    events = [e for e in shell[1] if len(e) > 1]
    if events:
        event = draw(st.sampled_from(events))
        name = draw(st.sampled_from(sorted(set(event) - {"type"})))
        event[name] = draw(_near(event[name]))
    return encode(shell)


@st.composite
def typed_stored(draw: st.DrawFn) -> BlockStored:
    """A BlockStored holding any values its declared types allow (msgpack's whole int range)."""
    any_hash = INTS | st.binary(max_size=4)
    block_size = draw(st.integers(1, 3) | INTS)
    hashes = draw(st.lists(any_hash, max_size=3))
    size = len(hashes) * block_size if 0 < block_size <= 3 else draw(st.integers(0, 6))
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=draw(st.none() | any_hash),
        token_ids=draw(st.lists(INTS, min_size=size, max_size=size)),
        block_size=block_size,
        lora_id=draw(st.none() | INTS),
        medium=draw(st.none() | st.just("GPU") | st.text(max_size=3)),
        lora_name=draw(st.none() | st.text(max_size=3)),
        extra_keys=draw(st.none() | st.lists(st.none() | st.tuples(st.text(max_size=3)))),
        group_idx=draw(st.none() | st.just(0) | INTS),
    )


@st.composite
def mutated(draw: st.DrawFn, payloads: st.SearchStrategy[bytes]) -> bytes:
    """A payload with a byte changed, bytes cut off, or a huge-length header spliced in."""
    raw = bytearray(draw(payloads))
    at = draw(st.integers(0, len(raw)))
    how = draw(st.sampled_from(["flip", "truncate", "huge-length"]))
    if how == "flip" and at < len(raw):
        raw[at] = draw(st.integers(0, 255))
    elif how == "truncate":
        del raw[at:]
    else:  # an array32 / map32 / bin32 header claiming ~4 billion members or bytes
        raw[at:at] = draw(st.sampled_from([b"\xdd", b"\xdf", b"\xc6"])) + b"\xff\xff\xff\xff"
    return bytes(raw)


PAYLOADS = st.one_of(
    valid_batches(),
    one_field_off(),
    batch_shells().map(encode),
    MSGPACK_VALUES.map(encode),
    st.binary(max_size=64),
    mutated(valid_batches()),
    mutated(batch_shells().map(encode)),
)

#: Payloads nested past msgspec's recursion guard, in each place the decoder looks.
DEEP_PAYLOADS = [
    DEEP,  # the batch itself
    encode([1.0, ["@"]]).replace(encode("@"), DEEP),  # an array event
    encode([1.0, [{"type": "@"}]]).replace(encode("@"), DEEP),  # a map event's tag
    # an unknown field the current-format decoder skips
    encode([1.0, [{"type": "AllBlocksCleared", "x": "@"}]]).replace(encode("@"), DEEP),
    encode([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "x": "@"}]]).replace(
        encode("@"), DEEP
    ),
]


# --------------------------------------------------------------------------- decode


def decode_or_error(payload: bytes) -> EventBatch | KVEventDecodeError:
    """The decoded batch, or the defined decode error; anything else fails the test."""
    try:
        batch = decode_payload(payload)
    except KVEventDecodeError as exc:
        return exc
    assert isinstance(batch, EventBatch)
    assert all(isinstance(e, BlockStored | BlockRemoved | AllBlocksCleared) for e in batch.events)
    return batch


@PROPERTY
@given(payload=PAYLOADS)
@example(payload=DEEP_PAYLOADS[0])
@example(payload=DEEP_PAYLOADS[1])  # msgspec's RecursionError escaped decode_payload
@example(payload=DEEP_PAYLOADS[2])
@example(payload=DEEP_PAYLOADS[3])
@example(payload=DEEP_PAYLOADS[4])
@example(payload=b"\x92\xcb" + bytes(8) + b"\xdd\xff\xff\xff\xff")  # a 4-billion-event list
# found by hypothesis: a str that is not UTF-8 raised UnicodeDecodeError, not a decode error
@example(payload=b"\x92\xcb" + bytes(8) + b"\x91\x81\xa4type\xac" + bytes(11) + b"\x80")
def test_any_payload_decodes_or_raises_the_decode_error(payload: bytes) -> None:
    decode_or_error(payload)


@pytest.mark.parametrize("payload", DEEP_PAYLOADS)
def test_deep_nesting_is_a_decode_error(payload: bytes) -> None:
    with pytest.raises(KVEventDecodeError):  # the batch itself fails its shape check first
        decode_payload(payload)


@PROPERTY
@given(payload=valid_batches())
def test_valid_batches_decode(payload: bytes) -> None:
    assert isinstance(decode_or_error(payload), EventBatch)


def test_huge_real_lists_decode_and_apply() -> None:
    """100,000 token ids in one event: decoded and keyed, not refused."""
    tokens = list(range(100_000))
    event = BlockStored(list(range(25_000)), None, tokens, 4, None, "GPU", None)
    batch = decode_payload(encode_payload(EventBatch(ts=1.0, events=[event])))
    applier, _ = _applier(map_capacity=25_000)
    asyncio.run(_apply_all(applier, [batch]))
    assert len(list(applier.hashes.live_blocks())) == 25_000


# --------------------------------------------------------------------------- apply


def _applier(map_capacity: int = 8) -> tuple[EventApplier, MemoryBlockIndex]:
    """An applier whose tiny hash map also overflows under hypothesis' short streams."""
    index = MemoryBlockIndex()
    epochs = itertools.count(1)
    applier = EventApplier(
        index, ReplicaId("r0"), AgentMetrics("r0"), model="m",
        map_capacity=map_capacity, epoch_source=lambda: Epoch(next(epochs)),
    )
    return applier, index


async def _apply_all(applier: EventApplier, batches: Sequence[EventBatch]) -> None:
    await applier.start()
    for batch in batches:
        await applier.apply_batch(batch)


def _stored_event(tokens: list[int]) -> bytes:
    fields = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
              "token_ids": tokens, "block_size": 1, "lora_id": None, "medium": "GPU",
              "lora_name": None}
    return encode([1.0, [fields]])


@PROPERTY
@given(payloads=st.lists(PAYLOADS, min_size=1, max_size=6))
@example(payloads=[_stored_event([-1])])  # see test_applier_takes_any_value_the_codec_types_allow
def test_whatever_decodes_applies_without_raising(payloads: list[bytes]) -> None:
    """A stream of decoded batches: each event is applied or counted as skipped."""
    batches = [b for b in map(decode_or_error, payloads) if isinstance(b, EventBatch)]
    applier, _ = _applier()
    asyncio.run(_apply_all(applier, batches))
    applied = sum(
        applier.metrics.value("fleetgate_agent_events_applied_total", type=kind)
        for kind in ("BlockStored", "BlockRemoved", "AllBlocksCleared")
    )
    assert applied == sum(len(b.events) for b in batches)


@PROPERTY
@given(events=st.lists(typed_stored(), min_size=1, max_size=4))
# token ids outside [0, 2**32) decoded fine (the struct says ``list[int]``), then hashing raised
# ValueError out of apply_batch, and so out of the agent's events loop
@example(events=[BlockStored([1], None, [-1], 1, None, None, None)])
@example(events=[BlockStored([1], None, [2**32], 1, None, None, None)])
def test_applier_takes_any_value_the_codec_types_allow(events: list[BlockStored]) -> None:
    batch = decode_payload(encode_payload(EventBatch(ts=1.0, events=list(events))))
    applier, _ = _applier()
    asyncio.run(_apply_all(applier, [batch]))
    assert applier.metrics.value("fleetgate_agent_events_applied_total", type="BlockStored") == (
        len(events)
    )


@pytest.mark.parametrize("token", [-1, 2**32, 2**64 - 1])
def test_token_ids_outside_uint32_are_skipped_and_counted(token: int) -> None:
    applier, index = _applier()
    event = BlockStored([1], None, [5, token], 2, None, "GPU", None)
    asyncio.run(_apply_all(applier, [EventBatch(ts=1.0, events=[event])]))
    assert applier.skipped_events == 1
    assert asyncio.run(index.stats()).entries == 0


# --------------------------------------------------------------------------- the ingest loop


class FramesSocket:
    """Stands in for the subscriber's ZMQ socket: delivers the given messages, then stays quiet."""

    def __init__(self, messages: Sequence[list[bytes]]) -> None:
        self._messages = list(messages)
        self.drained = asyncio.Event()

    async def recv_multipart(self) -> list[bytes]:
        if not self._messages:
            self.drained.set()
            await asyncio.Event().wait()  # a stream with nothing more to say
        return self._messages.pop(0)

    def close(self, linger: int = 0) -> None:
        pass


def _seq(n: int) -> bytes:
    return n.to_bytes(8, "big")


#: Sequence numbers in order, repeated, skipped ahead and going back (restart), and garbage.
SEQ_FRAMES = st.integers(0, 4).map(_seq) | st.binary(max_size=10)

MESSAGES = st.one_of(
    st.tuples(st.just(TOPIC), SEQ_FRAMES, PAYLOADS).map(list),
    st.lists(st.binary(max_size=12), max_size=5),  # any number of frames, any bytes
    st.tuples(st.sampled_from([b"kv2", b"", b"k"]), SEQ_FRAMES, PAYLOADS).map(list),
)


def _expected(frames: list[bytes]) -> str:
    """What the ingest loop must make of one message (the subscriber's documented checks)."""
    if len(frames) != 3:
        return "error"
    topic, seq, payload = frames
    if topic != TOPIC:
        return "ignored"  # another topic that shares the prefix
    if len(seq) != 8 or isinstance(decode_or_error(payload), KVEventDecodeError):
        return "error"
    return "applied"


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.malformed = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.malformed += "malformed KV-event message" in record.getMessage()


class _NoScraper:
    def __init__(self, engine_url: str) -> None:
        self.engine_url = engine_url

    async def close(self) -> None:
        pass


_endpoints = itertools.count()


async def _ingest(messages: list[list[bytes]]) -> tuple[ReplicaAgent, int]:
    """Run the agent's events loop over ``messages``; (the agent, malformed messages logged)."""
    config = AgentConfig("r0", "http://127.0.0.1:9", model="m", listen_port=None)
    # The events loop never scrapes, and a real scraper's HTTP client costs ~60 ms to build.
    with mock.patch("replica.agent.agent.EngineScraper", _NoScraper):
        agent = ReplicaAgent(config, index=MemoryBlockIndex(), fleet=MemoryFleetStore())
    await agent.applier.start()
    subscriber = KVEventSubscriber(f"inproc://kv-properties-{next(_endpoints)}", bind=True)
    # Replace the real socket (closed first) so the loop sees exactly the frames drawn.
    subscriber._sub.close(linger=0)
    socket = FramesSocket(messages)
    subscriber._sub = socket  # type: ignore[assignment]
    agent.subscriber = subscriber
    warnings = _Warnings()
    logging.getLogger("replica.agent.agent").addHandler(warnings)
    loop = asyncio.create_task(agent._events_loop())
    drained = asyncio.create_task(socket.drained.wait())
    try:
        await asyncio.wait({loop, drained}, return_when=asyncio.FIRST_COMPLETED)
        if loop.done():
            loop.result()  # re-raises what escaped the loop
            raise AssertionError("the events loop ended on its own")
    finally:
        logging.getLogger("replica.agent.agent").removeHandler(warnings)
        for task in (loop, drained):
            task.cancel()
        await asyncio.gather(loop, drained, return_exceptions=True)
        await agent.stop()
    return agent, warnings.malformed


@settings(PROPERTY, max_examples=100)  # each example builds an agent and a socket
@given(messages=st.lists(MESSAGES, max_size=8))
@example(messages=[[TOPIC, _seq(0), _stored_event([-1])], [TOPIC, _seq(1), DEEP_PAYLOADS[1]]])
@example(messages=[[], [TOPIC], [TOPIC, _seq(0)], [TOPIC, b"\x00", b""], [TOPIC, _seq(0), b""]])
def test_ingest_loop_survives_any_frames(messages: list[list[bytes]]) -> None:
    agent, malformed = asyncio.run(_ingest(messages))
    outcomes = [_expected(m) for m in messages]
    assert agent.batches_applied == outcomes.count("applied")
    assert malformed == outcomes.count("error")
