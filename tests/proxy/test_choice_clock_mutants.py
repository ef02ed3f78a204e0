"""Replicas read through report clocks, and the expiry of a choice made from them, pinned
where mutants of proxy/choice.py survived a full mutmut run after the C path began reading the
clocks (scripts/mutation choice; docs/testing.md).

What a user sees through each: a replica's times (the answers' `x-kroute-time-lag-ms`, which
replica is fresh), whether a read-your-writes bound is met, and how long a cached choice is
reused before it is computed again.
"""

from __future__ import annotations

from proxy.choice import (
    LagBudget,
    Replica,
    ReportClock,
    choice_expires_at,
    expires_at,
    expiry_terms,
)

NOW = 1_000_000
STALE_MS = 3_000


def clock(shift_ms: int = 0) -> ReportClock:
    made = ReportClock()
    made.shift_ms = shift_ms
    return made


def replica(
    node_id: str = "a",
    *,
    lag: int | None = 0,
    caught_up_at_ms: int | None = NOW - 10,
    reported_at_ms: int | None = NOW - 5,
    position: int | None = 100,
    on: ReportClock | None = None,
) -> Replica:
    return Replica(
        node_id,
        f"http://{node_id}:1",
        "standby",
        True,
        lag,
        caught_up_at_ms,
        reported_at_ms,
        position,
        on,
    )


# -- a replica and its clock -----------------------------------------------------------------


def test_a_replica_keeps_what_it_was_given_and_reads_its_times_through_its_clock() -> None:
    moving = clock(40)
    made = replica(on=moving)
    assert (made.node_id, made.url, made.role, made.alive, made.lag, made.position) == (
        "a", "http://a:1", "standby", True, 0, 100,
    )  # fmt: skip
    assert made.clock is moving
    assert made.times == (NOW + 30, NOW + 35)
    moving.shift_ms = 100
    assert made.times == (NOW + 90, NOW + 95)
    assert made.caught_up_at_as_given_ms == NOW - 10


def test_on_clock_is_the_same_replica_with_its_times_moved_by_the_new_clock() -> None:
    first, second = clock(40), clock(7)
    made = replica(lag=3, position=55, on=first)
    moved = made.on_clock(second)
    assert moved.clock is second
    assert (moved.node_id, moved.url, moved.role, moved.alive, moved.lag, moved.position) == (
        made.node_id, made.url, made.role, made.alive, made.lag, made.position,
    )  # fmt: skip
    assert moved.caught_up_at_as_given_ms == made.caught_up_at_as_given_ms
    assert moved.times == (NOW - 10 + 7, NOW - 5 + 7)
    second.shift_ms = 1_000
    assert moved.times == (NOW + 990, NOW + 995)
    assert made.times == (NOW + 30, NOW + 35), "the old replica moved with the new clock"


def test_replicas_are_equal_by_what_they_say_now_whatever_the_clock() -> None:
    given_later = replica(caught_up_at_ms=NOW, reported_at_ms=NOW + 5)
    moved_there = replica(caught_up_at_ms=NOW - 50, reported_at_ms=NOW - 45, on=clock(50))
    assert given_later == moved_there
    assert hash(given_later) == hash(moved_there)
    assert given_later.__eq__(given_later) is True
    assert given_later.__eq__("a") is NotImplemented
    others = [
        replica("b"),
        replica(lag=1),
        replica(position=101),
        replica(caught_up_at_ms=NOW - 11),
        replica(reported_at_ms=NOW - 6),
        replica(caught_up_at_ms=NOW - 10, on=clock(1)),
    ]
    base = replica()
    for other in others:
        assert base != other, other
        assert other != base, other
    distinct = [base, *others]
    assert len({hash(r) for r in distinct}) == len(distinct), "hashes say nothing"


def test_a_bound_is_reached_only_once_the_offset_is_applied() -> None:
    at = replica(position=10)  # the next offset to apply: 9 is applied, 10 is not
    assert at.has_reached(9)
    assert not at.has_reached(10)
    assert at.has_reached(None)
    assert not replica(position=None).has_reached(0)


# -- how long a choice is reused -------------------------------------------------------------


def test_a_fresh_replica_on_a_clock_gives_a_term_that_moves_with_it() -> None:
    moving = clock(20)
    fresh = replica(reported_at_ms=NOW - 100, caught_up_at_ms=None, on=moving)
    cap, terms = expiry_terms((fresh,), LagBudget(), now_ms=NOW, stale_after_ms=STALE_MS)
    assert cap == NOW + 60_000
    assert [(c, base) for c, base in terms] == [(moving, NOW - 100 + STALE_MS + 1)]
    assert expires_at(cap, terms) == NOW - 80 + STALE_MS + 1  # as the clock reads now
    moving.shift_ms = 520
    assert expires_at(cap, terms) == NOW + 420 + STALE_MS + 1


def test_the_budget_term_moves_with_the_clock_and_none_once_over() -> None:
    moving = clock(0)
    inside = replica(caught_up_at_ms=NOW - 200, reported_at_ms=None, on=moving)
    budget = LagBudget(max_ms=1_000)
    cap, terms = expiry_terms((inside,), budget, now_ms=NOW, stale_after_ms=STALE_MS)
    assert [base for _, base in terms] == [NOW + 801]
    moving.shift_ms = 300
    assert expires_at(cap, terms) == NOW + 1_101
    # Crossed the budget exactly now: no later moment changes that, only the cap is left.
    crossed = replica(caught_up_at_ms=NOW - 1_001, reported_at_ms=None, on=clock())
    cap, terms = expiry_terms((crossed,), budget, now_ms=NOW, stale_after_ms=STALE_MS)
    assert (cap, terms) == (NOW + 60_000, ())


def test_without_a_clock_the_moments_go_to_the_cap() -> None:
    plain = replica(caught_up_at_ms=NOW - 200, reported_at_ms=NOW - 100)
    cap, terms = expiry_terms((plain,), LagBudget(max_ms=1_000), now_ms=NOW)
    assert terms == ()
    assert cap == min(NOW - 100 + STALE_MS + 1, NOW + 801)


def test_the_staleness_limit_is_the_one_given_and_3_s_by_default() -> None:
    fresh = replica(reported_at_ms=NOW - 100, caught_up_at_ms=None)
    assert expiry_terms((fresh,), LagBudget(), now_ms=NOW)[0] == NOW - 100 + 3_001
    assert choice_expires_at((fresh,), LagBudget(), now_ms=NOW) == NOW - 100 + 3_001
    assert choice_expires_at((fresh,), LagBudget(), now_ms=NOW, stale_after_ms=500) == (
        NOW - 100 + 501
    )
