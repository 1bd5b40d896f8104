"""The embedded stack (`fleetgate up`) against real simulated replicas: prefix-aware routing,
the index predicting the engines' cached tokens, and the cache-busting-layout detector."""

from __future__ import annotations

import aiohttp
import pytest

from fleetgate.embedded import embedded_stack
from replica.sim.engine import EngineConfig

SYSTEM_PROMPTS = [
    " ".join(f"{topic} policy clause {i}." for i in range(60))
    for topic in ("billing", "shipping", "privacy")
]


def _metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _run(profile: str, messages_for: list[list[dict[str, str]]]) -> str:
    async with (
        embedded_stack(2, profile=profile, sim_speed=200.0) as stack,
        aiohttp.ClientSession() as http,
    ):
        for messages in messages_for:
            body = {"model": stack.model, "messages": messages, "max_tokens": 4}
            async with http.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
        async with http.get(f"{stack.url}/metrics") as resp:
            return await resp.text()


def _rounds(rounds: int) -> list[list[dict[str, str]]]:
    return [
        [{"role": "system", "content": system}, {"role": "user", "content": f"question {r}"}]
        for r in range(rounds)
        for system in SYSTEM_PROMPTS
    ]


def _hit_rate(metrics: str) -> float:
    prompt = _metric(metrics, "fleetgate_prompt_tokens_total")
    return _metric(metrics, "fleetgate_cached_tokens_total") / prompt


async def test_prefix_aware_routing_beats_round_robin_on_shared_prefixes() -> None:
    requests = _rounds(3)
    aware = await _run("expected-ttft", requests)
    blind = await _run("round-robin", requests)
    assert _hit_rate(aware) > _hit_rate(blind)
    # Every request after the first of its system prompt lands where that prompt is cached.
    assert _metric(aware, "fleetgate_prefix_hit_rate") > 0.5


async def test_index_predicts_engine_cached_tokens() -> None:
    metrics = await _run("expected-ttft", _rounds(2))
    exact = _metric(metrics, "fleetgate_cache_prediction_total", outcome="exact")
    assert exact == len(SYSTEM_PROMPTS) * 2
    predicted = _metric(metrics, "fleetgate_predicted_cached_tokens_total")
    assert predicted == _metric(metrics, "fleetgate_cached_tokens_total") > 0


@pytest.mark.parametrize(("unique_first", "flagged"), [(True, 1.0), (False, 0.0)])
async def test_cache_busting_layout_is_detected(unique_first: bool, flagged: float) -> None:
    shared = SYSTEM_PROMPTS[0]
    requests = []
    for i in range(24):
        stamp = f"request {i} at 2026-11-29T12:{i:02d}:00Z."
        system = f"{stamp} {shared}" if unique_first else f"{shared} {stamp}"
        requests.append([{"role": "system", "content": system}, {"role": "user", "content": "hi"}])
    metrics = await _run("expected-ttft", requests)
    assert _metric(metrics, "fleetgate_cache_busting_layout", route="default") == flagged
    repeat = _metric(metrics, "fleetgate_prefix_repeat_fraction", route="default")
    assert (repeat < 0.1) if unique_first else (repeat > 0.5)


async def test_the_embedded_gateway_starts_from_its_engines_speeds() -> None:
    # As the simulator does: the pools' configured speeds are the sim profile's roofline, not
    # the policy defaults (a 30 ms decode step, a 70B's, charged short decodes at twice the
    # simulator's rate on an 8B).
    async with (
        embedded_stack(2, sim_speed=200.0, admin_key="k") as stack,
        aiohttp.ClientSession() as http,
        http.get(f"{stack.url}/admin/replicas", headers={"Authorization": "Bearer k"}) as resp,
    ):
        assert resp.status == 200
        replicas = (await resp.json())["replicas"]
    profile = EngineConfig.from_profile("h100-llama3-8b")
    assert len(replicas) == 2
    for replica in replicas:
        assert replica["decode_step_ms"] == profile.configured_decode_step_ms
        assert replica["prefill_tokens_per_s"] == profile.configured_prefill_tokens_per_s
        assert replica["kv_capacity_blocks"] == profile.num_gpu_blocks


async def test_admin_replicas_shows_each_replicas_learned_speed_and_context() -> None:
    # What routing believes of each replica, beside the pool's configured speed: without it a
    # wrong configuration or a degraded engine showed only in decision explanations (the
    # heterogeneous-fleet review).
    async with (
        embedded_stack(2, sim_speed=200.0, admin_key="k") as stack,
        aiohttp.ClientSession() as http,
    ):
        for i, system in enumerate(SYSTEM_PROMPTS * 2):  # unique prompts, streamed: timed
            body = {
                "model": stack.model, "max_tokens": 2, "stream": True,
                "messages": [{"role": "system", "content": f"{i} {system}"}],
            }
            async with http.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()
        async with http.get(
            f"{stack.url}/admin/replicas", headers={"Authorization": "Bearer k"}
        ) as resp:
            replicas = (await resp.json())["replicas"]
    profile = EngineConfig.from_profile("h100-llama3-8b")
    learned = [r["calibrated_prefill_tokens_per_s"] for r in replicas]
    assert any(learned), learned  # some replica has had feedback
    for speeds in learned:
        assert all(isinstance(v, int) and v > 0 for v in speeds.values())
    assert all(r["max_model_len"] == profile.model_len for r in replicas)
