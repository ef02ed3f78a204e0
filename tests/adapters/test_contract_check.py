"""`kroute contract check` against a good writer (kroute's own cluster member, the code every
materializer node runs, on real redis-server) and against deliberately broken writers: one
break at a time on top of the good cluster, each reported on the key that holds it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis
import redis.asyncio as aioredis

from common.clock import SharedClock
from common.contract import (
    Assignment,
    Hosting,
    Keys,
    NodeInfo,
    PartitionReport,
    Role,
    StoreInfo,
    lag_field,
)
from kroute.cli import main
from kroute.contract_check import Report, check
from kroute.embedded import EmbeddedServices, RedisHandle
from materializer.cluster import ClusterMember, ClusterTiming

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

STORE = StoreInfo("customers", "customers", 6)
# TTLs and leases that outlast a test (under the 10 s the checker warns about): the good
# cluster must stay as written while the breaks are checked.
TIMING = ClusterTiming(alive_ttl_ms=9_000, leader_lease_ms=9_000, grace_ms=60_000)


@pytest.fixture(scope="module")
def own_redis(embedded: EmbeddedServices) -> Iterator[RedisHandle]:
    handle = embedded.start_redis()
    yield handle
    handle.process.stop()


@pytest.fixture
def client(own_redis: RedisHandle) -> Iterator[redis.Redis]:
    connection = redis.Redis.from_url(own_redis.url)
    yield connection
    connection.close()


class _Node:
    """What a materializer node hands its ClusterMember: hosting follows the assignment."""

    def __init__(self, node_id: str, clock: SharedClock) -> None:
        self.node_id = node_id
        self.clock = clock
        self.assignment: Assignment | None = None

    def on_assignment(self, assignment: Assignment) -> None:
        self.assignment = assignment

    def roles(self) -> dict[Role, list[int]]:
        mine = self.assignment.for_node(self.node_id) if self.assignment else {}
        return mine.get(STORE.name, {"active": [], "standby": []})

    def hosting(self) -> Hosting:
        roles = {role: tuple(ps) for role, ps in self.roles().items()}
        generation = self.assignment.generation if self.assignment else 0
        return Hosting(self.node_id, generation, {STORE.name: roles}, self.clock.now_ms())

    def reports(self) -> dict[int, PartitionReport]:
        at = self.clock.now_ms()
        hosted = [p for ps in self.roles().values() for p in ps]
        return {p: PartitionReport(100, 100, at - 5, at - 1, at) for p in hosted}


def write_good_cluster(url: str, keys: Keys, seconds: float = 1.5) -> None:
    """Two cluster members (the code kroute's nodes run) lead, assign and report for a while."""

    async def run() -> None:
        connection = aioredis.Redis.from_url(url)
        clock = SharedClock()
        members = []
        for node_id in ("n1", "n2"):
            node = _Node(node_id, clock)
            members.append(
                ClusterMember(
                    redis=connection,
                    keys=keys,
                    node=NodeInfo(node_id, "http://127.0.0.1:9", 1),
                    store=STORE,
                    timing=TIMING,
                    hosting=node.hosting,
                    reports=node.reports,
                    on_assignment=node.on_assignment,
                    clock=clock,
                )
            )
        tasks = [asyncio.create_task(member.run()) for member in members]
        await asyncio.sleep(seconds)
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks)
        await connection.aclose()

    asyncio.run(run())


@pytest.fixture
def good(own_redis: RedisHandle, client: redis.Redis) -> Keys:
    keys = Keys(f"c-{uuid.uuid4().hex[:8]}")
    write_good_cluster(own_redis.url, keys)
    return keys


def findings(report: Report) -> list[tuple[str, str, str]]:
    return [(f.level, f.key, f.message) for f in report.findings]


def test_a_cluster_written_by_kroutes_own_members_is_clean(
    client: redis.Redis, good: Keys, own_redis: RedisHandle, capsys: pytest.CaptureFixture[str]
) -> None:
    report = check(client, good.cluster)
    assert report.findings == [], findings(report)
    assert main(["contract", "check", "--redis", own_redis.url, "--cluster", good.cluster]) == 0
    assert "0 error(s), 0 warning(s)" in capsys.readouterr().out


def _node_value(client: redis.Redis, keys: Keys, node: str) -> dict[str, object]:
    return dict(json.loads(client.get(keys.node(node)) or b"{}"))


def _hosting(client: redis.Redis, keys: Keys, node: str) -> dict[str, object]:
    return dict(json.loads(client.get(keys.hosting(node)) or b"{}"))


def _set_json(client: redis.Redis, key: str, body: object) -> None:
    client.set(key, json.dumps(body))


