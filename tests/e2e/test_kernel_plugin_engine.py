"""fleetgate's own Triton kernel (``replica.kernels``) inside a real vLLM CPU engine.

A plain engine (no kernel plugin) answers a few greedy prompts first and stops; then one engine
is started with ``FLEETGATE_KERNEL_PLUGINS=replica.kernels.vllm_plugin`` and
``TRITON_INTERPRET=1`` (Triton has no CPU backend; its interpreter runs the same kernel source on
CPU tensors). One engine of this module runs at a time. The tests show, in order:

* the plugin loaded, with its ops verified, in every engine process, and Redis says so;
* the engine's model really called the kernel: the call counters the ops keep (written per
  process to ``FLEETGATE_KERNEL_TRACE_DIR``) grow by one RMSNorm and ``2 x layers`` fused
  add+RMSNorm calls per forward pass, in the worker process that runs the model;
* greedy completions are identical to the engine without the plugin. The bf16 kernel performs
  vLLM's native roundings (replica/kernels/reference.py), so outputs differ at most by rare
  one-ulp flips, too small to change an argmax on these prompts;
* the replica's agent publishes the kernel and its version, ``/admin/replicas`` shows it, and a
  route whose profile has a ``requires-kernels`` filter sends every request to that replica
  and none to a replica without it (a simulated one: it only has to be a healthy candidate).
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from gateway.app import create_app
from gateway.config import GatewayConfig
from replica.agent import AgentConfig, ReplicaAgent
from replica.fleet_store import RedisFleetStore
from replica.kernels import __version__ as KERNEL_VERSION
from replica.launcher import EngineSpec, VllmEngine
from replica.sim.fleet import start_sim_fleet
from replica.tiny_model import NUM_LAYERS, TinyModel
from replica.vllm_plugin.keys import PluginKeys
from tests.e2e.conftest import ENGINE_START_TIMEOUT_S, SERVED_MODEL
from tests.e2e.e2e_support import bounded, eventually
from tests.integration.test_gateway_support import serve
from tests.support.redis_server import RedisServer

# Two engine start-ups in sequence (plus a slow interpreted kernel) inside the first test's
# fixtures: more than the suite's default 300 s on a loaded 2-core machine.
pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.timeout(900)]

PLUGIN = "replica.kernels.vllm_plugin"
OPS = ["fleetgate::rms_norm", "fleetgate::fused_add_rms_norm"]
PREFIX = "fgk:"
KERNEL_REPLICA = "kernels-r0"
PLAIN_REPLICA = "plain-r0"
ADMIN = {"Authorization": "Bearer kernels-admin"}
PROMPTS = (
    "the fleet of replicas routes every request",
    "Morning river mountain forest",
    "system prompt user assistant answer question document retrieval context window memory",
    "a",
)
MAX_TOKENS = 12
#: vLLM turns custom ops off by default whenever its compile backend is Inductor, the CPU
#: platform's default even when LoRA then runs the model eagerly: switch RMSNorm's on in both
#: engines, so that the kernel plugin is the only difference between them.
ENGINE_ARGS = ("--compilation-config", '{"custom_ops": ["+rms_norm"]}')


@pytest.fixture(scope="module")
def redis_srv() -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernel-trace")


@pytest.fixture(scope="module")
def baseline(
    vllm_python: Path, tiny_model: TinyModel, tmp_path_factory: pytest.TempPathFactory,
) -> list[tuple[str, list[str]]]:
    """Greedy completions of ``PROMPTS`` by an engine without any kernel plugin."""
    engine = VllmEngine(
        EngineSpec(model=tiny_model.model_dir, served_model_name=SERVED_MODEL,
                   extra_args=ENGINE_ARGS),
        log_path=tmp_path_factory.mktemp("plain-engine") / "engine.log", python=vllm_python,
    )
    try:
        engine.start()
        engine.wait_healthy(ENGINE_START_TIMEOUT_S)
        return [complete(engine.url, p) for p in PROMPTS]
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def kernel_engine(
    baseline: list[tuple[str, list[str]]],
    vllm_python: Path, tiny_model: TinyModel, redis_srv: RedisServer, trace_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[VllmEngine]:
    """A real engine running fleetgate's kernel plugin (through Triton's interpreter).

    Depends on ``baseline`` so that the plain engine has stopped before this one starts.
    """
    probe = subprocess.run(
        [str(vllm_python), "-c", f"import redis, {PLUGIN.rsplit('.', 1)[0]}"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    if probe.returncode != 0:
        pytest.fail(f"the vLLM venv cannot import fleetgate's kernels: {probe.stderr[-500:]}\n"
                    "Install with: .venv-vllm/bin/pip install --no-deps -e .", pytrace=False)
    env = {
        "FLEETGATE_REDIS_URL": redis_srv.url,
        "FLEETGATE_REPLICA_ID": KERNEL_REPLICA,
        "FLEETGATE_KEY_PREFIX": PREFIX,
        "FLEETGATE_KERNEL_PLUGINS": PLUGIN,
        "FLEETGATE_KERNEL_TRACE_DIR": str(trace_dir),
        "TRITON_INTERPRET": "1",
    }
    engine = VllmEngine(
        EngineSpec(model=tiny_model.model_dir, served_model_name=SERVED_MODEL,
                   extra_args=ENGINE_ARGS, extra_env=env),
        log_path=tmp_path_factory.mktemp("kernel-engine") / "engine.log", python=vllm_python,
    )
    try:
        engine.start()
        engine.wait_healthy(ENGINE_START_TIMEOUT_S)
        yield engine
    finally:
        engine.stop()


def wait_for(predicate: Callable[[], Any], what: str, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (result := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.1)
    return result


def traces(trace_dir: Path) -> dict[int, dict[str, Any]]:
    """pid -> what that engine process's kernel ops counted (only processes that called one)."""
    return {int(p.stem): json.loads(p.read_text()) for p in trace_dir.glob("*.json")}


