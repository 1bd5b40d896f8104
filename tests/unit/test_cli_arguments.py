"""Command-line mistakes get one clear line and exit 2, never a traceback, and before anything
starts: ports out of range or in use, unknown profiles, engine URLs without a scheme, numbers
that cannot work."""

from __future__ import annotations

import argparse
import shutil
import socket
import sys
from pathlib import Path

import pytest

from fleetgate.cli import main

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["up", "--port", "70000"], "a port is 0 (any free one) to 65535 (got 70000)"),
        (["up", "--profile", "nosuch"], "unknown routing profile 'nosuch'; choose from:"),
        (["up", "--sim-speed", "0"], "must be a finite number > 0 (got 0)"),
        (["serve", "--replica", "10.0.0.5:8000"], "did you mean http://10.0.0.5:8000?"),
        (["serve", "--replica", "http://x", "--workers", "0"], "must be an integer >= 1"),
        # N workers' /metrics would each answer with one process's counters (docs/gateway.md).
        (
            ["serve", "--replica", "http://x", "--workers", "2"],
            "Run one worker per pod and scale pods",
        ),
        (["sim", "--speed", "nan"], "must be a finite number > 0 (got nan)"),
        (["triage", "--timeout", "-1"], "must be a finite number > 0 (got -1)"),
        (["plan", "levers", "--model-params", "nan"], "must be a finite number > 0 (got nan)"),
        (["plan", "levers", "--plot", "/nonexistent/levers.png"], "cannot write"),
        (
            ["sim", "--kv-events", "not-an-address", "--port", "0"],
            "argument --kv-events: a ZeroMQ endpoint is tcp://HOST:PORT",
        ),
        # The new user's review: each of these was a traceback, or accepted nonsense.
        (
            ["serve", "--replica", "http://x", "--redis", "localhost:6379"],
            "did you mean redis://localhost:6379/0?",
        ),
        (
            ["serve", "--replica", "http://x", "--redis", "redis://h:notaport/0"],
            "the port of 'redis://h:notaport/0' is not a number",
        ),
        (
            ["agent", "--replica-id", "p/r0", "--engine-url", "http://x", "--kv-events", "bogus"],
            "argument --kv-events: a ZeroMQ endpoint",
        ),
        (["sim", "--log-level", "LOUD"], "unknown level 'LOUD'; choose from: DEBUG, INFO"),
        (["up", "--usd-per-hour", "-3"], "must be a finite number >= 0 (got -3)"),
        (["serve", "--replica", "http://x", "--drain-timeout", "0"], "must be a finite number > 0"),
        # A policy naming an unset ${VAR}: one line before any worker starts (one traceback per
        # worker before, the second diff review).
        (
            ["serve", "--config", str(FIXTURES / "unset-env-redis.yaml"), "--workers", "2",
             "--no-metrics"],
            "names ${FG_TEST_UNSET_PASSWORD}, which is not set",
        ),
        (
            ["serve", "--replica", "http://x", "--adapter-prewarm-interval", "-1"],
            "argument --adapter-prewarm-interval: must be a finite number >= 0",
        ),
        (["up", "--model", ""], "argument --model: must not be empty"),
        (
            ["bench", "replay", "--trace", "t.jsonl", "--url", "localhost:1", "--model", "m"],
            "did you mean http://localhost:1?",
        ),
        (["triage", "--input", "x.yaml", "--window", "abc"], "a PromQL duration is a number"),
        (["advise", "--input", "x.yaml", "--verify", "--requests", "0"], "must be an integer >= 1"),
        (
            [
                *["replica", "run", "--replica-id", "p/r0", "--vllm-python", sys.executable],
                *["--backoff-min", "90", "--", "--model", "m"],
            ],
            "fleetgate replica run: need 0 < --backoff-min (90) <= --backoff-max (60)",
        ),
        (
            [
                *["replica", "run", "--replica-id", "p/r0", "--vllm-python", sys.executable],
                *["--health-timeout", "0", "--", "--model", "m"],
            ],
            "argument --health-timeout: must be a finite number > 0 (got 0)",
        ),
        (
            [
                *["replica", "run", "--replica-id", "p/r0", "--vllm-python", "/"],
                *["--", "--model", "m"],
            ],
            "no vLLM interpreter at / (a runnable file)",
        ),
        (
            [
                *["replica", "run", "--replica-id", "p/r0", "--vllm-python", sys.executable],
                *["--", "--model", "m", "--port", "99999"],
            ],
            "vLLM --port must be 1 to 65535 (got '99999')",
        ),
        (["serve"], "fleetgate serve: give --config FILE"),
        (
            ["serve", "--replica", "http://x", "--tokenizer", "/nonexistent"],
            "--tokenizer /nonexistent: no tokenizer.json there",
        ),
        # A flag --config makes moot is said to be ignored before the file's errors.
        (
            ["serve", "--config", "/nonexistent.yaml", "--replica", "http://x"],
            "warning: --replica ignored with --config",
        ),
        (["sim", "--port", "65535", "--replicas", "2"], "65535 + 1 is past 65535"),
        # The CLI review: a traceback, a silently wrapped port, or exit 1 with an inner name.
        (
            ["agent", "--replica-id", "p/r0", "--engine-url", "http://x", "--listen", "h:99999"],
            "argument --listen: a port is 0 (any free one) to 65535 (got 99999)",
        ),
        (
            ["agent", "--replica-id", "p/r0", "--engine-url", "http://x", "--listen", "bogus"],
            "argument --listen: HOST:PORT or 'off'",
        ),
        (
            ["agent", "--replica-id", "p/r0", "--engine-url", "http://x", "--stall-timeout", "-1"],
            "argument --stall-timeout: must be a finite number >= 0",
        ),
        (["agent", "--replica-id", "", "--engine-url", "http://x"], "--replica-id: must not be"),
        (["sim", "--kv-events", "tcp://*:99999"], "a port is 0 to 65535 (got 99999"),
        (["plan", "levers", "--batch", "0"], "error: --batch: must be"),
        (["advise", "--engine", "p=127.0.0.1:8000"], "did you mean http://127.0.0.1:8000?"),
        (["advise", "--input", "x.yaml", "--model", "nope"], "unknown model profile 'nope'"),
        (["advise", "--input", "x.yaml", "--hardware", "h9"], "unknown hardware profile 'h9'"),
        (["sim", "calibrate", "--engine", "127.0.0.1:8000"], "did you mean http://127.0.0.1:8000?"),
        (
            ["plan", "levers", "--shared-tokens", "5000", "--prompt-tokens", "100"],
            "--shared-tokens (5000) must be <= --prompt-tokens (100)",
        ),
        (["simulate", "--trace", "t.jsonl", "--stats-interval-ms", "inf"], "--stats-interval-ms"),
    ],
)
def test_a_setting_that_cannot_work_is_refused_before_starting(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:  # refused by argparse itself
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("command", ["up", "sim"])
def test_a_port_in_use_is_one_line_that_says_so(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [command, "--port", str(port)] + (["--sim", "1"] if command == "up" else [])
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in err
    assert "Traceback" not in err


def test_a_sim_fleet_with_a_later_replicas_port_in_use_names_its_ports(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Replica i listens on --port + i: naming --port alone sent the operator to a free port
    # (the CLI review).
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["sim", "--port", str(port - 1), "--replicas", "2"]) == 2
    assert f"cannot listen on 127.0.0.1:{port - 1}-{port}: the port is in use" in (
        capsys.readouterr().err
    )


def test_a_gateway_with_redis_on_a_port_in_use_says_so_and_exits(redis_url: str) -> None:
    # Bound after its background tasks (the Redis index mirror among them) had started, the
    # error never showed on uvloop: the process hung, deaf to SIGTERM. The subprocess's timeout
    # only stops a hang; nothing here asserts how long it took.
    import subprocess

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "fleetgate.cli", "serve", "--replica", "http://127.0.0.1:9",
             "--model", "m", "--host", "127.0.0.1", "--port", str(port), "--redis", redis_url],
            capture_output=True, text=True, timeout=120, check=False,
        )
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in done.stderr


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
async def test_a_gateway_on_an_ipv6_address_shows_a_url_that_can_be_pasted() -> None:
    from aiohttp import web

    from gateway.server import start_site

    runner, url = await start_site(web.Application(), "::1", 0, drain_timeout_s=1)
    try:
        assert url.startswith("http://[::1]:")
    finally:
        await runner.cleanup()


