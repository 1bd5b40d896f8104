"""Serialising vLLM's per-step stats into the engine-state hash (fake stats objects, no vLLM)."""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace
from typing import Any

import pytest

from replica.vllm_plugin.config import PluginConfig, PluginConfigError, parse_module_list
from replica.vllm_plugin.keys import PluginKeys
from replica.vllm_plugin.snapshot import EngineSnapshot, SnapshotBuilder
from replica.vllm_plugin.state_logger import static_fields_from_config


def sched(**kw: Any) -> SimpleNamespace:
    """A stand-in for ``vllm.v1.metrics.stats.SchedulerStats`` with the fields the plugin reads."""
    base: dict[str, Any] = {
        "num_running_reqs": 0, "num_waiting_reqs": 0, "num_skipped_waiting_reqs": 0,
        "kv_cache_usage": 0.0, "running_lora_adapters": {}, "waiting_lora_adapters": {},
        "prefix_cache_stats": SimpleNamespace(queries=0, hits=0),
    }
    base.update(kw)
    return SimpleNamespace(**base)


def it(preempted: int) -> SimpleNamespace:
    """A stand-in for ``IterationStats``."""
    return SimpleNamespace(num_preempted_reqs=preempted)


def builder() -> SnapshotBuilder:
    ticks = itertools.count(1000)
    return SnapshotBuilder(engine_index=0, pid=4242, wall_clock=lambda: float(next(ticks)))


def test_gauges_come_from_the_newest_scheduler_stats() -> None:
    b = builder()
    b.update(sched(num_running_reqs=9, kv_cache_usage=0.9), it(0))
    snap = b.update(
        sched(num_running_reqs=3, num_waiting_reqs=2, num_skipped_waiting_reqs=1,
              kv_cache_usage=0.25, running_lora_adapters={"a": 2, "idle": 0},
              waiting_lora_adapters={"b": 1}),
        it(0),
    )
    assert (snap.running, snap.waiting, snap.waiting_deferred) == (3, 3, 1)
    assert snap.kv_usage == 0.25
    assert snap.running_adapters == {"a": 2}  # zero-count adapters are dropped
    assert snap.waiting_adapters == {"b": 1}
    assert snap.pid == 4242 and snap.steps == 2


def test_counters_accumulate_across_every_step() -> None:
    b = builder()
    b.update(sched(prefix_cache_stats=SimpleNamespace(queries=64, hits=32)), it(1))
    b.update(None, it(2))  # a step without scheduler stats still counts preemptions
    snap = b.update(sched(prefix_cache_stats=SimpleNamespace(queries=10, hits=0)), None)
    assert snap.preemptions_total == 3
    assert (snap.prefix_cache_queries_total, snap.prefix_cache_hits_total) == (74, 32)


def test_a_step_without_scheduler_stats_keeps_the_previous_gauges() -> None:
    b = builder()
    b.update(sched(num_running_reqs=4, kv_cache_usage=0.5), None)
    snap = b.update(None, it(0))
    assert (snap.running, snap.kv_usage) == (4, 0.5)
    # Each snapshot is stamped with the step's wall-clock time (ticks: start, step 1, step 2).
    assert (snap.started_at, snap.metrics_read_at) == (1000.0, 1002.0)


def test_unexpected_field_types_degrade_to_zero_instead_of_raising() -> None:
    snap = builder().update(
        SimpleNamespace(num_running_reqs="lots", kv_cache_usage=None, running_lora_adapters=[]),
        SimpleNamespace(),
    )
    assert (snap.running, snap.kv_usage, snap.running_adapters, snap.preemptions_total) == (
        0, 0.0, {}, 0)


def test_fields_round_trip_through_redis_bytes() -> None:
    snap = builder().update(
        sched(num_running_reqs=2, kv_cache_usage=0.125, running_lora_adapters={"x": 1}), it(1)
    )
    fields = snap.to_fields()
    assert all(isinstance(v, str) for v in fields.values())
    assert json.loads(fields["running_adapters"]) == {"x": 1}
    as_read = {k.encode(): v.encode() for k, v in fields.items()}
    assert EngineSnapshot.from_fields(as_read) == snap


