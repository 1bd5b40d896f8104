"""A Redis URL's query options (TLS certificates above all): what can never connect is refused
where the URL is read, naming the option, and a missing certificate file when a process starts
(the TLS review: a typo or a missing CA passed `policy validate` and `serve`, and the gateway then
logged two connect errors a second for ever while the agent died with a raw traceback)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from fleetgate.commands._args import redis_url
from fleetgate.commands.serve import run as serve_run
from replica.agent.config import AgentConfig
from replica.vllm_plugin.config import PluginConfig, PluginConfigError
from routing.config import PolicyError, parse_policy
from routing.config.infra import IndexSettings
from routing.redis_clients import has_literal_password, redacted
from routing.redis_urls import check_url_files, check_url_options


@pytest.mark.parametrize(
    "url",
    [
        "rediss://redis:6380/0?ssl_ca_certs=/etc/redis/ca.pem&ssl_cert_reqs=required",
        "rediss://redis:6380/0?ssl_certfile=/c.pem&ssl_keyfile=/c.key&ssl_check_hostname=false",
        "redis://redis:6379/0?socket_timeout=0.5&health_check_interval=10",
        "rediss+cluster://redis-0:6380/0?ssl_cert_reqs=none",
        "rediss+sentinel://s:26380/m/0?ssl_ca_certs=${REDIS_CA}&sentinel_password=${SP}",
        "redis://redis:6379/0?socket_timeout=${TIMEOUT}",
        "unix:///run/redis.sock?db=2",
        "unix:///run/redis.sock?db=0&password=${REDIS_PASSWORD}",  # as redis-py documents it
        "rediss://redis:6380/0?ssl_min_version=3",
    ],
)
def test_options_a_connection_takes_pass(url: str) -> None:
    check_url_options(url)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        (
            "rediss://r/0?ssl_ca_cert=/ca.pem",
            r"unknown option 'ssl_ca_cert'.*did you mean ssl_ca_certs\?",
        ),
        ("redis://r/0?sentinel_password=x", "unknown option 'sentinel_password'"),
        ("redis://r/0?ssl_ca_certs=/ca.pem", "ssl_ca_certs is a TLS option: use rediss://"),
        ("redis+cluster://r:1/0?ssl_certfile=/c", "TLS option"),
        ("rediss://r/0?ssl_cert_reqs=bogus", "ssl_cert_reqs must be one of none, optional"),
        ("redis://r/0?socket_timeout=soon", "socket_timeout"),
        ("redis://r/0?timeout=1", r"unknown option 'timeout'.*did you mean socket_timeout\?"),
        ("redis+sentinel://s/m?db=2", "database in the path: /SERVICE/DB"),
        ("rediss://r/0?ssl_cert_reqs=NONE", "ssl_cert_reqs must be one of"),
        ("rediss://r/0?ssl_min_version=TLSv1_2", "ssl_min_version"),
    ],
)
def test_options_no_connection_could_take_are_refused_wherever_the_url_is_read(
    url: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_url_options(url)
    with pytest.raises(ValueError, match=message):
        IndexSettings(backend="redis", redis_url=url, mode="mirror")
    with pytest.raises(ValueError, match=message):
        AgentConfig(replica_id="r", engine_url="http://e:8000", index_url=url, fleet_url=url)
    if "cluster" not in url:
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            redis_url(url)
        with pytest.raises(PluginConfigError, match=message):
            PluginConfig.from_env({"FLEETGATE_REDIS_URL": url})


def test_a_policy_file_with_a_mistyped_tls_option_does_not_validate() -> None:
    with pytest.raises(PolicyError, match="did you mean ssl_ca_certs"):
        parse_policy(
            """
version: 1
replica_pools:
  - name: a
    discovery: {redis_url: "rediss://redis:6380/0?ssl_ca_cert=/etc/redis/ca.pem"}
models:
  - {name: m, pools: [a]}
"""
        )


def test_certificate_files_are_checked_by_the_process_that_connects(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    check_url_files(f"rediss://r/0?ssl_ca_certs={ca}&ssl_ca_path={tmp_path}")
    with pytest.raises(ValueError, match=r"ssl_keyfile=/nowhere/c\.key: no readable file"):
        check_url_files(f"rediss://r/0?ssl_ca_certs={ca}&ssl_keyfile=/nowhere/c.key")
    with pytest.raises(ValueError, match=r"ssl_ca_path=.*no readable directory"):
        check_url_files(f"rediss://r/0?ssl_ca_path={ca}")
    # The engine plugin runs where it connects: it checks at start-up, with its environment.
    url = "rediss://r/0?ssl_ca_certs=${FG_CA}"
    assert PluginConfig.from_env({"FLEETGATE_REDIS_URL": url, "FG_CA": str(ca)}).redis_url == url
    with pytest.raises(PluginConfigError, match=r"ssl_ca_certs=/gone\.pem: no readable file"):
        PluginConfig.from_env({"FLEETGATE_REDIS_URL": url, "FG_CA": "/gone.pem"})


def test_serve_refuses_to_start_on_a_missing_certificate(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser()
    from fleetgate.commands.serve import add_arguments

    add_arguments(parser)
    args = parser.parse_args(["--redis", "rediss://:pw@r:6380/0?ssl_ca_certs=/nowhere/ca.pem"])
    assert serve_run(args) == 2
    err = capsys.readouterr().err
    assert "ssl_ca_certs=/nowhere/ca.pem: no readable file" in err and "pw@" not in err


def test_passwords_in_the_query_are_secrets_too() -> None:
    url = "rediss+sentinel://:pw@s/m/0?sentinel_password=sp&ssl_password=kp&socket_timeout=1"
    assert redacted(url) == (
        "rediss+sentinel://:***@s/m/0?sentinel_password=***&ssl_password=***&socket_timeout=1"
    )
    assert has_literal_password("redis+sentinel://s/m?sentinel_password=sp")
    assert redacted("unix:///run/redis.sock?db=0&password=pw") == (
        "unix:///run/redis.sock?db=0&password=***"
    )
    referenced = "redis+sentinel://:${PW}@s/m?sentinel_password=${SP}"
    assert redacted(referenced) == referenced and not has_literal_password(referenced)
    with pytest.raises(PolicyError) as policy:
        parse_policy(
            """
version: 1
replica_pools:
  - name: a
    discovery: {redis_url: "redis+sentinel://s/m/x?sentinel_password=hunter2"}
models:
  - {name: m, pools: [a]}
"""
        )
    assert "hunter2" not in str(policy.value)


def test_the_warning_for_a_written_out_password_names_the_one_written_out() -> None:
    def warnings(url: str) -> list[str]:
        return parse_policy(
            f"""
version: 1
replica_pools:
  - name: a
    discovery: {{redis_url: "{url}"}}
models:
  - {{name: m, pools: [a]}}
"""
        ).warnings()

    (primary,) = warnings("redis://:hunter2@redis:6379/0")
    assert "${REDIS_PASSWORD}" in primary and "hunter2" not in primary
    (sentinels,) = warnings("redis+sentinel://:${PW}@s/m/0?sentinel_password=hunter2")
    assert "${SENTINEL_PASSWORD}" in sentinels
    assert warnings("redis+sentinel://:${PW}@s/m/0?sentinel_password=${SP}") == []
