"""A Redis password from the environment: the policy file (a ConfigMap, /admin/policy) names
``${VAR}``, and each client expands it when it connects (the deploy review: a password could
only be written into the policy file)."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from replica.agent.kernels import KernelReportReader
from replica.vllm_plugin import redis_store
from replica.vllm_plugin.config import PluginConfig, PluginConfigError
from routing.index.redis_client import connect
from routing.redis_clients import bounded_client
from tests.support.redis_server import RedisServer


async def _protected(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, password: str
) -> str:
    """Give the server ``password`` and the environment ``FG_TEST_REDIS_PASSWORD``; returns a
    URL naming the variable."""
    admin = Redis.from_url(redis_server.url)
    await admin.config_set("requirepass", password)
    await admin.aclose()
    monkeypatch.setenv("FG_TEST_REDIS_PASSWORD", password)
    return f"redis://:${{FG_TEST_REDIS_PASSWORD}}@127.0.0.1:{redis_server.port}/0"


async def test_redis_urls_take_their_password_from_the_environment(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What `openssl rand -base64` makes: '/', '+' and '=' must not break the URL.
    url = await _protected(redis_server, monkeypatch, "Ab/cD+9x%41=")
    for client in (bounded_client(url, 1.0), connect(url)):
        try:
            assert await client.ping()
        finally:
            await client.aclose()
    monkeypatch.delenv("FG_TEST_REDIS_PASSWORD")
    with pytest.raises(ValueError, match=r"\$\{FG_TEST_REDIS_PASSWORD\}, which is not set"):
        bounded_client(url, 1.0)


async def test_the_agents_kernel_reader_and_the_engine_plugin_take_it_too(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The agent's kernel-report reader and the engine plugin connected with the URL as written,
    # so "${VAR}" was sent as the password (the deploy review's left-over).
    password = "Zz/9+q="
    url = await _protected(redis_server, monkeypatch, password)
    admin = Redis.from_url(redis_server.url, password=password)
    await admin.hset("fg:replica:r0:kernels", "my.kernels", "1.2")
    await admin.aclose()

    reader = KernelReportReader(url, "fg:", "r0")
    try:
        assert await reader.read() == {"my.kernels": "1.2"}
    finally:
        await reader.close()

    config = PluginConfig.from_env(
        {"FLEETGATE_REDIS_URL": url, "FLEETGATE_REPLICA_ID": "r0",
         "FG_TEST_REDIS_PASSWORD": password}
    )
    assert config.redis_url == url  # the reference is kept; the value is read on connecting
    engine_side = redis_store.connect(config.redis_url, 1.0)
    try:
        assert engine_side.hget("fg:replica:r0:kernels", "my.kernels") == b"1.2"
    finally:
        engine_side.close()

    monkeypatch.delenv("FG_TEST_REDIS_PASSWORD")
    with pytest.raises(PluginConfigError, match=r"FLEETGATE_REDIS_URL: .*FG_TEST_REDIS_PASSWORD"):
        PluginConfig.from_env({"FLEETGATE_REDIS_URL": url})
