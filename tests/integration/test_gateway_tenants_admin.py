"""Policy mode: tenants and keys, cache-salt injection, adapter isolation, rate limits, admin API,
policy reload (a refused file keeps the running policy)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from tests.integration.test_gateway_support import FakeUpstream, serve


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def policy_yaml(upstream_url: str, acme_rps: float = 1000.0) -> str:
    return f"""
version: 1
replica_pools:
  - name: pool-a
    replicas: [{upstream_url}]
    gpu_price_per_hour: 2.0
models:
  - name: base-model
    pools: [pool-a]
tenants:
  - name: acme
    api_key_sha256: [{sha("acme-key")}]
    rate_limit: {{requests_per_s: {acme_rps}, burst: 1}}
  - name: globex
    api_key_sha256: [{sha("globex-key")}]
adapters:
  - name: acme-lora
    base_model: base-model
    source: /adapters/acme-lora
    rank: 8
    owners: [acme]
  - name: shared-lora
    base_model: base-model
    source: /adapters/shared-lora
    rank: 8
    public: true
routes:
  - name: acme-route
    match: {{tenant: acme}}
    profile: least-loaded
admin:
  api_key_sha256: [{sha("admin-key")}]
"""


@asynccontextmanager
async def policy_gateway(
    tmp_path: Path,
    upstream: FakeUpstream,
    acme_rps: float = 1000.0,
    poll_s: float = 0,
    admin_key: str | None = None,
) -> AsyncIterator[tuple[str, Path]]:
    async with serve(upstream.app()) as upstream_url:
        path = tmp_path / "policy.yaml"
        path.write_text(policy_yaml(upstream_url, acme_rps))
        config = GatewayConfig(policy_path=str(path), policy_poll_s=poll_s, admin_key=admin_key)
        app = create_app(config)
        config.health_interval_s = 3600  # the policy's interval; tests poll once at start-up
        async with serve(app, handler_cancellation=True) as url:
            yield url, path


def chat(model: str = "base-model") -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}]}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_tenant_salt_injected_and_client_salt_overridden(tmp_path: Path) -> None:
    upstream = FakeUpstream()
    async with policy_gateway(tmp_path, upstream) as (url, _), aiohttp.ClientSession() as http:
        for key in ("acme-key", "globex-key"):
            body = {**chat(), "cache_salt": "forged"}
            async with http.post(
                f"{url}/v1/chat/completions", json=body, headers=auth(key)
            ) as resp:
                assert resp.status == 200
    acme_salt, globex_salt = (b["cache_salt"] for b in upstream.received)
    assert "forged" not in (acme_salt, globex_salt)
    assert acme_salt != globex_salt


async def test_bad_or_missing_key_is_401(tmp_path: Path) -> None:
    async with (
        policy_gateway(tmp_path, FakeUpstream()) as (url, _),
        aiohttp.ClientSession() as http,
    ):
        for headers in ({}, auth("wrong")):
            async with http.post(
                f"{url}/v1/chat/completions", json=chat(), headers=headers
            ) as resp:
                assert resp.status == 401
                assert (await resp.json())["error"]["code"] == "invalid_api_key"


async def test_other_tenants_adapter_looks_like_a_missing_model(tmp_path: Path) -> None:
    upstream = FakeUpstream()
    async with policy_gateway(tmp_path, upstream) as (url, _), aiohttp.ClientSession() as http:
        answers = {}
        for model in ("acme-lora", "no-such-lora"):
            async with http.post(
                f"{url}/v1/chat/completions", json=chat(model), headers=auth("globex-key")
            ) as resp:
                answers[model] = (resp.status, (await resp.json())["error"])
        async with http.post(
            f"{url}/v1/chat/completions", json=chat("acme-lora"), headers=auth("acme-key")
        ) as resp:
            assert resp.status == 200
        async with http.get(f"{url}/v1/models", headers=auth("globex-key")) as resp:
            globex_models = {m["id"]: m["parent"] for m in (await resp.json())["data"]}
        cards = {}
        for model, key in (("acme-lora", "globex-key"), ("no-such-lora", "globex-key"),
                           ("acme-lora", "acme-key")):
            async with http.get(f"{url}/v1/models/{model}", headers=auth(key)) as resp:
                cards[model, key] = (resp.status, await resp.json())
    # One card: the same 404 for another tenant's adapter as for none, the card for its owner.
    assert cards["acme-lora", "globex-key"][0] == cards["no-such-lora", "globex-key"][0] == 404
    assert cards["acme-lora", "globex-key"][1]["error"]["message"].replace("acme-lora", "X") == (
        cards["no-such-lora", "globex-key"][1]["error"]["message"].replace("no-such-lora", "X")
    )
    assert cards["acme-lora", "acme-key"] == (200, {**cards["acme-lora", "acme-key"][1],
                                                    "id": "acme-lora", "parent": "base-model"})
    status, error = answers["acme-lora"]
    assert status == 404 and error["code"] == "model_not_found"
    missing_status, missing = answers["no-such-lora"]
    assert missing_status == 404
    assert error["message"].replace("acme-lora", "X") == missing["message"].replace(
        "no-such-lora", "X"
    )
    assert globex_models == {"base-model": None, "shared-lora": "base-model"}
    assert upstream.received[0]["model"] == "acme-lora"


async def test_rate_limit_is_429_with_retry_after(tmp_path: Path) -> None:
    upstream = FakeUpstream()
    async with (
        policy_gateway(tmp_path, upstream, acme_rps=0.001) as (url, _),
        aiohttp.ClientSession() as http,
    ):
        statuses = []
        for _ in range(2):
            async with http.post(
                f"{url}/v1/chat/completions", json=chat(), headers=auth("acme-key")
            ) as resp:
                statuses.append(resp.status)
                if resp.status == 429:
                    assert int(resp.headers["Retry-After"]) >= 1
                    assert (await resp.json())["error"]["code"] == "rate_limit_exceeded"
    assert statuses == [200, 429]


async def test_admin_api_requires_admin_key_and_reports(tmp_path: Path) -> None:
    upstream = FakeUpstream()
    async with policy_gateway(tmp_path, upstream) as (url, _), aiohttp.ClientSession() as http:
        async with http.get(f"{url}/admin/replicas", headers=auth("acme-key")) as resp:
            assert resp.status == 401
            assert (await resp.json())["error"]["message"] == "Incorrect admin key."
        async with http.get(f"{url}/admin/replicas") as resp:  # no key at all: say what to send
            assert resp.status == 401
            assert "Authorization: Bearer <admin key>" in (await resp.json())["error"]["message"]
        async with http.post(
            f"{url}/v1/chat/completions", json=chat(), headers=auth("acme-key")
        ) as resp:
            assert resp.status == 200
        admin = auth("admin-key")
        async with http.get(f"{url}/admin/replicas", headers=admin) as resp:
            replicas = (await resp.json())["replicas"]
        async with http.get(f"{url}/admin/decisions?n=5", headers=admin) as resp:
            decisions = (await resp.json())["decisions"]
        async with http.get(f"{url}/admin/policy", headers=admin) as resp:
            policy = await resp.json()
        async with http.get(f"{url}/admin/index", headers=admin) as resp:
            index = await resp.json()
        async with http.get(f"{url}/admin/layout", headers=admin) as resp:
            layout = await resp.json()
    assert [r["replica_id"] for r in replicas] == ["pool-a/0"]
    assert replicas[0]["healthy"] is True and replicas[0]["circuit"] == "closed"
    (decision,) = decisions
    assert decision["route"] == "acme-route" and decision["profile"] == "least-loaded"
    assert decision["replica"] == "pool-a/0" and "pool-a/0" in decision["explanations"]
    assert [r["name"] for r in policy["routes"]] == ["acme-route", "default"]
    assert index["available"] is True and index["backend"] == "memory"
    assert [r["route"] for r in layout["routes"]] == ["acme-route"]


async def test_reload_refuses_invalid_file_and_keeps_running_policy(tmp_path: Path) -> None:
    upstream = FakeUpstream()
    async with policy_gateway(tmp_path, upstream) as (url, path), aiohttp.ClientSession() as http:
        admin = auth("admin-key")
        async with http.get(f"{url}/admin/policy", headers=admin) as resp:
            digest_before = (await resp.json())["digest"]
        good = path.read_text()
        path.write_text(good.replace("version: 1", "version: 1\nbogus_key: 3"))
        async with http.post(f"{url}/admin/policy/reload", headers=admin) as resp:
            assert resp.status == 400
            refused = await resp.json()
        async with http.get(f"{url}/admin/policy", headers=admin) as resp:
            assert (await resp.json())["digest"] == digest_before  # a refused file: no change
        async with http.post(
            f"{url}/v1/chat/completions", json=chat(), headers=auth("acme-key")
        ) as resp:
            assert resp.status == 200  # still routing with the old policy
        path.write_text(good.replace(
            "profile: least-loaded",
            "profile: round-robin\n    slo: {ttft_p95_ms: 800, tpot_p95_ms: 40}",
        ))
        async with http.post(f"{url}/admin/policy/reload", headers=admin) as resp:
            assert resp.status == 200
        async with http.post(
            f"{url}/v1/chat/completions", json=chat(), headers=auth("acme-key")
        ) as resp:
            assert resp.status == 200
        async with http.get(f"{url}/admin/decisions?n=1", headers=admin) as resp:
            (latest,) = (await resp.json())["decisions"]
        async with http.get(f"{url}/metrics") as resp:
            metrics = await resp.text()
        async with http.get(f"{url}/admin/policy", headers=admin) as resp:
            digest_after = (await resp.json())["digest"]
    assert refused["error"]["code"] == "policy_invalid"
    # Which policy each pod runs, comparable across pods (a reload reaches each on its own).
    assert len(digest_before) == 16 and digest_after != digest_before
    assert f'fleetgate_policy_info{{digest="{digest_after}"}} 1.0' in metrics
    # The reloaded route's declared objectives, for `fleetgate triage` to check against (the
    # implicit default route declares none).
    slos = sorted(line for line in metrics.splitlines()
                  if line.startswith("fleetgate_route_slo_seconds{"))
    assert slos == [
        'fleetgate_route_slo_seconds{route="acme-route",slo="tpot"} 0.04',
        'fleetgate_route_slo_seconds{route="acme-route",slo="ttft"} 0.8',
    ]
    assert digest_before not in metrics  # the old policy's series went with it
    assert any("bogus_key" in line for line in refused["error"]["details"])
    assert latest["profile"] == "round-robin"
    assert 'fleetgate_policy_reloads_total{outcome="rejected"} 1.0' in metrics
    assert 'fleetgate_policy_reloads_total{outcome="ok"} 1.0' in metrics


@pytest.mark.parametrize("path", ["/admin/replicas", "/admin/decisions"])
async def test_admin_disabled_without_key(path: str) -> None:
    async with (
        serve(create_app(GatewayConfig())) as url,
        aiohttp.ClientSession() as http,
        http.get(f"{url}{path}", headers=auth("anything")) as resp,
    ):
        assert resp.status == 403
        assert json.loads(await resp.read())["error"]["code"] == "admin_disabled"


async def test_policy_file_change_is_picked_up_without_a_signal(tmp_path: Path) -> None:
    upstream = FakeUpstream()
    async with (
        policy_gateway(tmp_path, upstream, poll_s=0.05) as (url, path),
        aiohttp.ClientSession() as http,
    ):
        _rewrite(path, path.read_text().replace("least-loaded", "round-robin"))
        await _until_the_first_route_uses(http, url, "round-robin")


def _rewrite(path: Path, text: str, later_s: int = 1) -> None:
    """Write ``text`` with an mtime ``later_s`` seconds on, whatever the file system's
    timestamp resolution: a change the policy poller sees."""
    stat = os.stat(path)
    path.write_text(text)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + later_s * 1_000_000_000))


async def _until_the_first_route_uses(
    http: aiohttp.ClientSession, url: str, profile: str
) -> None:
    async with asyncio.timeout(30):
        while True:
            async with http.get(f"{url}/admin/policy", headers=auth("admin-key")) as resp:
                profiles = [r["profile"] for r in (await resp.json())["routes"]]
            if profiles[0] == profile:
                return
            await asyncio.sleep(0.05)


async def test_a_file_the_yaml_reader_chokes_on_keeps_the_policy_and_the_poller(
    tmp_path: Path,
) -> None:
    """The operator review of session 46: a stray control character (a terminal's colour code
    pasted in) raised PyYAML's ReaderError out of the reload: the admin reload answered 500, and
    the file poller died, so no later change on disk was ever taken in."""
    upstream = FakeUpstream()
    async with (
        policy_gateway(tmp_path, upstream, poll_s=0.02) as (url, path),
        aiohttp.ClientSession() as http,
    ):
        good = path.read_text()
        _rewrite(path, good.replace("least-loaded", "least-loaded \x1b[0m"), 1)
        async with http.post(f"{url}/admin/policy/reload", headers=auth("admin-key")) as resp:
            assert resp.status == 400
            assert "YAML error" in json.dumps(await resp.json())
        _rewrite(path, good.replace("least-loaded", "round-robin"), 2)
        await _until_the_first_route_uses(http, url, "round-robin")


async def test_the_policy_view_says_which_settings_wait_for_a_restart(tmp_path: Path) -> None:
    """The new user's review: after a reload that moved the index to Redis, /admin/policy's
    summary said index=redis while the memory index ran, and only the POST's answer (none for a
    file-watch reload) said a restart was needed."""
    upstream = FakeUpstream()
    async with policy_gateway(tmp_path, upstream) as (url, path), aiohttp.ClientSession() as http:
        admin = auth("admin-key")
        path.write_text(
            path.read_text() + "index: {backend: redis, redis_url: 'redis://127.0.0.1:1/0'}\n"
        )
        async with http.post(f"{url}/admin/policy/reload", headers=admin) as resp:
            assert resp.status == 200
        async with http.get(f"{url}/admin/policy", headers=admin) as resp:
            view = await resp.json()
    assert view["restart_needed"] == [
        "index backend (redis url): redis://127.0.0.1:1/0 (running: memory)"
    ]


async def test_a_policy_file_that_goes_away_is_said_once_and_its_return_too(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The new user's review: deleting the policy file of a running gateway (on Kubernetes, a
    broken mount) was silent. The running policy stays; the poller says so once, and once when
    the file is back."""
    upstream = FakeUpstream()
    caplog.set_level("WARNING", logger="gateway.reload")
    async with (
        policy_gateway(tmp_path, upstream, poll_s=0.02) as (url, path),
        aiohttp.ClientSession() as http,
    ):
        text = path.read_text()

        async def said(words: str) -> int:
            async with asyncio.timeout(30):
                while not any(words in r.getMessage() for r in caplog.records):
                    await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)  # ten more polls: still said once
            return sum(words in r.getMessage() for r in caplog.records)

        path.unlink()
        assert await said("cannot be read") == 1
        chat_url = f"{url}/v1/chat/completions"
        async with http.post(chat_url, json=chat(), headers=auth("acme-key")) as resp:
            assert resp.status == 200  # still routing on the running policy
        path.write_text(text)
        assert await said("can be read again") == 1


