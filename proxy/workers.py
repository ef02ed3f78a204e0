"""KROUTE_WORKERS=N: N proxy processes on one data port, under one supervising parent.

Each worker is a whole proxy (`python -m proxy` in worker mode: its own event loop, C path,
routing table and upstream pools) listening on the same port with SO_REUSEPORT, so the kernel
spreads new connections over the workers. The parent:

- holds the port: it binds it (SO_REUSEPORT, never listening, so it is handed no connection)
  before any worker starts, so a taken port fails at once, KROUTE_PORT=0 becomes one concrete
  port for every worker, and no other program can take the port while a worker restarts;
- restarts a worker that exits, at once the first time and with a doubling delay while it
  keeps exiting soon after starting (a crash loop is logged, never spun);
- serves the admin port for the whole proxy: each worker serves its admin app on a Unix socket
  in a private directory, and the parent asks every worker when it is asked (metrics merged by
  `proxy.metrics.WorkerMetrics`, status and readiness merged here);
- on SIGTERM or SIGINT sends SIGTERM to every worker (each drains its in-flight requests for
  up to KROUTE_SHUTDOWN_TIMEOUT_S, as a single proxy does) and exits when all have exited.

Workers die with the parent: each asks the kernel for SIGTERM when its parent dies
(PR_SET_PDEATHSIG), so a parent killed with SIGKILL leaves no worker behind; they drain and exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
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
from typing import Any

import httpx
import structlog
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.admin import AdminApp, AdminViews, admin_server
from proxy.lag_metrics import GAUGES as REPLICA_GAUGES
from proxy.lifetime import die_with_parent
from proxy.metrics import WorkerMetrics, parsed_exposition
from proxy.settings import ProxySettings
from proxy.status import status_page
from proxy.table_process import REFRESH_FAILURES_HELP, TableConfig, TableKeeper

log = structlog.get_logger("kroute.proxy.workers")

EXIT_OK, EXIT_BIND, EXIT_UNCLEAN = 0, 3, 1
# A worker that ran this long before exiting was not crash-looping: its restart is immediate.
HEALTHY_RUN_S = 10.0
FIRST_DELAY_S = 0.25
MAX_DELAY_S = 30.0
CRASH_LOOP_EXITS = 3  # quick exits in a row that make a crash loop (logged as an error)
# After KROUTE_SHUTDOWN_TIMEOUT_S, how long a worker may take to close before it is killed.
STOP_GRACE_S = 5.0
STOPPED_CLEANLY = (0, -signal.SIGTERM)  # a worker's exit status after the parent's SIGTERM
# A worker that runs but no longer answers (SIGSTOP, a stuck loop) still gets its share of the
# data port's new connections (SO_REUSEPORT), which would hang: the parent asks each worker
# whether it is live every WATCHDOG_INTERVAL_S and kills one that missed WATCHDOG_MISSES checks
# in a row (its keeper starts a new one). A worker starting (imports, the first table read) is
# not checked for WATCHDOG_START_GRACE_S.
WATCHDOG_INTERVAL_S = 1.0
WATCHDOG_MISSES = 3
WATCHDOG_START_GRACE_S = 10.0
ASK_TIMEOUT_S = 2.0  # one worker's admin answer; a worker that is slower is left out


# -- worker side ------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerRole:
    """How the parent started this process: which worker it is and where its admin listens."""

    index: int
    supervisor_pid: int
    admin_socket: Path
    # Where the table process shared by every worker listens (KROUTE_TABLE_PROCESS), or None.
    table_socket: Path | None = None

    def argv(self) -> list[str]:
        shared = [] if self.table_socket is None else ["--table-socket", str(self.table_socket)]
        return [
            "--worker", str(self.index),
            "--supervisor-pid", str(self.supervisor_pid),
            "--admin-socket", str(self.admin_socket),
            *shared,
        ]  # fmt: skip


def worker_role(argv: list[str]) -> WorkerRole | None:
    """The role the parent gave this process on its command line (None: not a worker)."""
    if "--worker" not in argv:
        return None
    parser = argparse.ArgumentParser(prog="python -m proxy", add_help=False)
    parser.add_argument("--worker", type=int, required=True)
    parser.add_argument("--supervisor-pid", type=int, required=True)
    parser.add_argument("--admin-socket", type=Path, required=True)
    parser.add_argument("--table-socket", type=Path, default=None)
    args = parser.parse_args(argv)
    return WorkerRole(args.worker, args.supervisor_pid, args.admin_socket, args.table_socket)


def die_with_supervisor(role: WorkerRole) -> None:
    """SIGTERM this process when its parent dies (PR_SET_PDEATHSIG): a worker never outlives
    the parent that would restart it, so no orphan holds the port. Exits if the parent died
    before the request was made (the kernel would never send the signal then)."""
    if not die_with_parent(role.supervisor_pid):
        log.error("the proxy's parent exited before this worker started", worker=role.index)
        sys.exit(EXIT_UNCLEAN)


# -- parent side -------------------------------------------------------------------------------


def bound_socket(host: str, port: int, *, share: bool) -> socket.socket:
    """host:port bound, or OSError if taken. `share`: with SO_REUSEPORT and not listening,
    the data port held for the workers (who bind it the same way and listen), so connections
    only ever go to listening sockets; otherwise listening (the admin port, served here)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if share:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        if not share:
            sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def log_bind_failure(port_name: str, variable: str, host: str, port: int, exc: OSError) -> None:
    log.error(
        f"cannot listen on the {port_name} port (is it taken? set {variable})",
        host=host,
        port=port,
        error=exc.strerror or str(exc),
    )


