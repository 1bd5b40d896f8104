"""A real ``redis-server`` started on a free port, so a benchmark or a test can kill and restart it.

Here, not in ``tests/``, because ``bench.routing_decision`` starts one too and must run from an
installed wheel, where ``tests`` does not exist; ``tests/support/redis_server.py`` re-exports it.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

#: Where test servers get their ports: below the kernel's ephemeral range, which the kernel
#: never hands to a ``bind(0)`` or to an outgoing connection's local port. A port probed free in
#: the ephemeral range can be taken by any client connection before the server binds it (the
#: "Address already in use" races); here only an explicit bind to that very port could.
_FIRST_TEST_PORT = 10_000
#: Ports this process has handed out: never twice, even before the first taker binds it.
_handed_out: set[int] = set()
_rng = random.Random(os.getpid() ^ time.time_ns())


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(count: int) -> int:
    """The first of ``count`` consecutive TCP ports on 127.0.0.1, free and outside the kernel's
    ephemeral range, never handed out before by this process.

    For servers that bind ``port``, ``port + 1``, ... (``fleetgate sim --replicas N``) and for
    servers a test stops and restarts on the same port (``RedisServer``).
    """
    low, _high = _ephemeral_range()
    last_base = low - count
    if last_base <= _FIRST_TEST_PORT:
        raise RuntimeError(f"the ephemeral port range starts at {low}: no room for test ports")
    for _ in range(500):
        base = _rng.randrange(_FIRST_TEST_PORT, last_base)
        ports = range(base, base + count)
        if any(p in _handed_out for p in ports) or not all(_bindable(p) for p in ports):
            continue
        _handed_out.update(ports)
        return base
    raise RuntimeError(f"no block of {count} free consecutive ports found")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on and no client connection can take."""
    return free_port_block(1)


@dataclass
class RedisServer:
    """One private redis-server process. ``stop()`` and ``start()`` simulate an outage."""

    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    workdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="fg-redis-"))

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server not found: install it (apt-get install redis-server) or set REDIS_URL"
            )
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.workdir],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within 10 s")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None