def test_the_gateway_listens_on_every_address_its_host_names() -> None:
    # Bound before the app starts (a port in use fails at once), on each address as asyncio's
    # create_server binds them: "" is every interface, IPv4 and IPv6, on one port.
    import errno

    from gateway.server import listening_sockets

    sockets = listening_sockets("", 0)
    try:
        names = [s.getsockname() for s in sockets]
        assert {name[1] for name in names} == {names[0][1]}  # one port for all
        assert "0.0.0.0" in {name[0] for name in names}
        if _ipv6_loopback():
            assert "::" in {name[0] for name in names}
        with pytest.raises(OSError) as taken:
            listening_sockets("127.0.0.1", names[0][1])
        assert taken.value.errno == errno.EADDRINUSE
    finally:
        for sock in sockets:
            sock.close()


def test_help_shows_defaults_and_the_examples_it_promises_but_never_a_secret(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`fleetgate --help` promised each command's examples; `up --help` (the README's first
    command) showed neither them nor its defaults. An admin key from the environment is a
    default too: it must never be printed."""
    monkeypatch.setenv("FLEETGATE_ADMIN_KEY", "s3cret-admin-key")
    for argv in (["up", "--help"], ["serve", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
    out = capsys.readouterr().out
    assert "simulated replicas (default: 2)" in out
    assert "examples:\n  fleetgate up " in out and "examples:\n  # with a policy file" in out
    assert "0.0.0.0, every interface" in " ".join(out.split())  # serve's --host: where it listens
    assert "s3cret-admin-key" not in out


def test_a_relative_vllm_python_is_the_callers_file_not_one_in_the_repository(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine starts from the repository's folder: `./venv/bin/python` named nothing there
    # and failed as "No such file" though it existed where the operator stood (the CLI review).
    from fleetgate.commands.replica import _interpreter

    monkeypatch.chdir(tmp_path)
    assert _interpreter("./venv/bin/python") == str(tmp_path / "venv" / "bin" / "python")
    assert _interpreter("sh") == shutil.which("sh")  # a bare name: looked up on PATH


def test_a_full_disk_under_the_output_is_one_line_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # `fleetgate plan levers > /dev/full`, and the same in every command (the CLI review).
    import errno
    import io

    class FullDisk(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sys, "stdout", FullDisk())
    assert main(["plan", "levers"]) == 1
    assert "fleetgate plan: cannot write the output: No space left on device" in (
        capsys.readouterr().err
    )


def test_a_folder_given_as_a_profile_is_called_a_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # `--profile adir` read as an unknown preset's name (the CLI review).
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    assert main(["sim", "--profile", "adir", "--port", "0"]) == 2
    assert "adir is a folder, not a profile YAML or a preset name" in capsys.readouterr().err


@pytest.mark.parametrize("window", ["10m", "1h30m", "90s", "500ms", "1d2h3m4s5ms"])
def test_a_promql_window_prometheus_takes(window: str) -> None:
    from fleetgate.commands._args import promql_duration

    assert promql_duration(window) == window


@pytest.mark.parametrize("window", ["1s5m", "0s", "0m0s", "10", "", "5m5m"])
def test_a_promql_window_prometheus_refuses_is_a_usage_error(window: str) -> None:
    # Prometheus refuses these; passed through they exited 1 as "cannot read metrics".
    from fleetgate.commands._args import promql_duration

    with pytest.raises(argparse.ArgumentTypeError, match="larger units first and not zero"):
        promql_duration(window)