@dataclass
class Backoff:
    """When to restart a worker that exited: at once, unless it keeps exiting soon after it
    started; then after a delay that doubles with each such exit, up to `max_delay_s`."""

    healthy_run_s: float = HEALTHY_RUN_S
    first_delay_s: float = FIRST_DELAY_S
    max_delay_s: float = MAX_DELAY_S
    quick_exits: int = 0  # exits in a row, each within healthy_run_s of its start

    def after_exit(self, ran_for_s: float) -> float:
        """The delay before the next start, given how long the exited run lasted."""
        self.quick_exits = self.quick_exits + 1 if ran_for_s < self.healthy_run_s else 0
        if self.quick_exits <= 1:
            return 0.0
        doublings = self.quick_exits - 2
        return min(self.first_delay_s * float(1 << doublings), self.max_delay_s)

    @property
    def crash_loop(self) -> bool:
        return self.quick_exits >= CRASH_LOOP_EXITS


@dataclass
class WorkerSlot:
    """One worker position: the process filling it now (replaced when it exits)."""

    role: WorkerRole
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff: Backoff = field(default_factory=Backoff)
    client: httpx.AsyncClient = field(init=False)

    def __post_init__(self) -> None:
        self.client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=str(self.role.admin_socket)),
            base_url="http://worker",
            timeout=ASK_TIMEOUT_S,
            trust_env=False,
        )

    @property
    def pid(self) -> int | None:
        """The running worker's pid (None between an exit and the next start)."""
        process = self.process
        return process.pid if process is not None and process.returncode is None else None

    async def ask(self, path: str) -> httpx.Response | None:
        """The worker's admin answer, or None if it is not running or does not answer."""
        if self.pid is None:
            return None
        try:
            return await self.client.get(path)
        except httpx.HTTPError:
            return None