async def test_admin_calls_that_cannot_apply_say_why() -> None:
    # A reload on a gateway without a policy file refused nothing (it said "Policy refused");
    # a decision count that is not a number was read as the default.
    async with (
        serve(create_app(GatewayConfig(admin_key="adm"))) as url,
        aiohttp.ClientSession() as http,
    ):
        async with http.post(f"{url}/admin/policy/reload", headers=auth("adm")) as resp:
            assert resp.status == 409
            error = (await resp.json())["error"]
            assert error["code"] == "no_policy_file" and "--config" in error["message"]
        async with http.get(f"{url}/admin/decisions?n=abc", headers=auth("adm")) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == "n"


async def test_a_route_whose_requirement_no_replica_meets_is_not_told_to_retry(
    tmp_path: Path,
) -> None:
    # The replica is healthy; the route's profile requires a kernel plugin it does not run.
    # Retrying soon changes nothing: no Retry-After, and a message that says it is the route's
    # requirement (the detail is in the gateway's log, not in a tenant's answer).
    upstream = FakeUpstream()
    async with serve(upstream.app()) as upstream_url:
        path = tmp_path / "policy.yaml"
        path.write_text(f"""
version: 1
replica_pools:
  - {{name: pool-a, replicas: [{upstream_url}]}}
models:
  - {{name: base-model, pools: [pool-a]}}
plugins:
  - {{type: requires-kernels, name: canary-kernel, parameters: {{kernels: [my.kernels]}}}}
  - {{type: max-score, name: best}}
profiles:
  - {{name: canary, filters: [canary-kernel], scorers: [{{ref: load}}], picker: best}}
routes:
  - {{name: canary-route, profile: canary}}
""")
        app = create_app(GatewayConfig(policy_path=str(path)))
        async with (
            serve(app, handler_cancellation=True) as url,
            aiohttp.ClientSession() as http,
            http.post(f"{url}/v1/chat/completions", json=chat()) as resp,
        ):
            status, headers, body = resp.status, resp.headers, await resp.json()
    assert status == 503 and "Retry-After" not in headers
    assert body["error"]["message"] == (
        "No replica of model 'base-model' meets what this request's route requires; the "
        "gateway's log says which requirement."
    )
    assert upstream.attempts == 0


