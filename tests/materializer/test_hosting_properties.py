"""Property tests of the node's hosting state machine (materializer.hosting): random sequences of
assignments, resets, outside-log checks, drop checks and clock steps, against a simple model of
what each partition has been through."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from common.contract import Role
from materializer.hosting import Changes, HostedPartitions

PARTITIONS = range(6)
GRACE = 1_000
CONFIRM = 2_000
DEFAULT: Role = "standby"
START = 1_000_000

roles_of = st.dictionaries(st.sampled_from(PARTITIONS), st.sampled_from(["active", "standby"]))
some_partitions = st.sets(st.sampled_from(PARTITIONS))
# Within the grace period (a partition assigned back in time) and beyond it.
ticks = st.one_of(st.integers(0, 300), st.integers(300, 2_500))
KINDS = st.sampled_from(["assign", "tick", "tick", "due", "reset", "outside", "outside"])


def mostly_hosted(hosted: list[int]) -> st.SearchStrategy[set[int]]:
    """Partitions to reset or see outside the log: mostly hosted ones (the others are ignored,
    so a few are enough)."""
    if not hosted:
        return some_partitions
    return st.one_of(st.sets(st.sampled_from(hosted)), some_partitions)


@dataclass
class Model:
    """What each partition went through, kept the plainest way."""

    at: int = START
    roles: dict[int, Role] = field(default_factory=dict)
    clock_start: dict[int, int] = field(default_factory=dict)  # hosted -> (re)hosted or reset
    given_up_at: dict[int, int] = field(default_factory=dict)  # unhosted, still on disk
    outside_from: dict[int, int] = field(default_factory=dict)  # hosted, outside every check


def new_hosting() -> HostedPartitions:
    return HostedPartitions(grace_ms=GRACE, default_role=DEFAULT, confirm_outside_ms=CONFIRM)


def check_assign(hosting: HostedPartitions, model: Model, roles: dict[int, Role]) -> None:
    before = dict(model.roles)
    changes = hosting.assign(roles, model.at)
    added = sorted(set(roles) - set(before))
    removed = sorted(set(before) - set(roles))
    assert changes.changed == (set(roles) != set(before)), "changed exactly when the set does"
    assert (list(changes.added), list(changes.removed)) == (added, removed)
    assert changes.hosted == tuple(sorted(roles))
    assert dict(changes.roles_changed) == {
        p: role for p, role in roles.items() if p in before and before[p] != role
    }
    # Assigned back within the grace period: the drop is cancelled (nothing to restore).
    assert list(changes.drops_cancelled) == sorted(p for p in roles if p in model.given_up_at)
    assert dict(changes.drops) == {p: model.at + GRACE for p in removed}
    for partition in roles:
        model.given_up_at.pop(partition, None)
    for partition in added:
        model.clock_start[partition] = model.at
    for partition in removed:
        model.given_up_at[partition] = model.at
        model.clock_start.pop(partition)
        model.outside_from.pop(partition, None)
    model.roles = dict(roles)


def check_due(hosting: HostedPartitions, model: Model) -> None:
    due = hosting.due_drops(model.at)
    for partition in due:
        assert partition not in hosting.hosted, "never dropped while hosted"
        given_up = model.given_up_at.pop(partition, None)
        assert given_up is not None, f"{partition} was not waiting to be dropped"
        assert model.at - given_up >= GRACE, "dropped before the whole grace period"
    late = [p for p, since in model.given_up_at.items() if model.at - since >= GRACE]
    assert late == [], f"unhosted for the grace period, not dropped: {late}"


def check_reset(hosting: HostedPartitions, model: Model, partitions: set[int]) -> None:
    emptied = hosting.reset(partitions, model.at)
    assert emptied == sorted(partitions & set(model.roles)), "only hosted stores are emptied"
    for partition in emptied:
        model.clock_start[partition] = model.at
        model.outside_from.pop(partition, None)


def check_outside(hosting: HostedPartitions, model: Model, seen: set[int]) -> None:
    confirmed = hosting.outside_log(seen, model.at)
    model.outside_from = {p: model.outside_from.get(p, model.at) for p in seen if p in model.roles}
    assert confirmed == sorted(
        p for p, since in model.outside_from.items() if model.at - since >= CONFIRM
    ), "confirmed only after being outside on every check for the confirm time"


def check_view(hosting: HostedPartitions, model: Model) -> None:
    assert hosting.hosted == tuple(sorted(model.roles))
    for partition in PARTITIONS:
        assert hosting.role_of(partition) == model.roles.get(partition, DEFAULT)
        assert hosting.stall_clock_start(partition) == model.clock_start.get(partition)
    assert dict(hosting.pending_drops) == {p: t + GRACE for p, t in model.given_up_at.items()}
    assert not set(hosting.pending_drops) & set(hosting.hosted)
    assert hosting.next_drop_at() == min(hosting.pending_drops.values(), default=None)


@settings(max_examples=500)
@given(st.data())
def test_hosting_follows_the_model(data):
    hosting, model = new_hosting(), Model()
    for _ in range(data.draw(st.integers(0, 40), label="steps")):
        kind = data.draw(KINDS, label="step")
        if kind == "assign":
            check_assign(hosting, model, data.draw(roles_of, label="roles"))
        elif kind == "tick":
            model.at += data.draw(ticks, label="ms")
        elif kind == "due":
            check_due(hosting, model)
        elif kind == "reset":
            check_reset(hosting, model, data.draw(mostly_hosted(sorted(model.roles))))
        else:
            check_outside(hosting, model, data.draw(mostly_hosted(sorted(model.roles))))
        check_view(hosting, model)


# -- the same rules, one example each ---------------------------------------------------------


def test_a_partition_given_up_is_dropped_after_the_grace_period_not_before():
    hosting = new_hosting()
    hosting.assign({0: "active", 1: "standby"}, START)
    changes = hosting.assign({0: "active"}, START + 10)
    assert (changes.removed, dict(changes.drops)) == ((1,), {1: START + 10 + GRACE})
    assert hosting.due_drops(START + 10 + GRACE - 1) == []
    assert hosting.due_drops(START + 10 + GRACE) == [1]
    assert hosting.due_drops(START + 10 + GRACE) == [], "handed over once"


def test_assigned_back_within_the_grace_period_nothing_is_dropped():
    hosting = new_hosting()
    hosting.assign({0: "active", 1: "standby"}, START)
    hosting.assign({0: "active"}, START + 10)
    back = hosting.assign({0: "active", 1: "active"}, START + 500)
    assert back.drops_cancelled == (1,)
    assert hosting.next_drop_at() is None
    assert hosting.due_drops(START + 10 * GRACE) == []
    assert hosting.stall_clock_start(1) == START + 500, "hosted again: a fresh stall clock"


def test_a_role_swap_alone_is_no_change_of_the_hosted_set():
    hosting = new_hosting()
    hosting.assign({0: "active", 1: "standby"}, START)
    swap: Changes = hosting.assign({0: "standby", 1: "active"}, START + 1)
    assert not swap.changed
    assert dict(swap.roles_changed) == {0: "standby", 1: "active"}
    assert hosting.stall_clock_start(0) == START, "still hosted: the stall clock runs on"
    contract = hosting.as_contract("n1", "customers", 7, START + 2)
    assert contract.stores == {"customers": {"active": (1,), "standby": (0,)}}
    assert (contract.node_id, contract.generation, contract.updated_at_ms) == ("n1", 7, START + 2)


def test_outside_the_log_is_confirmed_only_when_it_lasts():
    hosting = new_hosting()
    hosting.assign({0: "active", 1: "active"}, START)
    assert hosting.outside_log({0, 1, 5}, START) == []
    assert hosting.outside_log({0}, START + CONFIRM - 1) == []
    assert hosting.outside_log({0, 1}, START + CONFIRM) == [0], "1 came back in between"
    assert hosting.reset([0, 5], START + CONFIRM) == [0], "5 is not hosted"
    assert hosting.stall_clock_start(0) == START + CONFIRM
    assert hosting.outside_log({0}, START + CONFIRM + 1) == [], "reset: watched afresh"


def test_a_partition_given_up_and_back_is_watched_afresh_for_being_outside_the_log():
    hosting = new_hosting()
    hosting.assign({0: "active"}, START)
    assert hosting.outside_log({0}, START) == []
    hosting.assign({}, START + 1)
    hosting.assign({0: "active"}, START + 2)  # back, before the next check
    assert hosting.outside_log({0}, START + CONFIRM) == []
    assert hosting.outside_log({0}, START + 2 * CONFIRM) == [0]