class Supervisor:
    def __init__(self, settings: ProxySettings, table: TableConfig | None = None) -> None:
        """`table`: the table process's settings (KROUTE_TABLE_PROCESS), for the one process
        that builds the table for every worker (`TableKeeper`)."""
        self.settings = settings
        self._stopping = asyncio.Event()
        self._sockets = Path(tempfile.mkdtemp(prefix="kroute-proxy-"))  # mode 0700
        self.table = None if table is None else TableKeeper(table, self._sockets / "table.sock")
        table_socket = None if self.table is None else self.table.path
        self.slots = [
            WorkerSlot(WorkerRole(i, os.getpid(), self._sockets / f"worker-{i}.sock", table_socket))
            for i in range(settings.workers)
        ]
        self.metrics = WorkerMetrics(gauge.name for gauge in REPLICA_GAUGES)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Exposition(self._collect))
        self._last_merged: list[Metric] = []
        self._scraping = asyncio.Lock()

    async def run(self) -> int:
        settings = self.settings
        try:
            reservation = bound_socket(settings.host, settings.port, share=True)
        except OSError as exc:
            log_bind_failure("data", "KROUTE_PORT", settings.host, settings.port, exc)
            shutil.rmtree(self._sockets, ignore_errors=True)
            return EXIT_BIND
        port = int(reservation.getsockname()[1])
        try:
            admin_socket = bound_socket(settings.admin_host, settings.admin_port, share=False)
        except OSError as exc:
            # Before any worker starts: a taken admin port must not start workers that the
            # supervisor then has to stop.
            log_bind_failure(
                "admin", "KROUTE_ADMIN_PORT", settings.admin_host, settings.admin_port, exc
            )
            reservation.close()
            shutil.rmtree(self._sockets, ignore_errors=True)
            return EXIT_BIND
        admin_port = int(admin_socket.getsockname()[1])
        keeping_table = None
        if self.table is not None:  # bound before any worker starts and connects to it
            try:
                self.table.listen()
            except OSError as exc:  # (a socket path too long for a long TMPDIR, say)
                log.error(
                    "cannot listen for the workers on the table process's socket",
                    path=str(self.table.path),
                    error=exc.strerror or str(exc),
                )
                reservation.close()
                admin_socket.close()
                shutil.rmtree(self._sockets, ignore_errors=True)
                return EXIT_BIND
            keeping_table = asyncio.create_task(self.table.run())
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._stopping.set)
        admin = admin_server(
            AdminApp(
                views=AdminViews(self._metrics, self._status, self._readiness),
                status_page=status_page(),
                token=settings.admin_token.get_secret_value() if settings.admin_token else None,
            ),
            host=settings.admin_host,
            port=admin_port,
        )
        serving_admin = asyncio.create_task(admin.serve(sockets=[admin_socket]))
        keepers = [asyncio.create_task(self._keep_running(slot, port)) for slot in self.slots]
        watchdog = asyncio.create_task(self._watch_for_hung_workers())
        log.info(
            "proxy supervisor started",
            workers=len(self.slots),
            data_url=f"http://{settings.host}:{port}",
            admin_url=f"http://{settings.admin_host}:{admin_port}",
        )
        try:
            await self._stopping.wait()
        finally:
            watchdog.cancel()
            await asyncio.gather(watchdog, return_exceptions=True)
            clean = await self._stop_workers(keepers)
            if keeping_table is not None:  # the workers route on their tables until they exit
                keeping_table.cancel()
                await asyncio.gather(keeping_table, return_exceptions=True)
            admin.should_exit = True
            await asyncio.gather(serving_admin, return_exceptions=True)
            for slot in self.slots:
                await slot.client.aclose()
            reservation.close()
            admin_socket.close()
            shutil.rmtree(self._sockets, ignore_errors=True)
            log.info("proxy supervisor stopped", all_workers_drained=clean)
        return EXIT_OK if clean else EXIT_UNCLEAN

    # -- the workers ---------------------------------------------------------------------------

    async def _keep_running(self, slot: WorkerSlot, port: int) -> None:
        while not self._stopping.is_set():
            process = self._spawn(slot, port)
            code = await exited(process)
            self.metrics.exited(process.pid)
            if self._stopping.is_set():
                return
            delay = slot.backoff.after_exit(time.monotonic() - slot.started_at)
            slot.restarts += 1
            event = log.error if slot.backoff.crash_loop else log.warning
            event(
                "proxy worker crash loop: restarting after a delay"
                if slot.backoff.crash_loop
                else "proxy worker exited: restarting it",
                worker=slot.role.index,
                pid=process.pid,
                exit_code=code,
                signal=signal.Signals(-code).name if code < 0 else None,
                quick_exits_in_a_row=slot.backoff.quick_exits,
                restart_in_s=delay,
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)

    async def _watch_for_hung_workers(self) -> None:
        misses: dict[int, int] = {}
        while not self._stopping.is_set():
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            await asyncio.gather(*(self._check_live(slot, misses) for slot in self.slots))

    async def _check_live(self, slot: WorkerSlot, misses: dict[int, int]) -> None:
        index, pid, process = slot.role.index, slot.pid, slot.process
        if pid is None or process is None or self._stopping.is_set():
            misses.pop(index, None)
            return
        if time.monotonic() - slot.started_at < WATCHDOG_START_GRACE_S:
            misses.pop(index, None)
            return
        answer = None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(WATCHDOG_INTERVAL_S):
                answer = await slot.ask("/health/live")
        if answer is not None and answer.status_code == 200:
            misses.pop(index, None)
            return
        misses[index] = misses.get(index, 0) + 1
        if misses[index] >= WATCHDOG_MISSES and slot.pid == pid and not self._stopping.is_set():
            log.error(
                "proxy worker stopped answering: killing it so that it is replaced",
                worker=index,
                pid=pid,
                unanswered_checks=misses.pop(index),
            )
            process.kill()  # SIGKILL works on a stopped process too

    def _spawn(self, slot: WorkerSlot, port: int) -> subprocess.Popen[bytes]:
        slot.role.admin_socket.unlink(missing_ok=True)
        # The port the parent holds, in case KROUTE_PORT was 0 (any free port).
        env = {**os.environ, "KROUTE_PORT": str(port)}
        # A process group of its own: a terminal's Ctrl-C reaches the parent only, which stops
        # the workers in order (a worker still starting would die of SIGINT mid-import).
        slot.process = subprocess.Popen(
            [sys.executable, "-m", "proxy", *slot.role.argv()],
            env=env,
            stdin=subprocess.DEVNULL,
            process_group=0,
        )
        slot.started_at = time.monotonic()
        return slot.process

    async def _stop_workers(self, keepers: list[asyncio.Task[None]]) -> bool:
        """SIGTERM every worker, wait for them to drain; kill those that do not stop in time.
        True when every worker exited on its own: status 0, or killed by that SIGTERM before
        it could handle it (still starting, so nothing in flight)."""
        self._stopping.set()
        for slot in self.slots:
            if slot.pid is not None and slot.process is not None:
                slot.process.send_signal(signal.SIGTERM)
        limit = self.settings.shutdown_timeout_s + STOP_GRACE_S
        _, late = await asyncio.wait(keepers, timeout=limit)
        clean = not late
        for slot in self.slots:
            if slot.pid is not None and slot.process is not None:
                log.error("proxy worker did not stop in time: killed", worker=slot.role.index)
                slot.process.kill()
                await exited(slot.process)
                clean = False
            elif slot.process is not None and slot.process.returncode not in STOPPED_CLEANLY:
                clean = False
        for task in late:
            task.cancel()
        await asyncio.gather(*keepers, return_exceptions=True)
        return clean

    # -- the admin views, merged -----------------------------------------------------------------

    async def _metrics(self) -> list[bytes]:
        """Every worker's /metrics, merged. Parsing, merging and writing them take seconds at
        thousands of partitions (the per-replica series): done in threads, so this loop keeps
        answering health checks and watching the workers meanwhile. One scrape at a time: each
        merge reads what the one before it scraped."""
        async with self._scraping:
            asked = [slot.pid for slot in self.slots]
            answers = await asyncio.gather(*(slot.ask("/metrics") for slot in self.slots))
            texts = [
                answer.text if answer is not None and answer.status_code == 200 else None
                for answer in answers
            ]
            parsed = await asyncio.to_thread(_parsed_each, texts)
            for slot, pid, families in zip(self.slots, asked, parsed, strict=True):
                # Only while the process that answered still fills the slot: once it has
                # exited its counts are in the sums already (WorkerMetrics.exited). Not an
                # exposition: its last one is kept.
                if pid is not None and pid == slot.pid and families is not None:
                    self.metrics.scraped(pid, slot.role.index, families)
            live = [slot.pid for slot in self.slots if slot.pid is not None]
            return [await asyncio.to_thread(self._merged_exposition, live)]

    def _merged_exposition(self, live: list[int]) -> bytes:
        self._last_merged = self.metrics.merged(live)
        return generate_latest(self.registry)

    def _collect(self) -> Iterable[Metric]:
        yield from self._last_merged
        running = GaugeMetricFamily(
            "kroute_proxy_workers_running", "Proxy worker processes running (KROUTE_WORKERS)"
        )
        running.add_metric([], sum(slot.pid is not None for slot in self.slots))
        yield running
        restarts = CounterMetricFamily(
            "kroute_proxy_worker_restarts",
            "Proxy worker processes restarted after they exited",
            labels=["worker"],
        )
        for slot in self.slots:
            restarts.add_metric([str(slot.role.index)], slot.restarts)
        yield restarts
        if self.table is not None:
            yield CounterMetricFamily(
                "kroute_proxy_table_refresh_failures",
                REFRESH_FAILURES_HELP,
                value=self.table.refresh_failures,
            )
            yield CounterMetricFamily(
                "kroute_proxy_table_process_restarts",
                "The workers' table process restarted after it exited or went silent",
                value=self.table.restarts,
            )

    def _workers(self) -> list[dict[str, Any]]:
        return [
            {"worker": slot.role.index, "pid": slot.pid, "restarts": slot.restarts}
            for slot in self.slots
        ]

    async def _readiness(self) -> tuple[bool, dict[str, Any]]:
        answers = await asyncio.gather(*(slot.ask("/health/ready") for slot in self.slots))
        details = {
            slot.role.index: answer.json()
            for slot, answer in zip(self.slots, answers, strict=True)
            if answer is not None and answer.status_code in (200, 503)
        }
        return merged_readiness(details, self._workers(), self._stopping.is_set())

    async def _status(self) -> dict[str, Any]:
        answers = await asyncio.gather(*(slot.ask("/cluster/status") for slot in self.slots))
        statuses = {
            slot.role.index: answer.json()
            for slot, answer in zip(self.slots, answers, strict=True)
            if answer is not None and answer.status_code == 200
        }
        merged = merged_status(statuses, self._workers())
        if self.table is not None:
            merged["table_process"] = self.table.describe()
        return merged


