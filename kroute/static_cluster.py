"""Publish a cluster in Redis by hand: for services that are not kroute nodes.

The proxy routes to whatever the Redis contract describes. Materializer nodes publish
themselves; this writes the same keys for a fixed set of HTTP services (a benchmark's trivial
backends, a test's stand-in nodes), so the proxy can be put in front of them. Heartbeats are
written without a TTL: the caller says who is alive, and calls `publish` again to change
anything (lag reports carry the time); a node left out of `node_urls` is forgotten at once by
the next `publish` (`common.departed`: no grace period, the caller says it is gone). It is a
fixture, not a writer for real services (the contract wants heartbeats with a TTL, and
`kroute contract check` says so): those use `kroute adapt fixed`, which probes liveness and
reads lag (docs/existing-services.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import redis

from common.clock import now_ms
from common.contract import (
    Assignment,
    Event,
    Hosting,
    Keys,
    NodeInfo,
    PartitionAssignment,
    PartitionReport,
    ReportBodies,
    Role,
    StoreInfo,
    encode,
    write_node_report,
)
from common.departed import queue_forget

END_OFFSET = 1_000  # every partition's published high watermark
# Its reports stand until the caller publishes again (a fixture: no process renews them).
REPORT_EXPIRE_MS = 24 * 3600 * 1000


def round_robin(
    partitions: int, nodes: list[str], standbys: int = 1
) -> dict[int, PartitionAssignment]:
    """Actives dealt round robin; each partition's standbys on the next node(s)."""
    nodes = sorted(nodes)
    extra = min(standbys, len(nodes) - 1)
    return {
        p: PartitionAssignment(
            nodes[p % len(nodes)],
            tuple(nodes[(p + i) % len(nodes)] for i in range(1, extra + 1)),
        )
        for p in range(partitions)
    }


@dataclass
class StaticCluster:
    keys: Keys
    node_urls: Mapping[str, str]
    stores: dict[str, StoreInfo] = field(default_factory=dict)
    placements: dict[str, dict[int, PartitionAssignment]] = field(default_factory=dict)
    alive: set[str] = field(default_factory=set)
    lag: dict[tuple[str, str, int], int] = field(default_factory=dict)  # (node, store, p)
    lagging_since_ms: dict[tuple[str, str, int], int] = field(default_factory=dict)
    generation: int = 1
    report_bodies: ReportBodies = field(default_factory=ReportBodies)  # report:<id> written
    published_urls: dict[str, str] = field(default_factory=dict)  # node:<id> as last written

    def add_store(self, store: StoreInfo, standbys: int = 1) -> StaticCluster:
        self.stores[store.name] = store
        self.placements[store.name] = round_robin(store.partitions, list(self.node_urls), standbys)
        if not self.alive:
            self.alive = set(self.node_urls)
        return self

    def publish(self, client: redis.Redis) -> None:
        at = now_ms()
        keys = self.keys
        assignment = Assignment(self.generation, min(self.node_urls), at, dict(self.placements))
        pipe = client.pipeline(transaction=True)
        for info in self.stores.values():
            pipe.sadd(keys.stores, info.name)
            pipe.set(keys.store(info.name), encode(info))
        for node_id, url in self.node_urls.items():
            pipe.sadd(keys.nodes, node_id)
            pipe.set(keys.node(node_id), encode(NodeInfo(node_id, url, at)))
            if node_id in self.alive:
                pipe.set(keys.alive(node_id), "1")
            else:
                pipe.delete(keys.alive(node_id))
            hosted: dict[str, dict[Role, tuple[int, ...]]] = {
                store: {role: tuple(parts) for role, parts in roles.items()}
                for store, roles in assignment.for_node(node_id).items()
            }
            reports = {
                (store, partition): self._report(node_id, store, partition, at)
                for store, roles in hosted.items()
                for partition in (p for parts in roles.values() for p in parts)
            }
            hosting = Hosting(node_id, self.generation, hosted, at)
            write_node_report(
                pipe, keys, hosting, reports, REPORT_EXPIRE_MS, bodies=self.report_bodies
            )
        # Nodes published before and no longer described: gone, as far as the caller says.
        departed = sorted(set(self.published_urls) - set(self.node_urls))
        queue_forget(pipe, keys, departed)
        for node_id in departed:
            self.report_bodies.forget(node_id)
        pipe.set(keys.assignment, encode(assignment))
        pipe.publish(keys.events, encode(Event("assignment", generation=self.generation)))
        for node_id, url in self.node_urls.items():
            # A new URL is announced (the contract's rule): proxies read node:<id> rarely.
            if self.published_urls.get(node_id, url) != url:
                pipe.publish(keys.events, encode(Event("node", node_id=node_id)))
        pipe.execute()
        self.published_urls = dict(self.node_urls)

    def _report(self, node_id: str, store: str, partition: int, at: int) -> PartitionReport:
        lag = self.lag.get((node_id, store, partition), 0)
        return PartitionReport(
            current_offset=END_OFFSET - lag,
            end_offset=END_OFFSET,
            newest_record_ms=at,
            caught_up_at_ms=at
            if lag == 0
            else self.lagging_since_ms.get((node_id, store, partition), at),
            updated_at_ms=at,
        )
