"""The Sentinel URL (``redis+sentinel://``): how it reads, what it refuses and how, and every
place that takes a Redis URL taking it (policy file, CLI, agent, engine plugin, stores)."""

from __future__ import annotations

import argparse

import pytest

from fleetgate.commands._args import redis_url
from gateway.config import GatewayConfig
from replica.agent.config import AgentConfig
from replica.agent.kernels import build_kernel_reader
from replica.fleet_store import RedisFleetStore, build_fleet_store
from replica.vllm_plugin.config import PluginConfig, PluginConfigError
from routing.config import PolicyError, parse_policy
from routing.config.infra import IndexSettings
from routing.index import build_index
from routing.redis_clients import bounded_client
from routing.redis_sentinel import (
    SentinelPrimary,
    _client_settings,
    check_sentinel_url,
    is_sentinel_url,
    parse_sentinel_url,
)

URL = "redis+sentinel://sentinel-0:26379,sentinel-1:26379/mymaster/0"


@pytest.mark.parametrize(
    ("url", "sentinel"),
    [
        (URL, True),
        ("rediss+sentinel://s:26380/m", True),
        ("redis://redis:6379/0", False),
        ("redis+cluster://redis-0:6379", False),
        ("redis+sentinel", False),
    ],
)
def test_sentinel_urls_are_told_apart(url: str, sentinel: bool) -> None:
    assert is_sentinel_url(url) is sentinel


def test_a_sentinel_url_names_the_sentinels_the_service_and_the_primarys_settings() -> None:
    spec = parse_sentinel_url(
        "rediss+sentinel://app:p%40ss@sentinel-0,[fd00::2]:26380,10.0.0.3:5000/my%20master/3"
        "?ssl_ca_certs=/etc/redis/ca.pem&socket_timeout=0.25&sentinel_password=s%2Fp"
    )
    assert spec.sentinels == (("sentinel-0", 26379), ("fd00::2", 26380), ("10.0.0.3", 5000))
    assert (spec.service, spec.db, spec.tls) == ("my master", 3, True)
    assert (spec.username, spec.password) == ("app", "p@ss")
    assert (spec.sentinel_username, spec.sentinel_password) == (None, "s/p")
    # Typed as redis-py types them in a redis:// URL.
    assert spec.options == {"ssl_ca_certs": "/etc/redis/ca.pem", "socket_timeout": 0.25}
    plain = parse_sentinel_url("redis+sentinel://s/m")
    assert (plain.db, plain.tls, plain.password, plain.options) == (0, False, None, {})


def test_the_primarys_credentials_stay_off_the_sentinels_and_tls_goes_to_both() -> None:
    spec = parse_sentinel_url(
        "rediss+sentinel://:primary@s/m/2?ssl_ca_certs=/ca.pem&sentinel_password=theirs"
    )
    primary, sentinels = _client_settings(spec, {"socket_timeout": 0.5, "retry": None})
    assert primary["password"] == "primary" and primary["db"] == 2 and primary["ssl"] is True
    retry = sentinels.pop("retry")
    assert retry.get_retries() == 0  # the next Sentinel is the retry
    assert sentinels == {
        "socket_timeout": 0.5,
        "socket_connect_timeout": 0.5,
        "ssl_ca_certs": "/ca.pem",
        "ssl": True,
        "password": "theirs",
    }


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis+sentinel://s:26379", "names no service"),
        ("redis+sentinel://s:26379/", "names no service"),
        ("redis+sentinel://s/m/zero", "numeric DB"),
        ("redis+sentinel://s/m/0/extra", "numeric DB"),
        ("redis+sentinel:///m", "must name a node"),
        ("redis+sentinel://s:26a79/m", "no valid port"),
        ("redis+sentinel://[::1/m", "IPv6 node as"),
        ("redis+sentinel://s/m?socket_timeout=soon", "socket_timeout"),
    ],
)
def test_a_bad_sentinel_url_is_refused_saying_what_is_wrong(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_sentinel_url(url)
    with pytest.raises(ValueError, match=message):
        IndexSettings(backend="redis", redis_url=url)
    with pytest.raises(ValueError, match=message):
        AgentConfig(replica_id="r", engine_url="http://e:8000", index_url=url)
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        redis_url(url)


def test_references_to_the_environment_stand_for_any_value_until_connecting() -> None:
    url = "redis+sentinel://:${PW}@${HOST}:${PORT}/mymaster/0?sentinel_password=${SPW}"
    assert check_sentinel_url(url) == url
    assert IndexSettings(backend="redis", redis_url=url).redis_url == url


def test_every_place_that_takes_a_redis_url_takes_a_sentinel_url() -> None:
    policy = parse_policy(
        f"""
version: 1
replica_pools:
  - name: pool-a
    discovery: {{redis_url: "{URL}"}}
models:
  - {{name: m, pools: [pool-a]}}
index: {{backend: redis, redis_url: "{URL}", mode: lookup}}
"""
    )
    assert policy.index.redis_url == URL
    # One primary holds everything, as one server would: no Cluster-only split.
    config = GatewayConfig()
    config.apply_policy(policy, startup=True)
    assert (config.index_url, config.redis_url) == (URL, URL)
    assert redis_url(URL) == URL
    agent = AgentConfig(replica_id="r", engine_url="http://e:8000", index_url=URL)
    assert agent.index_url == URL
    plugin = PluginConfig.from_env({"FLEETGATE_REDIS_URL": URL, "FLEETGATE_REPLICA_ID": "r"})
    assert plugin.redis_url == URL
    assert isinstance(build_fleet_store(URL), RedisFleetStore)
    assert build_kernel_reader(URL, "fg:", "r") is not None
    for mode in ("lookup", "mirror"):
        assert build_index(URL, mode=mode) is not None


async def test_a_sentinel_url_makes_a_client_of_the_primary_that_connects_lazily() -> None:
    client = bounded_client(URL, 0.5)
    try:
        assert isinstance(client, SentinelPrimary)
        assert client.sentinel is not None
        hosts = [s.connection_pool.connection_kwargs["host"] for s in client.sentinel.sentinels]
        assert hosts == ["sentinel-0", "sentinel-1"]
    finally:
        await client.aclose()


def test_errors_about_a_sentinel_url_do_not_show_its_password() -> None:
    with pytest.raises(argparse.ArgumentTypeError) as cli:
        redis_url("redis+sentinel://:hunter2@s/m/x")
    assert "hunter2" not in str(cli.value) and "***" in str(cli.value)
    with pytest.raises(PluginConfigError) as plugin:
        PluginConfig.from_env({"FLEETGATE_REDIS_URL": "redis+sentinel://:hunter2@s/m/x"})
    assert "hunter2" not in str(plugin.value)
    with pytest.raises(PolicyError) as policy:
        parse_policy(
            """
version: 1
replica_pools:
  - name: a
    discovery: {redis_url: "redis+sentinel://:hunter2@s"}
models:
  - {name: m, pools: [a]}
"""
        )
    assert "hunter2" not in str(policy.value)
    with pytest.raises(argparse.ArgumentTypeError) as unreadable:
        redis_url("redis+sentinel://:hunter2@[::1/m")
    assert "hunter2" not in str(unreadable.value)
