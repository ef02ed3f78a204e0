"""The cluster harness's pure parts: waiting until a state holds still, a partition map by role."""

from __future__ import annotations

import itertools

import pytest

from kroute.cluster_harness import replicas_in_role, wait_steady

FAST = {"poll_s": 0.01, "timeout_s": 5.0}


def test_wait_steady_returns_once_one_value_has_held_for_the_hold():
    calls = itertools.count()
    wait_steady(
        lambda: "g1" if next(calls) else None,  # None first, then the same value
        hold_s=0.05,
        timeout_error=lambda: AssertionError("timed out"),
        **FAST,
    )
    assert next(calls) >= 5  # it kept looking for the hold (0.05 s at 0.01 s a look)


@pytest.mark.parametrize(
    "looks",
    [
        pytest.param(itertools.count(1), id="a new value starts the hold again"),
        pytest.param(itertools.repeat(None), id="None is never steady"),
    ],
)
def test_a_state_that_does_not_hold_still_times_out(looks):
    with pytest.raises(TimeoutError, match="never steady"):
        wait_steady(
            looks.__next__,
            hold_s=0.05,
            poll_s=0.01,
            timeout_s=0.3,
            timeout_error=lambda: TimeoutError("never steady"),
        )


def test_without_a_hold_the_first_good_look_is_enough():
    looks = []

    def state() -> object:
        looks.append(1)
        return True

    wait_steady(state, hold_s=0, timeout_error=AssertionError, **FAST)
    assert len(looks) == 1


def test_check_stops_the_wait_at_once():
    def exited() -> None:
        raise RuntimeError("node a exited")

    with pytest.raises(RuntimeError, match="node a exited"):
        wait_steady(lambda: None, hold_s=1, check=exited, timeout_error=AssertionError, **FAST)


def test_replicas_in_role_lists_partition_and_node_of_each_replica_in_the_role():
    def entry(partition: int, active: str, standby: str) -> dict[str, object]:
        return {
            "partition": partition,
            "replicas": [{"node": active, "role": "active"}, {"node": standby, "role": "standby"}],
        }

    entries = [entry(0, "a", "b"), entry(1, "b", "c")]
    assert replicas_in_role(entries, "active") == [(0, "a"), (1, "b")]
    assert replicas_in_role(entries, "standby") == [(0, "b"), (1, "c")]
    assert replicas_in_role([], "active") == []
