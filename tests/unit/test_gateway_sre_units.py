"""Units behind the observability review's fixes: queue-time buckets, gauges that can be removed
and created again, and ``policy validate``'s warning about a local tokenizer that is not there."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fleetgate.cli import main
from gateway.metrics import GatewayMetrics
from routing.config import parse_policy


def test_queue_time_buckets_reach_past_a_minute_and_keep_the_fine_ones() -> None:
    """Flow-control waits and adapter loads take seconds: an 8 s wait lands in a bucket of its
    own, not in +Inf (where every quantile reads the top bucket, 1 s)."""
    metrics = GatewayMetrics()
    metrics.queue_time.labels("r").observe(8.0)

    def bucket(le: str) -> float | None:
        return metrics.registry.get_sample_value(
            "fleetgate_queue_time_seconds_bucket", {"route": "r", "le": le}
        )

    assert bucket("5.0") == 0
    assert bucket("10.0") == 1
    for le in ("0.0001", "0.001", "0.1", "0.25", "1.0", "30.0", "60.0", "120.0"):
        assert bucket(le) is not None, le


def test_a_removed_gauge_child_is_exported_again_once_set() -> None:
    """``CachedLabels.remove`` also forgets its cached child: otherwise the next ``labels()``
    would return the orphan and its samples would never reach /metrics again."""
    metrics = GatewayMetrics()
    metrics.replica_decode_itl.labels("r0").set(0.02)
    metrics.replica_decode_itl.remove("r0")
    get = metrics.registry.get_sample_value
    assert get("fleetgate_replica_decode_itl_seconds", {"replica": "r0"}) is None
    metrics.replica_decode_itl.labels("r0").set(0.03)
    assert get("fleetgate_replica_decode_itl_seconds", {"replica": "r0"}) == 0.03


def test_forget_replica_drops_its_gauges_only() -> None:
    metrics = GatewayMetrics()
    for rid in ("r0", "r1"):
        metrics.replica_healthy.labels(rid).set(1)
        metrics.replica_inflight.labels(rid).set(3)
        metrics.replica_decode_itl.labels(rid).set(0.01)
    metrics.forget_replica("r1")
    metrics.forget_replica("never-seen")  # no error
    get = metrics.registry.get_sample_value
    for name in ("fleetgate_replica_healthy", "fleetgate_replica_inflight"):
        assert get(name, {"replica": "r1"}) is None
        assert get(name, {"replica": "r0"}) is not None


def _policy(tokenizer: dict[str, str]) -> str:
    return yaml.safe_dump(
        {
            "version": 1,
            "replica_pools": [{"name": "p", "replicas": ["http://127.0.0.1:9"]}],
            "models": [{"name": "m", "tokenizer": tokenizer, "pools": ["p"]}],
        }
    )


def test_a_local_tokenizer_missing_here_is_a_warning(tmp_path: Path) -> None:
    missing = parse_policy(_policy({"kind": "local", "path": str(tmp_path / "nowhere")}))
    (warning,) = missing.warnings()
    assert "models[0] (m): tokenizer path" in warning and "no tokenizer.json" in warning
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    assert parse_policy(_policy({"kind": "local", "path": str(tmp_path / "tok")})).warnings() == []
    remote = parse_policy(_policy({"kind": "remote", "url": "http://engine:8000"}))
    assert remote.warnings() == []


def test_validate_says_when_a_local_tokenizer_is_not_on_this_machine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(_policy({"kind": "local", "path": "/models/not-here"}))
    assert main(["policy", "validate", str(path)]) == 0  # a warning: it may run elsewhere
    out, err = capsys.readouterr()
    assert "OK:" in out
    assert f"{path}: warning: models[0] (m): tokenizer path /models/not-here" in err


def test_a_gateway_without_a_policy_file_has_the_policy_files_defaults() -> None:
    # `serve --replica` and a deployed policy used to differ (300 s vs 600 s upstream timeout,
    # 30 s vs 10 s speculative entries, 2 s vs 5 s health polls).
    from gateway.config import GatewayConfig
    from routing.config.infra import GatewaySettings, IndexSettings

    config, gateway, index = GatewayConfig(), GatewaySettings(), IndexSettings()
    assert config.upstream_timeout_s == gateway.upstream_timeout_s
    assert config.connect_timeout_s == gateway.connect_timeout_s
    assert config.health_interval_s == gateway.health_check_interval_s
    assert config.max_retries == gateway.max_retries
    assert config.max_body_bytes == gateway.max_body_bytes
    assert config.speculative_ttl_s == index.speculative_ttl_s
    assert config.index_timeout_s == index.lookup_timeout_ms / 1000
    applied = GatewayConfig()
    applied.apply_policy(type("P", (), {"gateway": gateway, "index": index})(), startup=False)
    assert applied == config


def test_a_reload_names_the_index_settings_that_need_a_restart() -> None:
    # A reload pointing the index at another Redis said "reloaded" and went on with the old one;
    # reloading the file the gateway started with must name nothing (--redis wins at start-up).
    from types import SimpleNamespace

    from gateway.config import GatewayConfig
    from routing.config.infra import IndexSettings

    started = SimpleNamespace(
        index=IndexSettings(backend="redis", redis_url="redis://old:6379/0", mode="mirror")
    )
    config = GatewayConfig()
    config.apply_policy(started, startup=True)
    assert config.needs_restart(started) == []
    moved = SimpleNamespace(
        index=IndexSettings(backend="redis", redis_url="redis://new:6379/0", mode="mirror")
    )
    (what,) = config.needs_restart(moved)
    assert "redis://new:6379/0" in what and "running: redis://old:6379/0" in what
    # --redis on the command line and a policy without an index section: nothing to restart.
    cli = GatewayConfig(redis_url="redis://cli:6379/0")
    plain = SimpleNamespace(index=IndexSettings())
    cli.apply_policy(plain, startup=True)
    assert cli.needs_restart(plain) == []
    assert GatewayConfig().needs_restart(plain) == []  # started without a policy file
    # Memory to Redis names both backends (it said "running: None").
    memory = GatewayConfig()
    memory.apply_policy(plain, startup=True)
    (what,) = memory.needs_restart(moved)
    assert what == "index backend (redis url): redis://new:6379/0 (running: memory)"
    # The listener's idle timeout is set once: a reload names a change, and keeps the running one.
    from routing.config.infra import GatewaySettings

    slower = SimpleNamespace(index=IndexSettings(), gateway=GatewaySettings(idle_timeout_s=30))
    assert memory.needs_restart(slower) == ["gateway idle_timeout_s: 30.0 (running: 75.0)"]
    memory.apply_policy(slower)
    assert memory.idle_timeout_s == 75.0


def test_a_policy_file_is_read_once_it_holds_still_between_two_polls(tmp_path: Path) -> None:
    """The reload review: a poll that caught a file half-written (still valid YAML) applied the
    half. A change is reloaded at the first poll that finds the file as the previous one did."""
    import os
    from types import SimpleNamespace

    from gateway.reload import file_identity, policy_file_changed

    path = tmp_path / "policy.yaml"
    path.write_text("version: 1\n")
    gw = SimpleNamespace(
        config=SimpleNamespace(policy_path=str(path)),
        policy_file_seen=file_identity(str(path)),
        policy_file_missing=False,
        policy_settling=None,
    )
    assert not policy_file_changed(gw)  # as loaded
    path.write_text("version: 1\nroutes: []\n")  # half of it
    os.utime(path, ns=(0, os.stat(path).st_mtime_ns + 10**9))
    assert not policy_file_changed(gw)  # changed since the last poll: wait
    path.write_text("version: 1\nroutes: []\ntenants: []\n")  # the rest arrives
    os.utime(path, ns=(0, os.stat(path).st_mtime_ns + 2 * 10**9))
    assert not policy_file_changed(gw)  # changed again: wait again
    assert policy_file_changed(gw)  # held still for a poll: reload
    # A new file of the same size and time put in its place (rsync -t, the deploy review): its
    # inode tells it apart.
    gw.policy_file_seen = file_identity(str(path))
    same = os.stat(path)
    other = tmp_path / "other.yaml"
    other.write_text(path.read_text().replace("tenants", "profiles"))
    os.utime(other, ns=(same.st_atime_ns, same.st_mtime_ns))
    os.replace(other, path)
    assert not policy_file_changed(gw)  # seen once
    assert policy_file_changed(gw)  # and reloaded


def test_a_redis_password_written_in_the_policy_is_warned_about_and_never_repeated() -> None:
    """The deploy review: a Redis password could only be written into the policy file. It may
    now be ``${VAR}`` (expanded on connecting); one written out is warned about, and the
    restart notice (the log, /admin/policy) shows it as ***."""
    from types import SimpleNamespace

    from gateway.config import GatewayConfig
    from routing.config.infra import IndexSettings

    started = SimpleNamespace(index=IndexSettings())
    config = GatewayConfig()
    config.apply_policy(started, startup=True)
    written = SimpleNamespace(
        index=IndexSettings(backend="redis", redis_url="redis://:hunter2@redis:6379/0")
    )
    (notice,) = config.needs_restart(written)
    assert "hunter2" not in notice and "redis://:***@redis:6379/0" in notice
    policy = parse_policy(
        yaml.safe_dump(
            {
                "version": 1,
                "replica_pools": [{"name": "a", "discovery": {"redis_url": "redis://:pw@r:1/0"}}],
                "models": [{"name": "m", "pools": ["a"]}],
                "index": {"backend": "redis", "redis_url": "redis://:${REDIS_PASSWORD}@r:1/0"},
            }
        )
    )
    warnings = policy.warnings()
    assert any(w.startswith("replica_pools[0].discovery.redis_url: a password") for w in warnings)
    assert not any(w.startswith("index.redis_url") for w in warnings)  # a reference: fine
