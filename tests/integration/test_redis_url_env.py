"""A Redis password from the environment: the policy file (a ConfigMap, /admin/policy) names
``${VAR}``, and each client expands it when it connects (the deploy review: a password could
only be written into the policy file)."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from routing.index.redis_client import connect
from routing.redis_clients import bounded_client
from tests.support.redis_server import RedisServer


async def test_redis_urls_take_their_password_from_the_environment(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What `openssl rand -base64` makes: '/', '+' and '=' must not break the URL.
    password = "Ab/cD+9x%41="
    admin = Redis.from_url(redis_server.url)
    await admin.config_set("requirepass", password)
    await admin.aclose()
    url = f"redis://:${{FG_TEST_REDIS_PASSWORD}}@127.0.0.1:{redis_server.port}/0"
    monkeypatch.setenv("FG_TEST_REDIS_PASSWORD", password)
    for client in (bounded_client(url, 1.0), connect(url)):
        try:
            assert await client.ping()
        finally:
            await client.aclose()
    monkeypatch.delenv("FG_TEST_REDIS_PASSWORD")
    with pytest.raises(ValueError, match=r"\$\{FG_TEST_REDIS_PASSWORD\}, which is not set"):
        bounded_client(url, 1.0)
