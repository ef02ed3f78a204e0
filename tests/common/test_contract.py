"""The Redis contract: key names, round trips, and refusing what it does not understand."""

from __future__ import annotations

import json
import re
import uuid

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from common.contract import (
    BODY_REWRITE_MS,
    SCHEMA_VERSION,
    Assignment,
    ContractError,
    Event,
    Hosting,
    Keys,
    NodeInfo,
    NodeReport,
    PartitionAssignment,
    PartitionReport,
    ReportBodies,
    StoreInfo,
    decode_assignment,
    decode_event,
    decode_hosting,
    decode_node,
    decode_node_report,
    decode_report,
    decode_report_at,
    decode_store,
    encode,
    encode_node_report,
    encode_report_at,
    lag_field,
    node_report,
    report_time,
    write_node_report,
)


def test_key_names_are_stable():
    keys = Keys("prod")
    assert keys.node("n1") == "kroute:prod:node:n1"
    assert keys.alive("n1") == "kroute:prod:alive:n1"
    assert keys.store("customers") == "kroute:prod:store:customers"
    assert keys.hosting("n1") == "kroute:prod:hosting:n1"
    assert keys.lag("n1") == "kroute:prod:lag:n1"
    assert keys.report("n1") == "kroute:prod:report:n1"
    assert keys.report_at("n1") == "kroute:prod:report_at:n1"
    assert keys.assignment == "kroute:prod:assignment"
    assert keys.leader == "kroute:prod:leader"
    assert keys.events == "kroute:prod:events"
    assert keys.dead_since == "kroute:prod:dead_since"
    assert keys.node_id_of(b"kroute:prod:node:n1") == "n1"
    assert lag_field("customers", 7) == "customers/7"


@pytest.mark.parametrize(
    ("value", "decode"),
    [
        (NodeInfo("n1", "http://10.0.0.1:8081", 1_700_000_000_000), decode_node),
        (StoreInfo("customers", "bookings", 12, "uuid", "murmur2", "json"), decode_store),
        (PartitionReport(10, 12, 1_700_000_000_000, None, 1_700_000_000_500), decode_report),
        (Event("assignment", generation=4), decode_event),
        (
            Hosting("n1", 4, {"customers": {"active": (0, 3), "standby": (1,)}}, 1_700_000_000_000),
            decode_hosting,
        ),
    ],
)
def test_round_trips(value, decode):
    assert decode(encode(value)) == value


@given(
    st.dictionaries(
        st.integers(0, 99),
        st.tuples(
            st.sampled_from(["a", "b", None]), st.lists(st.sampled_from(["c", "d"]), unique=True)
        ),
        max_size=10,
    ),
    st.integers(1, 10**6),
)
def test_assignment_round_trips(parts, generation):
    assignment = Assignment(
        generation,
        "a",
        123,
        {"customers": {p: PartitionAssignment(a, tuple(s)) for p, (a, s) in parts.items()}},
    )
    assert decode_assignment(encode(assignment)) == assignment


def test_every_value_says_its_schema_version():
    assert json.loads(encode(Event("node", node_id="n1")))["v"] == SCHEMA_VERSION


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b'{"v": 2, "node_id": "n1", "url": "u", "started_at_ms": 1}', "schema version 2"),
        (b'{"node_id": "n1"}', "schema version None"),
        (b"not json", "not JSON"),
        (b"[1, 2]", "expected a JSON object"),
        (b'{"v": 1, "node_id": "n1"}', "not a NodeInfo"),
        # No UTF-8 text holds a lone surrogate: such an id would break every exposition of it.
        (b'{"v": 1, "node_id": "n\\ud800", "url": "u", "started_at_ms": 1}', "not JSON"),
    ],
)
def test_values_it_does_not_understand_are_refused_with_a_reason(raw, reason):
    with pytest.raises(ContractError, match=reason):
        decode_node(raw)


def test_assignment_knows_each_nodes_roles():
    assignment = Assignment(
        3,
        "a",
        0,
        {
            "s": {
                0: PartitionAssignment("a", ("b",)),
                1: PartitionAssignment("b", ("a",)),
                2: PartitionAssignment("b", ()),
            }
        },
    )
    assert assignment.for_node("a") == {"s": {"active": [0], "standby": [1]}}
    assert assignment.for_node("b") == {"s": {"active": [1, 2], "standby": [0]}}
    assert assignment.for_node("z") == {}


# -- report:<id>, the compact per-node report ---------------------------------------------------

AT = 1_700_000_000_000
HOSTING = Hosting("n1", 3, {"s": {"active": (0, 5), "standby": (2,)}}, AT)
REPORTS = {
    ("s", 0): PartitionReport(500, 500, AT - 10, AT - 5, AT),
    ("s", 5): PartitionReport(100, 140, None, None, AT),
    # partition 2 (standby) has no report: unknown lag
}