def _future_report(client: redis.Redis, k: Keys) -> None:
    hosted = _hosting(client, k, "n1")["stores"]["customers"]  # type: ignore[index]
    partition = (hosted["active"] + hosted["standby"])[0]
    field = lag_field("customers", partition)
    body = json.loads(client.hget(k.lag("n1"), field) or b"{}")
    body["updated_at_ms"] += 60_000
    body["caught_up_at_ms"] = body["updated_at_ms"]
    client.hset(k.lag("n1"), field, json.dumps(body))


def _edit_report(client: redis.Redis, k: Keys, **changes: object) -> None:
    """Change fields of n1's first lag report (its end offset stays what it read)."""
    field = sorted(client.hkeys(k.lag("n1")))[0]
    body = json.loads(client.hget(k.lag("n1"), field) or b"{}")
    body.update(changes, end_offset=body["end_offset"] if body["end_offset"] is not None else 0)
    client.hset(k.lag("n1"), field, json.dumps(body))


def _edit_node_report(client: redis.Redis, k: Keys, *, lag: bool) -> None:
    """Make n1's report:<id> say another lag for its first partition (`lag`), or leave its
    first partition out (what it serves then disagrees with hosting:<id>)."""
    body = json.loads(client.get(k.report("n1")) or b"{}")
    store = body["stores"]["customers"]
    role = "active" if store["active"] else "standby"
    index = 0 if role == "active" else len(store["active"])
    if lag:
        store["lag"][index] = [123_456, 0, 0]
    else:
        store[role] = store[role][1:]
        del store["lag"][index]
    _set_json(client, k.report("n1"), body)


def _version_of(client: redis.Redis, k: Keys) -> int:
    return int((client.get(k.report_at("n1")) or b"0 0").split()[0])


def _at_of(client: redis.Redis, k: Keys) -> int:
    return int((client.get(k.report_at("n1")) or b"0 0").split()[1])


def _unhosted_report(client: redis.Redis, k: Keys) -> None:
    """n1 stops serving its first partition but leaves that partition's report standing."""
    body = _hosting(client, k, "n1")
    roles = body["stores"]["customers"]  # type: ignore[index]
    role = "active" if roles["active"] else "standby"
    roles[role] = roles[role][1:]
    _set_json(client, k.hosting("n1"), body)


