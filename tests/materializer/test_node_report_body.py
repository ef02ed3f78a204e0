"""A node's compact report (`report:<id>`) stays the same while nothing changes: proxies read a
body only when its version changes, and the writer makes a new version whenever the body
differs. So an idle, caught-up node must not make a new body on every report, whatever the
phase between its end-offset reads and its reports (issue 22)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from common.clock import now_ms
from common.contract import Keys, decode_report_at, encode_node_report, node_report
from kroute.cluster_harness import spark_jvm_pid
from kroute.contract_check import check
from materializer import node as node_module
from materializer.node import Node
from materializer.settings import NodeSettings
from materializer.store import Row
from tests.cluster_helpers import Cluster, running_cluster

# -- the node's stamps, in process (no Spark, no broker) ------------------------------------------


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    settings = NodeSettings.from_env(
        {
            "KROUTE_BOOTSTRAP_SERVERS": "127.0.0.1:9",
            "KROUTE_TOPIC": "bookings",
            "KROUTE_DATA_DIR": str(tmp_path),
            "KROUTE_STALL_TIMEOUT_MS": "30000",
        }
    )
    built = Node(settings, java=None)  # type: ignore[arg-type] - Spark is never started here
    for partition in (0, 1):
        built.store.add_partition(partition)
        built.store.apply(partition, [Row(b"k", b"{}", 7, None)], 8, None)
    built.hosting.assign({0: "active", 1: "active"}, now_ms() - 60_000)
    yield built
    built.store.close()


def body_at(node: Node, monkeypatch: pytest.MonkeyPatch, at: int) -> bytes:
    """The node's compact body (version 0) as its report at `at` makes it."""
    monkeypatch.setattr(node_module, "now_ms", lambda: at)
    reports = {(node.settings.store_name, p): r for p, r in node._reports().items()}
    return encode_node_report(node_report(node._hosting(), reports))


def test_an_idle_caught_up_node_makes_the_same_body_whatever_the_reads_phase(node, monkeypatch):
    t0 = now_ms()
    node.state.lag.apply_ends({0: 8, 1: 8}, t0)
    first = body_at(node, monkeypatch, t0 + 37)  # a report 37 ms after the read
    node.state.lag.apply_ends({0: 8, 1: 8}, t0 + 250)
    second = body_at(node, monkeypatch, t0 + 250 + 181)  # the next, 181 ms after its read
    assert first == second
    reports = node._reports()
    # As of the read its lag is measured against: caught up then, so its caught-up age is 0.
    assert {p: (r.updated_at_ms, r.caught_up_at_ms) for p, r in reports.items()} == {
        0: (t0 + 250, t0 + 250),
        1: (t0 + 250, t0 + 250),
    }


def test_a_report_without_a_known_end_is_stamped_with_its_own_time(node, monkeypatch):
    node.state.lag.refresh_offsets_only()  # the broker never answered: no end known
    at = now_ms() + 5
    monkeypatch.setattr(node_module, "now_ms", lambda: at)
    assert [(r.end_offset, r.updated_at_ms) for r in node._reports().values()] == [(None, at)] * 2


def test_an_end_read_too_long_ago_is_no_end_and_not_the_stamp(node, monkeypatch):
    t0 = now_ms()
    node.state.lag.apply_ends({0: 8, 1: 8}, t0)
    node.state.lag.keep_ends(t0 + 100)  # the broker cannot be read: ends kept, as of t0
    monkeypatch.setattr(node_module, "now_ms", lambda: t0 + 1_000)
    assert node._reports()[0].updated_at_ms == t0, "still known: as of its read"
    monkeypatch.setattr(node_module, "now_ms", lambda: t0 + 10_000)
    report = node._reports()[0]
    assert (report.end_offset, report.updated_at_ms) == (None, t0 + 10_000)


def test_a_partition_outside_the_log_reports_no_time_as_of_the_report(node, monkeypatch):
    t0 = now_ms()
    node.state.lag.apply_ends({0: 3, 1: 8}, t0)  # partition 0's log now ends before the store
    first = body_at(node, monkeypatch, t0 + 20)
    second = body_at(node, monkeypatch, t0 + 900)
    assert first == second, "nothing known, and nothing moving"
    report = node._reports()[0]
    assert (report.lag, report.caught_up_at_ms, report.updated_at_ms) == (None, None, t0 + 900)


