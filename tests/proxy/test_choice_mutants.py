"""Replica choice pinned where mutants of proxy/choice.py survived the other tests
(scripts/mutation, docs/testing.md).
"""

from __future__ import annotations

from proxy.choice import LagBudget, Replica, choice_expires_at, choose_replicas

NOW = 1_000_000


def standby(node_id: str, *, reported_at_ms: int, lag: int = 0) -> Replica:
    return Replica(
        node_id=node_id,
        url=f"http://{node_id}",
        role="standby",
        alive=True,
        lag=lag,
        caught_up_at_ms=None,
        reported_at_ms=reported_at_ms,
    )


def test_with_default_staleness_a_choice_expires_the_moment_a_report_turns_stale():
    """choose_replicas and choice_expires_at must share their default `stale_after_ms`: a
    choice reused past the moment a report turns stale would still offer a replica whose lag
    is no longer known (refused under the default 'reject' policy)."""
    budget = LagBudget(max_offsets=10)
    replicas = (standby("a", reported_at_ms=NOW - 3_000),)
    assert [r.node_id for r in choose_replicas(replicas, budget, now_ms=NOW).candidates] == ["a"]
    expires = choice_expires_at(replicas, budget, now_ms=NOW)
    assert expires == NOW + 1
    assert choose_replicas(replicas, budget, now_ms=expires).candidates == ()


def test_a_choice_expires_the_moment_a_replica_goes_over_the_time_budget():
    """A replica exactly at the time-lag budget is inside it; one millisecond later it is over,
    and a cached choice must not offer it then."""
    budget = LagBudget(max_ms=500)
    at_budget = Replica("a", "http://a", "standby", True, 3, NOW - 500, NOW)
    replicas = (at_budget,)
    assert [r.node_id for r in choose_replicas(replicas, budget, now_ms=NOW).candidates] == ["a"]
    expires = choice_expires_at(replicas, budget, now_ms=NOW)
    assert expires == NOW + 1
    later = choose_replicas(replicas, budget, now_ms=expires)
    assert later.candidates == ()
    assert [r.reason for r in later.rejected] == ["time lag 501 ms over budget 500 ms"]


def test_a_replica_one_behind_that_was_never_caught_up_is_not_in_sync():
    """Lag 1 with no caught-up moment is a restoring replica: after the in-sync one, and never
    among those reads are spread over."""
    restoring = Replica("a", "http://a", "active", True, 1, None, NOW)
    in_sync = Replica("b", "http://b", "standby", True, 5, NOW - 10, NOW)
    choice = choose_replicas((restoring, in_sync), LagBudget(), now_ms=NOW)
    assert [r.node_id for r in choice.candidates] == ["b", "a"]
    assert choice.spread_width == 1


def test_a_refusal_names_the_replica_and_its_role():
    dead = Replica("a", "http://a", "standby", False, 0, NOW, NOW)
    active = Replica("b", "http://b", "active", False, 0, NOW, NOW)
    choice = choose_replicas((dead, active), LagBudget(), now_ms=NOW)
    assert [(r.node_id, r.role, r.reason) for r in choice.rejected] == [
        ("a", "standby", "dead"),
        ("b", "active", "dead"),
    ]


def test_standbys_equally_fresh_in_time_are_ordered_by_offset_lag_before_node_id():
    behind = Replica("a", "http://a", "standby", True, 5, NOW - 100, NOW)
    closer = Replica("b", "http://b", "standby", True, 1, NOW - 100, NOW)
    choice = choose_replicas((behind, closer), LagBudget(), now_ms=NOW)
    assert [r.node_id for r in choice.candidates] == ["b", "a"]


def test_a_known_lag_however_large_comes_before_an_unknown_one():
    """Among replicas that are not in sync (unlimited budget), one restoring with a known lag
    of 500 is tried before one whose report is too old to tell."""
    restoring = Replica("b", "http://b", "standby", True, 500, None, NOW)
    unknown = Replica("a", "http://a", "standby", True, 0, NOW - 60_000, NOW - 60_000)
    choice = choose_replicas((unknown, restoring), LagBudget(), now_ms=NOW)
    assert [r.node_id for r in choice.candidates] == ["b", "a"]
