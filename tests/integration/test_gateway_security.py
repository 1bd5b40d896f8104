"""Security review findings, on real sockets: a policy with tenants never falls open, the
anonymous tenant is the full tenant, compressed bodies are limited by their decoded size, an
oversized header never reaches the log, a malformed ``Authorization`` is 401, and path-level
errors carry the request id in the API's own envelope."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import logging
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from routing.config import derive_cache_salt
from tests.integration.test_gateway_support import FakeUpstream, serve


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def policy_yaml(upstream_url: str, alpha_keys: list[str], anonymous: str | None = None) -> str:
    keys = ", ".join(sha(k) for k in alpha_keys)
    gateway = f"gateway: {{anonymous_tenant: {anonymous}}}" if anonymous else ""
    return f"""
version: 1
replica_pools:
  - name: pool-a
    replicas: [{upstream_url}]
models:
  - name: base-model
    pools: [pool-a]
tenants:
  - name: alpha
    api_key_sha256: [{keys}]
  - name: trial
    rate_limit: {{requests_per_s: 0.001, burst: 2}}
admin:
  api_key_sha256: [{sha("admin-key")}]
{gateway}
"""


@asynccontextmanager
async def gateway(
    tmp_path: Path, upstream: FakeUpstream, alpha_keys: list[str], anonymous: str | None = None
) -> AsyncIterator[tuple[str, Path]]:
    async with serve(upstream.app()) as upstream_url:
        path = tmp_path / "policy.yaml"
        path.write_text(policy_yaml(upstream_url, alpha_keys, anonymous))
        config = GatewayConfig(policy_path=str(path), policy_poll_s=0)
        app = create_app(config)
        config.health_interval_s = 3600
        async with serve(app, handler_cancellation=True) as url:
            yield url, path


CHAT = {"model": "base-model", "messages": [{"role": "user", "content": "hello"}]}


async def post_chat(
    http: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, object]]:
    async with http.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers or {}) as resp:
        return resp.status, await resp.json()


# ----------------------------------------------------------------- 1. never open on no keys


async def test_revoking_the_last_key_locks_out_instead_of_opening(tmp_path: Path) -> None:
    upstream = FakeUpstream()
    async with (
        gateway(tmp_path, upstream, ["sk-alpha"]) as (url, path),
        aiohttp.ClientSession() as http,
    ):
        assert (await post_chat(http, url, {"Authorization": "Bearer sk-alpha"}))[0] == 200
        path.write_text(path.read_text().replace(sha("sk-alpha"), ""))  # api_key_sha256: []
        admin = {"Authorization": "Bearer admin-key"}
        async with http.post(f"{url}/admin/policy/reload", headers=admin) as resp:
            assert resp.status == 200  # valid (a lock-out), with a warning in the log
        for headers in ({}, {"Authorization": "Bearer sk-alpha"}, {"Authorization": "Bearer x"}):
            status, body = await post_chat(http, url, headers)
            assert status == 401, headers
            assert body["error"]["code"] == "invalid_api_key"  # type: ignore[index]
    assert len(upstream.received) == 1


async def test_tenants_without_keys_refuse_every_request(tmp_path: Path) -> None:
    upstream = FakeUpstream()
    async with (
        gateway(tmp_path, upstream, []) as (url, _),
        aiohttp.ClientSession() as http,
    ):
        for headers in ({}, {"Authorization": "Bearer sk-anything"}):
            assert (await post_chat(http, url, headers))[0] == 401
    assert upstream.received == []


# ----------------------------------------------------------------- 2. the anonymous tenant


async def test_anonymous_tenant_has_its_rate_limit_and_salt(tmp_path: Path) -> None:
    upstream = FakeUpstream()
    async with (
        gateway(tmp_path, upstream, [], anonymous="trial") as (url, _),
        aiohttp.ClientSession() as http,
    ):
        statuses = [(await post_chat(http, url))[0] for _ in range(3)]
    assert statuses == [200, 200, 429]  # burst 2, then the bucket is empty
    assert [b["cache_salt"] for b in upstream.received] == [derive_cache_salt("trial")] * 2


# ----------------------------------------------------------------- 7. malformed Authorization


@pytest.mark.parametrize("header", ["sk-alpha", "Basic c2stYWxwaGE=", "Bearer", "Bearer  "])
async def test_malformed_authorization_is_401_not_anonymous(tmp_path: Path, header: str) -> None:
    upstream = FakeUpstream()
    async with (
        gateway(tmp_path, upstream, ["sk-alpha"], anonymous="trial") as (url, _),
        aiohttp.ClientSession() as http,
    ):
        assert (await post_chat(http, url))[0] == 200  # no header at all: anonymous
        status, body = await post_chat(http, url, {"Authorization": header})
        async with http.post(
            f"{url}/v1/messages",
            json={"model": "base-model", "max_tokens": 4, "messages": CHAT["messages"]},
            headers={"Authorization": header},
        ) as resp:
            messages_status = resp.status
            messages_body = await resp.json()
    assert status == 401 and body["error"]["code"] == "invalid_api_key"  # type: ignore[index]
    assert messages_status == 401
    assert messages_body["error"]["type"] == "authentication_error"
    assert len(upstream.received) == 1


# ----------------------------------------------------------------- 3. compressed bodies


def _gzip_bomb(inflated_mb: int) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    head = b'{"model": "base-model", "messages": [{"role": "user", "content": "'
    parts = [packer.compress(head)]
    block = b"a" * (1 << 20)
    parts += [packer.compress(block) for _ in range(inflated_mb)]
    parts += [packer.compress(b'"}]}'), packer.flush()]
    return b"".join(parts)


async def test_compressed_bodies_are_limited_by_their_decoded_size() -> None:
    upstream = FakeUpstream()
    async with serve(upstream.app()) as upstream_url:
        config = GatewayConfig(max_body_bytes=1 << 20)
        from gateway.policy_view import GatewayPolicy, ReplicaSpec

        policy = GatewayPolicy.default([ReplicaSpec("r0", upstream_url)])
        app = create_app(config, policy)
        async with serve(app) as url, aiohttp.ClientSession() as http:
            answers = {}
            bodies = {
                "small_gzip": (gzip.compress(b'{"model": "base-model", "prompt": "hi"}'), "gzip"),
                "deflate": (zlib.compress(b'{"model": "base-model", "prompt": "hi"}'), "deflate"),
                "bomb": (_gzip_bomb(64), "gzip"),  # 64 MiB from ~65 KB, limit 1 MiB
                "not_gzip": (b'{"model": "base-model", "prompt": "hi"}', "gzip"),
                "truncated": (gzip.compress(b'{"model": "base-model"}')[:-12], "gzip"),
                "brotli": (b"\x0b\x02\x80{}\x03", "br"),
            }
            for name, (data, encoding) in bodies.items():
                headers = {"Content-Encoding": encoding, "Content-Type": "application/json"}
                async with http.post(f"{url}/v1/completions", data=data, headers=headers) as resp:
                    answers[name] = (resp.status, await resp.json(), resp.headers)
            # The event loop stayed free: /health answers at once after the bomb.
            async with asyncio.timeout(2), http.get(f"{url}/health") as resp:
                assert resp.status == 200
    assert answers["small_gzip"][0] == 200 and answers["deflate"][0] == 200
    assert [b["prompt"] for b in upstream.received] == ["hi", "hi"]  # forwarded decoded
    status, body, _ = answers["bomb"]
    assert status == 413 and body["error"]["code"] == "request_too_large"
    for name in ("not_gzip", "truncated"):
        status, body, _ = answers[name]
        assert status == 400, name
        assert "not valid gzip" in body["error"]["message"]
    status, body, headers = answers["brotli"]
    assert status == 415 and body["error"]["code"] == "unsupported_content_encoding"
    assert headers["Accept-Encoding"] == "gzip, deflate"


async def test_a_body_that_trickles_in_gets_408_and_the_connection_closes() -> None:
    """A client that sends its headers and then its body slowly (or never) held a connection
    and its handler as long as it liked (aiohttp's server bounds neither): a few thousand such
    clients used up a pod's file descriptors. The body must now arrive within
    ``body_timeout_s``; then the answer is 408 in the OpenAI envelope and the connection closes.
    Nothing reaches an engine; a body that arrives in time in pieces is served."""
    from gateway.policy_view import GatewayPolicy, ReplicaSpec

    upstream = FakeUpstream()
    async with serve(upstream.app()) as upstream_url:
        config = GatewayConfig(body_timeout_s=0.5)
        app = create_app(config, GatewayPolicy.default([ReplicaSpec("r0", upstream_url)]))
        async with serve(app) as url:
            host, port = url.removeprefix("http://").rsplit(":", 1)
            body = b'{"model": "base-model", "prompt": "hi"}'

            async def send(pieces: list[bytes], pause_s: float) -> tuple[bytes, bytes]:
                """The answer, and what followed it until the connection closed."""
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Type: application/json\r\n"
                    # the client's keep-alive is refused: only the gateway's own close is tested
                    + (b"Connection: close\r\n" if len(pieces) > 1 else b"")
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                )
                for piece in pieces:
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(pause_s)
                # Bounded, so a bug fails rather than hangs: aiohttp reads (and drops) what a
                # client sends after an answer for up to 10 s before it closes the connection.
                async with asyncio.timeout(30):
                    answer = await reader.readuntil(b"\r\n\r\n")
                    length = int(answer.split(b"Content-Length: ")[1].split(b"\r\n")[0])
                    payload = await reader.readexactly(length)
                    rest = await reader.read()  # b"" once the connection closes
                writer.close()
                return answer + payload, rest

            stalled, after = await send([body[:10]], 0)  # and then nothing more
            assert stalled.startswith(b"HTTP/1.1 408 ")
            assert b'"code": "request_timeout"' in stalled and b"body_timeout_s" in stalled
            assert after == b""  # closed without a client's asking, not kept for another request
            quick, _ = await send([body[:10], body[10:]], 0.05)  # in pieces, within the bound
            assert quick.startswith(b"HTTP/1.1 200 ")
    assert [b["prompt"] for b in upstream.received] == ["hi"]  # the stalled one reached nothing


async def test_a_connection_that_never_completes_its_headers_is_closed() -> None:
    """A client that connects and sends nothing, or half its headers, held its connection as
    long as it liked (a slowloris): ``gateway.idle_timeout_s`` closes it."""
    from gateway.policy_view import GatewayPolicy, ReplicaSpec
    from gateway.server import start_site

    upstream = FakeUpstream()
    async with serve(upstream.app()) as upstream_url:
        config = GatewayConfig(idle_timeout_s=0.5)
        app = create_app(config, GatewayPolicy.default([ReplicaSpec("r0", upstream_url)]))
        runner, url = await start_site(
            app, "127.0.0.1", 0, drain_timeout_s=1, idle_timeout_s=config.idle_timeout_s
        )
        try:
            host, port = url.removeprefix("http://").rsplit(":", 1)
            for sent in (b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"):
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(sent)
                async with asyncio.timeout(30):  # bounded: a bug fails instead of hanging
                    assert await reader.read() == b""  # closed by the gateway, unanswered
                writer.close()
        finally:
            await runner.cleanup()


# ----------------------------------------------------------------- 4. oversized headers


async def test_oversized_authorization_never_reaches_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    secret = "sk-alpha-SECRET"
    async with (
        gateway(tmp_path, FakeUpstream(), ["sk-alpha"]) as (url, _),
        aiohttp.ClientSession() as http,
    ):
        # 9 KB: past aiohttp's default 8190-byte field limit, within the gateway's 16 KiB. The
        # gateway's own 401, in the envelope.
        status, body = await post_chat(http, url, {"Authorization": f"Bearer {secret}{'Z' * 9000}"})
        assert status == 401 and body["error"]["code"] == "invalid_api_key"  # type: ignore[index]
        # 40 KB: refused by the HTTP parser; the log must not quote it.
        headers = {"Authorization": f"Bearer {secret}{'Z' * 40_000}"}
        async with http.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers) as resp:
            assert resp.status == 400
    logged = "\n".join(
        f"{r.levelname} {r.name} {r.getMessage()} {r.exc_text or ''}" for r in caplog.records
    )
    assert secret not in logged
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "refused a malformed HTTP request" in logged  # kept, as one redacted DEBUG line


# ----------------------------------------------------------------- path-level errors


async def test_path_errors_carry_request_id_allow_and_the_apis_envelope() -> None:
    async with serve(create_app(GatewayConfig())) as url, aiohttp.ClientSession() as http:
        rid = {"X-Request-Id": "client-id-1"}
        async with http.get(f"{url}/v1/nowhere", headers=rid) as resp:
            not_found = (resp.status, resp.headers.get("X-Request-Id"), await resp.json())
        async with http.get(f"{url}/v1/chat/completions", headers=rid) as resp:
            not_allowed = (resp.status, resp.headers, await resp.json())
        async with http.get(f"{url}/v1/messages") as resp:
            messages_405 = (resp.status, resp.headers, await resp.json())
        async with http.post(f"{url}/v1/messages/nope", json={}) as resp:
            messages_404 = (resp.status, resp.headers, await resp.json())
    status, request_id, body = not_found
    assert status == 404 and request_id == "client-id-1"
    assert body["error"]["code"] == "not_found"
    status, headers, body = not_allowed
    assert status == 405 and headers["Allow"] == "POST"
    assert headers["X-Request-Id"] == "client-id-1" and body["error"]["type"]
    for status_expected, (status, headers, body) in ((405, messages_405), (404, messages_404)):
        assert status == status_expected
        assert body["type"] == "error" and "message" in body["error"]  # Anthropic's envelope
        assert headers["X-Request-Id"].startswith("fg-")
    assert messages_404[2]["error"]["type"] == "not_found_error"
    assert messages_405[1]["Allow"] == "POST"
