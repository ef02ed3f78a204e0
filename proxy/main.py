"""The proxy's composition root: settings → collaborators → listeners; SIGTERM → graceful stop.

python -m proxy        (configured by KROUTE_* variables; see proxy/settings.py)

KROUTE_WORKERS=1 runs one proxy process. More make this process the parent of that many
workers (proxy.workers), each of them this same program started with a worker role.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import sys
from typing import Any

import redis.asyncio as aioredis
import structlog
import uvloop
from prometheus_client import CollectorRegistry, generate_latest

from common.clock import now_ms
from common.contract import Keys
from common.known_settings import report_unknown_variables
from common.logging import configure_logging
from common.settings import SettingsError, help_text, redacted_url
from proxy._hotpath import Hub
from proxy.admin import AdminApp, AdminViews, admin_server
from proxy.exchange import Exchange, ExchangeContext
from proxy.exposition import encoded
from proxy.handler import BUDGET_HEADERS, RequestHandler, choice_policy
from proxy.health import Ejections
from proxy.http import BODY_HEADERS, DROP_FROM_REQUEST, DROP_FROM_RESPONSE, status_lines
from proxy.lag_metrics import replica_gauge_lines
from proxy.listener import Limits, Listener
from proxy.metrics import (
    MetricsCollector,
    ProxyMetrics,
    node_lines,
    replica_choice_lines,
)
from proxy.outliers import Outliers
from proxy.retry_budget import RetryBudget
from proxy.routes import RouteTable
from proxy.routing import RoutingSnapshot
from proxy.settings import ProxySettings
from proxy.status import cluster_status, node_counts, status_page
from proxy.table_process import (
    REFRESH_FAILURES_HELP,
    SharedTableProcess,
    TableConfig,
    TableProcess,
)
from proxy.upstream import UpstreamPool
from proxy.watcher import TableWatcher, redis_client
from proxy.workers import Supervisor, WorkerRole, die_with_supervisor, worker_role

log = structlog.get_logger("kroute.proxy")
EXIT_OK, EXIT_CONFIG, EXIT_BIND = 0, 2, 3


class Proxy:
    """One proxy process: the whole proxy, or one worker of several (`worker` given)."""

    def __init__(self, settings: ProxySettings, worker: WorkerRole | None = None) -> None:
        self.abandoned = False  # a background task did not stop when cancelled (see _stopped)
        self.settings = settings
        self.worker = worker
        self.metrics = ProxyMetrics()
        self._stop = asyncio.Event()
        self.redis = redis_client(
            settings.redis_url.get_secret_value(),
            settings.redis_timeout_ms,
            str(settings.redis_ca_file) if settings.redis_ca_file else None,
        )
        # The C path serves the common case; with the access log on, every request takes the
        # Python path (which logs each one). Answers with a retry status have no status line
        # in C, so the C path hands them to the Python exchange, which fails over; so are
        # 5xx when they count towards ejection (proxy.outliers).
        retry_statuses = settings.retry_status_codes()
        counted = frozenset(range(500, 600)) if settings.eject_consecutive_5xx else frozenset()
        try_timeout_s = settings.try_timeout_ms() / 1000  # the C path forwards keyed reads only
        self.hub = Hub(
            status_lines=status_lines(leave_out=retry_statuses | counted),
            request_drop=tuple(sorted(DROP_FROM_REQUEST)),
            response_drop=tuple(sorted(DROP_FROM_RESPONSE)),
            python_only=BODY_HEADERS + BUDGET_HEADERS,
            id_prefix=_request_id_prefix(worker),
            response_timeout_s=try_timeout_s,
            idle_timeout_s=settings.idle_timeout_ms / 1000,
            max_response_bytes=settings.max_response_bytes,
            max_request_bytes=settings.max_header_bytes,
            max_headers=settings.max_headers,
            idle_per_origin=settings.upstream_idle_per_node,
            spread=settings.spread,
        )
        self.hub.enabled = settings.hot_path and not settings.access_log
        self.pool = UpstreamPool(
            hub=self.hub,
            connect_timeout_s=settings.connect_timeout_ms / 1000,
            response_timeout_s=settings.upstream_timeout_ms / 1000,
            idle_per_origin=settings.upstream_idle_per_node,
            max_response_bytes=settings.max_response_bytes,
            idle_timeout_s=settings.upstream_idle_timeout_ms / 1000,
            try_timeout_s=try_timeout_s,
            hedge_after_s=settings.hedge_after_ms / 1000 if settings.hedge_after_ms else None,
        )
        self.ejections = Ejections(
            eject_ms=settings.eject_ms,
            probe_interval_ms=settings.probe_interval_ms,
            probe_timeout_s=settings.connect_timeout_ms / 1000 + 0.5,
            health_path=settings.health_path,
        )
        self.watcher = _watcher(settings, self.redis, worker)
        context = ExchangeContext(
            pool=self.pool,
            ejections=self.ejections,
            metrics=self.metrics,
            refresh_table=self.watcher.refresh_soon,
            retry_budget=RetryBudget(
                percent=settings.retry_budget_percent,
                min_per_s=settings.min_retries_per_s,
                burst=settings.retry_burst,
                pending=self.hub.take_deposits,
            ),
            access_log=settings.access_log,
            retry_statuses=retry_statuses,
            try_timeout_s=try_timeout_s,
            hedging=settings.hedge_after_ms is not None,
            outliers=Outliers(
                self.ejections,
                self.metrics,
                consecutive_5xx=settings.eject_consecutive_5xx,
                max_ejection_percent=settings.max_ejection_percent,
                live_nodes=lambda: len(self.watcher.snapshot.alive),
            )
            if settings.eject_consecutive_5xx
            else None,
        )
        self.handler = RequestHandler(
            routes=RouteTable(settings.route_specs()),
            policy=choice_policy(settings),
            context=context,
            metrics=self.metrics,
            hub=self.hub,
        )
        self.listener = Listener(
            self.handler,
            Limits(
                max_header_bytes=settings.max_header_bytes,
                max_headers=settings.max_headers,
                max_body_bytes=settings.max_body_bytes,
                request_timeout_s=settings.request_timeout_ms / 1000,
                idle_timeout_s=settings.idle_timeout_ms / 1000,
                max_connections=settings.max_connections,
                send_timeout_s=settings.send_timeout_ms / 1000,
                close_timeout_s=settings.close_timeout_ms / 1000,
            ),
            self.hub,
        )
        self.context = context
        self.pool.adopt = lambda connection: Exchange.adopt(context, connection)
        self.ejections.on_change = self.handler.forget_choices
        self.watcher.on_snapshot = self.handler.use_snapshot
        self.watcher.keep_choices(
            self.handler.choice_stability, self.handler.renew_choices, self.handler.renew_due
        )
        self.watcher.freeze_heap = True
        self.watcher.stall_report_ms = settings.stall_report_ms
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(
            MetricsCollector(self.metrics, self._gauges, self.hub.stats, self._counts)
        )

    def stop(self) -> None:
        self._stop.set()

    def _gauges(self) -> dict[str, float]:
        snapshot = self.watcher.snapshot
        return {
            "table_age_seconds": (now_ms() - snapshot.built_at_ms) / 1000
            if snapshot.built_at_ms
            else -1.0,
            "table_generation": snapshot.generation,
            "redis_degraded": float(self.watcher.degraded),
            "nodes_alive": len(snapshot.alive),
            "nodes_ejected": len(self.ejections.ejected),
            "client_connections": len(self.listener.connections),
            "requests_in_flight": self.context.in_flight + self.hub.in_flight,
            "upstream_connections_idle": self.pool.idle_count(),
            "upstream_connections_busy": self.pool.busy_count(),
        }

    def _counts(self) -> dict[str, tuple[str, float]]:
        counts: dict[str, tuple[str, float]] = {
            "upstream_connections_opened": (
                "Connections opened to nodes",
                self.pool.opened,
            ),
        }
        # A table process shared by the workers: its failures are counted once, by the
        # supervisor, not once per worker.
        if not isinstance(self.watcher, SharedTableProcess):
            counts["table_refresh_failures"] = (
                REFRESH_FAILURES_HELP,
                self.watcher.refresh_failures,
            )
        return counts

    async def _metrics_view(self) -> list[bytes]:
        """The request path's metrics, rendered on the loop (they read state only the loop
        changes, none of it growing with the table), then the series that do grow, rendered in
        a thread so a scrape does not stop the event loop for as long as they take
        (`_table_series`). One exposition, in parts: their metric names differ."""
        own = generate_latest(self.registry)
        return [own, *await asyncio.to_thread(self._table_series, self.watcher.snapshot)]

    def _table_series(self, snapshot: RoutingSnapshot) -> list[bytes]:
        """The replicas' lag gauges, from the immutable snapshot, the per-replica request
        counters and the families with a series per node: at 20,000 partitions with a standby
        each, 200,000 lines and about 20 MB of text, encoded in parts (`encoded`)."""
        lines = replica_gauge_lines(snapshot, now_ms())
        lines += replica_choice_lines(self.metrics)
        lines += node_lines(self.metrics)
        return encoded(lines)

    async def _status_view(self) -> dict[str, Any]:
        """Inputs gathered on the loop; the walk over every partition in a thread."""
        snapshot = self.watcher.snapshot
        requests, failures = node_counts(self.metrics, list(snapshot.node_urls))
        return await asyncio.to_thread(
            cluster_status,
            snapshot,
            now_ms=now_ms(),
            ejected={n: self.ejections.since(n) for n in self.ejections.ejected},
            requests=requests,
            failures=failures,
            proxy=self._proxy_status(),
        )

    async def _readiness_view(self) -> tuple[bool, dict[str, Any]]:
        return self._readiness()

    def _proxy_status(self) -> dict[str, Any]:
        return {
            "degraded": self.watcher.degraded,
            "redis_error": self.watcher.last_error,
            "table_loaded": self.watcher.loaded,
            "failovers": self.metrics.failovers,
            "retry_budget_exhausted": self.metrics.retry_budget_exhausted,
        }

    def _readiness(self) -> tuple[bool, dict[str, Any]]:
        snapshot = self.watcher.snapshot
        ready = self.watcher.loaded and bool(snapshot.alive) and not self.listener.closing
        return ready, {
            "status": "ready" if ready else "not_ready",
            "table_loaded": self.watcher.loaded,
            "nodes_alive": len(snapshot.alive),
            "degraded": self.watcher.degraded,
            "shutting_down": self.listener.closing,
        }

    async def run(self) -> int:
        settings = self.settings
        worker = self.worker
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._stop.set)
        await self.watcher.start()  # serve from the first table if Redis is there already
        self.pool.start()
        try:
            host, port = await self.listener.start(
                settings.host, settings.port, reuse_port=worker is not None
            )
        except OSError as exc:
            log.error(
                "cannot listen on the data port (is it taken? set KROUTE_PORT)",
                host=settings.host,
                port=settings.port,
                error=exc.strerror or str(exc),
            )
            return EXIT_BIND
        admin_app = AdminApp(
            views=AdminViews(self._metrics_view, self._status_view, self._readiness_view),
            status_page=status_page(),
            # a worker's admin is a Unix socket in a directory only the proxy's user may enter
            token=settings.admin_token.get_secret_value()
            if settings.admin_token and worker is None
            else None,
        )
        admin = (
            admin_server(admin_app, host=settings.admin_host, port=settings.admin_port)
            if worker is None
            else admin_server(admin_app, uds=worker.admin_socket)
        )
        serving_admin = asyncio.create_task(admin.serve())
        background = [
            asyncio.create_task(self.watcher.run(), name="table watcher"),
            asyncio.create_task(
                self.ejections.run(
                    lambda n: n in self.watcher.snapshot.alive,
                    lambda n: self.watcher.snapshot.node_urls.get(n),  # noqa: PLW0108 - the snapshot is replaced
                ),
                name="ejection probes",
            ),
        ]
        await asyncio.sleep(0)
        log.info(
            "proxy listening",
            data_url=f"http://{host}:{port}",
            admin_url=f"http://{settings.admin_host}:{settings.admin_port}"
            if worker is None
            else f"unix:{worker.admin_socket}",
            worker=None if worker is None else worker.index,
            cluster=settings.cluster,
            routes=[spec.path for spec in settings.route_specs()],
            table_loaded=self.watcher.loaded,
            redis=redacted_url(settings.redis_url),
        )
        try:
            await self._stop.wait()
        finally:
            log.info(
                "proxy stopping: draining in-flight requests", timeout_s=settings.shutdown_timeout_s
            )
            unfinished = await self.listener.shutdown(settings.shutdown_timeout_s)
            admin.should_exit = True
            for task in background:
                task.cancel()
            self.abandoned = not await _stopped([serving_admin, *background])
            self.pool.close()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(STOP_TASKS_S):
                    await self.ejections.close()
                    await self.redis.aclose()
            log.info("proxy stopped", unfinished_requests=unfinished)
        return EXIT_OK


def _watcher(
    settings: ProxySettings, redis: aioredis.Redis, worker: WorkerRole | None
) -> TableWatcher:
    """The table's keeper: on this loop, or (KROUTE_TABLE_PROCESS) in a process of its own,
    which the supervisor runs for every worker when there are several."""
    keys = Keys(settings.cluster)
    if not settings.table_process_on():
        return TableWatcher(
            redis,
            keys,
            refresh_interval_ms=settings.refresh_interval_ms,
            networks=settings.networks(),
        )
    config = table_config(settings)
    if worker is not None and worker.table_socket is not None:
        return SharedTableProcess(redis, keys, config=config, path=worker.table_socket)
    return TableProcess(redis, keys, config=config)


def table_config(settings: ProxySettings) -> TableConfig:
    """What the table process needs of the settings."""
    return TableConfig(
        redis_url=settings.redis_url.get_secret_value(),
        redis_timeout_ms=settings.redis_timeout_ms,
        redis_ca_file=str(settings.redis_ca_file) if settings.redis_ca_file else None,
        cluster=settings.cluster,
        refresh_interval_ms=settings.refresh_interval_ms,
        networks=settings.networks(),
        log_level=settings.log_level,
        stall_report_ms=settings.stall_report_ms,
        cpus=settings.table_cpus(),
        stability=choice_policy(settings).stability,
    )


def _request_id_prefix(worker: WorkerRole | None) -> bytes:
    """Random per process, so ids from different proxies never collide; a worker's also says
    which worker it is (`<random>.<worker>-<count>`)."""
    prefix = os.urandom(4).hex()
    return (prefix if worker is None else f"{prefix}.{worker.index}").encode()


# How long stopping waits for the background tasks (already cancelled) before it gives up on
# them: a shutdown must end, whatever a library does with a cancellation.
STOP_TASKS_S = 5.0


async def _stopped(tasks: list[asyncio.Task[Any]]) -> bool:
    """Wait for cancelled tasks to end; False (and each stuck task's stack logged) when some
    did not within STOP_TASKS_S."""
    _, pending = await asyncio.wait(tasks, timeout=STOP_TASKS_S)
    if not pending:
        return True
    current = asyncio.current_task()
    for task in asyncio.all_tasks():
        if task is current or task.done():
            continue
        stack = io.StringIO()
        task.print_stack(file=stack)
        log.error(
            "a task did not stop when cancelled: abandoned",
            task=task.get_name(),
            stack=stack.getvalue(),
        )
    return False


_USAGE = "python -m proxy  (configured by KROUTE_* environment variables)"
_SUMMARY = (
    "Run the partition-aware proxy: each keyed request goes to the node that holds its "
    "partition (or a standby inside the lag budget)."
)


GIL_SWITCH_S = 0.001


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args in (["--help"], ["-h"]):
        print(help_text(ProxySettings, _USAGE, _SUMMARY), end="")
        return EXIT_OK
    try:
        settings = ProxySettings.from_env()
    except SettingsError as exc:
        print(f"kroute proxy: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    configure_logging(settings.log_level, component="proxy")
    worker = worker_role(args)
    if worker is None:
        report_unknown_variables(ProxySettings)  # once, by the parent (workers share its env)
    else:
        structlog.contextvars.bind_contextvars(worker=worker.index)
        die_with_supervisor(worker)

    async def run() -> int:  # built inside the loop: collaborators bind to the running loop
        if worker is None and settings.workers > 1:
            shared = table_config(settings) if settings.table_process_on() else None
            return await Supervisor(settings, shared).run()
        # Work handed to a thread (rendering the lag gauges, decoding a new assignment) runs
        # Python while the loop waits for the GIL: hand it back every millisecond, not every
        # 5 ms (CPython's default), so such work stalls requests by at most about that.
        sys.setswitchinterval(GIL_SWITCH_S)
        proxy = Proxy(settings, worker)
        code = await proxy.run()
        if proxy.abandoned:  # the loop's own close would wait for them again, without end
            os._exit(code)
        return code

    return uvloop.run(run())
