"""Multi-LoRA serving through the gateway: a real gateway (policy mode, in-memory placement) in
front of simulated vLLM replicas that serve vLLM's runtime LoRA API."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest

from adapters_registry import RegistrySettings
from adapters_registry.thrash import ThrashSettings
from fleetgate.commands.up import banner
from fleetgate.embedded import embedded_stack
from replica.sim.fleet import SimFleet, start_sim_fleet
from tests.integration.test_adapters_fixtures import count_engine_loads, served_adapters
from tests.integration.test_gateway_adapters_support import (
    ADMIN,
    BASE_MODEL,
    adapter,
    adapter_gateway,
    auth,
    last_decision,
    metric,
    policy_yaml,
    post_chat,
)
from tests.support.polling import wait_until


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    async with start_sim_fleet(2, kv_events=None, kv_replay=None, speed=1000.0) as running:
        yield running


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def replica_url(fleet: SimFleet, replica_id: str) -> str:
    """The sim behind a policy replica id (``pool-a/<i>`` is the pool's i-th URL)."""
    return fleet.urls[int(replica_id.rsplit("/", 1)[1])]


async def test_first_request_loads_the_adapter_where_it_is_routed_then_sticks_there(
    tmp_path: Path, fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    loads = [count_engine_loads(handle) for handle in fleet.replicas]
    async with adapter_gateway(tmp_path, fleet, [adapter("acme-lora")]) as (url, _):
        status, body = await post_chat(http, url, "acme", "acme-lora")
        assert status == 200, body
        first = await last_decision(http, url)
        chosen = first["replica"]
        assert first["served_by"] == chosen
        assert first["adapter_load"] == {
            "replica": chosen,
            "cold_ms": pytest.approx(first["adapter_load"]["cold_ms"]),
            "loaded_now": True,
        }
        other = next(u for u in fleet.urls if u != replica_url(fleet, chosen))
        assert await served_adapters(http, replica_url(fleet, chosen)) == ["acme-lora"]
        assert await served_adapters(http, other) == []

        # Distinct prompts (no shared prefix to follow): only adapter affinity keeps them there.
        for i in range(6):
            status, body = await post_chat(http, url, "acme", "acme-lora", f"question {i} " * 3)
            assert status == 200, body
            decision = await last_decision(http, url)
            assert decision["served_by"] == chosen
            cold = {
                r: e["terms"]["adapter_cold_load_ms"] for r, e in decision["explanations"].items()
            }
            assert cold[chosen] == 0.0 and min(v for r, v in cold.items() if r != chosen) > 0
        assert loads[0] + loads[1] == ["acme-lora"]  # one load in the whole fleet
        # /metrics is on the tenants' port: a private adapter's label is opaque, and only the
        # admin API maps it back to the adapter.
        async with http.get(f"{url}/admin/adapters", headers=ADMIN) as resp:
            (entry,) = (a for a in (await resp.json())["adapters"] if a["name"] == "acme-lora")
        label = entry["metrics_label"]
        assert label.startswith("private-") and "acme-lora" not in label
        assert await metric(http, url, "fleetgate_adapter_requests_total", adapter=label) == 7
        async with http.get(f"{url}/metrics") as resp:
            assert "acme-lora" not in await resp.text()


async def test_other_tenants_adapter_is_a_404_identical_to_an_unknown_model(
    tmp_path: Path, fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    loads = [count_engine_loads(handle) for handle in fleet.replicas]
    async with adapter_gateway(tmp_path, fleet, [adapter("acme-lora")]) as (url, _):
        answers = {}
        for name in ("acme-lora", "no-such-lora"):
            for path in ("/v1/chat/completions", "/v1/completions"):
                body = {
                    "model": name,
                    "prompt": "hi",
                    "messages": [{"role": "user", "content": "hi"}],
                }
                async with http.post(f"{url}{path}", json=body, headers=auth("globex")) as resp:
                    answers[name, path] = (resp.status, (await resp.text()).replace(name, "X"))
    for path in ("/v1/chat/completions", "/v1/completions"):
        forbidden, unknown = answers["acme-lora", path], answers["no-such-lora", path]
        assert forbidden == unknown
        assert forbidden[0] == 404 and '"model_not_found"' in forbidden[1]
    assert loads == [[], []]


async def test_models_lists_what_each_tenant_may_use_including_runtime_additions(
    tmp_path: Path, fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    catalog = [adapter("acme-lora"), adapter("globex-lora", "globex"), adapter("shared", None)]

    async def models(url: str, tenant: str) -> dict[str, str | None]:
        async with http.get(f"{url}/v1/models", headers=auth(tenant)) as resp:
            assert resp.status == 200
            return {m["id"]: m["parent"] for m in (await resp.json())["data"]}

    async with adapter_gateway(tmp_path, fleet, catalog) as (url, _):
        base = {BASE_MODEL: None}
        assert await models(url, "acme") == {**base, "acme-lora": BASE_MODEL, "shared": BASE_MODEL}
        assert await models(url, "globex") == {
            **base,
            "globex-lora": BASE_MODEL,
            "shared": BASE_MODEL,
        }
        assert await models(url, "initech") == {**base, "shared": BASE_MODEL}

        spec = adapter("acme-new")
        async with http.post(f"{url}/admin/adapters", json=spec, headers=ADMIN) as resp:
            assert resp.status == 201, await resp.text()
        assert "acme-new" in await models(url, "acme")
        assert "acme-new" not in await models(url, "globex")
        status, body = await post_chat(http, url, "acme", "acme-new")
        assert status == 200, body
        served_by = replica_url(fleet, (await last_decision(http, url))["served_by"])
        assert await served_adapters(http, served_by) == ["acme-new"]

        async with http.get(f"{url}/admin/adapters", headers=ADMIN) as resp:
            report = await resp.json()
        entries = {a["name"]: a for a in report["adapters"]}
        assert entries["acme-new"]["runtime"] and not entries["acme-lora"]["runtime"]
        assert len(entries["acme-new"]["loaded_on"]) == 1

        async with http.delete(f"{url}/admin/adapters/acme-new", headers=ADMIN) as resp:
            assert resp.status == 200
            assert (await resp.json())["unload_failures"] == []
        async with http.delete(f"{url}/admin/adapters/acme-lora", headers=ADMIN) as resp:
            assert resp.status == 409  # the policy file's: edit the file instead
        assert "acme-new" not in await models(url, "acme")
        assert await served_adapters(http, served_by) == []
        status, _ = await post_chat(http, url, "acme", "acme-new")
        assert status == 404


async def test_invalid_runtime_adapter_is_refused_with_every_reason(
    tmp_path: Path, fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    async with adapter_gateway(tmp_path, fleet, [adapter("acme-lora")]) as (url, _):
        bad = adapter("acme-lora", base_model="no-such-base", owners=["nobody"])
        async with http.post(f"{url}/admin/adapters", json=bad, headers=ADMIN) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
        assert error["code"] == "invalid_adapter"
        assert any(d.startswith("base_model:") for d in error["details"])
        assert any(d.startswith("owners:") for d in error["details"])
        # Shape errors read as `fleetgate policy validate` words them, not pydantic's text.
        typo = {**adapter("acme-typo"), "sorce": "/x"}
        async with http.post(f"{url}/admin/adapters", json=typo, headers=ADMIN) as resp:
            assert resp.status == 400
            details = (await resp.json())["error"]["details"]
        assert "sorce: unknown key" in details
        assert not any("Extra inputs" in d or "Value error" in d for d in details)
        async with http.post(f"{url}/admin/adapters", json=adapter("x")) as resp:
            assert resp.status == 401  # the admin key guards it
        # Bodies that are not a JSON object, or nest absurdly deep: a 400, never a 500.
        for raw in (b"[" * 5000 + b"]" * 5000, b'{"name": ', b"[1, 2]", b"\xff\xfe"):
            async with http.post(f"{url}/admin/adapters", data=raw, headers=ADMIN) as resp:
                assert resp.status == 400, raw[:20]
                assert (await resp.json())["error"]["code"] == "invalid_json"


async def test_pinned_adapter_survives_eviction_pressure(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    catalog = [adapter("pin", pinned=True)] + [adapter(n) for n in ("a", "b", "c")]
    async with (
        start_sim_fleet(1, kv_events=None, kv_replay=None, speed=1000.0, max_loras=1) as fleet,
        adapter_gateway(tmp_path, fleet, catalog, max_loras=1, max_cpu_loras=2) as (url, gw),
    ):
        sim = fleet.urls[0]
        for name in ("pin", "a", "b", "c"):
            status, body = await post_chat(http, url, "acme", name)
            assert status == 200, body
            assert "pin" in await served_adapters(http, sim)
        assert sorted(await served_adapters(http, sim)) == ["c", "pin"]
        assert gw.adapters is not None
        unloads, label = gw.adapters.metrics.unloads, gw.adapters.catalog.metrics_label
        pinned = unloads.labels(adapter=label("pin"), replica="pool-a/0", reason="lru")
        assert pinned._value.get() == 0
        for evicted in ("a", "b"):
            lru = unloads.labels(adapter=label(evicted), replica="pool-a/0", reason="lru")
            assert lru._value.get() == 1


async def test_replica_without_a_free_slot_falls_back_to_the_next_one(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    # Round-robin over sorted ids makes the choice deterministic: pool-a/0, /1, /0, ...
    catalog = [adapter("pin", pinned=True), adapter("x")]
    async with (
        start_sim_fleet(
            2,
            kv_events=None,
            kv_replay=None,
            speed=1000.0,
            max_loras=1,
            engine_overrides={"max_cpu_loras": 1},
        ) as fleet,
        adapter_gateway(
            tmp_path, fleet, catalog, max_loras=1, max_cpu_loras=1, profile="round-robin"
        ) as (url, _),
    ):
        assert (await post_chat(http, url, "acme", "pin"))[0] == 200  # pool-a/0: pinned, full
        assert (await post_chat(http, url, "acme", "x"))[0] == 200  # pool-a/1 loads x
        status, body = await post_chat(http, url, "acme", "x")  # pool-a/0 first: no slot
        assert status == 200, body
        decision = await last_decision(http, url)
        assert (decision["replica"], decision["served_by"]) == ("pool-a/0", "pool-a/1")
        retries = await metric(
            http, url, "fleetgate_upstream_retries_total", reason="no_adapter_slot"
        )
        assert retries == 1
        assert await served_adapters(http, fleet.urls[0]) == ["pin"]


async def test_thrash_guard_sends_loads_elsewhere_but_the_last_replica_still_serves(
    tmp_path: Path, fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    settings = RegistrySettings(thrash=ThrashSettings(max_loads=1, window_s=3600.0))
    catalog = [adapter(n) for n in ("a", "b", "c")]
    async with adapter_gateway(
        tmp_path, fleet, catalog, profile="round-robin", settings=settings
    ) as (url, _):
        assert (await post_chat(http, url, "acme", "a"))[0] == 200  # pool-a/0: its one load
        assert (await post_chat(http, url, "acme", "b"))[0] == 200  # pool-a/1: its one load
        status, body = await post_chat(http, url, "acme", "c")  # both tripped now
        assert status == 200, body
        decision = await last_decision(http, url)
        # pool-a/0 refused (another replica was left); pool-a/1 was the last resort and loaded.
        assert (decision["replica"], decision["served_by"]) == ("pool-a/0", "pool-a/1")
        assert decision["adapter_load"]["loaded_now"]
        assert (
            await metric(
                http, url, "fleetgate_upstream_retries_total", reason="adapter_thrash_guard"
            )
            == 1
        )
        assert await served_adapters(http, fleet.urls[1]) == ["b", "c"]


async def test_every_replica_full_of_pinned_adapters_is_a_503(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    catalog = [adapter("pin", pinned=True), adapter("x")]
    async with (
        start_sim_fleet(1, kv_events=None, kv_replay=None, speed=1000.0, max_loras=1) as fleet,
        adapter_gateway(tmp_path, fleet, catalog, max_loras=1, max_cpu_loras=1) as (url, _),
    ):
        assert (await post_chat(http, url, "acme", "pin"))[0] == 200
        status, body = await post_chat(http, url, "acme", "x")
    assert status == 503
    assert body["error"]["code"] == "no_adapter_slot"


async def test_adapter_the_engine_lost_is_loaded_again_before_answering(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    async with (
        start_sim_fleet(1, kv_events=None, kv_replay=None, speed=1000.0) as fleet,
        adapter_gateway(tmp_path, fleet, [adapter("acme-lora")]) as (url, _),
    ):
        loads = count_engine_loads(fleet.replicas[0])
        assert (await post_chat(http, url, "acme", "acme-lora"))[0] == 200
        # The engine forgets it behind the gateway's back (a restart, an operator).
        async with http.post(
            f"{fleet.urls[0]}/v1/unload_lora_adapter", json={"lora_name": "acme-lora"}
        ) as resp:
            assert resp.status == 200
        status, body = await post_chat(http, url, "acme", "acme-lora")
        assert status == 200, body
        assert loads == ["acme-lora", "acme-lora"]
        assert (
            await metric(http, url, "fleetgate_upstream_retries_total", reason="adapter_missing")
            == 1
        )


async def test_policy_reload_updates_the_catalog(
    tmp_path: Path, fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    async with adapter_gateway(tmp_path, fleet, [adapter("acme-lora")]) as (url, _):
        async with http.post(f"{url}/admin/adapters", json=adapter("later"), headers=ADMIN) as r:
            assert r.status == 201
        assert (await post_chat(http, url, "globex", "globex-lora"))[0] == 404
        policy = tmp_path / "gateway.yaml"
        catalog = [adapter("acme-lora"), adapter("globex-lora", "globex"), adapter("later")]
        policy.write_text(policy_yaml(fleet.urls, catalog))
        async with http.post(f"{url}/admin/policy/reload", headers=ADMIN) as resp:
            assert resp.status == 200, await resp.text()
        status, body = await post_chat(http, url, "globex", "globex-lora")
        assert status == 200, body
        async with http.get(f"{url}/admin/adapters", headers=ADMIN) as resp:
            entries = {a["name"]: a for a in (await resp.json())["adapters"]}
        assert not entries["later"]["runtime"]  # the file now defines it: the file's entry wins


async def test_fleetgate_up_demo_adapters(http: aiohttp.ClientSession) -> None:
    async with embedded_stack(2, sim_speed=1000.0, adapters=2, admin_key="k") as stack:
        assert stack.adapters == ["demo-lora-0", "demo-lora-1"]
        shown = banner(stack, "k")
        assert '"model": "demo-lora-0"' in shown
        async with http.get(f"{stack.url}/v1/models") as resp:
            parents = {m["id"]: m["parent"] for m in (await resp.json())["data"]}
        assert parents == {
            stack.model: None,
            "demo-lora-0": stack.model,
            "demo-lora-1": stack.model,
        }
        body = {"model": "demo-lora-0", "messages": [{"role": "user", "content": "Hello!"}]}
        async with http.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
        loaded = [await served_adapters(http, u) for u in stack.replica_urls]
        assert sorted(loaded) == [[], ["demo-lora-0"]]


async def _roots(http: aiohttp.ClientSession, engine_url: str) -> dict[str, str]:
    """Adapter name -> the source it was loaded from, as the (simulated) vLLM lists them."""
    async with http.get(f"{engine_url}/v1/models") as resp:
        body = await resp.json()
    return {m["id"]: m["root"] for m in body["data"] if m.get("parent")}


async def test_new_weights_under_an_old_name_are_never_served_from_the_old_source(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """vLLM loads by name (and answers a second load of a loaded name 'already loaded'): an
    adapter replaced with another source, at runtime or by a policy reload, is unloaded from
    the replicas that hold it, so that the next request loads the new weights. Otherwise the
    new owner would be served the old owner's fine-tune."""
    async with (
        start_sim_fleet(1, kv_events=None, kv_replay=None, speed=1000.0) as fleet,
        adapter_gateway(tmp_path, fleet, [adapter("acme-lora")]) as (url, _),
    ):
        engine = fleet.urls[0]
        async with http.post(f"{url}/admin/adapters", json=adapter("x"), headers=ADMIN) as r:
            assert r.status == 201
        assert (await post_chat(http, url, "acme", "x"))[0] == 200
        assert (await _roots(http, engine))["x"] == "/adapters/acme/x"
        replaced = adapter("x", "globex")  # /adapters/globex/x, owned by globex
        async with http.post(
            f"{url}/admin/adapters?replace=true", json=replaced, headers=ADMIN
        ) as r:
            assert r.status == 201 and (await r.json())["unload_failures"] == []
        assert "x" not in await _roots(http, engine)
        assert (await post_chat(http, url, "globex", "x"))[0] == 200
        assert (await _roots(http, engine))["x"] == "/adapters/globex/x"
        # A policy reload that points a file adapter at other weights does the same.
        assert (await post_chat(http, url, "acme", "acme-lora"))[0] == 200
        moved = adapter("acme-lora", source="/adapters/acme/acme-lora-v2")
        (tmp_path / "gateway.yaml").write_text(policy_yaml(fleet.urls, [moved]))
        async with http.post(f"{url}/admin/policy/reload", headers=ADMIN) as resp:
            assert resp.status == 200, await resp.text()

        async def unloaded() -> bool:
            return "acme-lora" not in await _roots(http, engine)

        await wait_until(unloaded, "the old acme-lora weights to be unloaded")
        assert (await post_chat(http, url, "acme", "acme-lora"))[0] == 200
        assert (await _roots(http, engine))["acme-lora"] == "/adapters/acme/acme-lora-v2"


async def test_a_404_that_is_not_about_the_adapter_is_relayed_without_reloading_it(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """Only vLLM's 'The model `x` does not exist' means the engine lost the adapter; a path the
    engine does not serve (here /classify on a generative model) is answered as it is."""
    async with (
        start_sim_fleet(1, kv_events=None, kv_replay=None, speed=1000.0) as fleet,
        adapter_gateway(tmp_path, fleet, [adapter("acme-lora")]) as (url, _),
    ):
        loads = count_engine_loads(fleet.replicas[0])
        body = {"model": "acme-lora", "input": "hello"}
        async with http.post(f"{url}/classify", json=body, headers=auth("acme")) as resp:
            assert resp.status == 404
        assert loads == ["acme-lora"]  # loaded once to send it, never again for the 404
        retries = await metric(
            http, url, "fleetgate_upstream_retries_total", reason="adapter_missing"
        )
        assert retries == 0


async def test_a_replica_that_leaves_the_fleet_leaves_no_adapter_gauges_behind(
    tmp_path: Path, fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    async with adapter_gateway(tmp_path, fleet, [adapter("acme-lora")]) as (url, _):
        assert (await post_chat(http, url, "acme", "acme-lora"))[0] == 200

        async def slot_gauges() -> set[str]:
            async with http.get(f"{url}/metrics") as resp:
                text = await resp.text()
            return {
                line.split('replica="', 1)[1].split('"', 1)[0]
                for line in text.splitlines()
                if line.startswith("fleetgate_adapter_slots_used{")
            }

        assert await slot_gauges() == {"pool-a/0", "pool-a/1"}
        # A reload takes the second replica out of the pool.
        (tmp_path / "gateway.yaml").write_text(
            policy_yaml(fleet.urls[:1], [adapter("acme-lora")])
        )
        async with http.post(f"{url}/admin/policy/reload", headers=ADMIN) as resp:
            assert resp.status == 200, await resp.text()

        async def forgotten() -> bool:
            return await slot_gauges() == {"pool-a/0"}

        await wait_until(forgotten, "the departed replica's adapter gauges to go")


async def test_an_adapter_whose_only_replica_is_down_gets_the_fleets_503_and_opens_the_circuit(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """The live adapter review: the adapter got 502 ``adapter_load_failed`` (no Retry-After)
    while its base model got 503 ``no_healthy_replica``, and a failed load never counted on the
    replica's circuit, so every adapter request tried the dead engine again. Nothing refused the
    load: the engine is down, and the answer is the same as for the base model."""
    down = SimpleNamespace(urls=["http://127.0.0.1:9"])  # discard port: connection refused
    async with adapter_gateway(tmp_path, down, [adapter("acme-lora")]) as (url, gw):  # type: ignore[arg-type]
        for _ in range(6):
            async with http.post(
                f"{url}/v1/chat/completions",
                json={"model": "acme-lora", "messages": [{"role": "user", "content": "hi"}]},
                headers=auth("acme"),
            ) as resp:
                body = await resp.json()
                assert resp.status == 503, body
                assert body["error"]["code"] == "no_healthy_replica"
                assert resp.headers["Retry-After"] == "1"
        failed = await metric(http, url, "fleetgate_adapter_loads_total", outcome="failed")
        # The circuit opened after its failure threshold: later requests never tried a load.
        assert 1 <= failed < 6
        assert not gw.registry.breaker(gw.registry.all()[0].replica_id).allows()
        # One replica: nothing was ever retried elsewhere (each failure was once counted as a
        # retry all the same).
        assert await metric(http, url, "fleetgate_upstream_retries_total") == 0


async def test_a_reload_that_removes_an_adapter_withdraws_its_traffic_at_once(
    tmp_path: Path, fleet: SimFleet, http: aiohttp.ClientSession
) -> None:
    """The LoRA-reload re-check: the counts a gateway had published for a removed adapter were
    withdrawn only at its next pre-warm round (30 s), and a gateway still on the old policy
    pre-warmed the adapter from them meanwhile."""
    catalog = [adapter("acme-lora"), adapter("gone")]
    async with adapter_gateway(tmp_path, fleet, catalog) as (url, gw):
        registry = gw.adapters
        assert registry is not None
        for _ in range(3):
            assert (await post_chat(http, url, "acme", "gone"))[0] == 200
        await registry.share_traffic()  # a pre-warm round publishes the counts

        async def published() -> int:  # as another gateway reads them
            counts = await registry.store.traffic(0, besides="another-gateway")
            return sum(n for (_, name), n in counts.items() if name == "gone")

        assert await published() == 3
        (tmp_path / "gateway.yaml").write_text(policy_yaml(fleet.urls, [adapter("acme-lora")]))
        async with http.post(f"{url}/admin/policy/reload", headers=ADMIN) as resp:
            assert resp.status == 200, await resp.text()

        async def withdrawn() -> bool:
            return await published() == 0

        await wait_until(withdrawn, "the removed adapter's counts are withdrawn")


async def test_a_replica_without_lora_is_learned_from_its_refusal_and_skipped_for_adapters(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """A pool mixing engines with and without LoRA, whose policy does not say which (no
    ``max_loras: 0``): the first refused load ("LoRA is disabled") marks that replica as having
    no slot, so later cold adapters go straight to the one that can load them (the
    heterogeneous-fleet review: 31 failed loads and retries for 30 adapter requests)."""
    names = [f"pub-{i}" for i in range(6)]
    burst = [f"burst-{i}" for i in range(4)]
    async with (
        start_sim_fleet(
            1, kv_events=None, kv_replay=None, speed=1000.0,
            engine_overrides={"max_loras": 0},
        ) as plain,
        # At real speed: a burst's requests are in flight together there.
        start_sim_fleet(1, kv_events=None, kv_replay=None, speed=1.0) as lora,
    ):
        mixed = SimpleNamespace(urls=[plain.urls[0], lora.urls[0]])
        entries = [adapter(name, owner=None) for name in names + burst]
        async with adapter_gateway(tmp_path, mixed, entries) as (url, gw):  # type: ignore[arg-type]
            for i, name in enumerate(names):  # each adapter cold everywhere when asked for
                status, body = await post_chat(http, url, "acme", name, f"question {i} " * 3)
                assert status == 200, body
                assert (await last_decision(http, url))["served_by"] == "pool-a/1"
            # A burst: the LoRA replica's queue passes the load bound, and each request tried
            # every replica without a slot first (the re-check: 135 attempts for 30 requests).
            answers = await asyncio.gather(*(
                post_chat(http, url, "acme", burst[i % len(burst)], f"burst {i} " * 3)
                for i in range(30)
            ))
            assert [status for status, _ in answers] == [200] * 30
            retries = await metric(http, url, "fleetgate_upstream_retries_total")  # any reason
            plain_state = gw.registry.get("pool-a/0")  # type: ignore[arg-type]
    assert retries <= 1  # at most the load that taught it
    assert plain_state is not None and plain_state.max_loras == 0
