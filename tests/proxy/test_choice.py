"""Replica choice: property tests of the pure function the proxy asks on every request."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.choice import LagBudget, Replica, choose_replicas, rotated

NOW = 1_000_000

offsets = st.one_of(st.none(), st.integers(0, 10_000))
millis = st.one_of(st.none(), st.integers(0, 60_000))


@st.composite
def replica_sets(draw):
    count = draw(st.integers(1, 5))
    replicas = []
    for i in range(count):
        lag = draw(offsets)
        caught_up_ago = draw(millis)
        reported_ago = draw(st.one_of(st.none(), st.integers(0, 10_000)))
        replicas.append(
            Replica(
                node_id=f"n{i}",
                url=f"http://127.0.0.1:{8000 + i}",
                role="active" if i == 0 else "standby",
                alive=draw(st.booleans()),
                lag=lag,
                caught_up_at_ms=None if caught_up_ago is None else NOW - caught_up_ago,
                reported_at_ms=None if reported_ago is None else NOW - reported_ago,
            )
        )
    return tuple(replicas)


budgets = st.builds(LagBudget, offsets, millis)
ejections = st.frozensets(st.sampled_from([f"n{i}" for i in range(5)]), max_size=2)
policies = st.sampled_from(["reject", "accept"])


def fresh(replica: Replica) -> bool:
    return replica.reported_at_ms is not None and NOW - replica.reported_at_ms <= 3_000


def time_lag_of(replica: Replica) -> int | None:
    """The staleness bound as the contract defines it (written here, not taken from choice.py):
    the time since it was last known caught up; 0 for lag 0 with no such time; else unknown."""
    if replica.caught_up_at_ms is None:
        return 0 if replica.lag == 0 else None
    return max(NOW - replica.caught_up_at_ms, 0)


def may_answer(replica: Replica, budget: LagBudget, unknown_lag: str, standby_reads: bool) -> bool:
    """Whether the replica may be offered at all: alive, allowed by its role, and inside
    every limit of the budget (a limit is met exactly at its value)."""
    if not replica.alive or (replica.role == "standby" and not standby_reads):
        return False
    if budget.max_offsets is None and budget.max_ms is None:
        return True
    for limit, value in ((budget.max_offsets, replica.lag), (budget.max_ms, time_lag_of(replica))):
        known = value if fresh(replica) else None
        if limit is None:
            continue
        if known is None:
            if unknown_lag == "reject":
                return False
        elif known > limit:
            return False
    return True


@st.composite
def replicas_and_budgets(draw):
    """Replica sets with budgets often exactly at, one under or one over a replica's own lag
    or time lag: the boundaries where a comparison written the wrong way shows."""
    replicas = draw(replica_sets())

    def limits(values: list[int]) -> st.SearchStrategy[int | None]:
        near = sorted({v + d for v in values for d in (-1, 0, 1) if v + d >= 0})
        return st.one_of(st.none(), st.sampled_from(near)) if near else st.none()

    lags = [r.lag for r in replicas if r.lag is not None]
    time_lags = [t for r in replicas if (t := time_lag_of(r)) is not None]
    budget = draw(
        st.one_of(
            budgets,
            st.builds(LagBudget, limits(lags), limits(time_lags)),
        )
    )
    return replicas, budget


@settings(max_examples=1000)
@given(replica_sets(), budgets, ejections)
def test_never_a_dead_or_over_budget_replica_and_ejected_ones_last(replicas, budget, ejected):
    choice = choose_replicas(replicas, budget, now_ms=NOW, ejected=ejected)
    was_ejected = [replica.node_id in ejected for replica in choice.candidates]
    assert was_ejected == sorted(was_ejected)  # every ejected candidate after all the others
    for replica in choice.candidates:
        assert replica.alive
        if budget.max_offsets is not None:
            assert fresh(replica)
            assert replica.lag is not None
            assert replica.lag <= budget.max_offsets
        if budget.max_ms is not None:
            assert fresh(replica)
            time_lag = replica.time_lag_ms(NOW)
            assert time_lag is not None
            assert time_lag <= budget.max_ms


@settings(max_examples=600)
@given(replicas_and_budgets(), ejections, policies, st.booleans())
def test_every_replica_that_may_answer_is_offered_and_no_other(
    case, ejected, unknown_lag, standby_reads
):
    """Liveness as well as safety: refusing an in-budget replica turns a read that could be
    answered into a 503, as surely as offering an over-budget one serves stale data."""
    replicas, budget = case
    choice = choose_replicas(
        replicas,
        budget,
        now_ms=NOW,
        ejected=ejected,
        unknown_lag=unknown_lag,
        standby_reads=standby_reads,
    )
    expected = {r.node_id for r in replicas if may_answer(r, budget, unknown_lag, standby_reads)}
    assert {r.node_id for r in choice.candidates} == expected


def test_a_replica_exactly_at_the_budget_is_inside_it():
    at_limits = replica("b", lag=100, caught_up_ago=10_000)
    exact = LagBudget(max_offsets=100, max_ms=10_000)
    assert choose_replicas((at_limits,), exact, now_ms=NOW).candidates == (at_limits,)
    for tighter in (LagBudget(max_offsets=99), LagBudget(max_ms=9_999)):
        assert choose_replicas((at_limits,), tighter, now_ms=NOW).candidates == ()


@settings(max_examples=500)
@given(replica_sets(), budgets, ejections)
def test_every_replica_is_either_a_candidate_or_rejected_with_a_reason(replicas, budget, ejected):
    choice = choose_replicas(replicas, budget, now_ms=NOW, ejected=ejected)
    candidates = {r.node_id for r in choice.candidates}
    rejected = {r.node_id for r in choice.rejected}
    assert candidates | rejected == {r.node_id for r in replicas}
    assert not candidates & rejected
    assert all(r.reason for r in choice.rejected)


@settings(max_examples=500)
@given(replica_sets(), budgets)
def test_in_sync_replicas_first_each_group_active_then_standbys_by_least_lag(replicas, budget):
    choice = choose_replicas(replicas, budget, now_ms=NOW)
    in_sync = [in_sync_now(r) for r in choice.candidates]
    assert in_sync == sorted(in_sync, reverse=True)
    for group in (True, False):
        members = [r for r in choice.candidates if in_sync_now(r) == group]
        roles = [r.role for r in members]
        assert roles == sorted(roles, key=lambda role: role != "active")
        standby_lags = [
            (r.lag if fresh(r) and r.lag is not None else 2**62)
            for r in members
            if r.role == "standby"
        ]
        assert standby_lags == sorted(standby_lags)


def in_sync_now(replica: Replica) -> bool:
    """Reported caught up, or caught up at a known moment, in a fresh report."""
    return fresh(replica) and (
        replica.lag == 0 or (replica.lag is not None and replica.caught_up_at_ms is not None)
    )


def test_a_restoring_active_answers_only_after_an_in_sync_standby():
    restoring = Replica("a", "http://a", "active", True, 5_000, None, NOW - 100)
    standby = Replica("b", "http://b", "standby", True, 3, NOW - 400, NOW - 100)
    unreported = Replica("c", "http://c", "standby", True, None, None, None)
    choice = choose_replicas((restoring, standby, unreported), LagBudget(), now_ms=NOW)
    assert [r.node_id for r in choice.candidates] == ["b", "a", "c"]


@settings(max_examples=300)
@given(replica_sets(), ejections)
def test_an_unlimited_budget_refuses_only_dead_nodes(replicas, ejected):
    choice = choose_replicas(replicas, LagBudget(), now_ms=NOW, ejected=ejected)
    assert {r.node_id for r in choice.candidates} == {r.node_id for r in replicas if r.alive}


def test_an_ejected_replica_is_the_last_resort_not_refused():
    """A dead active and a standby ejected after one failed request: the standby is still
    tried (it is alive and in sync), after any replica that was not ejected."""
    dead = Replica("a", "http://a", "active", False, 0, NOW - 50, NOW - 100)
    ejected_standby = Replica("b", "http://b", "standby", True, 0, NOW - 50, NOW - 100)
    lagging = Replica("c", "http://c", "standby", True, 900, NOW - 5_000, NOW - 100)
    ejected = frozenset({"b"})
    alone = choose_replicas((dead, ejected_standby), LagBudget(), now_ms=NOW, ejected=ejected)
    assert [r.node_id for r in alone.candidates] == ["b"]
    assert [(r.node_id, r.reason) for r in alone.rejected] == [("a", "dead")]
    replicas = (dead, ejected_standby, lagging)
    both = choose_replicas(replicas, LagBudget(), now_ms=NOW, ejected=ejected)
    assert [r.node_id for r in both.candidates] == ["c", "b"]


@settings(max_examples=500)
@given(replica_sets(), budgets, ejections, st.integers(0, 100))
def test_spreading_rotates_in_sync_replicas_only_and_keeps_ejected_ones_last(
    replicas, budget, ejected, counter
):
    choice = choose_replicas(replicas, budget, now_ms=NOW, ejected=ejected)
    spread = rotated(choice.candidates, choice.spread_width, counter)
    assert sorted(spread, key=lambda r: r.node_id) == sorted(
        choice.candidates, key=lambda r: r.node_id
    )
    width = choice.spread_width
    assert spread[width:] == choice.candidates[width:]  # restoring and ejected stay behind
    was_ejected = [replica.node_id in ejected for replica in spread]
    assert was_ejected == sorted(was_ejected)
    for replica in spread[:width] if width > 1 else ():
        assert replica.node_id not in ejected
        assert replica.lag == 0 or replica.caught_up_at_ms is not None  # in sync
    if width > 1:  # every one of them gets the first read in turn
        firsts = {rotated(choice.candidates, width, n)[0] for n in range(width)}
        assert firsts == set(choice.candidates[:width])


@settings(max_examples=500)
@given(replica_sets(), budgets, ejections)
def test_reads_spread_over_every_in_sync_replica_that_was_not_ejected(replicas, budget, ejected):
    """Liveness of spreading: each in-sync, non-ejected candidate gets the first read in
    turn (not merely: whoever does is in sync); with none in sync only the first is tried."""
    choice = choose_replicas(replicas, budget, now_ms=NOW, ejected=ejected)
    sharing = {r.node_id for r in choice.candidates if in_sync_now(r) and r.node_id not in ejected}
    firsts = {
        rotated(choice.candidates, choice.spread_width, n)[0].node_id
        for n in range(len(choice.candidates))
    }
    if sharing:
        assert firsts == sharing
    else:
        assert firsts == {r.node_id for r in choice.candidates[:1]}


def test_spreading_never_puts_an_ejected_replica_first():
    replicas = (
        replica("a", role="active"),
        replica("b"),
        replica("c"),
    )
    choice = choose_replicas(replicas, LagBudget(), now_ms=NOW, ejected=frozenset({"c"}))
    assert choice.spread_width == 2
    firsts = [rotated(choice.candidates, choice.spread_width, n)[0].node_id for n in range(6)]
    assert set(firsts) == {"a", "b"}
    assert [r.node_id for r in rotated(choice.candidates, 2, 1)] == ["b", "a", "c"]


def replica(node_id, *, role="standby", lag=0, caught_up_ago=0, reported_ago=0, alive=True):
    return Replica(
        node_id, f"http://{node_id}", role, alive, lag, NOW - caught_up_ago, NOW - reported_ago
    )


def test_reasons_say_what_was_wrong():
    replicas = (
        replica("a", role="active", alive=False),
        replica("b", lag=500, caught_up_ago=9_000),
        replica("c", lag=None),
        replica("d", lag=0, reported_ago=60_000),
        replica("e", lag=3, caught_up_ago=20_000),
    )
    choice = choose_replicas(
        replicas, LagBudget(max_offsets=100, max_ms=10_000), now_ms=NOW, ejected=frozenset()
    )
    assert choice.candidates == ()
    assert {r.node_id: r.reason for r in choice.rejected} == {
        "a": "dead",
        "b": "lag 500 over budget 100",
        "c": "unknown lag",
        "d": "lag report too old",
        "e": "time lag 20000 ms over budget 10000 ms",
    }


@settings(max_examples=300)
@given(replica_sets(), budgets, ejections)
def test_without_standby_reads_only_the_active_answers(replicas, budget, ejected):
    choice = choose_replicas(replicas, budget, now_ms=NOW, ejected=ejected, standby_reads=False)
    with_standbys = choose_replicas(replicas, budget, now_ms=NOW, ejected=ejected)
    assert all(r.role == "active" for r in choice.candidates)
    assert choice.candidates == tuple(r for r in with_standbys.candidates if r.role == "active")
    reasons = {r.node_id: r.reason for r in choice.rejected}
    for standby in (r for r in replicas if r.role == "standby" and r.alive):
        assert reasons[standby.node_id] == "standby reads are off"


def test_unknown_lag_can_be_accepted_explicitly():
    replicas = (replica("a", role="active", lag=None),)
    budget = LagBudget(max_offsets=10)
    assert choose_replicas(replicas, budget, now_ms=NOW).candidates == ()
    assert (
        choose_replicas(replicas, budget, now_ms=NOW, unknown_lag="accept").candidates == replicas
    )


def test_a_request_can_only_tighten_the_budget():
    configured = LagBudget(max_offsets=100, max_ms=None)
    assert configured.tightened(LagBudget(max_offsets=1000, max_ms=500)) == LagBudget(100, 500)
    assert configured.tightened(LagBudget()) == configured
    assert LagBudget().unlimited


@settings(max_examples=400)
@given(replica_sets(), budgets, st.integers(0, 70_000))
def test_a_choice_holds_until_it_expires(replicas, budget, later):
    """The handler reuses a choice until choice_expires_at: time alone must not change who is
    tried, in what order, or who is refused before then (a refusal's time-lag figure is the
    one measured when the choice was made)."""
    from proxy.choice import choice_expires_at  # noqa: PLC0415

    first = choose_replicas(replicas, budget, now_ms=NOW)
    expires = choice_expires_at(replicas, budget, now_ms=NOW)
    assert expires > NOW
    moment = NOW + later
    if moment < expires:
        again = choose_replicas(replicas, budget, now_ms=moment)
        assert again.candidates == first.candidates
        assert [(r.node_id, r.role) for r in again.rejected] == [
            (r.node_id, r.role) for r in first.rejected
        ]
