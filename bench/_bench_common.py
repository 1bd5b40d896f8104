"""Shared pieces of the HTTP benchmarks (``bench.gateway_overhead``, ``bench.soak``).

Every server a benchmark needs runs as its own subprocess on loopback (simulated replicas, the
fleetgate gateway, the baseline routers), so the load generator never shares an event loop with
what it measures. Each process is started in its own session and stopped by its own pid.
"""

from __future__ import annotations

import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
ROUTERS_BIN = REPO / ".venv-routers" / "bin"
HOST = "127.0.0.1"
MODEL = "sim-model"

# A fixed vocabulary, so prompts are deterministic for a seed and every target sees the same text.
_TEXT = (
    "the fleet routes each request to the replica that already holds the longest cached prefix "
    "of its prompt while keeping load balanced across engines adapters tenants and pools so that "
    "time to first token stays inside the service level objective and the cost per million "
    "tokens falls as the prefix cache hit rate rises under real chatbot agent and batch traffic"
)
_WORDS = _TEXT.split()


def words(rng: random.Random, n: int) -> str:
    """``n`` pseudo-random words from a fixed vocabulary."""
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (held open together while choosing, so no repeats)."""
    socks = []
    try:
        for _ in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((HOST, 0))
            socks.append(sock)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for sock in socks:
            sock.close()


def consecutive_free_ports(n: int, tries: int = 50) -> int:
    """First of ``n`` consecutive free ports (``fleetgate sim`` puts replica i on PORT+i)."""
    for _ in range(tries):
        base = random.randint(20000, 60000 - n)
        socks = []
        try:
            for port in range(base, base + n):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(sock)
                sock.bind((HOST, port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {n} consecutive free ports found")


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (psutil when installed, else ``/proc/PID/status`` VmRSS)."""
    try:
        import psutil  # type: ignore[import-not-found]
    except ImportError:
        psutil = None
    if psutil is not None:
        return int(psutil.Process(pid).memory_info().rss)
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as children:
                out += [int(c) for c in children.read().split()]
    except OSError:
        pass
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds ``pid`` and its live descendants (``--workers N``) have used
    so far, all threads included (``/proc/PID/stat``)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total, todo, seen = 0.0, [pid], set()
    while todo and len(seen) < 256:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            with open(f"/proc/{current}/stat", encoding="ascii") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks
        todo += _children(current)
    return total


def drop_option(argv: Sequence[str], option: str) -> list[str]:
    """``argv`` without ``option`` and its value (``--opt V`` or ``--opt=V``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            out.append(arg)
    return out


NOTES_MARKER = "<!-- notes: kept as written when the benchmark rewrites this page -->"


def write_page(path: Path, page: str) -> None:
    """Write a generated page, keeping the hand-written notes after ``NOTES_MARKER``."""
    notes = ""
    if path.exists():
        old = path.read_text()
        if NOTES_MARKER in old:
            notes = old[old.index(NOTES_MARKER):]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page.rstrip("\n") + "\n" + ("\n" + notes if notes else ""))


def machine_line() -> str:
    """One line describing where the benchmark ran."""
    return (
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"aiohttp {aiohttp.__version__}"
    )


@dataclass
class Proc:
    """A server subprocess: its command, log file and the URL it answers on."""

    name: str
    argv: list[str]
    url: str
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)

    def start(self) -> None:
        log = open(self.log_path, "wb")  # noqa: SIM115 - closed with the process
        env = {**os.environ, **self.env}
        self.popen = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
            start_new_session=True,
        )
        log.close()

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGINT (the routers and fleetgate both stop cleanly on it), then SIGKILL this pid."""
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGINT)
        try:
            self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=timeout_s)

    def log_tail(self, n: int = 20) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


async def wait_ready(
    session: aiohttp.ClientSession, proc: Proc, path: str, timeout_s: float = 60.0,
    body: dict | None = None,
) -> None:
    """Poll ``proc.url + path`` until it answers 200 (GET, or POST ``body``)."""
    import asyncio

    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited:\n{proc.log_tail()}")
        try:
            if body is None:
                request = session.get(proc.url + path, timeout=aiohttp.ClientTimeout(total=5))
            else:
                request = session.post(
                    proc.url + path, json=body, timeout=aiohttp.ClientTimeout(total=5)
                )
            async with request as resp:
                await resp.read()
                if resp.status == 200:
                    return
                last = f"HTTP {resp.status}"
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            last = repr(exc)
        await asyncio.sleep(0.25)
    raise RuntimeError(f"{proc.name} not ready after {timeout_s}s ({last}):\n{proc.log_tail()}")


def sim_proc(
    n: int, speed: float, log_dir: Path, *, name: str = "sim", extra: Sequence[str] = ()
) -> tuple[Proc, list[str]]:
    """``fleetgate sim`` with ``n`` replicas on consecutive ports; returns it and the URLs."""
    base = consecutive_free_ports(n)
    argv = [
        str(VENV_BIN / "fleetgate"), "sim", "--host", HOST, "--port", str(base),
        "--replicas", str(n), "--speed", str(speed), "--log-level", "WARNING", *extra,
    ]
    urls = [f"http://{HOST}:{base + i}" for i in range(n)]
    return Proc(name, argv, urls[0], log_dir / f"{name}.log"), urls


def fleetgate_proc(
    replicas: Sequence[str], log_dir: Path, *, workers: int = 1, extra: Sequence[str] = (),
    python_prefix: Sequence[str] = (),
) -> Proc:
    """``fleetgate serve`` quick start (expected-ttft, in-memory index, text blocks)."""
    port = free_port()
    argv = [*python_prefix] if python_prefix else [str(VENV_BIN / "fleetgate")]
    argv += ["serve", "--host", HOST, "--port", str(port), "--workers", str(workers)]
    if workers > 1:
        argv.append("--no-metrics")  # several workers' /metrics would disagree (docs/gateway.md)
    for url in replicas:
        argv += ["--replica", url]
    argv += list(extra)
    return Proc("fleetgate", argv, f"http://{HOST}:{port}", log_dir / "fleetgate.log")
