"""A Spark standalone cluster (one master, workers) on 127.0.0.1, from the pyspark package.

The pyspark wheel carries Spark's jars and `bin/spark-class`, which is all a standalone master
and worker need: no separate Spark download. Tests and benchmarks use this to run materializer
nodes with `KROUTE_SPARK_MASTER=spark://127.0.0.1:<port>`; a person can use it the same way to
try a node on a cluster (`python -m kroute.spark_cluster`).

Every daemon starts in a process group of its own, so a worker and the executors it launched
(JVMs, and their Python workers) are stopped, or killed with SIGKILL in fault tests, together
by that group's id. Ports are free loopback ports; logs and the workers' scratch directories
go to one directory (a temporary one unless given).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx

from common.java import find_java
from kroute.embedded import LOOPBACK, die_with_parent, free_port
from kroute.errors import ServiceStartError

_MASTER_CLASS = "org.apache.spark.deploy.master.Master"
_WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
_STOP_GRACE_S = 10.0


def spark_home() -> Path:
    """The pyspark package directory: it holds bin/spark-class and Spark's jars."""
    import pyspark  # noqa: PLC0415 - only needed to find the directory

    return Path(pyspark.__file__).resolve().parent


@dataclass
class SparkDaemon:
    """A master or worker JVM we started, in its own process group (pgid == pid)."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    web_ui_port: int

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def web_ui_url(self) -> str:
        return f"http://{LOOPBACK}:{self.web_ui_port}"

    def is_running(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the whole process group: the daemon and every executor it started."""
        self._signal_group(signal.SIGKILL)
        self.popen.wait(timeout=_STOP_GRACE_S)

    def stop(self) -> None:
        """SIGTERM the group (a worker then stops its executors), SIGKILL what is left."""
        self._signal_group(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=_STOP_GRACE_S)
        # Executors exit a moment after their worker; whatever is left of the group goes now.
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=_STOP_GRACE_S)

    def _signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signum)  # start_new_session: the group's id is our pid


