"""What a node says about its pipeline's progress: stalls found from the store and the lag
snapshot, and the lag reports proxies route by (no Spark: a stand-in pipeline)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from common.clock import now_ms
from materializer import node as node_module
from materializer.node import Node
from materializer.pipeline import PipelineProgress
from materializer.settings import NodeSettings
from materializer.store import Row


@dataclass
class StandInPipeline:
    progress_state: PipelineProgress
    running: bool = True

    def state(self) -> PipelineProgress:
        return self.progress_state

    def progress(self) -> None:
        return None


@pytest.fixture
def node(tmp_path: Path):
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
    started = now_ms() - 60_000
    built.pipeline = StandInPipeline(  # type: ignore[assignment]
        # It failed a second from now: during the stall the tests below look at.
        PipelineProgress(started, started, "ValueError: poison", now_ms() + 1_000, restarts=7)
    )
    yield built
    built.store.close()


def later(monkeypatch: pytest.MonkeyPatch, by_ms: int) -> int:
    """The node's clock, `by_ms` from now: nothing has moved meanwhile."""
    at = now_ms() + by_ms
    monkeypatch.setattr(node_module, "now_ms", lambda: at)
    return at


def behind_since_caught_up(node: Node) -> int:
    """Partition 0 caught up at t0, then 92 records arrived; partition 1 stays caught up."""
    t0 = now_ms()
    node.state.lag.apply_ends({0: 8, 1: 8}, t0)
    node.state.lag.apply_ends({0: 100, 1: 8}, t0 + 1)
    return t0


def test_a_partition_behind_with_no_progress_for_the_timeout_is_stalled(node, monkeypatch):
    behind_since_caught_up(node)
    assert node.stalls() == {}, "just written: not yet"
    later(monkeypatch, 45_000)
    stalls = node.stalls()
    assert list(stalls) == [0], "partition 1 has nothing unread"
    assert stalls[0].unread == 92
    assert "poison" in stalls[0].reason, "the pipeline's error during the stall says why"


def test_a_stalled_partition_is_reported_as_not_known_caught_up_with_its_true_offsets(
    node, monkeypatch
):
    # The proxy then prefers any in-sync replica even without a budget, and refuses this one
    # under a time budget (unknown time lag); the offsets stay true for offset budgets.
    t0 = behind_since_caught_up(node)
    assert node._reports()[0].caught_up_at_ms == t0
    at = later(monkeypatch, 45_000)
    node.state.lag.apply_ends({0: 100, 1: 8}, at)  # the broker is still read: ends are fresh
    reports = node._reports()
    assert reports[0].caught_up_at_ms is None
    assert (reports[0].current_offset, reports[0].end_offset, reports[0].lag) == (8, 100, 92)
    assert reports[1].caught_up_at_ms is not None
    assert reports[1].lag == 0


def test_a_partition_newly_hosted_gets_a_fresh_start(node, monkeypatch):
    behind_since_caught_up(node)
    later(monkeypatch, 45_000)
    assigned = node_module.now_ms() - 1_000
    node.hosting.assign({1: "active"}, assigned - 1)
    node.hosting.assign({0: "active", 1: "active"}, assigned)  # given back a second ago
    assert node.stalls() == {}


def test_pipeline_status_says_when_the_last_batch_was_applied_and_the_last_error(node):
    status = node.pipeline_status()
    assert status["last_batch_applied_at_ms"] == node.pipeline.state().last_batch_at_ms
    assert status["last_error"] == "ValueError: poison"
    assert status["restarts"] == 7


def test_a_partition_outside_the_log_is_reported_unknown_and_reset_to_read_again(node):
    """The log was recreated shorter than the store's position: the report must not carry the
    old caught-up time, and the reset empties the store (values and checkpoint) so the next
    plan reads the partition from the start of the new log."""
    at = now_ms()
    node.state.lag.apply_ends({0: 8, 1: 8}, at)
    assert node._reports()[0].caught_up_at_ms is not None
    node.state.lag.apply_ends({0: 3, 1: 8}, at + 1)  # partition 0's log now ends at 3
    report = node._reports()[0]
    assert (report.caught_up_at_ms, report.end_offset, report.lag) == (None, None, None)
    assert node._reports()[1].caught_up_at_ms is not None, "partition 1 is untouched"
    node._reset([0])
    assert node.store.get(0, b"k") is None
    assert node.plan().starting_offsets == {0: 0, 1: 8}
