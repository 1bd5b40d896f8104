"""The gateway's OpenAI-compatible API against fake upstreams: passthrough, streaming, errors."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import aiohttp.web
import openai
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.policy_view import GatewayPolicy, ReplicaSpec
from tests.integration.test_gateway_support import FakeUpstream, serve


@asynccontextmanager
async def gateway(
    upstreams: list[FakeUpstream],
    profile: str = "expected-ttft",
    **config: object,
) -> AsyncIterator[str]:
    """Fake upstreams plus a policy-less gateway in front of them; yields the gateway URL."""
    async with _serve_all(upstreams) as urls:
        specs = [
            ReplicaSpec(f"r{i}", url, models=frozenset(u.models))
            for i, (u, url) in enumerate(zip(upstreams, urls, strict=True))
        ]
        cfg = GatewayConfig(health_interval_s=3600, **config)  # type: ignore[arg-type]
        app = create_app(cfg, GatewayPolicy.default(specs, profile=profile))
        async with serve(app, handler_cancellation=True) as url:
            yield url


@asynccontextmanager
async def _serve_all(upstreams: list[FakeUpstream]) -> AsyncIterator[list[str]]:
    urls: list[str] = []
    stack = []
    try:
        for upstream in upstreams:
            cm = serve(upstream.app())
            upstream.url = await cm.__aenter__()
            stack.append(cm)
            urls.append(upstream.url)
        yield urls
    finally:
        for cm in reversed(stack):
            await cm.__aexit__(None, None, None)


CHAT = {"model": "base-model", "messages": [{"role": "user", "content": "hello there"}]}


async def test_chat_passthrough_keeps_client_fields_and_request_id() -> None:
    upstream = FakeUpstream()
    async with gateway([upstream]) as url, aiohttp.ClientSession() as http:
        body = {**CHAT, "temperature": 0.3, "top_k": 7, "cache_salt": "client-chosen"}
        async with http.post(
            f"{url}/v1/chat/completions", json=body, headers={"X-Request-Id": "req-42"}
        ) as resp:
            assert resp.status == 200
            assert resp.headers["X-Request-Id"] == "req-42"
            answer = await resp.json()
    assert answer["choices"][0]["message"]["content"] == "a b c"
    sent = upstream.received[0]
    assert sent["temperature"] == 0.3 and sent["top_k"] == 7
    # Open access (no tenants): the gateway sets no salt, so the client's own goes to the
    # engine, as it would without the gateway (a declared tenant's always replaces it).
    assert sent["cache_salt"] == "client-chosen"
    # The engine gets it with a suffix of its own: ids are unique per gateway only, and vLLM
    # refuses one already running (gateway/request_body.py, engine_request_id).
    assert upstream.headers[0]["X-Request-Id"].startswith("req-42~")


async def test_open_access_routes_a_client_salted_prompt_apart_from_the_unsalted_one() -> None:
    # The client's salt seeds routing's block hashes too: the engine caches the salted prompt
    # apart, so routing must not count the unsalted one's blocks as its cache.
    upstream = FakeUpstream()
    async with gateway([upstream], admin_key="adm") as url, aiohttp.ClientSession() as http:
        admin = {"Authorization": "Bearer adm"}
        long_chat = {**CHAT, "messages": [{"role": "user", "content": "a shared prompt " * 40}]}
        for salt in (None, None, "mine"):
            body = long_chat if salt is None else {**long_chat, "cache_salt": salt}
            async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
        async with http.get(f"{url}/admin/decisions?n=3", headers=admin) as resp:
            salted, unsalted, _ = (await resp.json())["decisions"]  # newest first
    assert unsalted["explanations"]["r0"]["matched_blocks"] > 0  # the same unsalted prompt
    assert salted["explanations"]["r0"]["matched_blocks"] == 0
    assert [sent.get("cache_salt") for sent in upstream.received] == [None, None, "mine"]


@pytest.mark.parametrize("salt", ["", 7, ["a"]])
async def test_open_access_refuses_a_salt_vllm_would_refuse(salt: object) -> None:
    upstream = FakeUpstream()
    async with (
        gateway([upstream]) as url,
        aiohttp.ClientSession() as http,
        http.post(f"{url}/v1/chat/completions", json={**CHAT, "cache_salt": salt}) as resp,
    ):
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "cache_salt"
    assert upstream.attempts == 0


async def test_request_id_generated_when_absent() -> None:
    upstream = FakeUpstream()
    async with (
        gateway([upstream]) as url,
        aiohttp.ClientSession() as http,
        http.post(f"{url}/v1/chat/completions", json=CHAT) as resp,
    ):
        generated = resp.headers["X-Request-Id"]
    assert generated.startswith("fg-")
    assert upstream.headers[0]["X-Request-Id"].startswith(f"{generated}~")


async def test_a_request_id_already_in_flight_is_suffixed_not_shared() -> None:
    """Routing and flow control key their state by request id: a second request reusing one in
    flight gets its own (the first id with a suffix), shown in its X-Request-Id."""
    upstream = FakeUpstream(header_gate=asyncio.Event())
    headers = {"X-Request-Id": "same-id"}
    async with gateway([upstream]) as url, aiohttp.ClientSession() as http:
        post = f"{url}/v1/chat/completions"
        first = asyncio.create_task(http.post(post, json=CHAT, headers=headers))
        while not upstream.headers:  # the first is at the engine, holding its id
            await asyncio.sleep(0.01)
        second = asyncio.create_task(http.post(post, json=CHAT, headers=headers))
        while len(upstream.headers) < 2:
            await asyncio.sleep(0.01)
        upstream.header_gate.set()
        answers = [await first, await second]
        ids = [r.headers["X-Request-Id"] for r in answers]
        assert [r.status for r in answers] == [200, 200]
        for r in answers:
            r.release()
        # Free again once both ended: a new request keeps the id it sent.
        async with http.post(post, json=CHAT, headers=headers) as third:
            assert third.headers["X-Request-Id"] == "same-id"
    assert ids[0] == "same-id"
    assert ids[1].startswith("same-id~") and ids[1] != ids[0]
    # The engine gets the client's id with one random suffix of its own, each distinct.
    sent = [h["X-Request-Id"] for h in upstream.headers[:2]]
    assert len(set(sent)) == 2 and all(s.startswith("same-id~") and s.count("~") == 1 for s in sent)


async def test_another_callers_request_id_in_flight_is_not_revealed_by_a_suffix() -> None:
    """The security review: a suffix on a client's own ``X-Request-Id`` told it that another
    tenant had a request of that id in flight. The gateway still keeps them apart (the engine
    and its own state see two ids); only a caller reusing its own id is shown the suffix."""
    upstream = FakeUpstream(header_gate=asyncio.Event())
    async with gateway([upstream]) as url, aiohttp.ClientSession() as http:
        post = f"{url}/v1/chat/completions"

        def sent_by(key: str) -> dict[str, str]:
            return {"X-Request-Id": "acme-job-42", "Authorization": f"Bearer {key}"}

        first = asyncio.create_task(http.post(post, json=CHAT, headers=sent_by("tenant-a")))
        while not upstream.headers:
            await asyncio.sleep(0.01)
        probe = asyncio.create_task(http.post(post, json=CHAT, headers=sent_by("tenant-b")))
        while len(upstream.headers) < 2:
            await asyncio.sleep(0.01)
        upstream.header_gate.set()
        answers = [await first, await probe]
        for r in answers:
            r.release()
    assert [r.headers["X-Request-Id"] for r in answers] == ["acme-job-42", "acme-job-42"]
    # Kept apart at the engine too, each with one suffix: vLLM names its answer after this id
    # (``chatcmpl-<id>``), where a second suffix told the prober that another ran the same id.
    sent = [h["X-Request-Id"] for h in upstream.headers[:2]]
    assert len(set(sent)) == 2
    assert all(s.startswith("acme-job-42~") and s.count("~") == 1 for s in sent)


async def test_two_gateways_never_hand_an_engine_the_same_request_id() -> None:
    # Ids are unique per gateway only: a tenant reusing another's id through another gateway
    # must neither be refused by the engine nor learn that the id is running.
    upstream = FakeUpstream(header_gate=asyncio.Event())
    headers = {"X-Request-Id": "job-42"}
    async with serve(upstream.app()) as upstream_url, aiohttp.ClientSession() as http:
        spec = ReplicaSpec("r0", upstream_url, models=frozenset({"base-model"}))
        apps = [create_app(GatewayConfig(), GatewayPolicy.default([spec])) for _ in range(2)]
        async with serve(apps[0]) as url_a, serve(apps[1]) as url_b:
            sent = [
                asyncio.create_task(
                    http.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers)
                )
                for url in (url_a, url_b)
            ]
            while len(upstream.headers) < 2:  # both at the engine at once
                await asyncio.sleep(0.01)
            upstream.header_gate.set()
            answers = [await task for task in sent]
            for answer in answers:
                assert answer.status == 200
                assert answer.headers["X-Request-Id"] == "job-42"  # nothing tells of the other
                answer.release()
    engine_ids = [h["X-Request-Id"] for h in upstream.headers]
    assert len(set(engine_ids)) == 2 and all(i.startswith("job-42~") for i in engine_ids)


async def test_openai_client_chat_completions_streaming_and_models() -> None:
    upstream = FakeUpstream(adapters={"support-lora": "base-model"})
    async with gateway([upstream]) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="anything", max_retries=0)
        chat = await client.chat.completions.create(
            model="base-model", messages=[{"role": "user", "content": "hi"}]
        )
        assert chat.choices[0].message.content == "a b c"
        text = await client.completions.create(model="base-model", prompt="once upon")
        assert text.choices[0].text == "a b c"
        stream = await client.chat.completions.create(
            model="base-model", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        chunks = [c async for c in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "a b c"
        # The gateway asked for usage on the client's behalf; the client must not see it.
        assert all(c.choices for c in chunks)
        models = await client.models.list()
        cards = {m.id: getattr(m, "parent", None) for m in models.data}
        assert cards == {"base-model": None, "support-lora": "base-model"}
        # vLLM's cards carry max_model_len (clients size prompts from it); so do the gateway's,
        # an adapter's being its base model's.
        limits = {m.id: getattr(m, "max_model_len", None) for m in models.data}
        assert limits == {"base-model": 4096, "support-lora": 4096}
        await client.close()
    assert upstream.received[2]["stream_options"] == {"include_usage": True}


async def test_stream_usage_reaches_client_that_asked() -> None:
    upstream = FakeUpstream()
    async with gateway([upstream]) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        stream = await client.completions.create(
            model="base-model",
            prompt="x",
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        await client.close()
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 10


async def test_stream_is_relayed_before_upstream_finishes() -> None:
    gate = asyncio.Event()
    upstream = FakeUpstream(stream_gate=gate)
    async with (
        gateway([upstream]) as url,
        aiohttp.ClientSession() as http,
        http.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": True}) as resp,
    ):
        first = await resp.content.readuntil(b"\n\n")
        # The upstream is still held at the gate: the first token was not buffered.
        assert not gate.is_set()
        assert b'"a"' in first
        gate.set()
        rest = await resp.read()
    assert rest.endswith(b"data: [DONE]\n\n")


async def test_client_disconnect_aborts_upstream() -> None:
    gate = asyncio.Event()
    upstream = FakeUpstream(stream_gate=gate)
    async with gateway([upstream]) as url:
        async with aiohttp.ClientSession() as http:
            resp = await http.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": True})
            await resp.content.readuntil(b"\n\n")
            resp.close()  # the client walks away mid-stream
        await asyncio.wait_for(upstream.client_gone.wait(), timeout=10)
        gate.set()


@pytest.mark.parametrize(
    ("failing", "reason"),
    [
        # It took the request, then dropped the connection: not a connect failure.
        (FakeUpstream(drop_completions=True), "upstream_dropped"),
        # Its engine answered 500 (vLLM's answer once its engine core died).
        (FakeUpstream(fail_status=500), "upstream_5xx"),
    ],
    ids=["dropped", "500"],
)
async def test_a_replica_failing_before_the_first_byte_is_retried_on_a_fallback(
    failing: FakeUpstream, reason: str
) -> None:
    good = FakeUpstream()
    async with (
        gateway([failing, good], profile="round-robin") as url,
        aiohttp.ClientSession() as http,
    ):
        statuses = []
        for _ in range(2):
            async with http.post(f"{url}/v1/chat/completions", json=CHAT) as resp:
                statuses.append(resp.status)
        async with http.get(f"{url}/metrics") as resp:
            metrics = await resp.text()
    assert statuses == [200, 200]
    assert failing.attempts == 1 and len(good.received) == 2
    assert f'fleetgate_upstream_retries_total{{reason="{reason}",route="default"}} 1.0' in metrics


async def test_with_no_replica_left_an_engines_503_reaches_the_client_as_it_is() -> None:
    busy = FakeUpstream(fail_status=503)
    async with (
        gateway([busy]) as url,
        aiohttp.ClientSession() as http,
        http.post(f"{url}/v1/chat/completions", json=CHAT) as resp,
    ):
        assert resp.status == 503
        assert (await resp.json())["error"]["message"] == "EngineCore encountered an issue."
    assert busy.attempts == 1


async def test_an_unreachable_replica_is_a_connect_failed_retry_and_connections_are_counted() -> (
    None
):
    """A replica that died between health polls refuses connections: a fallback serves."""
    doomed, good = FakeUpstream(), FakeUpstream()
    async with serve(good.app()) as good_url:
        doomed_serving = serve(doomed.app())
        doomed_url = await doomed_serving.__aenter__()
        specs = [
            ReplicaSpec("r0", doomed_url, models=frozenset(doomed.models)),
            ReplicaSpec("r1", good_url, models=frozenset(good.models)),
        ]
        policy = GatewayPolicy.default(specs, profile="round-robin")
        app = create_app(GatewayConfig(health_interval_s=3600), policy)
        async with serve(app, handler_cancellation=True) as url, aiohttp.ClientSession() as http:
            await doomed_serving.__aexit__(None, None, None)  # it dies; no poll notices yet
            statuses = []
            for _ in range(4):
                async with http.post(f"{url}/v1/chat/completions", json=CHAT) as resp:
                    statuses.append(resp.status)
            async with http.get(f"{url}/metrics") as resp:
                metrics = await resp.text()
    assert statuses == [200] * 4 and len(good.received) == 4 and not doomed.received
    assert 'fleetgate_upstream_retries_total{reason="connect_failed",route="default"}' in metrics
    # One keep-alive connection to the live replica served all four.
    assert "fleetgate_upstream_connections 1.0" in metrics


class BrokenBodyUpstream(FakeUpstream):
    """Answers 200 with a Content-Length, sends part of the body, then drops the connection."""

    async def _complete(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        self.attempts += 1
        await request.read()
        transport = request.transport
        assert transport is not None
        transport.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"partial":'
        )
        transport.close()
        return aiohttp.web.Response()  # never written: the connection is gone


async def test_a_non_streamed_answer_that_breaks_off_is_retried_on_a_fallback() -> None:
    """Nothing reached the client yet: a fallback serves it (it used to be a 500)."""
    broken, good = BrokenBodyUpstream(), FakeUpstream()
    async with (
        gateway([broken, good], profile="round-robin") as url,
        aiohttp.ClientSession() as http,
        http.post(f"{url}/v1/chat/completions", json=CHAT) as resp,
    ):
        status, body = resp.status, await resp.json()
    assert status == 200 and body["object"] == "chat.completion"
    assert broken.attempts == 1 and len(good.received) == 1


async def test_a_client_gone_at_the_end_of_a_stream_is_never_replayed_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client write failing after the stream started must not send the request to a fallback."""
    import gateway.proxy as proxy

    class ClientGoneAtEof(aiohttp.web.StreamResponse):
        async def write_eof(self, data: bytes = b"") -> None:
            raise ConnectionResetError("Cannot write to closing transport")

    class Web:  # the proxy's view of aiohttp.web, with the failing stream response
        StreamResponse = ClientGoneAtEof
        Response = aiohttp.web.Response
        Request = aiohttp.web.Request

    monkeypatch.setattr(proxy, "web", Web)
    first, second = FakeUpstream(), FakeUpstream()
    async with (
        gateway([first, second], profile="round-robin") as url,
        aiohttp.ClientSession() as http,
    ):
        body = {**CHAT, "stream": True}
        async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            with contextlib.suppress(aiohttp.ClientError):
                await resp.read()
        async with http.get(f"{url}/metrics") as resp:
            metrics = await resp.text()
    assert len(first.received) + len(second.received) == 1, "the request was replayed"
    # Retry series are created at 0 (so dashboards show 0, not "No data"): none may have moved.
    retries = [x for x in metrics.splitlines() if x.startswith("fleetgate_upstream_retries_total{")]
    assert all(x.endswith(" 0.0") for x in retries), retries


