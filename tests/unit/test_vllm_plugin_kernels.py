"""The kernel-plugin hook and the stat logger's wiring, without vLLM, torch or a Redis server."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from importlib.metadata import version as dist_version
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from replica.vllm_plugin import general
from replica.vllm_plugin.config import PluginConfig
from replica.vllm_plugin.kernels import (
    UNKNOWN_VERSION,
    KernelLoadReport,
    KernelPluginError,
    aggregate_reports,
    current_report,
    load_kernel_plugins,
    module_version,
    pid_alive,
    set_current_report,
)
from replica.vllm_plugin.keys import PluginKeys
from replica.vllm_plugin.log import LOGGER_NAME
from replica.vllm_plugin.redis_store import RedisStateStore
from replica.vllm_plugin.state_logger import EngineStateLogger


def module(name: str, **attrs: Any) -> ModuleType:
    mod = ModuleType(name)
    for key, value in attrs.items():
        setattr(mod, key, value)
    return mod


def importer_of(*mods: ModuleType) -> Any:
    table = {m.__name__: m for m in mods}

    def load(name: str) -> ModuleType:
        if name not in table:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return table[name]

    return load


@pytest.fixture(autouse=True)
def _no_leftover_report() -> Iterator[None]:
    set_current_report(None)
    yield
    set_current_report(None)


# -- loading -----------------------------------------------------------------------------------

def test_versions_ops_and_failures_are_reported_per_module() -> None:
    good = module("acme_kernels", __version__="1.4.0", FLEETGATE_OPS=("acme::fused_rms",))
    errors: list[str] = []
    report = load_kernel_plugins(
        ["acme_kernels", "missing_kernels"],
        importer=importer_of(good),
        on_error=lambda name, exc: errors.append(name),
        op_exists=lambda ns, name: (ns, name) == ("acme", "fused_rms"),
    )
    assert report.loaded == {"acme_kernels": "1.4.0"}
    assert report.ops == {"acme_kernels": ["acme::fused_rms"]}
    assert report.failed["missing_kernels"].startswith("ModuleNotFoundError: No module named")
    assert errors == ["missing_kernels"]
    summary = report.summary()
    assert "acme_kernels==1.4.0" in summary and "FAILED missing_kernels" in summary


def test_a_declared_op_that_is_not_registered_is_a_failure() -> None:
    liar = module("liar", __version__="0.1", FLEETGATE_OPS=("acme::ghost", "malformed"))
    report = load_kernel_plugins(["liar"], importer=importer_of(liar),
                                 op_exists=lambda ns, name: False)
    assert report.loaded == {}
    assert "acme::ghost" in report.failed["liar"] and "malformed" in report.failed["liar"]


def test_the_error_points_into_the_plugin_not_the_import_machinery(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plugin = tmp_path / "fg_unit_broken_kernels.py"
    plugin.write_text('"""A plugin whose extension is missing."""\n'
                      'raise OSError("libacme.so: cannot open shared object file")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    report = load_kernel_plugins(["fg_unit_broken_kernels", "fg_unit_absent_kernels"])
    assert report.failed["fg_unit_broken_kernels"] == (
        f"OSError: libacme.so: cannot open shared object file at {plugin}:2")
    assert report.failed["fg_unit_absent_kernels"] == (
        "ModuleNotFoundError: No module named 'fg_unit_absent_kernels'")


def test_version_falls_back_to_the_distribution_then_unknown() -> None:
    # xxhash (a fleetgate dependency) is installed; a module of that name without __version__
    # must get the distribution's version from package metadata.
    assert module_version(module("xxhash")) == dist_version("xxhash")
    assert module_version(module("surely_not_a_distribution_name")) == UNKNOWN_VERSION


def test_report_json_shape() -> None:
    report = KernelLoadReport(pid=7, process="EngineCore", loaded={"a": "1"}, failed={"b": "E: x"})
    assert json.loads(json.dumps(report.to_dict())) == {
        "pid": 7, "process": "EngineCore", "loaded": {"a": "1"}, "failed": {"b": "E: x"},
        "ops": {}}


# -- the general plugin entry point --------------------------------------------------------

@pytest.fixture
def fake_plugin(monkeypatch: pytest.MonkeyPatch) -> str:
    name = "fg_unit_fake_kernel_plugin"
    monkeypatch.setitem(sys.modules, name, module(name, __version__="2.0.0"))
    return name


def _env(monkeypatch: pytest.MonkeyPatch, **env: str) -> None:
    for var in ("FLEETGATE_REDIS_URL", "FLEETGATE_KERNEL_PLUGINS",
                "FLEETGATE_KERNEL_PLUGINS_STRICT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FLEETGATE_REPLICA_ID", "r-unit")
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def test_register_without_kernel_plugins_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    _env(monkeypatch)
    general.register()
    assert current_report() is None


def test_register_imports_and_remembers_the_plugins(
    monkeypatch: pytest.MonkeyPatch, fake_plugin: str
) -> None:
    _env(monkeypatch, FLEETGATE_KERNEL_PLUGINS=fake_plugin)
    general.register()
    report = current_report()
    assert report is not None and report.loaded == {fake_plugin: "2.0.0"}


def test_strict_mode_aborts_with_the_module_and_the_way_out(
    monkeypatch: pytest.MonkeyPatch, fake_plugin: str
) -> None:
    _env(monkeypatch, FLEETGATE_KERNEL_PLUGINS=f"{fake_plugin},fg_unit_absent_plugin")
    with pytest.raises(KernelPluginError, match="fg_unit_absent_plugin") as info:
        general.register()
    assert "FLEETGATE_KERNEL_PLUGINS_STRICT=0" in str(info.value)
    report = current_report()  # recorded before aborting, so the stat logger/Redis can show it
    assert report is not None and "fg_unit_absent_plugin" in report.failed


def test_lenient_mode_serves_without_the_failed_plugin(
    monkeypatch: pytest.MonkeyPatch, fake_plugin: str
) -> None:
    _env(monkeypatch, FLEETGATE_KERNEL_PLUGINS=f"fg_unit_absent_plugin,{fake_plugin}",
         FLEETGATE_KERNEL_PLUGINS_STRICT="0")
    general.register()
    report = current_report()
    assert report is not None
    assert report.loaded == {fake_plugin: "2.0.0"} and list(report.failed) == [
        "fg_unit_absent_plugin"]


def test_the_log_line_waits_for_vllm_logging_when_none_is_set_up(
    monkeypatch: pytest.MonkeyPatch, fake_plugin: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The API server runs general plugins before vLLM configures logging: nothing would print.
    _env(monkeypatch, FLEETGATE_KERNEL_PLUGINS=fake_plugin)
    monkeypatch.setattr(general.logger, "hasHandlers", lambda: False)
    line = f"{fake_plugin}==2.0.0"
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        general.register()
        assert line not in caplog.text
        for _ in range(2):  # the stat logger flushes it, once
            EngineStateLogger(PluginConfig(redis_url=None, replica_id="r")).close()
    assert caplog.text.count(line) == 1


# -- Redis writes, against a recording stand-in for redis-py's pipeline ----------------------

class FakePipeline:
    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        self.log = log
        self.batch: list[tuple[Any, ...]] = []

    def __getattr__(self, command: str) -> Any:
        return lambda *args, **kwargs: self.batch.append((command, args, kwargs))

    def execute(self) -> None:
        self.log.append(tuple(self.batch))


class FakeRedis:
    """Records pipelined commands; ``hashes`` answers HGETALL as redis-py does (bytes)."""

    def __init__(self, hashes: dict[str, dict[bytes, bytes]] | None = None) -> None:
        self.executed: list[tuple[Any, ...]] = []
        self.transactions: list[bool] = []
        self.hashes = hashes or {}

    def pipeline(self, transaction: bool = True) -> FakePipeline:
        self.transactions.append(transaction)
        return FakePipeline(self.executed)

    def hgetall(self, key: str) -> dict[bytes, bytes]:
        return self.hashes.get(key, {})

    def close(self) -> None:
        pass


KEYS = PluginKeys("p:", "r")


def report(pid: int, process: str, loaded: dict[str, str] | None = None,
           failed: dict[str, str] | None = None) -> dict[str, Any]:
    return KernelLoadReport(pid, process, loaded=loaded or {}, failed=failed or {}).to_dict()


def test_plain_engine_write_is_one_round_trip_refreshing_every_ttl() -> None:
    redis = FakeRedis()
    RedisStateStore(redis, KEYS, ttl_s=9).write_engine({"running": "1"})
    (batch,) = redis.executed
    assert ("hset", ("p:replica:r:engine",), {"mapping": {"running": "1"}}) in batch
    expiring = {a[0]: a[1] for c, a, _ in batch if c == "pexpire"}
    assert expiring == {k: 9000 for k in ("p:replica:r:engine", *KEYS.kernel_keys())}
    assert {c for c, _, _ in batch} == {"hset", "pexpire"}
    assert redis.transactions == [False]


def test_heartbeat_without_snapshot_only_refreshes() -> None:
    redis = FakeRedis()
    RedisStateStore(redis, KEYS, ttl_s=3).write_engine(None)
    (batch,) = redis.executed
    assert {c for c, _, _ in batch} == {"pexpire"}


def test_reconcile_drops_dead_processes_and_rebuilds_the_kernel_view() -> None:
    own = report(1, "MainProcess", loaded={"acme": "1.0"})
    redis = FakeRedis({KEYS.kernel_procs: {
        b"100": json.dumps(report(100, "EngineCore", loaded={"acme": "1.0"})).encode(),
        # An earlier incarnation whose import failed: dead now, its error must go.
        b"200": json.dumps(report(200, "EngineCore", failed={"old": "E: x"})).encode(),
        b"300": b"not json",
    }})
    RedisStateStore(redis, KEYS, ttl_s=3).write_engine(
        {"running": "0"}, kernel_report=own, reconcile=True, is_alive=lambda pid: pid in (1, 100)
    )
    (batch,) = redis.executed
    assert redis.transactions == [True]  # readers never see the kernel hashes half-rebuilt
    assert ("hdel", (KEYS.kernel_procs, "200", "300"), {}) in batch
    live = {"100": json.dumps(report(100, "EngineCore", loaded={"acme": "1.0"}), sort_keys=True),
            "1": json.dumps(own, sort_keys=True)}
    assert ("hset", (KEYS.kernel_procs,), {"mapping": live}) in batch
    assert ("delete", (KEYS.kernels, KEYS.kernel_errors), {}) in batch
    assert ("hset", (KEYS.kernels,), {"mapping": {"acme": "1.0"}}) in batch
    assert not any(c == "hset" and a[0] == KEYS.kernel_errors for c, a, _ in batch)


def test_reports_redis_lost_of_live_processes_are_re_asserted() -> None:
    # Each process writes its report once, at start-up. After Redis lost them (a restart without
    # persistence, FLUSHALL) the view held only the API server's own, and a kernel that failed in
    # the model worker read as loaded (the failover review).
    own = report(1, "MainProcess", loaded={"acme": "1.0", "fast": "2"})
    worker = report(2, "VllmWorker-0", loaded={"acme": "1.0"}, failed={"fast": "E: no sm90"})
    redis = FakeRedis({KEYS.kernel_procs: {b"2": json.dumps(worker).encode()}})
    store = RedisStateStore(redis, KEYS, ttl_s=3)
    alive = {1, 2}
    store.write_engine(None, kernel_report=own, reconcile=True, is_alive=alive.__contains__)
    redis.hashes.clear()  # Redis lost everything
    store.write_engine(None, kernel_report=own, reconcile=True, is_alive=alive.__contains__)
    batch = redis.executed[-1]
    assert ("hset", (KEYS.kernels,), {"mapping": {"acme": "1.0"}}) in batch
    assert ("hset", (KEYS.kernel_errors,), {"mapping": {"fast": "VllmWorker-0: E: no sm90"}}) in (
        batch)
    restored = {"1": json.dumps(own, sort_keys=True), "2": json.dumps(worker, sort_keys=True)}
    assert ("hset", (KEYS.kernel_procs,), {"mapping": restored}) in batch
    alive.discard(2)  # the worker ended: its report goes with it
    store.write_engine(None, kernel_report=own, reconcile=True, is_alive=alive.__contains__)
    batch = redis.executed[-1]
    assert ("hset", (KEYS.kernels,), {"mapping": {"acme": "1.0", "fast": "2"}}) in batch


def test_startup_report_adds_errors_with_the_process_and_a_long_ttl() -> None:
    redis = FakeRedis()
    bad = report(11, "VllmWorker-0", failed={"m": "ImportError: x"})
    RedisStateStore(redis, KEYS, ttl_s=3).write_kernel_report(bad, ttl_s=3600)
    (batch,) = redis.executed
    assert ("hset", (KEYS.kernel_procs, "11", json.dumps(bad, sort_keys=True)), {}) in batch
    assert ("hset", (KEYS.kernel_errors,), {"mapping": {"m": "VllmWorker-0: ImportError: x"}}) in (
        batch)
    assert {a[1] for c, a, _ in batch if c == "pexpire"} == {3_600_000}


def test_aggregate_counts_a_module_loaded_only_where_every_process_has_it() -> None:
    loaded, errors = aggregate_reports([
        report(1, "MainProcess", loaded={"a": "1", "b": "2", "c": "3"}),
        report(2, "VllmWorker-0", loaded={"a": "1"}, failed={"b": "OSError: no GPU"}),
    ])
    assert loaded == {"a": "1"}  # c never reached the worker; b failed there
    assert errors == {"b": "VllmWorker-0: OSError: no GPU"}


def test_pid_alive() -> None:
    import os

    assert pid_alive(os.getpid())
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    assert not pid_alive(int(proc.stdout))  # exited and reaped


# -- the stat logger core -------------------------------------------------------------------

def test_logger_without_redis_url_is_a_no_op() -> None:
    state = EngineStateLogger(PluginConfig(redis_url=None, replica_id="r"))
    assert not state.enabled
    state.record(SimpleNamespace(num_running_reqs=1), None)  # must not raise
    state.close()


def test_logger_publishes_steps_and_static_fields_from_its_thread() -> None:
    got = threading.Event()
    seen: list[Mapping[str, str]] = []

    def write(fields: Mapping[str, str] | None) -> None:
        if fields and fields.get("running") == "2":
            seen.append(dict(fields))
            got.set()

    state = EngineStateLogger(PluginConfig(redis_url=None, replica_id="r"), write=write,
                              static_fields={"block_size": "32"})
    try:
        state.record(SimpleNamespace(num_running_reqs=2, kv_cache_usage=0.5), None)
        assert got.wait(timeout=30)
    finally:
        state.close()
    assert seen[0]["block_size"] == "32" and seen[0]["kv_usage"] == "0.5"


def test_a_failing_step_is_counted_not_raised() -> None:
    class Exploding:
        def __getattr__(self, name: str) -> Any:
            raise RuntimeError("stats layout changed")

    state = EngineStateLogger(PluginConfig(redis_url=None, replica_id="r"), write=lambda f: None)
    try:
        state.record(Exploding(), None)
        state.record(Exploding(), None)
    finally:
        state.close()
    assert state.errors == 2
