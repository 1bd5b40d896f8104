"""vLLM's KV-event wire format: the msgpack codec, a ZMQ publisher and an asyncio subscriber.

Byte-compatible with vLLM 0.32/0.33 (``vllm/distributed/kv_events.py``): the agent decodes real
engines' events with it and the simulated replica publishes with it.
"""

from replica.kv_events.codec import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    EventBatch,
    KVEvent,
    KVEventDecodeError,
    decode_payload,
    encode_payload,
    make_batch,
)
from replica.kv_events.endpoints import (
    offset_port,
    publisher_binds,
    subscriber_binds,
    subscriber_endpoint_for,
)
from replica.kv_events.publisher import END_SEQ, KVEventPublisher, running_publisher
from replica.kv_events.subscriber import KVEventSubscriber

__all__ = [
    "END_SEQ",
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EngineHash",
    "EventBatch",
    "KVEvent",
    "KVEventDecodeError",
    "KVEventPublisher",
    "KVEventSubscriber",
    "decode_payload",
    "encode_payload",
    "make_batch",
    "offset_port",
    "publisher_binds",
    "running_publisher",
    "subscriber_binds",
    "subscriber_endpoint_for",
]