def _error(body: bytes) -> dict[str, object]:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "code", "param"}
    return error


@pytest.mark.parametrize(
    ("raw", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_json"),
        (b'{"model": "base-model", "temperature": NaN}', 400, "invalid_json"),  # not JSON
        (b'{"model": "base-model"} trailing', 400, "invalid_json"),
        (
            json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(),
            400,
            "invalid_request",
        ),
        (json.dumps({"model": "base-model", "messages": []}).encode(), 400, "invalid_request"),
        (json.dumps({**CHAT, "stream": "yes"}).encode(), 400, "invalid_request"),
        (json.dumps({**CHAT, "model": "nope"}).encode(), 404, "model_not_found"),
        (json.dumps({**CHAT, "pad": "x" * 5000}).encode(), 413, "request_too_large"),
    ],
)
async def test_errors_use_openai_envelope(raw: bytes, status: int, code: str) -> None:
    upstream = FakeUpstream()
    headers = {"Content-Type": "application/json"}
    async with (
        gateway([upstream], max_body_bytes=4096) as url,
        aiohttp.ClientSession() as http,
        http.post(f"{url}/v1/chat/completions", data=raw, headers=headers) as resp,
    ):
        assert resp.status == status
        assert resp.headers["X-Request-Id"]
        assert _error(await resp.read())["code"] == code
    assert upstream.received == []


