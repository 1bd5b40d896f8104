"""fleetgate's vLLM plugin inside a real vLLM CPU engine (see docs/vllm-plugin.md).

The plugin is found through the entry points of fleetgate's distribution installed (``--no-deps``,
editable) in the vLLM venv, exactly as in the production image. These tests start their own
engine (one at a time) with ``FLEETGATE_*`` set, so the session's shared engines stay plugin-free,
and read what the plugin wrote into a private Redis:

* the test kernel plugin (``tests.support.kernel_plugin_example``) was imported, and its
  ``fleetgate_test::scale`` op verified, in every engine process, with its version;
* the stat logger publishes scheduler state at engine-step granularity: running requests, KV
  usage and running adapters while a request streams, and the idle state afterwards;
* a kernel plugin that fails to import aborts the engine (strict default) and Redis says why.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from replica.launcher import EngineExited, EngineSpec, VllmEngine
from replica.tiny_model import TinyModel
from replica.vllm_env import REPO_ROOT
from replica.vllm_plugin.general import STARTUP_TTL_S
from replica.vllm_plugin.keys import PluginKeys
from tests.e2e.conftest import ENGINE_START_TIMEOUT_S, SERVED_MODEL
from tests.support.redis_server import RedisServer

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

KERNEL_PLUGIN = "tests.support.kernel_plugin_example"
KERNEL_PLUGIN_FILE = REPO_ROOT / "tests" / "support" / "kernel_plugin_example" / "__init__.py"
ADAPTER = "tiny-lora-0"
REPLICA_ID = "plugin-r0"
STATE_TTL_S = 10
#: What a repair looks like when the vLLM venv lacks the plugin (or the redis client).
PLUGIN_INSTALL_COMMAND = (
    ".venv-vllm/bin/pip install --no-deps -e . && .venv-vllm/bin/pip install redis==8.1.0"
)


def declared_version(path: Path) -> str:
    """The ``__version__`` the test kernel plugin declares (read from source: no torch here)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets
        ):
            return str(ast.literal_eval(node.value))
    raise AssertionError(f"{path} declares no __version__")


def wait_for(predicate: Callable[[], Any], what: str, timeout_s: float = 60.0) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.05)


def decoded(mapping: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in mapping.items()}


@pytest.fixture(scope="module")
def plugin_installed(vllm_python: Path) -> Path:
    """The vLLM venv sees fleetgate's two entry points and has a redis client; else FAIL."""
    probe = subprocess.run(
        [str(vllm_python), "-c",
         "import json, redis; from importlib.metadata import entry_points as e; print(json.dumps("
         "{g: sorted(p.value for p in e(group=g)) for g in "
         "('vllm.general_plugins', 'vllm.stat_logger_plugins')}))"],
        cwd="/", capture_output=True, text=True, timeout=120, check=False,
    )
    if probe.returncode != 0:
        pytest.fail(f"the vLLM venv cannot import redis: {probe.stderr.strip()[-500:]}\n"
                    f"Repair it with: {PLUGIN_INSTALL_COMMAND}", pytrace=False)
    groups = json.loads(probe.stdout.strip().splitlines()[-1])
    if ("replica.vllm_plugin.general:register" not in groups["vllm.general_plugins"]
            or "replica.vllm_plugin.vllm_logger:FleetgateStatLogger"
            not in groups["vllm.stat_logger_plugins"]):
        pytest.fail(f"fleetgate's vLLM plugin is not installed in the vLLM venv ({groups}).\n"
                    f"Install it with: {PLUGIN_INSTALL_COMMAND}", pytrace=False)
    return vllm_python


@pytest.fixture(scope="module")
def redis_srv() -> Iterator[RedisServer]:
    """A private redis-server for this module's engines."""
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()


