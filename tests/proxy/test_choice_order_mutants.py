"""Replica order, spread width and refusal reasons pinned where mutants of proxy/choice.py
survived a full mutmut run (scripts/mutation choice; docs/testing.md).

Each test states the behaviour a user sees: which replica is asked first, over how many
replicas reads are spread, and what a refusal says.
"""

from __future__ import annotations

from proxy.choice import LagBudget, Replica, choose_replicas

NOW = 1_000_000
UNLIMITED = LagBudget()


def replica(
    node_id: str,
    *,
    role: str = "standby",
    lag: int | None = 0,
    caught_up_at_ms: int | None = None,
    reported_at_ms: int | None = NOW,
    position: int | None = None,
) -> Replica:
    return Replica(
        node_id=node_id,
        url=f"http://{node_id}",
        role=role,  # type: ignore[arg-type]
        alive=True,
        lag=lag,
        caught_up_at_ms=caught_up_at_ms,
        reported_at_ms=reported_at_ms,
        position=position,
    )


def order(*replicas: Replica, budget: LagBudget = UNLIMITED, **options: object) -> list[str]:
    choice = choose_replicas(replicas, budget, now_ms=NOW, **options)  # type: ignore[arg-type]
    return [r.node_id for r in choice.candidates]


def test_a_replica_whose_position_reached_the_min_offset_is_asked_before_the_active():
    """Read-your-writes: the standby that shows the write goes first, even before the
    active (x-kroute-min-offset), and without the bound the active goes first."""
    behind_active = replica("a", role="active", position=100)
    reached_standby = replica("b", position=201)
    assert order(behind_active, reached_standby, min_offset=200) == ["b", "a"]
    assert order(behind_active, reached_standby) == ["a", "b"]


def test_among_equals_the_replica_caught_up_more_recently_is_asked_first():
    """Same role, both in sync at lag 0: the one with the smaller time lag first, whatever
    the order the table lists them in."""
    older = replica("a", caught_up_at_ms=NOW - 5_000)
    newer = replica("b", caught_up_at_ms=NOW - 100)
    assert order(older, newer) == ["b", "a"]
    assert order(newer, older) == ["b", "a"]


def test_a_fresh_report_with_a_known_time_lag_goes_before_a_stale_report():
    """Both out of sync and of unknown offset lag: the one whose report is fresh and says
    when it was caught up (10 s ago) is asked before the one whose report is too old."""
    stale = replica("a", lag=5, reported_at_ms=NOW - 60_000)
    known_time = replica("z", lag=None, caught_up_at_ms=NOW - 10_000)
    assert order(stale, known_time) == ["z", "a"]


def test_reads_spread_over_in_sync_standbys_when_no_active_can_answer():
    """The active is dead: the two in-sync standbys share the reads."""
    dead_active = Replica("a", "http://a", "active", False, 0, None, NOW)
    choice = choose_replicas((dead_active, replica("b"), replica("c")), UNLIMITED, now_ms=NOW)
    assert [r.node_id for r in choice.candidates] == ["b", "c"]
    assert choice.spread_width == 2


def test_reads_spread_over_in_sync_replicas_when_none_reached_the_min_offset():
    """A min offset no report shows yet: every replica is equally short of it, so the in-sync
    ones still share the reads (each node waits for the offset itself)."""
    choice = choose_replicas(
        (replica("a", role="active", position=10), replica("b", position=10)),
        UNLIMITED,
        now_ms=NOW,
        min_offset=500,
    )
    assert choice.spread_width == 2


def test_a_time_budget_refuses_an_unknown_time_lag_and_says_so():
    """Lag 5 with no caught-up time: its time lag is unknown, refused under a time budget
    with the reason the 503 shows."""
    choice = choose_replicas((replica("a", lag=5),), LagBudget(max_ms=1_000), now_ms=NOW)
    assert choice.candidates == ()
    assert [r.reason for r in choice.rejected] == ["unknown time lag"]


# Replica and LagBudget are slots dataclasses, whose methods mutmut 3.7 does not mutate: these
# were checked by hand-planted mutants instead (docs/testing.md).


def test_lag_0_with_no_caught_up_time_is_inside_a_time_budget():
    """A replica at lag 0 whose caught-up time is not known yet has time lag 0, not unknown:
    a time budget admits it (and its answers say x-kroute-time-lag-ms: 0)."""
    at_zero = replica("a", lag=0, caught_up_at_ms=None)
    assert at_zero.time_lag_ms(NOW) == 0
    assert order(at_zero, budget=LagBudget(max_ms=100)) == ["a"]


def test_a_caught_up_time_slightly_ahead_of_now_is_time_lag_0_never_negative():
    """Clocks within the tolerance can stamp a caught-up time a little after this process's
    now: the time lag (and the header that carries it) is 0, never negative."""
    ahead = replica("a", caught_up_at_ms=NOW + 50)
    assert ahead.time_lag_ms(NOW) == 0


def test_among_equal_lags_a_lag_0_without_a_time_ranks_before_any_caught_up_time():
    """`staleness_rank`: lag 0 with no caught-up time is a time lag of 0, the least there is,
    ahead of a replica caught up 10 ms ago and of one caught up "in the future"."""
    assert order(
        replica("n1", caught_up_at_ms=NOW - 10),
        replica("n2", caught_up_at_ms=None),
        replica("n3", caught_up_at_ms=NOW + 300),
    ) == ["n2", "n3", "n1"]


def test_among_equal_lags_a_newer_caught_up_time_ranks_first_even_ahead_of_the_clock():
    """Ranked by the time itself, not by a time lag clamped at 0: two times ahead of the
    clock keep the order they will have once it passes them."""
    assert order(
        replica("n1", caught_up_at_ms=NOW + 100),
        replica("n2", caught_up_at_ms=NOW + 400),
    ) == ["n2", "n1"]


def test_a_stale_report_and_an_unknown_lag_rank_alike_whichever_node_is_named_first():
    """Both unknown: neither is preferred, the node id decides (in both arrangements)."""
    stale = {"lag": 3, "caught_up_at_ms": NOW - 50, "reported_at_ms": NOW - 60_000}
    unknown = {"lag": None, "caught_up_at_ms": None}
    assert order(replica("n1", **unknown), replica("n2", **stale)) == ["n1", "n2"]  # type: ignore[arg-type]
    assert order(replica("n1", **stale), replica("n2", **unknown)) == ["n1", "n2"]  # type: ignore[arg-type]