class _Exposition(Collector):
    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterable[Metric]:
        return self._collect()


# -- merging the workers' views (pure) ----------------------------------------------------------


async def exited(process: subprocess.Popen[bytes]) -> int:
    """Wait for the process to exit (its pidfd turns readable) and reap it: its exit status."""
    loop = asyncio.get_running_loop()
    pidfd = os.pidfd_open(process.pid)
    gone: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not gone.done():
            gone.set_result(None)

    loop.add_reader(pidfd, readable)
    try:
        await gone
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    return process.wait()


def merged_readiness(
    details: dict[int, dict[str, Any]], workers: list[dict[str, Any]], stopping: bool
) -> tuple[bool, dict[str, Any]]:
    """Ready once every worker has started and answers ready; afterwards a worker being
    restarted is left out until it answers (it does not listen on the data port meanwhile),
    so the proxy stays ready on the others. Never while stopping."""
    first_start = [w["worker"] for w in workers if w["restarts"] == 0]
    ready = (
        not stopping
        and bool(details)
        and all(detail.get("status") == "ready" for detail in details.values())
        and all(worker in details for worker in first_start)
    )
    return ready, {
        "status": "ready" if ready else "not_ready",
        "table_loaded": bool(details) and all(d.get("table_loaded") for d in details.values()),
        "nodes_alive": max((d.get("nodes_alive", 0) for d in details.values()), default=0),
        "degraded": any(d.get("degraded") for d in details.values()),
        "shutting_down": stopping or any(d.get("shutting_down") for d in details.values()),
        "workers": [
            {**worker, "answered": worker["worker"] in details, **details.get(worker["worker"], {})}
            for worker in workers
        ],
    }


