"""A Redis Cluster holds the mirrored index only: the URL scheme, and the settings that refuse
what a Cluster cannot do (lookup mode; the fleet store, in-flight counts and budgets)."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from gateway.config import GatewayConfig
from replica.agent.config import AgentConfig
from routing.config.infra import IndexSettings
from routing.index import build_index
from routing.index.redis_client import cluster_seed_nodes, connect, is_cluster_url

CLUSTER = "redis+cluster://redis-0:6379"


@pytest.mark.parametrize(
    ("url", "cluster"),
    [
        (CLUSTER, True),
        ("rediss+cluster://redis-0:6380/0", True),
        ("redis://redis:6379/0", False),
        ("unix:///run/redis.sock", False),
        ("redis+cluster", False),
    ],
)
def test_cluster_urls_are_told_apart(url: str, cluster: bool) -> None:
    assert is_cluster_url(url) is cluster


async def test_a_cluster_url_makes_a_cluster_client() -> None:
    client = connect(CLUSTER)
    assert isinstance(client, aioredis.RedisCluster)
    await client.aclose()
    plain = connect("redis://127.0.0.1:1/0")
    assert isinstance(plain, aioredis.Redis)
    await plain.aclose()


@pytest.mark.parametrize(
    ("url", "nodes"),
    [
        (CLUSTER, [("redis-0", 6379)]),
        ("redis+cluster://redis-0", [("redis-0", 6379)]),
        (
            "rediss+cluster://:p%40ss@redis-0:7000,redis-1:7001,10.0.0.3/0?ssl_cert_reqs=none",
            [("redis-0", 7000), ("redis-1", 7001), ("10.0.0.3", 6379)],
        ),
        ("redis+cluster://[::1]:7000,[fd00::2]", [("::1", 7000), ("fd00::2", 6379)]),
        ("redis+cluster://a:1, b:2,", [("a", 1), ("b", 2)]),
    ],
)
def test_a_cluster_url_may_name_several_seed_nodes(url: str, nodes: list) -> None:
    assert cluster_seed_nodes(url) == nodes


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis+cluster://", "must name a node"),
        ("redis+cluster:///0", "must name a node"),
        ("redis+cluster://redis-0:6379,:7000", "names no host"),
        ("redis+cluster://redis-0:63a9", "no valid port"),
        ("redis+cluster://redis-0:70000", "no valid port"),
        ("redis+cluster://[::1:7000", "IPv6 node as"),
    ],
)
def test_a_cluster_url_with_a_bad_node_is_refused_naming_it(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cluster_seed_nodes(url)
    with pytest.raises(ValueError, match=message):
        IndexSettings(backend="redis", redis_url=url, mode="mirror")


def test_a_cluster_url_may_take_its_nodes_from_the_environment() -> None:
    """Checked before ``${NAME}`` is expanded (when connecting): a reference stands for any
    value, as in a one-node URL (diff review: ``${PORT}`` was refused)."""
    url = "redis+cluster://:${PW}@redis-0:${PORT},${HOST}:6379/0"
    assert IndexSettings(backend="redis", redis_url=url, mode="mirror").redis_url == url


async def test_every_seed_node_is_a_startup_node_with_the_urls_credentials() -> None:
    client = connect("redis+cluster://:s3cret@redis-0:7000,redis-1:7001,[::1]:7002/0")
    try:
        seeds = list(client.nodes_manager.startup_nodes.values())
        assert [node.name for node in seeds] == ["redis-0:7000", "redis-1:7001", "::1:7002"]
        assert all(node.connection_kwargs.get("password") == "s3cret" for node in seeds)
    finally:
        await client.aclose()


def test_lookup_mode_refuses_a_cluster() -> None:
    with pytest.raises(ValueError, match="needs index mode 'mirror'"):
        build_index(CLUSTER, mode="lookup")
    with pytest.raises(ValueError, match="needs mode: mirror"):
        IndexSettings(backend="redis", redis_url=CLUSTER, mode="lookup")
    assert IndexSettings(backend="redis", redis_url=CLUSTER, mode="mirror").redis_url == CLUSTER


def test_the_gateway_keeps_the_cluster_for_the_index_only() -> None:
    with pytest.raises(ValueError, match="holds the block index only"):
        GatewayConfig(redis_url=CLUSTER)

    class Policy:
        gateway = None
        index = IndexSettings(backend="redis", redis_url=CLUSTER, mode="mirror")

    config = GatewayConfig(redis_url="redis://redis:6379/0")
    config.apply_policy(Policy(), startup=True)
    assert (config.index_url, config.redis_url) == (CLUSTER, "redis://redis:6379/0")
    alone = GatewayConfig()
    alone.apply_policy(Policy(), startup=True)
    assert (alone.index_url, alone.redis_url) == (CLUSTER, None)  # counts stay in memory


def test_an_agent_on_a_cluster_names_its_fleet_store() -> None:
    with pytest.raises(ValueError, match="give fleet_url"):
        AgentConfig(replica_id="r", engine_url="http://e:8000", index_url=CLUSTER)
    with pytest.raises(ValueError, match="needs index_mode 'mirror'"):
        AgentConfig(
            replica_id="r", engine_url="http://e:8000", index_url=CLUSTER,
            fleet_url="redis://redis:6379/0", index_mode="lookup",
        )
    config = AgentConfig(
        replica_id="r", engine_url="http://e:8000", index_url=CLUSTER,
        fleet_url="redis://redis:6379/0",
    )
    assert config.index_url == CLUSTER
    with pytest.raises(ValueError, match="index_url: the node 'redis-1:x' has no valid port"):
        AgentConfig(
            replica_id="r", engine_url="http://e:8000", index_url=f"{CLUSTER},redis-1:x",
            fleet_url="redis://redis:6379/0",
        )