def test_a_node_report_is_compact_and_aligned_with_its_partitions():
    raw = encode_node_report(node_report(HOSTING, REPORTS, version=AT - 60_000))
    assert json.loads(raw) == {
        "v": 1,
        "node_id": "n1",
        "generation": 3,
        "version": AT - 60_000,
        "stores": {
            # The newest record's age is left out (null): it moves on every report.
            "s": {"active": [0, 5], "standby": [2], "lag": [[0, 5, None], [40, None, None], None]}
        },
    }


def _idle_node_report(end_read_at: int, reported_at: int) -> NodeReport:
    """An idle, caught-up node's report: stamped as of its last end-offset read, caught up at
    that read, its newest record written long ago, made `reported_at` (after the read)."""
    hosting = Hosting("n1", 3, {"s": {"active": (0, 5), "standby": (2,)}}, reported_at)
    reports = {
        ("s", p): PartitionReport(500 + p, 500 + p, AT - 60_000, end_read_at, end_read_at)
        for p in (0, 5, 2)
    }
    return node_report(hosting, reports)


def test_an_idle_caught_up_node_reports_the_same_body_whatever_the_reads_phase():
    """What makes report:<id> written (and read by every proxy) only when something changes:
    two reports, 250 ms apart, each made a different while after its end-offset read."""
    first = _idle_node_report(end_read_at=AT, reported_at=AT + 37)
    second = _idle_node_report(end_read_at=AT + 250, reported_at=AT + 250 + 181)
    assert encode_node_report(first) == encode_node_report(second)  # both version 0
    assert first.lags == {"s": ((0, 0, None), (0, 0, None), (0, 0, None))}
    # As of the read: report_at:<id> says when the figures were true, not when sent.
    hosting = first.hosting(AT + 37)
    reports = {("s", p): PartitionReport(500, 500, None, AT, AT) for p in (0, 5, 2)}
    assert report_time(hosting, reports) == AT


def test_a_node_report_gives_back_the_hosting_and_the_lags_around_known_ends():
    decoded = decode_node_report(encode_node_report(node_report(HOSTING, REPORTS, version=7)))
    assert decoded.version == 7
    assert decoded.hosting(AT) == HOSTING
    ends = {("s", 0): 500, ("s", 5): 130}  # 5's end is older: its position end - lag, lower
    rebuilt = decoded.partition_reports(ends, AT)
    assert rebuilt[("s", 0)] == PartitionReport(500, 500, None, AT - 5, AT)  # no newest
    assert rebuilt[("s", 5)] == PartitionReport(90, 130, None, None, AT)  # lag 40 exact
    assert ("s", 2) not in rebuilt
    assert decoded.partition_reports({}, AT)[("s", 0)].current_offset == 0  # no end: 0
    # Confirmed later, the same body: every time moves with the confirmation.
    later = decoded.partition_reports(ends, AT + 250)[("s", 0)]
    assert later == PartitionReport(500, 500, None, AT + 245, AT + 250)


def test_a_node_report_is_never_younger_than_its_oldest_report():
    old = {**REPORTS, ("s", 2): PartitionReport(7, 7, None, AT - 900, AT - 800)}
    assert report_time(HOSTING, old) == AT - 800
    decoded = decode_node_report(encode_node_report(node_report(HOSTING, old)))
    assert decoded.partition_reports({}, AT - 800)[("s", 0)].caught_up_at_ms == AT - 5  # exact


def _report_body(**changes: object) -> bytes:
    body = json.loads(encode_node_report(node_report(HOSTING, REPORTS)))
    body.update(changes)
    return json.dumps(body).encode()


def _store_body(**changes: object) -> bytes:
    store = {"active": [0, 5], "standby": [2], "lag": [[0, 5, 10], [40, None, None], None]}
    return _report_body(stores={"s": {**store, **changes}})


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"{", "not JSON"),
        (b"[]", "JSON object"),
        (_report_body(v=2), "schema version 2"),
        (_report_body(extra=1), "fields"),
        (_report_body(version="1"), "wrong type"),
        (_report_body(at_ms=AT), "fields"),  # the time is report_at's
        (_report_body(version=None), "wrong type"),
        (_report_body(generation=True), "wrong type"),
        (_report_body(node_id=7), "wrong type"),
        (_report_body(stores=[]), "not an object"),
        (_store_body(active=["0"]), "not integers"),
        (_store_body(standby=[-1]), "not integers"),
        (_store_body(offsets=[]), "is not"),
        (_store_body(lag=[[0, 5, 10], [40, None, None]]), "not aligned"),
        (_store_body(lag=[[0, 5, 10], [-1, None, None], None]), "lag ≥ 0"),
        (_store_body(lag=[[0, 5, 10], [40, None], None]), "is not [lag, ago, ago]"),
        (_store_body(lag=[[0, 5, 10], [40, 1.5, None], None]), "lag ≥ 0"),
        (_store_body(lag=[[0, 5, 10], [40, None, None], 0]), "is not [lag, ago, ago]"),
    ],
)
def test_a_node_report_it_does_not_understand_is_refused_with_a_reason(raw, reason):
    with pytest.raises(ContractError, match=re.escape(reason)):
        decode_node_report(raw)


