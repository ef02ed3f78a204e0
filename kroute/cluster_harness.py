"""A real cluster of materializer nodes, started one way for the run command, tests and benchmarks.

The embedded launcher (kroute.embedded) starts the broker and redis-server; `NodeCluster`
starts the nodes of one cluster on one topic with one set of settings (each in a data directory
of its own, under the launcher, stopped by PID), waits until they are ready, and stops them.
What "settled" means differs by caller (the tests read the nodes' reports in Redis, the
benchmarks the proxy's partition map, the run command asks for answers through the proxy), so
each passes its own test to `wait_steady`, which waits the same way for all of them.

Also here, because callers needed them in more than one place: the producer that partitions
keys as Java clients do, the proxy's partition map read by role, and a node's Spark JVM.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import Producer

from kroute.embedded import EmbeddedServices
from kroute.errors import KrouteError
from kroute.nodes import NodeHandle, start_node
from kroute.proxies import ProxyHandle


class NodeNotReady(KrouteError):
    """A node exited, or did not get ready in time, while the cluster was starting."""


class NodeExited(KrouteError):
    """A node the caller expects to be running has exited."""


@dataclass
class NodeCluster:
    """The materializer nodes of one cluster: same broker, topic and settings (KROUTE_* names
    without the prefix); node `name` keeps its store in `workdir / (dir_prefix + name)`."""

    services: EmbeddedServices
    bootstrap: str
    topic: str
    workdir: Path
    settings: dict[str, str]
    dir_prefix: str = "node-"
    nodes: dict[str, NodeHandle] = field(default_factory=dict)

    def data_dir(self, name: str) -> Path:
        return self.workdir / f"{self.dir_prefix}{name}"

    def start(self, name: str, *, wipe: bool = False) -> NodeHandle:
        """Start node `name` (replacing a stopped one of that name) without waiting until it
        is ready; `wipe` deletes its store first, so it restores from the topic."""
        if wipe:
            shutil.rmtree(self.data_dir(name), ignore_errors=True)
        node = start_node(
            self.services,
            self.bootstrap,
            self.topic,
            self.data_dir(name),
            name=name,
            wait_ready=False,
            **self.settings,
        )
        self.nodes[name] = node
        return node

    def start_all(self, names: Iterable[str]) -> None:
        """All at once: each node's Spark start-up (15-60 s) overlaps the others'."""
        for name in names:
            self.start(name)

    def wait_ready(
        self, timeout_s: float, on_ready: Callable[[str, NodeHandle], None] | None = None
    ) -> None:
        """Until every node serves (/health/ready), each within `timeout_s`."""
        for name, node in self.nodes.items():
            try:
                node.wait_ready(timeout_s=timeout_s)
            except (TimeoutError, RuntimeError) as exc:
                raise NodeNotReady(
                    f"materializer {name} did not become ready ({exc}); its log is "
                    f"{node.process.log_path} (is the machine short of memory or CPU?)"
                ) from None
            if on_ready is not None:
                on_ready(name, node)

    def check_running(self, names: Iterable[str] | None = None) -> None:
        """NodeExited for the first of `names` (default: all) whose process has exited."""
        for name in sorted(self.nodes) if names is None else names:
            process = self.nodes[name].process
            if not process.is_running():
                raise NodeExited(f"node {name} exited:\n{process.log_tail(30)}")

    def stop(self) -> None:
        """Stop every node by PID and close its HTTP client."""
        for node in self.nodes.values():
            node.process.stop()
            node.close()


def wait_steady(
    state: Callable[[], Hashable | None],
    *,
    hold_s: float,
    poll_s: float,
    timeout_s: float,
    timeout_error: Callable[[], Exception],
    check: Callable[[], None] = lambda: None,
) -> None:
    """Until `state()` has returned one and the same value, not None, for `hold_s` seconds.

    The value names what must hold still (an assignment's generation, or just True): a new
    one starts the hold again. `check` runs after each look that did not end the wait and
    raises when waiting is pointless (a process exited); after `timeout_s`, `timeout_error()`
    is raised.
    """
    deadline = time.monotonic() + timeout_s
    steady: tuple[Hashable, float] | None = None  # (value, since when)
    while True:
        value = state()
        if value is None:
            steady = None
        elif steady is None or steady[0] != value:
            steady = (value, time.monotonic())
        if steady is not None and time.monotonic() - steady[1] >= hold_s:
            return
        check()
        if time.monotonic() > deadline:
            raise timeout_error()
        time.sleep(poll_s)


def keyed_producer(bootstrap: str, linger_ms: int = 5) -> Producer:
    """A producer that puts each key in the partition the Java client would (murmur2), which
    is what `partitioner.partition` computes and every node and proxy assumes."""
    return Producer(
        {"bootstrap.servers": bootstrap, "partitioner": "murmur2_random", "linger.ms": linger_ms}
    )


def proxy_partition_map(proxy: ProxyHandle, store: str) -> list[dict[str, Any]]:
    """The proxy's view of who holds each partition of `store`, with lag (/cluster/status)."""
    return list(proxy.status()["stores"].get(store, {}).get("partition_map", []))


def replicas_in_role(entries: list[dict[str, Any]], role: str) -> list[tuple[int, str]]:
    """(partition, node) of every replica in `role` ("active" or "standby") in a partition map."""
    return [
        (entry["partition"], replica["node"])
        for entry in entries
        for replica in entry["replicas"]
        if replica["role"] == role
    ]


def spark_jvm_pid(node: NodeHandle) -> int:
    """The node's Spark JVM: a child of whichever of the node's threads started Spark."""
    children = [
        child
        for task in Path(f"/proc/{node.process.pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]
    for child in children:
        if b"java" in Path(f"/proc/{child}/cmdline").read_bytes():
            return int(child)
    raise LookupError(f"no Spark JVM among the children of node {node.process.name}: {children}")