class SteppedBack:
    """The shared clock just after stepping back `step_ms`: stamps up to `horizon` move back."""

    def __init__(self, horizon: int, step_ms: int) -> None:
        self.horizon, self.step_ms = horizon, step_ms

    def conservative_ms(self, stamp_ms: int) -> int:
        return stamp_ms - self.step_ms if stamp_ms <= self.horizon else stamp_ms


def test_after_the_clock_steps_back_a_report_is_stamped_with_its_own_time_not_seconds_old(
    node, monkeypatch
):
    t0 = now_ms()
    node.state.lag.apply_ends({0: 8, 1: 8}, t0)
    monkeypatch.setattr(node_module, "SHARED", SteppedBack(horizon=t0 + 5_000, step_ms=5_000))
    monkeypatch.setattr(node_module, "now_ms", lambda: t0 + 200)
    report = node._reports()[0]
    # Mapped, the read would read 5 s old and every proxy (3 s by default) would refuse it.
    assert report.updated_at_ms == t0 + 200
    assert report.caught_up_at_ms is not None
    assert report.caught_up_at_ms <= report.updated_at_ms  # never fresher than the stamp
    monkeypatch.setattr(node_module, "SHARED", SteppedBack(horizon=t0 - 1, step_ms=5_000))
    assert node._reports()[0].updated_at_ms == t0, "past the step: as of its read again"


# -- a real node: report:<id> keeps its version while idle ----------------------------------------


@pytest.fixture(scope="module")
def idle_cluster(embedded, broker, tmp_path_factory) -> Iterator[Cluster]:
    with running_cluster(
        embedded,
        broker,
        tmp_path_factory.mktemp("stablebody"),
        300,  # nothing moves on its own
        names=("a",),
        seed=200,
        prefix="stablebody",
    ) as built:
        built.wait_settled({"a"})
        yield built


def report_at(cluster: Cluster) -> tuple[int, int]:
    raw = cluster.redis.get(cluster.keys.report_at("a"))
    assert raw is not None, "the node writes no report_at:<id>"
    return decode_report_at(raw)


def versions_over(cluster: Cluster, seconds: float) -> tuple[set[int], set[int]]:
    """The versions report_at:<id> names and the times it gives, sampled for `seconds`."""
    versions, times = set(), set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        version, at_ms = report_at(cluster)
        versions.add(version)
        times.add(at_ms)
        time.sleep(0.05)
    return versions, times


def checked_without_a_report_between(client: redis.Redis, keys: Keys, cluster: Cluster) -> list:  # type: ignore[type-arg]
    """`kroute contract check`'s errors, from a run no report was written during (its reads
    are not one snapshot: a report between two of them is not a disagreement)."""
    for _ in range(20):
        before = report_at(cluster)
        found = check(client, keys.cluster)
        if report_at(cluster) == before:
            return found.errors
    raise AssertionError("a report was written during every check")


@pytest.mark.integration
def test_an_idle_real_node_keeps_its_report_version_and_changes_it_on_new_records(idle_cluster):
    cluster = idle_cluster
    # Reports every 250 ms: 3 s is a dozen reports, each confirmed with a later time.
    versions, times = versions_over(cluster, 3.0)
    assert len(versions) == 1, f"an idle node made {len(versions)} bodies in 3 s"
    assert len(times) >= 6, "report_at:<id> is confirmed on every report"
    assert checked_without_a_report_between(cluster.redis, cluster.keys, cluster) == []

    # Records written while Spark is stopped: the node reports them as lag, a new body.
    jvm = spark_jvm_pid(cluster.nodes["a"])
    os.kill(jvm, signal.SIGSTOP)
    try:
        cluster.produce(300, "more")
        behind, _ = versions_over(cluster, 2.0)
    finally:
        os.kill(jvm, signal.SIGCONT)
    assert behind - versions, "records written and not applied make a new body"
    cluster.wait_settled({"a"})  # applied: caught up again
    after, _ = versions_over(cluster, 3.0)
    assert len(after) == 1, f"idle again, yet {len(after)} bodies in 3 s"
    assert after.isdisjoint(versions | behind), "caught up again: a new body"
