"""Fixtures shared by every test tier."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from bench.local_redis import LocalRedisCluster
from tests.support.redis_server import RedisServer

# What a session leaves running is reported and stopped, and the run always exits.
from tests.support.session_guard import (  # noqa: F401
    pytest_configure,
    pytest_sessionfinish,
    pytest_unconfigure,
)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A Redis URL: ``REDIS_URL`` if set, else a private redis-server for this test session.

    Never skips: a missing Redis is a test failure, so CI cannot silently pass without it.
    """
    env_url = os.environ.get("REDIS_URL")
    if env_url:
        yield env_url
        return
    server = RedisServer().start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A private redis-server that the test may stop and start (outage tests)."""
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalRedisCluster]:
    """A private three-primary Redis Cluster (real redis-server processes) for the session."""
    cluster = LocalRedisCluster(primaries=3).start()
    try:
        yield cluster
    finally:
        cluster.stop()