def calls(trace: dict[int, dict[str, Any]], op: str) -> int:
    return sum(t["ops"].get(op, {}).get("calls", 0) for t in trace.values())


def complete(url: str, prompt: str) -> tuple[str, list[str]]:
    """A greedy completion of exactly ``MAX_TOKENS`` tokens: its text and its tokens."""
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "logprobs": 1}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["text"], choice["logprobs"]["tokens"]


def test_the_kernel_plugin_loads_in_every_engine_process(
    kernel_engine: VllmEngine, redis_srv: RedisServer,
) -> None:
    client = redis.Redis.from_url(redis_srv.url, decode_responses=True)
    keys = PluginKeys(PREFIX, KERNEL_REPLICA)
    wait_for(lambda: client.hgetall(keys.engine()), "the engine hash (stat logger running)")
    assert client.hgetall(keys.kernels) == {PLUGIN: KERNEL_VERSION}
    assert client.hgetall(keys.kernel_errors) == {}
    procs = [json.loads(raw) for raw in client.hgetall(keys.kernel_procs).values()]
    print(f"\nkernel_procs: {json.dumps(procs, sort_keys=True)}")
    assert len(procs) == 3, procs  # API server, EngineCore, worker
    for report in procs:
        assert report["loaded"] == {PLUGIN: KERNEL_VERSION}
        assert report["ops"] == {PLUGIN: OPS}


def test_the_engine_runs_the_triton_kernel_and_answers_as_an_engine_without_it(
    kernel_engine: VllmEngine, baseline: list[tuple[str, list[str]]], trace_dir: Path,
) -> None:
    before = traces(trace_dir)
    with_kernel = [complete(kernel_engine.url, p) for p in PROMPTS]
    after = traces(trace_dir)

    print(f"\nkernel call counters before the requests: {json.dumps(before, sort_keys=True)}"
          f"\nafter {len(PROMPTS)} x {MAX_TOKENS} tokens: {json.dumps(after, sort_keys=True)}")
    # Only the process that runs the model calls the kernel: not the API server.
    assert after and kernel_engine.pid not in after
    assert all("Worker" in t["process"] and t["version"] == KERNEL_VERSION
               for t in after.values()), after
    norms = calls(after, "rms_norm") - calls(before, "rms_norm")
    fused = calls(after, "fused_add_rms_norm") - calls(before, "fused_add_rms_norm")
    # One forward pass per generated token (the prefill makes the first). Each pass normalises
    # once without a residual (layer 0's input norm) and 2 x layers - 1 + 1 (final norm) times
    # with one: both counters move, in that ratio, or the layers are not ours.
    assert norms >= len(PROMPTS) * MAX_TOKENS, (norms, fused)
    assert fused == 2 * NUM_LAYERS * norms, (norms, fused)

    for prompt, got, want in zip(PROMPTS, with_kernel, baseline, strict=True):
        assert got == want, f"{prompt!r}: with the kernel {got!r}, without {want!r}"