Break = Callable[[redis.Redis, Keys], object]
BREAKS: dict[str, tuple[Break, str, str, str]] = {
    # name: (break it, level, key suffix, words the finding must contain)
    "heartbeat without TTL": (
        lambda c, k: c.set(k.alive("n1"), "1"), "error", "alive:n1", "has no TTL"),
    "node value not JSON": (
        lambda c, k: c.set(k.node("n1"), "{'node_id': 'n1'}"), "error", "node:n1", "not JSON"),
    "newer schema version": (
        lambda c, k: _set_json(c, k.node("n1"), {**_node_value(c, k, "n1"), "v": 2}),
        "error", "node:n1", '"v" is 2'),
    "number as a string": (
        lambda c, k: _set_json(c, k.node("n1"), {**_node_value(c, k, "n1"), "started_at_ms": "1"}),
        "error", "node:n1", "field started_at_ms: Input should be a valid integer"),
    "unknown field": (
        lambda c, k: _set_json(c, k.node("n1"), {**_node_value(c, k, "n1"), "zone": "eu"}),
        "error", "node:n1", "field zone: Extra inputs are not permitted"),
    "url not http://host:port": (
        lambda c, k: _set_json(c, k.node("n1"), {**_node_value(c, k, "n1"), "url": "https://x"}),
        "error", "node:n1", "is not http://host:port"),
    "node_id differs from the key": (
        lambda c, k: _set_json(c, k.node("n1"), {**_node_value(c, k, "n1"), "node_id": "n2"}),
        "error", "node:n1", "node_id is 'n2'"),
    "partition out of range": (
        lambda c, k: _set_json(c, k.hosting("n1"), {**_hosting(c, k, "n1"), "stores": {
            "customers": {"active": [0, 6], "standby": []}}}),
        "error", "hosting:n1", "partitions [6] outside 0..5"),
    "role that is not active/standby": (
        lambda c, k: _set_json(c, k.hosting("n1"), {**_hosting(c, k, "n1"), "stores": {
            "customers": {"leader": [0]}}}),
        "error", "hosting:n1", "Input should be 'active' or 'standby'"),
    "hosting disagrees with the assignment": (
        lambda c, k: (c.delete(*(key("n1") for key in (k.lag, k.report, k.report_at))),
                      _set_json(c, k.hosting("n1"), {
            **_hosting(c, k, "n1"), "stores": {"customers": {"active": [], "standby": []}}})),
        "warning", "assignment", "its hosting does not serve it so"),
    "compact report not one": (
        lambda c, k: _set_json(c, k.report("n1"), {"v": 1, "node_id": "n1"}),
        "error", "report:n1", "proxies refuse it"),
    "compact report disagrees with lag": (
        lambda c, k: _edit_node_report(c, k, lag=True), "error", "report:n1", "lag 123456"),
    "compact report disagrees with hosting": (
        lambda c, k: _edit_node_report(c, k, lag=False), "error", "report:n1",
        "disagrees with"),
    "compact report without report_at": (
        lambda c, k: c.delete(k.report_at("n1")), "error", "report_at:n1", "absent while"),
    "report_at not two integers": (
        lambda c, k: c.set(k.report_at("n1"), "abc", keepttl=True), "error", "report_at:n1",
        "proxies refuse it"),
    "report_at names another version": (
        lambda c, k: c.set(k.report_at("n1"), f"1 {_at_of(c, k)}", keepttl=True), "error",
        "report_at:n1", "names version 1"),
    "report_at in the future": (
        lambda c, k: c.set(k.report_at("n1"), f"{_version_of(c, k)} {_at_of(c, k) + 60_000}",
                           keepttl=True), "error", "report_at:n1", "in the future"),
    "report_at without expiry": (
        lambda c, k: c.persist(k.report_at("n1")), "error", "report_at:n1", "has no expiry"),
    "report_at without the body": (
        lambda c, k: c.delete(k.report("n1")), "warning", "report_at:n1", "present without"),
    "lag report for a partition not hosted": (
        _unhosted_report, "error", "lag:n1", "a partition the node's hosting does not list"),
    "position past the end offset": (
        lambda c, k: _edit_report(c, k, current_offset=10**9), "error", "lag:n1",
        "is past end_offset"),
    "caught up after the report was written": (
        lambda c, k: _edit_report(c, k, caught_up_at_ms=10**13), "error", "lag:n1",
        "later than updated_at_ms"),
    "report stamped in the future": (
        _future_report, "error", "lag:n1", "in the future"),
    "lag field name": (
        lambda c, k: c.hset(k.lag("n1"), "customers-3", "{}"), "error", "lag:n1",
        "field names are <store>/<partition>"),
    "wrong Redis type": (
        lambda c, k: (c.delete(k.nodes), c.set(k.nodes, "n1,n2")), "error", "nodes",
        "is a string, must be a set"),
    "assignment names an unregistered node": (
        lambda c, k: c.srem(k.nodes, "n2"), "error", "assignment", "not in the nodes set"),
    "no assignment": (lambda c, k: c.delete(k.assignment), "error", "assignment", "missing"),
    "generation not a number": (
        lambda c, k: _set_json(c, k.assignment, {
            **json.loads(c.get(k.assignment) or b"{}"), "generation": "7"}),
        "error", "assignment", "field generation"),
    "unknown key format": (
        lambda c, k: _set_json(c, k.store("customers"), {
            **json.loads(c.get(k.store("customers")) or b"{}"), "key_format": "yaml"}),
        "error", "store:customers", "key_format 'yaml'"),
    "leader lease without TTL": (
        lambda c, k: c.persist(k.leader), "error", "leader", "has no TTL"),
    "a key the contract does not name": (
        lambda c, k: c.set(k.prefix + "host:n1", "{}"), "warning", "host:n1", "a typo?"),
    "dead node": (lambda c, k: c.delete(k.alive("n2")), "warning", "alive:n2", "counts as dead"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(BREAKS))
def test_each_break_is_reported_on_its_key(client: redis.Redis, good: Keys, name: str) -> None:
    breaking, level, key_suffix, words = BREAKS[name]
    breaking(client, good)
    report = check(client, good.cluster)
    matching = [
        f
        for f in report.findings
        if f.level == level and f.key.startswith(good.prefix + key_suffix) and words in f.message
    ]
    assert matching, findings(report)
    if level == "warning":
        assert not report.errors, findings(report)


def test_the_command_fails_on_errors_and_speaks_json(
    client: redis.Redis, good: Keys, own_redis: RedisHandle, capsys: pytest.CaptureFixture[str]
) -> None:
    client.set(good.alive("n1"), "1")  # no TTL
    argv = ["contract", "check", "--redis", own_redis.url, "--cluster", good.cluster, "--json"]
    assert main(argv) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False
    assert out["errors"] == 1
    assert out["findings"][0]["key"] == good.alive("n1")


def test_a_cluster_with_no_keys_names_the_clusters_there(client: redis.Redis, good: Keys) -> None:
    report = check(client, "no-such-cluster")
    assert len(report.errors) == 1
    assert good.cluster in report.errors[0].message