def test_key_layout_sits_beside_the_fleet_store_key() -> None:
    keys = PluginKeys("fleetgate:", "pool-a/r0")
    assert keys.base == "fleetgate:replica:pool-a/r0"
    assert keys.engine() == "fleetgate:replica:pool-a/r0:engine"
    assert keys.engine(2) == "fleetgate:replica:pool-a/r0:engine:2"
    assert keys.kernel_keys() == (
        "fleetgate:replica:pool-a/r0:kernels",
        "fleetgate:replica:pool-a/r0:kernel_errors",
        "fleetgate:replica:pool-a/r0:kernel_procs",
    )
    with pytest.raises(ValueError):
        keys.engine(-1)


def test_static_fields_read_from_a_vllm_config_shape() -> None:
    config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=32, num_gpu_blocks=None),
        lora_config=None,
        model_config=SimpleNamespace(served_model_name=["tiny", "tiny-alias"]),
    )
    assert static_fields_from_config(config) == {
        "block_size": "32", "served_model_name": "tiny,tiny-alias"}
    config.cache_config.num_gpu_blocks = 1024
    config.lora_config = SimpleNamespace(max_loras=2)
    assert static_fields_from_config(config)["num_gpu_blocks"] == "1024"
    assert static_fields_from_config(config)["max_loras"] == "2"


# -- configuration ---------------------------------------------------------------------------

def test_config_defaults() -> None:
    config = PluginConfig.from_env({"FLEETGATE_REPLICA_ID": "r1"})
    assert config.redis_url is None
    assert (config.replica_id, config.key_prefix) == ("r1", "fleetgate:")
    assert config.kernel_plugins == () and config.kernel_plugins_strict is True
    assert config.min_interval_s == pytest.approx(0.05)
    assert config.heartbeat_s == pytest.approx(config.ttl_s / 3)


def test_config_reads_every_variable() -> None:
    config = PluginConfig.from_env({
        "FLEETGATE_REDIS_URL": "redis://h:6379/0", "FLEETGATE_REPLICA_ID": "r1",
        "FLEETGATE_KEY_PREFIX": "fg2:", "FLEETGATE_KERNEL_PLUGINS": "a.b, c,,a.b",
        "FLEETGATE_KERNEL_PLUGINS_STRICT": "off", "FLEETGATE_ENGINE_STATE_INTERVAL_MS": "20",
        "FLEETGATE_ENGINE_STATE_TTL_S": "6", "FLEETGATE_REDIS_TIMEOUT_MS": "100",
    })
    assert config.redis_url == "redis://h:6379/0" and config.key_prefix == "fg2:"
    assert config.kernel_plugins == ("a.b", "c") and not config.kernel_plugins_strict
    assert (config.min_interval_s, config.ttl_s, config.redis_timeout_s) == pytest.approx(
        (0.02, 6.0, 0.1))


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"FLEETGATE_REDIS_URL": "http://x"}, "FLEETGATE_REDIS_URL"),
        ({"FLEETGATE_ENGINE_STATE_INTERVAL_MS": "fast"}, "FLEETGATE_ENGINE_STATE_INTERVAL_MS"),
        ({"FLEETGATE_ENGINE_STATE_INTERVAL_MS": "0"}, "FLEETGATE_ENGINE_STATE_INTERVAL_MS"),
        ({"FLEETGATE_ENGINE_STATE_TTL_S": "-1"}, "FLEETGATE_ENGINE_STATE_TTL_S"),
        ({"FLEETGATE_ENGINE_STATE_TTL_S": "0.1"}, "FLEETGATE_ENGINE_STATE_TTL_S"),
        ({"FLEETGATE_KERNEL_PLUGINS_STRICT": "maybe"}, "FLEETGATE_KERNEL_PLUGINS_STRICT"),
    ],
)
def test_bad_values_name_the_variable(env: dict[str, str], names: str) -> None:
    with pytest.raises(PluginConfigError, match=names):
        PluginConfig.from_env({"FLEETGATE_REPLICA_ID": "r1", **env})


def test_replica_id_defaults_to_the_host_name() -> None:
    import socket

    assert PluginConfig.from_env({}).replica_id == socket.gethostname()


def test_module_list_parsing() -> None:
    assert parse_module_list(None) == ()
    assert parse_module_list(" x , y.z ,x") == ("x", "y.z")