def merged_status(
    statuses: dict[int, dict[str, Any]], workers: list[dict[str, Any]]
) -> dict[str, Any]:
    """One /cluster/status for the whole proxy: the routing table as the worker with the
    newest table sees it; per node, requests and failures summed over the workers and the
    earliest ejection any worker holds (each worker ejects on what it saw itself)."""
    if not statuses:
        return {"proxy": {"table_loaded": False}, "nodes": {}, "stores": {}, "workers": workers}
    newest = max(statuses, key=lambda i: (statuses[i].get("table_built_at_ms") or 0, -i))
    merged = dict(statuses[newest])
    nodes: dict[str, dict[str, Any]] = {}
    for status in statuses.values():
        for node_id, node in status.get("nodes", {}).items():
            seen = nodes.setdefault(node_id, {**node, "requests": 0, "failures": 0})
            seen["requests"] += node.get("requests", 0)
            seen["failures"] += node.get("failures", 0)
            since = [t for t in (seen.get("ejected_since_ms"), node.get("ejected_since_ms")) if t]
            seen["ejected_since_ms"] = min(since) if since else None
    merged["nodes"] = {node_id: nodes[node_id] for node_id in sorted(nodes)}
    proxies = [status.get("proxy", {}) for status in statuses.values()]
    merged["proxy"] = {
        **merged.get("proxy", {}),
        "degraded": any(p.get("degraded") for p in proxies),
        "table_loaded": all(p.get("table_loaded") for p in proxies),
        "failovers": sum(p.get("failovers", 0) for p in proxies),
        "retry_budget_exhausted": sum(p.get("retry_budget_exhausted", 0) for p in proxies),
    }
    merged["workers"] = workers
    return merged


def _parsed_each(texts: list[str | None]) -> list[list[Metric] | None]:
    return [None if text is None else parsed_exposition(text) for text in texts]
