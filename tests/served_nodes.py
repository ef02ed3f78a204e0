"""Real node HTTP apps (materializer.server over a real RocksDB store and LagTracker) served by
uvicorn in this process, so a test sets each store's position exactly, without Spark.

The store's end offsets are kept fresh the way a node's lag loop keeps them (every 100 ms), at
whatever `end` the test sets; `write` applies a record as the pipeline would."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

from common.clock import now_ms
from common.contract import Role
from kroute.embedded import free_port
from materializer.forwarding import Forwarder
from materializer.hosting import HostedPartitions
from materializer.lag import LagTracker
from materializer.pipeline import Stall
from materializer.server import NodeApp, NodeState
from materializer.sink import IngestStats
from materializer.store import Row, Store
from partitioner import KeyPartitioner


@dataclass
class StandInNode:
    """What a running node tells its HTTP app (`materializer.server.RunningNode`), as a test
    sets it: no Spark, no cluster."""

    partitioner: KeyPartitioner | None = None
    forwarder: Forwarder | None = None
    status: dict[str, Any] = field(default_factory=dict)  # the pipeline's
    stalled: dict[int, Stall] = field(default_factory=dict)
    owner: str | None = None  # every partition's owner, for forwarding

    def pipeline_status(self) -> dict[str, Any]:
        return dict(self.status)

    def stalls(self) -> dict[int, Stall]:
        return dict(self.stalled)

    def owner_of(self, partition: int) -> str | None:
        return self.owner


def hosting(
    partitions: Iterable[int], role: Role = "active", roles: Mapping[int, Role] | None = None
) -> HostedPartitions:
    """A node's hosting as an assignment leaves it: these partitions, each in `role` unless
    `roles` says otherwise."""
    hosted = HostedPartitions(grace_ms=60_000, default_role=role)
    hosted.assign({p: (roles or {}).get(p, role) for p in partitions}, now_ms())
    return hosted


class ServedNode:
    """One node: store, lag tracker and HTTP server (127.0.0.1, a free port)."""

    def __init__(self, name: str, workdir: Path, partitions: int, *, wait_ms: int = 300) -> None:
        self.name = name
        self.partitions = partitions
        self.store = Store(workdir / name)
        hosted = tuple(range(partitions))
        for p in hosted:
            self.store.add_partition(p)
        self.end: dict[int, int] = dict.fromkeys(hosted, 0)
        self.state = NodeState(
            node_id=name,
            store_name="customers",
            topic="bookings",
            value_format="json",
            store=self.store,
            lag=LagTracker(self.store, "bookings", lambda: hosted),
            stats=IngestStats(),
            hosting=hosting(hosted),
            node=StandInNode(
                KeyPartitioner("string", "murmur2", partitions), status={"running": True}
            ),
            min_offset_wait_ms=wait_ms,
        )
        self.port = free_port()
        config = uvicorn.Config(
            NodeApp(self.state),
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="off",
            loop="asyncio",
            http="httptools",
        )
        self._server = uvicorn.Server(config)
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._server.run, daemon=True),
            threading.Thread(target=self._refresh_ends, daemon=True),
        ]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServedNode:
        self.state.lag.apply_ends(self.end, now_ms())
        for thread in self._threads:
            thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, f"node {self.name} did not start"
            time.sleep(0.02)
        return self

    def write(self, partition: int, key: str, value: object, offset: int) -> None:
        """The record at `offset` applied (the store's position moves to offset + 1)."""
        row = Row(key.encode(), json.dumps(value).encode(), offset, now_ms())
        self.store.apply(partition, [row], offset + 1, now_ms())
        self.end[partition] = max(self.end[partition], offset + 1)

    def set_end(self, partition: int, end: int) -> None:
        """The partition's log now ends at `end`, as the node's next lag refresh reads it."""
        self.end[partition] = end
        self.state.lag.apply_ends(dict(self.end), now_ms())

    def position(self, partition: int) -> int:
        checkpoint = self.store.checkpoint(partition)
        return checkpoint.next_offset if checkpoint else 0

    def _refresh_ends(self) -> None:
        while not self._stop.wait(0.1):
            self.state.lag.apply_ends(dict(self.end), now_ms())

    def stop(self) -> None:
        self._stop.set()
        self._server.should_exit = True
        for thread in self._threads:
            thread.join(10)
        self.store.close()