async def test_openai_client_sees_not_found_error() -> None:
    async with gateway([FakeUpstream()]) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        with pytest.raises(openai.NotFoundError) as err:
            await client.chat.completions.create(
                model="missing", messages=[{"role": "user", "content": "x"}]
            )
        await client.close()
    assert err.value.code == "model_not_found"


async def test_upstream_timeout_is_504() -> None:
    gate = asyncio.Event()
    upstream = FakeUpstream(header_gate=gate)
    async with gateway([upstream], upstream_timeout_s=0.2) as url:
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{url}/v1/chat/completions", json=CHAT) as resp,
        ):
            assert resp.status == 504
            assert _error(await resp.read())["code"] == "upstream_timeout"
        gate.set()


async def test_no_healthy_replica_is_503_and_not_ready() -> None:
    upstream = FakeUpstream()
    async with gateway([upstream]) as url, aiohttp.ClientSession() as http:
        async with http.get(f"{url}/ready") as resp:
            assert resp.status == 200
        upstream.drop_completions = True  # every attempt now fails before the first byte
        async with http.post(f"{url}/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 503
            assert _error(await resp.read())["code"] == "no_healthy_replica"


async def test_ready_is_200_without_replicas_and_says_no_model_is_served() -> None:
    """Readiness is the gateway's own (a load balancer's question), not the replicas'."""
    async with gateway([]) as url, aiohttp.ClientSession() as http:
        async with http.get(f"{url}/health") as resp:
            assert resp.status == 200
        async with http.get(f"{url}/ready") as resp:
            assert resp.status == 200
            body = await resp.json()
            assert body["ready"] is True and body["all_models_ready"] is False


async def test_unknown_path_is_enveloped_404() -> None:
    async with (
        gateway([FakeUpstream()]) as url,
        aiohttp.ClientSession() as http,
        http.get(f"{url}/v1/nothing") as resp,
    ):
        assert resp.status == 404
        assert _error(await resp.read())["code"] == "not_found"


async def test_inflight_counts_follow_a_stream() -> None:
    gate = asyncio.Event()
    upstream = FakeUpstream(stream_gate=gate)
    admin = {"Authorization": "Bearer adm"}
    async with (
        gateway([upstream], admin_key="adm") as url,
        aiohttp.ClientSession() as http,
    ):

        async def replica_view() -> dict[str, object]:
            async with http.get(f"{url}/admin/replicas", headers=admin) as resp:
                return (await resp.json())["replicas"][0]

        async with http.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
            await resp.content.readuntil(b"\n\n")
            during = await replica_view()
            gate.set()
            await resp.read()
        after = await replica_view()
    # Streaming: the prompt is prefilled (first token out), the request still runs.
    assert (during["inflight_requests"], during["inflight_prefill_tokens"]) == (1, 0)
    assert (after["inflight_requests"], after["inflight_prefill_tokens"]) == (0, 0)


async def test_shutdown_drains_inflight_stream() -> None:
    gate = asyncio.Event()
    upstream = FakeUpstream(stream_gate=gate)
    async with _serve_all([upstream]) as (upstream_url,):
        spec = ReplicaSpec("r0", upstream_url, models=frozenset(upstream.models))
        app = create_app(GatewayConfig(health_interval_s=3600), GatewayPolicy.default([spec]))
        shutdown_started = asyncio.Event()

        async def mark(_app: object) -> None:
            shutdown_started.set()

        app.on_shutdown.append(mark)
        runner = aiohttp.web.AppRunner(app, handler_cancellation=True, shutdown_timeout=30)
        await runner.setup()
        site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        async with aiohttp.ClientSession() as http:
            resp = await http.post(
                f"http://{host}:{port}/v1/chat/completions", json={**CHAT, "stream": True}
            )
            await resp.content.readuntil(b"\n\n")
            cleanup = asyncio.create_task(runner.cleanup())
            await shutdown_started.wait()
            gate.set()  # the upstream finishes only after shutdown began
            rest = await resp.read()
            await cleanup
    assert rest.endswith(b"data: [DONE]\n\n")


async def test_bad_token_ids_are_400_and_errors_are_counted_by_code() -> None:
    async with (
        gateway([FakeUpstream()]) as url,
        aiohttp.ClientSession() as http,
    ):
        body = {"model": "base-model", "prompt": [-1, 5]}
        async with http.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 400
            assert _error(await resp.read())["param"] == "prompt"
        async with http.post(f"{url}/v1/completions", json={**body, "model": "x"}) as resp:
            assert resp.status == 404
        async with http.get(f"{url}/metrics") as resp:
            metrics = await resp.text()
    assert 'fleetgate_errors_total{code="invalid_request",route="default"} 1.0' in metrics
    assert 'fleetgate_errors_total{code="model_not_found",route="unrouted"} 1.0' in metrics
    assert (
        'fleetgate_requests_total{model="base-model",replica="none",route="default",status="400"}'
        " 1.0" in metrics
    )