@dataclass
class LocalRedisCluster:
    """A private Redis Cluster: ``primaries`` redis-server processes, each with ``replicas``
    replicas, every slot assigned (``redis-cli --cluster create``). For the mirrored index's
    Cluster tests (failovers need replicas) and sizing."""

    primaries: int = 3
    replicas: int = 0
    #: Every node requires this password (``requirepass``); None: no authentication.
    password: str | None = None
    servers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)
    workdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="fg-redis-cluster-"))

    @property
    def url(self) -> str:
        """A cluster URL as fleetgate takes it: any one node, the ``redis+cluster`` scheme."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis+cluster://{auth}127.0.0.1:{self.ports[0]}/0"

    def _auth_args(self) -> list[str]:
        return ["-a", self.password, "--no-auth-warning"] if self.password else []

    def start(self) -> LocalRedisCluster:
        binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if binary is None or cli is None:
            raise RuntimeError(
                "redis-server and redis-cli not found: install them (apt-get install redis-server)"
            )
        for i in range(self.primaries * (1 + self.replicas)):
            # The cluster bus port is given, not port + 10000: that could land in the kernel's
            # ephemeral range, where an outgoing connection can take it first.
            port, bus = free_port(), free_port()
            node_dir = os.path.join(self.workdir, f"node{i}")
            os.makedirs(node_dir, exist_ok=True)
            self.servers.append(
                subprocess.Popen(
                    [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no", "--dir", node_dir, "--cluster-enabled", "yes",
                     "--cluster-port", str(bus), "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", "5000",
                     *(["--requirepass", self.password, "--masterauth", self.password]
                       if self.password else [])],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            self.ports.append(port)
        try:
            for port in self.ports:
                _wait_for_pong(port, password=self.password)
            subprocess.run(
                [cli, *self._auth_args(), "--cluster", "create",
                 *(f"127.0.0.1:{p}" for p in self.ports),
                 "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                check=True, capture_output=True, timeout=60,
            )
            deadline = time.monotonic() + 30
            while not all(self._state_ok(cli, port, self._auth_args()) for port in self.ports) or (
                self.replicas and not self._replicas_synced()
            ):
                if time.monotonic() > deadline:
                    raise RuntimeError("the Redis Cluster did not reach cluster_state:ok in 30 s")
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise
        return self

    def _cli(self, port: int, *args: str, check: bool = True) -> str:
        """``redis-cli -p PORT ARGS...`` against one node; its output."""
        cli = shutil.which("redis-cli")
        assert cli is not None, "redis-cli not found"
        return subprocess.run(
            [cli, *self._auth_args(), "-p", str(port), *args],
            check=check, capture_output=True, text=True, timeout=10,
        ).stdout.strip()

    def _replicas_synced(self) -> bool:
        """Every replica has finished its first sync with its primary (a failover needs it)."""
        for port in self.ports:
            info = self._cli(port, "info", "replication", check=False)
            if "role:slave" in info and "master_link_status:up" not in info:
                return False
        return True

    def _nodes(self) -> list[list[str]]:
        """``CLUSTER NODES``, a list of fields per node: id, address, flags, primary's id, ..."""
        out = self._cli(self.ports[0], "cluster", "nodes")
        return [line.split() for line in out.splitlines() if line.strip()]

    @staticmethod
    def _port(fields: list[str]) -> int:
        return int(fields[1].split("@")[0].rsplit(":", 1)[1])

    def primary_ports(self) -> list[int]:
        """The ports of the nodes that are primaries now (a failover changes them)."""
        return [
            self._port(fields) for fields in self._nodes()
            if "master" in fields[2].split(",") and "fail" not in fields[2]
        ]

    def replica_of(self, primary_port: int) -> int:
        """The port of a replica of the primary on ``primary_port``."""
        nodes = self._nodes()
        primary_id = next(f[0] for f in nodes if self._port(f) == primary_port)
        return next(self._port(f) for f in nodes if f[3] == primary_id)

    def fail_over(self, replica_port: int) -> None:
        """``CLUSTER FAILOVER`` on the replica at ``replica_port`` (a graceful failover, as in an
        upgrade); returns once it reports itself a primary."""
        self._cli(replica_port, "cluster", "failover")
        deadline = time.monotonic() + 30
        while "role:master" not in self._cli(replica_port, "info", "replication", check=False):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replica on port {replica_port} did not take over")
            time.sleep(0.05)

    def move_slot(self, slot: int, to_port: int) -> None:
        """Move ``slot`` and its keys to the primary on ``to_port``, as a resharding does
        (``SETSLOT IMPORTING``/``MIGRATING``, ``MIGRATE``, then ``SETSLOT NODE`` on every node):
        clients that kept the old slot map get ``MOVED`` from the former owner."""
        run = self._cli
        owner = self._owner_of(slot)
        if owner == to_port:
            raise ValueError(f"slot {slot} is already on port {to_port}")
        source_id, target_id = run(owner, "cluster", "myid"), run(to_port, "cluster", "myid")
        run(to_port, "cluster", "setslot", str(slot), "importing", source_id)
        run(owner, "cluster", "setslot", str(slot), "migrating", target_id)
        auth = ["auth", self.password] if self.password else []
        while keys := run(owner, "cluster", "getkeysinslot", str(slot), "100").split():
            run(owner, "migrate", "127.0.0.1", str(to_port), "", "0", "5000", *auth, "keys", *keys)
        for port in self.ports:
            run(port, "cluster", "setslot", str(slot), "node", target_id)

    def _owner_of(self, slot: int) -> int:
        """The port of the primary that owns ``slot`` now."""
        for fields in self._nodes():
            for assigned in fields[8:]:
                low, _, high = assigned.partition("-")
                if low.isdigit() and int(low) <= slot <= int(high or low):
                    return self._port(fields)
        raise ValueError(f"no node owns slot {slot}")

    @staticmethod
    def _state_ok(cli: str, port: int, auth: list[str]) -> bool:
        out = subprocess.run(
            [cli, *auth, "-p", str(port), "cluster", "info"],
            capture_output=True, text=True, timeout=10,
        ).stdout
        return "cluster_state:ok" in out

    def stop(self) -> None:
        for server in self.servers:
            server.kill()
            server.wait(timeout=10)
        self.servers.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)