def plugin_env(redis_url: str, replica_id: str, kernel_plugins: str) -> dict[str, str]:
    return {
        "FLEETGATE_REDIS_URL": redis_url,
        "FLEETGATE_REPLICA_ID": replica_id,
        "FLEETGATE_KEY_PREFIX": "fgtest:",
        "FLEETGATE_KERNEL_PLUGINS": kernel_plugins,
        "FLEETGATE_ENGINE_STATE_TTL_S": str(STATE_TTL_S),
        # The test kernel plugin lives in the repository's tests package, not in a wheel.
        "PYTHONPATH": str(REPO_ROOT),
    }


def test_a_failing_kernel_plugin_aborts_the_engine_and_redis_says_why(
    plugin_installed: Path, tiny_model: TinyModel, redis_srv: RedisServer,
    tmp_path: Path,
) -> None:
    # Runs first (file order) and dies during argument handling, before any model is loaded:
    # never two engines of this module at once.
    missing = "tests.support.no_such_kernel_plugin"
    # The same replica id as the healthy engine below: that one is this replica restarted with
    # a fixed plugin list, and must not keep showing this incarnation's error.
    env = plugin_env(redis_srv.url, REPLICA_ID, f"{KERNEL_PLUGIN},{missing}")
    engine = VllmEngine(
        EngineSpec(model=tiny_model.model_dir, served_model_name=SERVED_MODEL,
                   enable_lora=False, extra_env=env),
        log_path=tmp_path / "engine-broken.log", python=plugin_installed,
    )
    try:
        engine.start()
        with pytest.raises(EngineExited):
            engine.wait_healthy(ENGINE_START_TIMEOUT_S)
    finally:
        engine.stop()
    assert engine.poll() not in (None, 0)
    log = engine.log_path.read_text(errors="replace")
    assert "KernelPluginError" in log and missing in log
    assert "FLEETGATE_KERNEL_PLUGINS_STRICT=0" in log

    keys = PluginKeys("fgtest:", REPLICA_ID)
    client = redis.Redis.from_url(redis_srv.url)
    errors = decoded(client.hgetall(keys.kernel_errors))
    print(f"\nkernel_errors after the aborted start: {errors}")
    assert list(errors) == [missing]
    assert errors[missing].startswith("MainProcess: ModuleNotFoundError")
    # The plugin that did load is listed too, and the record outlives the dead engine.
    assert decoded(client.hgetall(keys.kernels)) == {
        KERNEL_PLUGIN: declared_version(KERNEL_PLUGIN_FILE)}
    assert client.pttl(keys.kernel_errors) > STATE_TTL_S * 1000
    assert client.pttl(keys.kernel_errors) <= STARTUP_TTL_S * 1000


@dataclass
class PluginEngine:
    engine: VllmEngine
    redis: redis.Redis
    keys: PluginKeys

    def state(self) -> dict[str, str]:
        return decoded(self.redis.hgetall(self.keys.engine()))


