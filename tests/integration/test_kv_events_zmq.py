"""Real ZMQ PUB/SUB and ROUTER replay on 127.0.0.1, in both bind/connect directions."""

from __future__ import annotations

import asyncio

import pytest

from replica.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
    KVEventSubscriber,
    running_publisher,
    subscriber_endpoint_for,
)
from tests.support.redis_server import free_port


def _stored(first_token: int) -> BlockStored:
    return BlockStored(
        block_hashes=[first_token],
        parent_block_hash=None,
        token_ids=[first_token] * 4,
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


async def _await_subscription(pub: KVEventPublisher, sub: KVEventSubscriber) -> int:
    """Publish probes until one arrives (ZMQ's slow joiner); returns the last probe's seq.

    Retries use no timing assumptions: each probe waits for a bounded recv, and only the
    first arrival matters.
    """
    for _ in range(200):
        pub.publish([AllBlocksCleared()])
        try:
            seq, _batch = await asyncio.wait_for(sub.recv(), timeout=0.05)
        except TimeoutError:
            continue
        # Drain the probes that were still in flight behind the first arrival.
        while seq < pub.next_seq - 1:
            seq, _batch = await asyncio.wait_for(sub.recv(), timeout=5)
        return seq
    raise AssertionError("subscriber never received a probe batch")


async def test_publisher_binds_subscriber_connects_with_replay() -> None:
    data_port, replay_port = free_port(), free_port()
    publisher_setting = f"tcp://*:{data_port}"  # '*': the engine binds
    pub = KVEventPublisher(
        endpoint=publisher_setting, topic="kv", replay_endpoint=f"tcp://*:{replay_port}"
    )
    async with running_publisher(pub):
        sub = KVEventSubscriber(
            subscriber_endpoint_for(publisher_setting),
            topic="kv",
            replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        )
        with sub:
            last_probe = await _await_subscription(pub, sub)
            sent = [
                pub.publish([_stored(1), _stored(2)], ts=100.0),
                pub.publish([BlockRemoved(block_hashes=[1], medium="GPU")], ts=101.0),
            ]
            received = [await sub.recv() for _ in sent]
            assert [seq for seq, _ in received] == sent == [last_probe + 1, last_probe + 2]
            assert received[0][1].events == [_stored(1), _stored(2)]
            assert received[0][1].data_parallel_rank == 0
            assert received[1][1].events == [BlockRemoved(block_hashes=[1], medium="GPU")]

            replayed = await sub.request_replay(last_probe + 1)
            assert replayed == received
            everything = await sub.request_replay(0)
            assert [seq for seq, _ in everything] == list(range(pub.next_seq))


async def test_publisher_connects_subscriber_binds() -> None:
    port = free_port()
    publisher_setting = f"tcp://127.0.0.1:{port}"  # no '*': the engine connects
    sub = KVEventSubscriber(subscriber_endpoint_for(publisher_setting), topic="kv")
    with sub:
        pub = KVEventPublisher(endpoint=publisher_setting, topic="kv")
        try:
            await _await_subscription(pub, sub)
            seq = pub.publish([_stored(7)])
            got_seq, batch = await sub.recv()
            assert (got_seq, batch.events) == (seq, [_stored(7)])
        finally:
            pub.close()



async def test_an_ipv6_publisher_address_is_connected_to_with_replay() -> None:
    """An IPv6 address: the publisher binds it (vLLM's rule binds anything with ``::``) and the
    subscriber connects to that address. Before, the subscriber took the ``::`` for a wildcard
    and bound too, and neither socket set ZeroMQ's IPV6 option, without which libzmq refuses
    an IPv6 address ("No such device")."""
    data_port, replay_port = free_port(), free_port()
    publisher_setting = f"tcp://[::1]:{data_port}"
    pub = KVEventPublisher(
        endpoint=publisher_setting, topic="kv", replay_endpoint=f"tcp://[::1]:{replay_port}"
    )
    async with running_publisher(pub):
        endpoint = subscriber_endpoint_for(publisher_setting)
        assert endpoint == publisher_setting
        with KVEventSubscriber(
            endpoint, topic="kv", replay_endpoint=f"tcp://[::1]:{replay_port}"
        ) as sub:
            await _await_subscription(pub, sub)
            seq = pub.publish([_stored(9)])
            received = await sub.recv()
            assert received[0] == seq and received[1].events == [_stored(9)]
            assert await sub.request_replay(seq) == [received]


async def test_a_subscriber_binding_the_ipv6_wildcard_takes_ipv6_publishers() -> None:
    """``tcp://[::]:PORT``: the subscriber binds every IPv6 interface; a publisher connects to
    it (the loopback written out in full: by vLLM's rule an address with ``::`` binds)."""
    port = free_port()
    sub = KVEventSubscriber(f"tcp://[::]:{port}", topic="kv")
    with sub:
        pub = KVEventPublisher(endpoint=f"tcp://[0:0:0:0:0:0:0:1]:{port}", topic="kv")
        try:
            await _await_subscription(pub, sub)
        finally:
            pub.close()


@pytest.mark.parametrize("events", ["tcp://*:*", "tcp://[::]:*"])
async def test_a_simulated_fleet_on_ipv6_gives_subscribers_an_address_that_delivers(
    events: str,
) -> None:
    """``start_sim_fleet(host="::1")``: an IPv4 wildcard publisher was handed out as
    ``tcp://::1:PORT`` (no brackets, and it listens on IPv4 only), the IPv6 one as
    ``tcp://[::]:PORT``, which a subscriber binds (diff review): nothing arrived either way."""
    import aiohttp

    from replica.sim.fleet import start_sim_fleet

    async with start_sim_fleet(1, host="::1", kv_events=events, kv_replay=None) as fleet:
        (handle,) = fleet.replicas
        assert handle.kv_events_endpoint is not None
        with KVEventSubscriber(handle.kv_events_endpoint, topic="kv") as sub:
            async with aiohttp.ClientSession() as http:
                for attempt in range(100):  # ZeroMQ's slow joiner: ask until one arrives
                    body = {"model": "sim-model", "prompt": f"hello {attempt} " * 40,
                            "max_tokens": 1}
                    async with http.post(f"{handle.url}/v1/completions", json=body) as resp:
                        assert resp.status == 200
                    try:
                        await asyncio.wait_for(sub.recv(), timeout=0.2)
                        return
                    except TimeoutError:
                        continue
    raise AssertionError(f"no KV event reached {handle.kv_events_endpoint}")
