"""Hypothesis-drawn bodies through a real gateway on a real socket, in front of a simulated
replica: whatever the body, the answer is never a 500.

The stack (``embedded_stack``: gateway, one simulated replica, its agent) runs on its own event
loop in a thread for the whole module, so each example is one plain blocking HTTP request.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fleetgate.embedded import embedded_stack
from gateway import errors
from gateway.request_body import MAX_JSON_DEPTH
from tests.unit.test_request_body_properties import (
    JSON_VALUES,
    mutated_bodies,
    mutated_bytes,
    nested,
    valid_bodies,
)

#: Deterministic, bounded, no timing assertions, nothing written into the working tree; fewer
#: examples than the unit tier, since each one is a real request.
PROPERTY = settings(
    derandomize=True,
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


@dataclass
class Stack:
    gateway: str
    replica: str
    model: str


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    """A running embedded stack; its loop runs in a thread until the module's tests are done."""
    loop = asyncio.new_event_loop()
    ready: Future[Stack] = Future()
    stop = asyncio.Event()

    async def serve() -> None:
        try:
            # speed: the sim's simulated seconds per real second; requests finish in ms.
            async with embedded_stack(1, sim_speed=10_000.0) as running:
                ready.set_result(Stack(running.url, running.replica_urls[0], running.model))
                await stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            raise

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    try:
        yield ready.result(timeout=60)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=30)
        loop.close()


def post(base_url: str, path: str, raw: bytes) -> tuple[int, bytes]:
    """POST ``raw`` as a JSON body; (status, whole response body, streams read to the end)."""
    url = urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=60)
    try:
        conn.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def assert_not_500(status: int, data: bytes) -> None:
    assert status != 500, data[:500]
    if status >= 400 and data.startswith(b"{"):
        code = json.loads(data).get("error", {}).get("code")
        assert code != errors.INTERNAL_ERROR, data[:500]


def _with_model(stack: Stack, body: Any) -> Any:
    """Point a body at the served model (when it still names one), so it reaches the replica."""
    if isinstance(body, dict) and isinstance(body.get("model"), str):
        return {**body, "model": stack.model}
    return body


def _send(stack: Stack, kind: str, body: Any) -> tuple[int, bytes]:
    raw = json.dumps(_with_model(stack, body)).encode()
    status, data = post(stack.gateway, PATHS[kind], raw)
    assert_not_500(status, data)
    return status, data


@PROPERTY
@given(case=valid_bodies())
def test_valid_bodies_are_served(stack: Stack, case: tuple[str, dict[str, Any]]) -> None:
    kind, body = case
    status, data = _send(stack, kind, body)
    # Valid for the gateway; the replica may still refuse some (a salt or prompt it rejects).
    assert status == 200 or 400 <= status < 500, data[:500]


@PROPERTY
@given(case=mutated_bodies())
def test_mutated_bodies_never_500(stack: Stack, case: tuple[str, dict[str, Any]]) -> None:
    _send(stack, *case)


@PROPERTY
@given(kind=st.sampled_from(sorted(PATHS)), value=JSON_VALUES)
def test_any_json_value_never_500(stack: Stack, kind: str, value: Any) -> None:
    _send(stack, kind, value)


@PROPERTY
@given(case=mutated_bytes())
@example(case=("chat", nested(5_000)))  # the report: a 500 `internal_error`
def test_mutated_bytes_never_500(stack: Stack, case: tuple[str, bytes]) -> None:
    kind, raw = case
    status, data = post(stack.gateway, PATHS[kind], raw)
    assert_not_500(status, data)


def test_deep_body_is_400_invalid_json(stack: Stack) -> None:
    status, data = post(stack.gateway, PATHS["chat"], nested(5_000))
    assert status == 400
    error = json.loads(data)["error"]
    assert error["code"] == errors.INVALID_JSON
    assert str(MAX_JSON_DEPTH) in error["message"]


@pytest.mark.parametrize(
    "raw",
    [nested(5_000), b'{"model":"m","messages":[{"role":"user","content":"\xff"}]}'],
    ids=["nested-5000", "invalid-utf8"],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize"])
def test_simulated_replica_answers_400_not_500(stack: Stack, raw: bytes, path: str) -> None:
    """The sim parsed bodies too: msgspec's RecursionError and UnicodeDecodeError were 500s."""
    status, data = post(stack.replica, path, raw)
    assert status == 400, data[:500]