@pytest.fixture(scope="module")
def plugin_engine(
    plugin_installed: Path, tiny_model: TinyModel, redis_srv: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[PluginEngine]:
    """One real engine with the plugin on and the test kernel plugin listed."""
    engine = VllmEngine(
        EngineSpec(model=tiny_model.model_dir, served_model_name=SERVED_MODEL,
                   extra_env=plugin_env(redis_srv.url, REPLICA_ID, KERNEL_PLUGIN)),
        log_path=tmp_path_factory.mktemp("vllm-plugin") / "engine.log",
        python=plugin_installed,
    )
    try:
        engine.start()
        engine.wait_healthy(ENGINE_START_TIMEOUT_S)
        yield PluginEngine(engine, redis.Redis.from_url(redis_srv.url),
                           PluginKeys("fgtest:", REPLICA_ID))
    finally:
        engine.stop()


def test_kernel_plugin_is_loaded_in_every_engine_process(plugin_engine: PluginEngine) -> None:
    client, keys = plugin_engine.redis, plugin_engine.keys
    version = declared_version(KERNEL_PLUGIN_FILE)
    # The engine hash is written with (or after) the stat logger's first write, which
    # rebuilds the kernel keys from the live processes.
    wait_for(plugin_engine.state, "the engine hash")
    assert decoded(client.hgetall(keys.kernels)) == {KERNEL_PLUGIN: version}
    assert client.hgetall(keys.kernel_errors) == {}
    procs = {int(pid): json.loads(raw) for pid, raw in client.hgetall(keys.kernel_procs).items()}
    names = sorted(p["process"] for p in procs.values())
    print(f"\nkernels: {decoded(client.hgetall(keys.kernels))}\n"
          f"kernel_procs: {json.dumps(procs, sort_keys=True)}")
    # The API server (the engine's own pid), the EngineCore and its worker each registered the
    # op themselves: registrations do not cross process boundaries. Nothing else is listed (the
    # aborted incarnation of this replica id, if that test ran, was dropped).
    assert len(procs) == 3, names
    assert procs[plugin_engine.engine.pid]["process"] == "MainProcess"
    assert "EngineCore" in names and any("Worker" in n for n in names), names
    for report in procs.values():
        assert report["loaded"] == {KERNEL_PLUGIN: version}
        assert report["ops"] == {KERNEL_PLUGIN: ["fleetgate_test::scale"]}
    log = plugin_engine.engine.log_path.read_text(errors="replace")
    assert log.count("fleetgate: kernel plugins in") >= len(procs)
    assert f"{KERNEL_PLUGIN}=={version}" in log
    for key in keys.kernel_keys()[::2]:  # kernels, kernel_procs (kernel_errors is empty)
        assert 0 < client.pttl(key) <= STATE_TTL_S * 1000


def test_idle_engine_state_is_published_before_any_request(
    plugin_engine: PluginEngine,
) -> None:
    state = wait_for(plugin_engine.state, "the engine hash")
    print(f"\nidle engine state: {state}")
    assert state["pid"] == str(plugin_engine.engine.pid)  # written from the API server process
    assert state["served_model_name"] == SERVED_MODEL
    assert state["block_size"] == "32" and int(state["num_gpu_blocks"]) > 0
    assert state["max_loras"] == "2"
    assert (state["running"], state["waiting"]) == ("0", "0")
    assert 0 < plugin_engine.redis.pttl(plugin_engine.keys.engine()) <= STATE_TTL_S * 1000


class EngineWrites:
    """Every snapshot the plugin writes to the engine hash, as Redis executes it (MONITOR).

    A test that reads the hash when a stream chunk arrives sees nothing while the engine runs if
    the API server, starved of CPU, flushes the stream's chunks only after the last step (it
    failed that way on a loaded machine). Redis's own command feed has every write in order,
    whenever the client gets to read it.
    """

    #: One argument of a MONITOR line: a double-quoted string with backslash escapes.
    _ARG = re.compile(r'"((?:[^"\\]|\\.)*)"')

    def __init__(self, plugin_engine: PluginEngine) -> None:
        self._connection = plugin_engine.redis.connection_pool.connection_kwargs
        self._key = plugin_engine.keys.engine()
        self.snapshots: list[dict[str, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="monitor", daemon=True)

    def __enter__(self) -> EngineWrites:
        self._thread.start()
        if not self._ready.wait(30):
            raise AssertionError("timed out after 30s waiting for MONITOR to start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._client().ping()  # a command for the feed to show: the reader wakes and sees stop
        self._thread.join(10)

    def _client(self, socket_timeout: float | None = 5.0) -> redis.Redis:
        kwargs = self._connection
        return redis.Redis(host=kwargs.get("host", "localhost"), port=kwargs.get("port", 6379),
                           socket_timeout=socket_timeout)

    def _run(self) -> None:
        # No socket timeout: a timed-out read drops the connection, and MONITOR with it. It must
        # be said: redis-py 8 reads with a 5 s timeout by default, and a quiet 5 s on a loaded
        # machine killed this thread, after which the test waited 60 s for snapshots in vain.
        with self._client(socket_timeout=None).monitor() as monitor:
            self._ready.set()
            while not self._stop.is_set():
                line = monitor.connection.read_response()
                if isinstance(line, bytes):
                    line = line.decode(errors="replace")
                self._take(str(line))

    def _take(self, line: str) -> None:
        args = [re.sub(r"\\(.)", r"\1", arg) for arg in self._ARG.findall(line)]
        if len(args) >= 4 and args[0].upper() == "HSET" and args[1] == self._key:
            with self._lock:
                merged = dict(self.snapshots[-1]) if self.snapshots else {}
                merged.update(zip(args[2::2], args[3::2], strict=False))
                self.snapshots.append(merged)

    def seen(self) -> list[dict[str, str]]:
        with self._lock:
            return list(self.snapshots)


def stream_and_watch(
    plugin_engine: PluginEngine, model: str, max_tokens: int = 1500
) -> list[dict[str, str]]:
    """Stream one long completion; return every snapshot the plugin wrote from its start until
    the idle one after it (the publisher's trailing write)."""
    body = {"model": model, "prompt": "the fleet of replicas routes every request " * 8,
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    with EngineWrites(plugin_engine) as writes:
        with httpx.Client(base_url=plugin_engine.engine.url, timeout=120) as http, \
                http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200, response.read()
            for _ in response.iter_lines():
                pass
        # Engine idle by its own count with every step of this request counted: the trailing
        # write, written at most one publish interval after the last step.
        wait_for(
            lambda: any(
                s.get("running") == "0" and any(b.get("running") != "0" for b in writes.seen())
                for s in writes.seen()[-1:]
            ),
            "the plugin's idle snapshot after a busy one",
        )
        return writes.seen()


def test_engine_steps_are_published_while_a_request_runs(plugin_engine: PluginEngine) -> None:
    before = wait_for(plugin_engine.state, "the engine hash")
    during = stream_and_watch(plugin_engine, SERVED_MODEL)
    busy = [s for s in during if s["running"] == "1"]
    print(f"\n{len(during)} snapshots written during the request; first busy one: {busy[:1]}")
    assert busy, f"no snapshot with running=1 was written during the stream: {during}"
    assert any(float(s["kv_usage"]) > 0 for s in busy)
    # Each step is folded in, not sampled: the idle snapshot after the request counts all of its
    # 1,500 steps (one per token), however few snapshots the throttled publisher wrote while it
    # ran (a CPU-starved API server handles a request's outputs in one burst: one busy write).
    after = during[-1]
    assert after["running"] == "0"
    assert int(after["steps"]) >= int(before["steps"]) + 1500
    assert int(after["prefix_cache_queries_total"]) > int(before["prefix_cache_queries_total"])
    assert float(after["metrics_read_at"]) > float(before["metrics_read_at"])


def test_running_adapter_is_published(plugin_engine: PluginEngine, tiny_model: TinyModel) -> None:
    loaded = httpx.post(
        f"{plugin_engine.engine.url}/v1/load_lora_adapter",
        json={"lora_name": ADAPTER, "lora_path": str(tiny_model.adapters[ADAPTER])},
        timeout=120,
    )
    assert loaded.status_code == 200, loaded.text
    during = stream_and_watch(plugin_engine, ADAPTER, max_tokens=300)
    with_adapter = [s for s in during if json.loads(s["running_adapters"]).get(ADAPTER) == 1]
    print(f"\nfirst state with the adapter running: {with_adapter[:1]}")
    assert with_adapter, f"never saw {ADAPTER} running: {during}"
    idle = wait_for(
        lambda: (s := plugin_engine.state())["running"] == "0" and s, "idle after the adapter"
    )
    assert json.loads(idle["running_adapters"]) == {}
