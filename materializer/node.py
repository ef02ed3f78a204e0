"""A materializer node: the composition root that wires store, Spark, lag and HTTP together.

Start-up never crash-loops: the HTTP server answers at once (liveness yes, readiness no), the
broker is retried with a capped back-off until it answers, then Spark starts (seconds: the JVM)
and reads every hosted partition from the store's checkpoint. SIGTERM/SIGINT stop HTTP, then
the query, then close the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Iterator
from typing import Any

import structlog
import uvicorn
from aiokafka.client import AIOKafkaClient

from common.java import JavaRuntime
from materializer.lag import LagTracker
from materializer.pipeline import Pipeline, QueryPlan, create_spark_session
from materializer.server import NodeApp, NodeState
from materializer.settings import NodeSettings
from materializer.sink import BatchSink, IngestStats
from materializer.store import Store
from materializer.transform import load_transform
from partitioner import KeyPartitioner

log = structlog.get_logger("kroute.materializer.node")


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The node handles SIGINT/SIGTERM itself: after HTTP it must stop Spark and the store.
        yield


def bind_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(
            f"kroute materializer: cannot listen on {host}:{port}: {exc.strerror} "
            "(is the port taken? set KROUTE_PORT)"
        ) from exc
    sock.listen(1024)
    sock.setblocking(False)
    return sock


async def connect_to_broker(settings: NodeSettings) -> tuple[AIOKafkaClient, int]:
    """(client, partition count of the topic), retrying with a capped back-off."""
    delay = 0.5
    while True:
        client = AIOKafkaClient(
            bootstrap_servers=settings.bootstrap_servers, request_timeout_ms=5_000
        )
        try:
            await client.bootstrap()
            metadata = await client.fetch_all_metadata()
            partitions = metadata.partitions_for_topic(settings.topic)
            if partitions:
                return client, len(partitions)
            problem = f"topic {settings.topic!r} does not exist"
        except Exception as exc:  # noqa: BLE001 - any failure: say what, wait, try again
            problem = f"broker {settings.bootstrap_servers} not reachable: {exc}"
        await client.close()
        log.warning("waiting for Kafka", problem=problem, retry_in_s=delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, settings.start_retry_max_s)


class Node:
    def __init__(self, settings: NodeSettings, java: JavaRuntime) -> None:
        self.settings = settings
        self.java = java
        self.store = Store(settings.data_dir / "stores" / settings.store_name)
        self.stats = IngestStats()
        self.pipeline: Pipeline | None = None
        self.state = NodeState(
            node_id=settings.node_id,
            store_name=settings.store_name,
            topic=settings.topic,
            key_format=settings.key_format,
            value_format=settings.value_format,
            role=settings.role,
            store=self.store,
            lag=LagTracker(self.store, settings.topic, lambda: self.state.hosted),
            stats=self.stats,
            pipeline_status=self._pipeline_status,
        )
        self.transform = load_transform(settings.transform, settings.merge)
        self.exit_code = 0
        self._stop = asyncio.Event()
        self._client: AIOKafkaClient | None = None
        self._lag_task: asyncio.Task[None] | None = None

    def _pipeline_status(self) -> dict[str, Any]:
        pipeline = self.pipeline
        if pipeline is None:
            return {"running": False, "state": "starting"}
        progress = pipeline.progress() or {}
        return {
            "running": pipeline.running,
            "restarts": pipeline.restarts,
            "last_error": pipeline.last_error,
            "last_batch": {k: progress.get(k) for k in ("batchId", "numInputRows", "durationMs")}
            if progress
            else None,
        }

    def plan(self) -> QueryPlan:
        checkpoints = self.store.checkpoints()
        return QueryPlan(
            topic=self.settings.topic,
            starting_offsets={
                p: (cp.next_offset if (cp := checkpoints.get(p)) else 0) for p in self.state.hosted
            },
        )

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._stop.set)
        sock = bind_socket(self.settings.host, self.settings.port)
        host, port = sock.getsockname()[:2]
        server = _Server(
            uvicorn.Config(
                NodeApp(self.state),
                http="httptools",
                lifespan="off",
                access_log=False,
                log_config=None,
                timeout_graceful_shutdown=5,
            )
        )
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        log.info(
            "node listening",
            node=self.settings.node_id,
            url=f"http://{host}:{port}",
            store=self.settings.store_name,
            topic=self.settings.topic,
        )
        self.state.lag.refresh_offsets_only()
        starting = asyncio.create_task(self._start_materializing())
        try:
            await self._stop.wait()
        finally:
            log.info("node stopping")
            server.should_exit = True
            background = [task for task in (starting, self._lag_task) if task is not None]
            for task in background:
                task.cancel()
            await asyncio.gather(serving, *background, return_exceptions=True)
            if self.pipeline is not None:
                await asyncio.to_thread(self.pipeline.stop)
            if self._client is not None:
                await self._client.close()
            self.store.close()
            log.info("node stopped")

    async def _start_materializing(self) -> None:
        self._client, num_partitions = await connect_to_broker(self.settings)
        try:
            hosted = self.settings.hosted_partitions(num_partitions)
        except ValueError as exc:
            log.error("bad configuration", error=str(exc))
            self.exit_code = 2
            self._stop.set()
            return
        for partition in hosted:
            self.store.add_partition(partition)
        self.state.hosted = hosted
        self.state.partitioner = KeyPartitioner(
            self.settings.key_format, self.settings.partitioner, num_partitions
        )
        self._lag_task = asyncio.create_task(
            self.state.lag.run(self._client, self.settings.lag_interval_ms / 1000)
        )
        log.info(
            "starting Spark",
            master=self.settings.spark_master,
            java=str(self.java.java),
            partitions=list(hosted),
        )
        spark = await asyncio.to_thread(create_spark_session, self.settings, self.java.java_home)
        sink = BatchSink(self.store, self.transform, self.settings.value_format, self.stats)
        self.pipeline = Pipeline(spark, self.settings, sink, self.plan)
        self.pipeline.start()