POLICY = """
version: 1
replica_pools:
  - name: cpu
    discovery: {{redis_url: "{redis_url}", key_prefix: "{prefix}"}}
    block_size: 32
models:
  - name: {model}
    tokenizer: {{kind: local, path: "{tokenizer}"}}
    pools: [cpu]
plugins:
  - type: requires-kernels
    name: fused-norm
    parameters: {{kernels: ["{plugin}=={version}"]}}
profiles:
  - name: on-fleetgate-kernels
    filters: [fused-norm]
    picker: least-loaded
routes:
  - name: main
    match: {{path_prefix: /v1/}}
    profile: on-fleetgate-kernels
"""


async def test_agent_reports_the_kernel_and_routing_can_require_it(
    kernel_engine: VllmEngine, redis_srv: RedisServer, tiny_model: TinyModel, tmp_path: Path,
) -> None:
    def agent(rid: str, url: str) -> ReplicaAgent:
        return ReplicaAgent(AgentConfig(
            replica_id=rid, engine_url=url, pool="cpu", model=SERVED_MODEL,
            fleet_url=redis_srv.url, fleet_key_prefix=PREFIX, listen_port=None,
            heartbeat_ttl_s=10.0,
        ))

    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(
        redis_url=redis_srv.url, prefix=PREFIX, model=SERVED_MODEL, plugin=PLUGIN,
        version=KERNEL_VERSION, tokenizer=tiny_model.model_dir,
    ))
    config = GatewayConfig(policy_path=str(policy), policy_poll_s=0,
                           admin_key=ADMIN["Authorization"].split()[1])
    fleet = RedisFleetStore(redis_srv.url, key_prefix=PREFIX)
    plain = start_sim_fleet(1, model=SERVED_MODEL, kv_events=None, kv_replay=None,
                            block_size=32, speed=100, tokenizer_dir=str(tiny_model.model_dir))
    async with (plain as sim,
                bounded(agent(KERNEL_REPLICA, kernel_engine.url), "stopping agent 0"),
                bounded(agent(PLAIN_REPLICA, sim.urls[0]), "stopping agent 1"),
                bounded(serve(create_app(config), handler_cancellation=True), "the gateway")
                as url,
                httpx.AsyncClient(base_url=url, timeout=300) as http):

        async def published() -> bool:
            states = {s.replica_id: s for s in await fleet.list_replicas()}
            return (set(states) == {KERNEL_REPLICA, PLAIN_REPLICA}
                    and states[KERNEL_REPLICA].kernel_plugins == {PLUGIN: KERNEL_VERSION})

        await eventually(published, "the agents publish both replicas, with the kernel")

        async def view() -> dict[str, dict[str, Any]]:
            resp = await http.get("/admin/replicas", headers=ADMIN)
            assert resp.status_code == 200, resp.text
            return {r["replica_id"]: r for r in resp.json()["replicas"]}

        async def both_routable() -> bool:
            v = await view()
            return all(rid in v and v[rid]["healthy"] for rid in (KERNEL_REPLICA, PLAIN_REPLICA))

        await eventually(both_routable, "the gateway sees both replicas healthy")
        replicas = await view()
        print(f"\n/admin/replicas kernel_plugins: "
              f"{ {rid: r['kernel_plugins'] for rid, r in replicas.items()} }")
        assert replicas[KERNEL_REPLICA]["kernel_plugins"] == {PLUGIN: KERNEL_VERSION}
        assert replicas[PLAIN_REPLICA]["kernel_plugins"] == {}

        for prompt in PROMPTS:
            body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
            resp = await http.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
        resp = await http.get("/admin/decisions?n=100", headers=ADMIN)
        decisions = resp.json()["decisions"]
        assert len(decisions) == len(PROMPTS)
        for decision in decisions:
            assert decision["replica"] == KERNEL_REPLICA, decision
            assert decision["explanations"][PLAIN_REPLICA]["filtered_out_by"] == "fused-norm"
    await fleet.close()
