"""Issue 19 items 3 and 4 through a real proxy: a stale routing table never serves beyond a lag
budget or short of a read-your-writes offset, because the nodes enforce both.

Two real node apps (materializer.server over real RocksDB stores, served by uvicorn in this
process: tests.served_nodes) are published in a real redis-server by kroute.static_cluster,
whose reports claim every replica is at the partition's end (lag 0, position 1000) whatever
the stores hold: the table is stale. n0 is the active of the even partitions, n1 their
standby. Every request carries a unique x-request-id, checked on its answer.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import redis

from common.contract import Keys, StoreInfo
from kroute.embedded import EmbeddedServices
from kroute.proxies import ProxyHandle, start_proxy
from kroute.static_cluster import StaticCluster
from partitioner import partition
from tests.served_nodes import ServedNode

pytestmark = pytest.mark.integration

PARTITIONS = 4
WAIT_MS = 300  # the nodes' KROUTE_MIN_OFFSET_WAIT_MS
REFRESH_MS = 200


def key_in(p: int, tag: str) -> str:
    return next(f"{tag}-{i}" for i in range(10_000) if partition(f"{tag}-{i}".encode(), 4) == p)


@dataclass
class Setup:
    nodes: dict[str, ServedNode]
    proxy: ProxyHandle
    redis: redis.Redis
    http: httpx.Client

    def get(self, key: str, **headers: str) -> tuple[httpx.Response, str]:
        """GET through the proxy with a unique request id, checked on the answer."""
        request_id = uuid.uuid4().hex
        sent = {name.replace("_", "-"): value for name, value in headers.items()}
        response = self.http.get(
            f"{self.proxy.url}/stores/customers/keys/{key}",
            headers={"x-request-id": request_id, **sent},
        )
        assert response.headers["x-request-id"] == request_id, response.headers
        return response, request_id

    def table_reads(self) -> int:
        """How often the proxy has read its table from redis (two SMEMBERS a read)."""
        stats = self.redis.info("commandstats")
        return int(stats.get("cmdstat_smembers", {}).get("calls", 0)) // 2


@pytest.fixture(scope="module")
def setup(embedded: EmbeddedServices, tmp_path_factory) -> Iterator[Setup]:
    workdir = tmp_path_factory.mktemp("freshness")
    nodes = {n: ServedNode(n, workdir, PARTITIONS, wait_ms=WAIT_MS).start() for n in ("n0", "n1")}
    redis_server = embedded.start_redis()
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(f"fresh-{uuid.uuid4().hex[:8]}")
    table = StaticCluster(keys, {name: node.url for name, node in nodes.items()})
    table.add_store(StoreInfo("customers", "customers", PARTITIONS, "string"))
    table.publish(client)  # every replica at lag 0, position 1000: whatever the stores say
    proxy = start_proxy(
        embedded,
        redis_server.url,
        name=f"proxy-{keys.cluster}",
        cluster=keys.cluster,
        max_lag="100",  # the configured budget: a looser header must not loosen the node's
        refresh_interval_ms=str(REFRESH_MS),
        lag_report_stale_ms="600000",
        min_retries_per_s="100000",
        retry_burst="100000",
    )
    try:
        yield Setup(nodes, proxy, client, httpx.Client(timeout=10))
    finally:
        proxy.process.stop()
        proxy.close()
        for node in nodes.values():
            node.stop()
        client.close()
        redis_server.process.stop()


def test_a_stale_table_never_serves_beyond_the_budget(setup):
    n0, n1 = setup.nodes["n0"], setup.nodes["n1"]
    key = key_in(0, "budget")
    n0.write(0, key, {"who": "n0", "at": 500}, 500)
    n1.write(0, key, {"who": "n1", "at": 999}, 999)
    for node in (n0, n1):
        node.set_end(0, 1_000)  # n0 is 499 behind; the table says 0

    # A read that asks for no budget carries the proxy's configured one (100) to the node, on
    # the C path as on the Python path: the stale active refuses it, the standby answers.
    before = hot_path_count(setup.proxy)
    for _ in range(20):
        plain, _ = setup.get(key)
        assert (plain.status_code, plain.headers["x-kroute-node"]) == (200, "n1"), plain.text
        assert plain.json()["value"] == {"who": "n1", "at": 999}
        assert plain.headers["x-kroute-attempts"] == "2"
    assert hot_path_count(setup.proxy) > before  # the C path sent some of them (and the budget)

    # The header asks 1,000 but the proxy's budget is 100: the node checks 100.
    for header in ("10", "100", "1000"):
        for _ in range(20):
            response, _ = setup.get(key, x_kroute_max_lag=header)
            assert response.status_code == 200, response.text
            assert response.headers["x-kroute-node"] == "n1"
            assert response.json()["value"] == {"who": "n1", "at": 999}
            assert response.headers["x-kroute-attempts"] == "2"
            assert response.headers["x-kroute-position"] == "0:999"


def test_every_replica_beyond_the_budget_is_a_503_naming_each_refusal(setup):
    n0, n1 = setup.nodes["n0"], setup.nodes["n1"]
    key = key_in(2, "behind")
    n0.write(2, key, {"who": "n0"}, 100)
    n1.write(2, key, {"who": "n1"}, 200)
    for node in (n0, n1):
        node.set_end(2, 1_001)

    response, _ = setup.get(key, x_kroute_max_lag="10")
    assert response.status_code == 503
    body = response.json()
    assert (body["error"], body["partition"], body["budget"]["max_lag"]) == ("beyond_budget", 2, 10)
    assert body["tried"] == [
        {"node": "n0", "outcome": "421: lag 900 over budget 10"},
        {"node": "n1", "outcome": "421: lag 800 over budget 10"},
    ]


def test_refusals_do_not_make_the_proxy_reread_its_table(setup):
    """A node refusing a budget is not a sign the table is out of date: 200 refusals within a
    second must not become table reads (each 421 without the reason still asks for one)."""
    n0, n1 = setup.nodes["n0"], setup.nodes["n1"]
    key = key_in(2, "hammer")
    for node in (n0, n1):
        node.set_end(2, 1_001)
    before, started = setup.table_reads(), time.monotonic()
    for _ in range(100):
        assert setup.get(key, x_kroute_max_lag="10")[0].status_code == 503
    elapsed = time.monotonic() - started
    polls = elapsed / (REFRESH_MS / 1000)
    assert setup.table_reads() - before <= polls + 3, (setup.table_reads() - before, polls)


def test_read_your_writes_through_a_stale_table(setup):
    """Each write gets a unique value; a read with its offset returns that value or, when no
    replica applies it in time, a 503 naming the offset and the furthest position: never an
    older value, although the table claims both replicas are past every offset used here."""
    n0, n1 = setup.nodes["n0"], setup.nodes["n1"]
    key = key_in(0, "ryw")
    n0.write(0, key, {"id": "first"}, 1_000)
    n1.write(0, key, {"id": "first"}, 1_000)
    outcomes: dict[str, int] = {}
    offset = 1_000
    for round_ in range(12):
        offset += 1
        written = uuid.uuid4().hex
        kind = ("standby_only", "active_late", "nobody")[round_ % 3]
        late = _plan(kind, n0, n1, key, value={"id": written}, offset=offset)
        started = time.monotonic()
        response, _ = setup.get(key, x_kroute_min_offset=str(offset))
        took = time.monotonic() - started
        late.join()
        outcomes[kind] = outcomes.get(kind, 0) + 1
        if kind == "nobody":
            assert response.status_code == 503, response.text
            body = response.json()
            assert (body["error"], body["partition"], body["min_offset"]) == (
                "position_not_reached",
                0,
                offset,
            )
            assert body["best_applied_offset"] == offset - 1
            assert [t["outcome"] for t in body["tried"]] == [
                f"421: position {offset - 1} short of min offset {offset}"
            ] * 2
            _catch_up(n0, n1, key, {"id": written}, offset)  # the next round starts level
            continue
        _catch_up(n0, n1, key, {"id": written}, offset)
        assert response.status_code == 200, (kind, response.text)
        assert response.json()["value"] == {"id": written}, kind
        assert response.headers["x-kroute-position"] == f"0:{offset}"
        if kind == "active_late":  # n0 applied it while waiting: no second try
            assert response.headers["x-kroute-node"] == "n0"
            assert took < WAIT_MS / 1000
        else:  # n0 waited its bound, then n1 answered
            assert response.headers["x-kroute-node"] == "n1"
            assert took >= WAIT_MS / 1000 * 0.9
    assert outcomes == {"standby_only": 4, "active_late": 4, "nobody": 4}


def test_without_the_header_the_same_read_is_stale(setup):
    """The control: what the reads above would have returned without x-kroute-min-offset."""
    n0, n1 = setup.nodes["n0"], setup.nodes["n1"]
    key = key_in(0, "control")
    n0.write(0, key, {"id": "old"}, 5_000)
    n1.write(0, key, {"id": "new"}, 5_001)
    plain, _ = setup.get(key)
    assert (plain.headers["x-kroute-node"], plain.json()["value"]) == ("n0", {"id": "old"})
    bounded, _ = setup.get(key, x_kroute_min_offset="5001")
    assert (bounded.headers["x-kroute-node"], bounded.json()["value"]) == ("n1", {"id": "new"})
    # An answer's position token, sent back, asks for at least as fresh an answer.
    token = bounded.headers["x-kroute-position"]
    assert token == "0:5001"
    again, _ = setup.get(key, x_kroute_min_offset=token)
    assert again.json()["value"] == {"id": "new"}


@pytest.mark.parametrize(
    ("header", "value"),
    [("x-kroute-min-offset", "soon"), ("x-kroute-min-offset", "0:1,x"), ("x-kroute-max-lag", "-1")],
)
def test_malformed_freshness_headers_are_400_saying_what_is_wrong(setup, header, value):
    response, _ = setup.get(key_in(1, "bad"), **{header.replace("-", "_"): value})
    assert response.status_code == 400
    body = response.json()
    assert body["error"] == "bad_request"
    assert header in body["detail"]


def _plan(
    kind: str, n0: ServedNode, n1: ServedNode, key: str, *, value: Any, offset: int
) -> threading.Thread:
    """Apply the write where `kind` says: n1 now (n0 never, for this read), n0 100 ms into
    the read (n1 never), or nowhere. Returns the thread applying it late (started)."""
    if kind == "standby_only":
        n1.write(0, key, value, offset)

    def apply_late() -> None:
        if kind == "active_late":
            time.sleep(0.1)
            n0.write(0, key, value, offset)

    late = threading.Thread(target=apply_late)
    late.start()
    return late


def _catch_up(n0: ServedNode, n1: ServedNode, key: str, value: Any, offset: int) -> None:
    for node in (n0, n1):
        if node.position(0) <= offset:
            node.write(0, key, value, offset)


def hot_path_count(proxy: ProxyHandle) -> float:
    found = re.search(
        r"^kroute_proxy_hot_path_requests_total (\S+)$", proxy.admin("/metrics").text, re.M
    )
    assert found is not None
    return float(found.group(1))


def test_the_c_path_leaves_requests_with_a_min_offset_to_python(setup):
    """The C path serves cached choices; a read-your-writes request needs its own choice and
    its refusals read, so it must take the Python path (like the budget headers)."""
    key = key_in(1, "hot")
    for node in setup.nodes.values():
        node.write(1, key, {"id": "hot"}, 7_000)
    for _ in range(3):  # warm: the choice cached, the pool filled; these may be served in C
        assert setup.get(key)[0].status_code == 200
    before = hot_path_count(setup.proxy)
    served_in_c, _ = setup.get(key)
    assert served_in_c.status_code == 200
    assert hot_path_count(setup.proxy) == before + 1  # the C path is on and serves this key
    assert served_in_c.headers["x-kroute-position"] == "1:7000"  # the token, passed on in C
    for _ in range(10):
        response, _ = setup.get(key, x_kroute_min_offset="7000")
        assert response.status_code == 200
    assert hot_path_count(setup.proxy) == before + 1