@dataclass
class SparkStandaloneCluster:
    """One master and its workers; a context manager that stops them all.

    `worker_cores` and `worker_memory` are what each worker offers applications (Spark's
    `--cores`/`--memory`); applications take a share with spark.cores.max and
    spark.executor.memory (see docs/spark-cluster.md).
    """

    log_dir: Path
    worker_cores: int = 2
    worker_memory: str = "1g"
    startup_timeout_s: float = 60.0
    master: SparkDaemon | None = None
    master_port: int = 0
    workers: list[SparkDaemon] = field(default_factory=list)
    _started_workers: int = 0

    @property
    def master_url(self) -> str:
        """What nodes take as KROUTE_SPARK_MASTER."""
        return f"spark://{LOOPBACK}:{self.master_port}"

    def __post_init__(self) -> None:
        atexit.register(self.stop)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start_master(self) -> SparkDaemon:
        self.master_port, web_ui_port = free_port(), free_port()
        command = [_MASTER_CLASS, "--host", LOOPBACK, "--port", str(self.master_port)]
        self.master = self._spawn("master", [*command, "--webui-port", str(web_ui_port)])
        self.master.web_ui_port = web_ui_port
        self._await(self.master, lambda: self.state() is not None, "master answering")
        return self.master

    def start_worker(self) -> SparkDaemon:
        """A worker registered with the master (waits until the master lists it as ALIVE)."""
        self._started_workers += 1
        name = f"worker-{self._started_workers}"
        web_ui_port = free_port()
        work_dir = self.log_dir / name
        work_dir.mkdir(parents=True, exist_ok=True)
        command = [
            _WORKER_CLASS, self.master_url,
            "--host", LOOPBACK,
            "--port", str(free_port()),
            "--webui-port", str(web_ui_port),
            "--cores", str(self.worker_cores),
            "--memory", self.worker_memory,
            "--work-dir", str(work_dir),
        ]  # fmt: skip
        worker = self._spawn(name, command)
        worker.web_ui_port = web_ui_port
        self.workers.append(worker)
        self._await(worker, lambda: self._worker_alive(worker), "worker registered")
        return worker

    def kill_worker(self, worker: SparkDaemon) -> None:
        """kill -9 a worker and its executors, as a lost machine would: nothing says goodbye."""
        worker.kill()
        self.workers.remove(worker)

    def state(self) -> dict[str, Any] | None:
        """The master's view (its web UI's /json/): workers, applications and their cores;
        None while it does not answer."""
        if self.master is None:
            return None
        try:
            response = httpx.get(f"{self.master.web_ui_url}/json/", timeout=2, trust_env=False)
            return dict(response.json()) if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def running_apps(self) -> list[dict[str, Any]]:
        return list((self.state() or {}).get("activeapps", []))

    def stop(self) -> None:
        """Workers first (they stop their executors), then the master."""
        for daemon in [*reversed(self.workers), *([self.master] if self.master else [])]:
            daemon.stop()
        self.workers.clear()
        self.master = None

    def _worker_alive(self, worker: SparkDaemon) -> bool:
        listed = (self.state() or {}).get("workers", [])
        return any(
            entry.get("state") == "ALIVE"
            and str(entry.get("webuiaddress", "")).endswith(f":{worker.web_ui_port}")
            for entry in listed
        )

    def _spawn(self, name: str, arguments: list[str]) -> SparkDaemon:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"spark-{name}.log"
        with log_path.open("ab") as log:
            popen = subprocess.Popen(
                die_with_parent([str(spark_home() / "bin" / "spark-class"), *arguments]),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.log_dir,
                env=self._environment(),
                start_new_session=True,  # its own process group: stopped and killed as one
            )
        return SparkDaemon(name, popen, log_path, web_ui_port=0)

    def _environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KROUTE_", "SPARK_"))}
        env.update(
            JAVA_HOME=str(find_java(os.environ).java_home),
            SPARK_HOME=str(spark_home()),
            SPARK_LOCAL_IP=LOOPBACK,
            # Executors start Python workers with the driver's interpreter; this is the
            # fallback for anything that asks the worker's environment.
            PYSPARK_PYTHON=sys.executable,
            # The daemons' own JVMs: small heaps, C1 only (they mostly wait on sockets).
            SPARK_DAEMON_MEMORY="256m",
            SPARK_DAEMON_JAVA_OPTS="-XX:TieredStopAtLevel=1",
        )
        return env

    def _await(self, daemon: SparkDaemon, ready: Any, what: str) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while not ready():
            if not daemon.is_running():
                raise ServiceStartError(
                    f"spark {daemon.name}",
                    f"exited with code {daemon.popen.returncode}; its log ({daemon.log_path}) "
                    f"ends with:\n{daemon.log_tail()}",
                )
            if time.monotonic() > deadline:
                daemon.stop()
                raise ServiceStartError(
                    f"spark {daemon.name}",
                    f"not {what} within {self.startup_timeout_s:.0f}s; log: {daemon.log_path}",
                )
            time.sleep(0.2)


@contextlib.contextmanager
def spark_standalone_cluster(
    workers: int = 1,
    worker_cores: int = 2,
    worker_memory: str = "1g",
    log_dir: Path | None = None,
) -> Iterator[SparkStandaloneCluster]:
    """A running master with `workers` workers; everything is stopped on exit. Logs go to
    `log_dir`, else to a temporary directory removed on exit."""
    temporary = log_dir is None
    directory = log_dir or Path(tempfile.mkdtemp(prefix="kroute-spark-"))
    cluster = SparkStandaloneCluster(directory, worker_cores, worker_memory)
    try:
        cluster.start_master()
        for _ in range(workers):
            cluster.start_worker()
        yield cluster
    finally:
        cluster.stop()
        if temporary:
            shutil.rmtree(directory, ignore_errors=True)


def main() -> int:
    """Start a cluster and keep it up until Ctrl-C (to try nodes on a cluster by hand)."""
    with spark_standalone_cluster(log_dir=Path(tempfile.mkdtemp(prefix="kroute-spark-"))) as c:
        assert c.master is not None
        print(f"Spark master {c.master_url} (web UI {c.master.web_ui_url}); logs in {c.log_dir}")
        print(f"  KROUTE_SPARK_MASTER={c.master_url}")
        print('  KROUTE_SPARK_CONF=\'{"spark.cores.max": "1", "spark.executor.memory": "512m"}\'')
        # SIGTERM too stops the cluster in order (the context manager's exit).
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())