async def test_a_tenants_key_given_as_the_admin_key_opens_no_admin_api(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The security review: ``--admin-key`` set to a tenant's key made that tenant an admin
    (the policy file's admin hashes are checked against the tenants', the flag's was not)."""
    upstream = FakeUpstream()
    async with (
        policy_gateway(tmp_path, upstream, admin_key="acme-key") as (url, _),
        aiohttp.ClientSession() as http,
    ):
        async with http.get(f"{url}/admin/replicas", headers=auth("acme-key")) as resp:
            assert resp.status == 401
        async with http.get(f"{url}/admin/replicas", headers=auth("admin-key")) as resp:
            assert resp.status == 200  # the policy's own admin key still works
    assert "is also tenant 'acme''s API key" in caplog.text


async def test_a_key_header_sent_twice_is_refused(tmp_path: Path) -> None:
    """Which of two keys counts is ambiguous (a proxy in front reading the last one would
    disagree with the gateway about who calls): 401, as a repeated priority header is a 400."""
    upstream = FakeUpstream()
    async with policy_gateway(tmp_path, upstream) as (url, _), aiohttp.ClientSession() as http:
        for name, first, second in (
            ("Authorization", "Bearer globex-key", "Bearer acme-key"),
            ("x-api-key", "globex-key", "acme-key"),
        ):
            headers = [(name, first), (name, second)]
            async with http.post(
                f"{url}/v1/chat/completions", json=chat(), headers=headers
            ) as resp:
                assert resp.status == 401, name
                assert "sent more than once" in (await resp.json())["error"]["message"], name
        async with http.post(
            f"{url}/v1/chat/completions", json=chat(), headers=auth("acme-key")
        ) as resp:
            assert resp.status == 200


async def test_dashboard_data_is_not_open_where_tenants_are_declared_without_an_admin_key(
    tmp_path: Path,
) -> None:
    """The security review: with tenants and private adapters but no admin key, the dashboard's
    data (its decisions name each request's adapter) answered any caller, tenants included."""
    upstream = FakeUpstream()
    async with serve(upstream.app()) as upstream_url:
        path = tmp_path / "policy.yaml"
        no_admin = policy_yaml(upstream_url).split("admin:")[0]
        path.write_text(no_admin)
        async with (
            serve(create_app(GatewayConfig(policy_path=str(path)))) as url,
            aiohttp.ClientSession() as http,
        ):
            for headers in ({}, auth("acme-key")):
                async with http.get(f"{url}/dashboard/data", headers=headers) as resp:
                    assert resp.status == 403
                    assert (await resp.json())["error"]["code"] == "admin_disabled"
    # Without tenants (open access, the quick start) the page still gets its data.
    async with (
        serve(create_app(GatewayConfig())) as url,
        aiohttp.ClientSession() as http,
        http.get(f"{url}/dashboard/data") as resp,
    ):
        assert resp.status == 200