# -- report_at:<id>, the confirmation, and the writer's rule -------------------------------------


def test_report_at_is_two_integers_round_trip():
    assert encode_report_at(7, AT) == f"7 {AT}".encode()
    assert decode_report_at(encode_report_at(7, AT)) == (7, AT)
    assert decode_report_at(f"7 {AT}") == (7, AT)


@pytest.mark.parametrize(
    "raw", [b"abc", b"1", b"-5 6", b"5 -6", b"1 2 3", b"1  2", b" 1 2", b"1 2 ", b"\xc2\xb2 1",
            b"1.5 2", b"", b"1 " + b"9" * 19, b'{"version": 1}', b"\xff 1"]
)  # fmt: skip
def test_a_report_at_it_does_not_understand_is_refused(raw):
    with pytest.raises(ContractError, match="not a report_at value"):
        decode_report_at(raw)


@pytest.fixture
def client(redis_server) -> redis.Redis:  # type: ignore[no-untyped-def]
    connection = redis.Redis.from_url(redis_server.url)
    yield connection  # type: ignore[misc]
    connection.close()


def _write(client: redis.Redis, keys: Keys, bodies: ReportBodies, at: int, lag: int = 0) -> None:
    """n1's report at `at`: caught up 5 ms before it (the same body whenever `lag` is)."""
    reports = {("s", 0): PartitionReport(500, 500 + lag, at - 10, at - 5, at)}
    pipe = client.pipeline(transaction=True)
    hosting = Hosting("n1", 3, {"s": {"active": (0,), "standby": ()}}, at)
    write_node_report(pipe, keys, hosting, reports, 60_000, bodies=bodies)
    pipe.execute()


def _stamp(client: redis.Redis, keys: Keys) -> tuple[int, int]:
    return decode_report_at(client.get(keys.report_at("n1")) or b"")


@pytest.mark.integration
def test_the_writer_writes_the_body_only_when_it_changes_and_always_report_at(client):
    keys, bodies = Keys(f"rule-{uuid.uuid4().hex[:8]}"), ReportBodies()
    _write(client, keys, bodies, AT)
    assert _stamp(client, keys) == (AT, AT)  # version: the writer's time when first written
    assert decode_node_report(client.get(keys.report("n1")) or b"").version == AT
    client.set(keys.report("n1"), b"marker", keepttl=True)  # to see whether it is rewritten

    _write(client, keys, bodies, AT + 250)  # the same body relative to its time
    assert client.get(keys.report("n1")) == b"marker", "an unchanged body was rewritten"
    assert _stamp(client, keys) == (AT, AT + 250), "report_at not written on every report"
    assert 0 < client.pttl(keys.report("n1")) <= 60_000  # same expiry as report_at
    assert 0 < client.pttl(keys.report_at("n1")) <= 60_000

    _write(client, keys, bodies, AT + 500, lag=3)  # changed: a new version, body and stamp
    body = decode_node_report(client.get(keys.report("n1")) or b"")
    assert body.version == AT + 500
    assert body.lags == {"s": ((3, 5, None),)}
    assert _stamp(client, keys) == (AT + 500, AT + 500)


@pytest.mark.integration
def test_the_writer_rewrites_an_unchanged_body_now_and_then_in_case_a_write_was_lost(client):
    keys, bodies = Keys(f"rule-{uuid.uuid4().hex[:8]}"), ReportBodies()
    _write(client, keys, bodies, AT)
    client.delete(keys.report("n1"))  # a Redis restarted empty, a transaction that failed
    _write(client, keys, bodies, AT + BODY_REWRITE_MS - 1)
    assert client.get(keys.report("n1")) is None
    _write(client, keys, bodies, AT + BODY_REWRITE_MS)
    assert decode_node_report(client.get(keys.report("n1")) or b"").version == AT  # same one
    assert _stamp(client, keys) == (AT, AT + BODY_REWRITE_MS)


@pytest.mark.integration
def test_a_restarted_writer_gives_a_higher_version(client):
    keys, bodies = Keys(f"rule-{uuid.uuid4().hex[:8]}"), ReportBodies()
    _write(client, keys, bodies, AT)
    _write(client, keys, bodies, AT + 100, lag=1)
    _write(client, keys, bodies, AT + 100, lag=2)  # two changes in one ms: still increasing
    assert _stamp(client, keys) == (AT + 101, AT + 100)
    _write(client, keys, ReportBodies(), AT + 300)  # a restart: nothing known of the last run
    version, at_ms = _stamp(client, keys)
    assert (version, at_ms) == (AT + 300, AT + 300)
    assert decode_node_report(client.get(keys.report("n1")) or b"").version == version
