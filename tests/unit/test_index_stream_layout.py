"""The mirrored index's Redis key layout: every key of a replica in one Cluster slot, replicas
spread over the shards' slots (docs/index.md, "Mirror mode")."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from routing.index.stream_layout import StreamLayout
from routing.index.stream_writer import pack_blocks, unpack_blocks

_HASH_TAG = re.compile(r"\{([^}]*)\}")


def _tag(key: str) -> str:
    """The part of a key Redis Cluster hashes (its first ``{...}``)."""
    found = _HASH_TAG.search(key)
    assert found is not None, key
    return found.group(1)


def test_a_replicas_keys_share_its_shards_hash_tag() -> None:
    layout = StreamLayout("fleetgate:", shards=16)
    keys = layout.replica_keys("pool-a/replica-7")
    shard = layout.shard_of("pool-a/replica-7")
    assert {_tag(key) for key in keys.as_list()} == {f"fleetgate:s{shard}"}
    tag = "{fleetgate:s" + str(shard) + "}"
    assert keys.events == f"{tag}:events"
    assert keys.state == f"{tag}:r:pool-a/replica-7"
    assert keys.blocks == f"{tag}:blk:pool-a/replica-7"


def test_replicas_spread_over_every_shard() -> None:
    layout = StreamLayout("fg", shards=16)
    per_shard = Counter(layout.shard_of(f"pool/r{n}") for n in range(1000))
    assert set(per_shard) == set(range(16))
    assert max(per_shard.values()) < 2 * 1000 / 16  # no shard takes twice its share


def test_the_shard_of_a_replica_is_stable() -> None:
    # CRC-32, not Python's salted hash(): every gateway and agent must agree.
    assert StreamLayout("fg", shards=16).shard_of("pool-a/replica-0") == 8
    assert StreamLayout("fg", shards=1).shard_of("anything") == 0


def test_the_generation_key_is_outside_the_shards() -> None:
    layout = StreamLayout("fg:", shards=4)
    assert layout.generation_key == "{fg}:gen"
    assert len({_tag(key) for key in layout.all_events_keys()}) == 4


@pytest.mark.parametrize(
    ("prefix", "shards", "message"),
    [
        ("", 16, "key_prefix must be a non-empty string"),
        ("a{b", 16, "key_prefix must not contain"),
        ("fg", 0, r"shards must be an integer in \[1, 4096\]"),
        ("fg", True, r"shards must be an integer in \[1, 4096\]"),
    ],
)
def test_bad_layouts_are_refused(prefix: str, shards: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StreamLayout(prefix, shards)


def test_blocks_pack_to_eight_bytes_each_and_back() -> None:
    blocks = [0, 12, 2**64 - 1]
    assert len(pack_blocks(blocks)) == 24
    assert unpack_blocks(pack_blocks(blocks)) == tuple(blocks)