@dataclass
class LocalRedisSentinel:
    """A private Redis behind Sentinel: one primary, ``replicas`` replicas of it and
    ``sentinels`` Sentinels watching it as ``service``, for the Sentinel URL's tests.
    ``kill_primary`` is the outage Sentinel exists for: the Sentinels promote a replica."""

    service: str = "fg-primary"
    replicas: int = 1
    sentinels: int = 1
    #: Every data node requires this password (``requirepass``; Sentinels connect with it too);
    #: None: no authentication.
    password: str | None = None
    #: The Sentinels themselves require this password; None: they do not.
    sentinel_password: str | None = None
    #: Milliseconds without an answer before a Sentinel calls the primary down.
    down_after_ms: int = 1000
    data_ports: list[int] = field(default_factory=list)
    sentinel_ports: list[int] = field(default_factory=list)
    processes: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    workdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="fg-redis-sentinel-"))

    @property
    def url(self) -> str:
        """The Sentinel URL fleetgate takes: every Sentinel, the service, database 0."""
        auth = f":{self.password}@" if self.password else ""
        nodes = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        query = f"?sentinel_password={self.sentinel_password}" if self.sentinel_password else ""
        return f"redis+sentinel://{auth}{nodes}/{self.service}/0{query}"

    def _spawn(self, port: int, args: list[str]) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found: install it (apt-get install redis-server)")
        self.processes[port] = subprocess.Popen(
            [binary, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def _data_args(self, port: int) -> list[str]:
        node_dir = os.path.join(self.workdir, f"data{port}")
        os.makedirs(node_dir, exist_ok=True)
        auth = (
            ["--requirepass", self.password, "--masterauth", self.password] if self.password else []
        )
        return ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", node_dir, *auth]

    def start(self) -> LocalRedisSentinel:
        try:
            primary = free_port()
            self.data_ports.append(primary)
            self._spawn(primary, self._data_args(primary))
            _wait_for_pong(primary, password=self.password)
            for _ in range(self.replicas):
                port = free_port()
                self.data_ports.append(port)
                replica_of = ["--replicaof", "127.0.0.1", str(primary)]
                self._spawn(port, [*self._data_args(port), *replica_of])
                _wait_for_pong(port, password=self.password)
            quorum = self.sentinels // 2 + 1
            for i in range(self.sentinels):
                port = free_port()
                self.sentinel_ports.append(port)
                # Sentinel rewrites its configuration file (what it learns): one each, writable.
                conf = os.path.join(self.workdir, f"sentinel{i}.conf")
                lines = [
                    f"port {port}", "bind 127.0.0.1", f"dir {self.workdir}",
                    f"sentinel monitor {self.service} 127.0.0.1 {primary} {quorum}",
                    f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}",
                    f"sentinel failover-timeout {self.service} 10000",
                ]
                if self.password:
                    lines.append(f"sentinel auth-pass {self.service} {self.password}")
                if self.sentinel_password:
                    lines.append(f"requirepass {self.sentinel_password}")
                with open(conf, "w") as out:
                    out.write("\n".join(lines) + "\n")
                self._spawn(port, [conf, "--sentinel"])
                _wait_for_pong(port, password=self.sentinel_password)
            # A failover needs the Sentinels to know the replicas and the replicas synced.
            self._wait(lambda: self._sentinels_see_replicas(), "the Sentinels to find the replicas")
        except BaseException:
            self.stop()
            raise
        return self

    def _wait(self, ready: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"waited {timeout_s:g} s for {what}")
            time.sleep(0.1)

    def _cli(self, port: int, *args: str, password: str | None) -> str:
        cli = shutil.which("redis-cli")
        assert cli is not None, "redis-cli not found"
        auth = ["-a", password, "--no-auth-warning"] if password else []
        return subprocess.run(
            [cli, *auth, "-p", str(port), *args], capture_output=True, text=True, timeout=10,
        ).stdout.strip()

    def _sentinels_see_replicas(self) -> bool:
        """Every Sentinel lists every replica, linked to the primary (``SENTINEL REPLICAS``:
        field and value on alternate lines, one block per replica, each opening with ``name``)."""
        for port in self.sentinel_ports:
            lines = self._cli(port, "sentinel", "replicas", self.service,
                              password=self.sentinel_password).splitlines()
            replicas: list[dict[str, str]] = []
            for key, value in zip(lines[::2], lines[1::2], strict=False):
                if key == "name":
                    replicas.append({})
                if replicas:
                    replicas[-1][key] = value
            linked = [r for r in replicas if r.get("master-link-status") == "ok"]
            if len(linked) < self.replicas:
                return False
        return True

    def primary_port(self) -> int:
        """The port of the primary the first Sentinel names now."""
        out = self._cli(self.sentinel_ports[0], "sentinel", "get-master-addr-by-name",
                        self.service, password=self.sentinel_password)
        return int(out.split()[1])

    def kill_primary(self, timeout_s: float = 30.0) -> int:
        """SIGKILL the primary, then wait until the Sentinels name another and it answers as a
        primary; returns its port."""
        old = self.primary_port()
        process = self.processes.pop(old)
        process.kill()
        process.wait(timeout=10)

        def promoted() -> bool:
            port = self.primary_port()
            role = self._cli(port, "info", "replication", password=self.password)
            return port != old and "role:master" in role

        self._wait(promoted, f"the Sentinels to promote a replica of port {old}", timeout_s)
        return self.primary_port()

    def fail_over(self, timeout_s: float = 30.0) -> int:
        """``SENTINEL FAILOVER``: a graceful failover (an upgrade's), the old primary alive and
        answering until the Sentinels turn it into a replica; returns the new primary's port
        once the Sentinels name it."""
        old = self.primary_port()
        self._cli(self.sentinel_ports[0], "sentinel", "failover", self.service,
                  password=self.sentinel_password)
        self._wait(lambda: self.primary_port() != old, "the Sentinels to name a new primary",
                   timeout_s)
        return self.primary_port()

    def stop(self) -> None:
        for process in self.processes.values():
            process.kill()
            process.wait(timeout=10)
        self.processes.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _wait_for_pong(port: int, timeout_s: float = 10.0, password: str | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    # With a password, AUTH first: its +OK and the +PONG come back together.
    hello = f"AUTH {password}\r\nPING\r\n".encode() if password else b"PING\r\n"
    expected = b"+OK\r\n+PONG" if password else b"+PONG"
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
                sock.sendall(hello)
                reply = b""
                while len(reply) < len(expected) and (chunk := sock.recv(64)):
                    reply += chunk
                if reply.startswith(expected):
                    return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"redis-server did not answer on port {port} within {timeout_s:g} s")
