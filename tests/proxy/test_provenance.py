"""Properties of the provenance lines every forwarded answer carries (proxy.exchange).

`provenance_lines` is built once per candidate and sent as it is by both paths (the C path
sends the candidate's copy); `answer_lines` adds what changes per answer. Whatever the
replica's state, the lines must parse as HTTP header fields (a malformed line once reached
clients on unkeyed answers), name each field once, and say what the table knew.
"""

from __future__ import annotations

from dataclasses import dataclass

import httptools
from hypothesis import given
from hypothesis import strategies as st

from proxy.choice import Replica
from proxy.exchange import answer_lines, provenance_lines

NOW_MS = 1_800_000_000_000

node_ids = st.from_regex(r"[a-z0-9][a-z0-9_.-]{0,20}", fullmatch=True)
replicas = st.builds(
    Replica,
    node_id=node_ids,
    url=st.just("http://127.0.0.1:1"),
    role=st.sampled_from(["active", "standby"]),
    alive=st.booleans(),
    lag=st.none() | st.integers(0, 2**40),
    caught_up_at_ms=st.none() | st.integers(NOW_MS - 10**9, NOW_MS + 10**6),
    reported_at_ms=st.none() | st.integers(NOW_MS - 10**6, NOW_MS),
)
request_ids = st.from_regex(r"[0-9a-f]{8}\.[0-9]-[0-9]{1,6}", fullmatch=True).map(str.encode)


@dataclass
class _Candidate:
    """What answer_lines reads of a candidate (the C type needs a target and tallies)."""

    provenance: bytes
    replica: Replica | None


class _Headers:
    def __init__(self) -> None:
        self.fields: list[tuple[str, str]] = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name.decode().lower(), value.decode()))


def parse(lines: bytes) -> list[tuple[str, str]]:
    """The header fields `lines` make in a real answer; raises if they are not HTTP."""
    headers = _Headers()
    parser = httptools.HttpResponseParser(headers)
    parser.feed_data(b"HTTP/1.1 200 OK\r\n" + lines + b"content-length: 0\r\n\r\n")
    return [field for field in headers.fields if field[0] != "content-length"]


@given(node_ids, st.none() | st.integers(0, 100_000), st.none() | replicas)
def test_provenance_lines_are_header_fields_that_say_what_the_table_knew(
    node_id: str, partition: int | None, replica: Replica | None
) -> None:
    fields = parse(provenance_lines(node_id, partition, replica))
    names = [name for name, _ in fields]
    assert len(names) == len(set(names)), fields
    found = dict(fields)
    assert found["x-kroute-node"] == node_id
    if partition is None or replica is None:
        assert names == ["x-kroute-node"]  # an unkeyed answer names the node only
        return
    assert found["x-kroute-partition"] == str(partition)
    assert found["x-kroute-role"] == replica.role
    assert found["x-kroute-lag"] == ("unknown" if replica.lag is None else str(replica.lag))
    # Time lag is fixed here only when it cannot grow: lag 0 with no caught-up time known.
    fixed = replica.caught_up_at_ms is None and replica.lag == 0
    assert ("x-kroute-time-lag-ms" in found) == fixed
    if fixed:
        assert found["x-kroute-time-lag-ms"] == "0"


# As the handler makes candidates: a keyed one has both, an unkeyed one neither.
keyed_or_not = st.tuples(st.none(), st.none()) | st.tuples(st.integers(0, 100_000), replicas)


@given(node_ids, keyed_or_not, st.integers(1, 5), request_ids)
def test_answer_lines_add_time_lag_once_attempts_when_retried_and_the_request_id_last(
    node_id: str,
    placed: tuple[int, Replica] | tuple[None, None],
    attempts: int,
    rid: bytes,
) -> None:
    partition, replica = placed
    provenance = provenance_lines(node_id, partition, replica)
    lines = answer_lines(_Candidate(provenance, replica), attempts, rid)  # type: ignore[arg-type]
    assert lines.startswith(provenance)
    fields = parse(lines)
    names = [name for name, _ in fields]
    assert len(names) == len(set(names)), fields
    found = dict(fields)
    assert names[-1] == "x-request-id"
    assert found["x-request-id"] == rid.decode()
    assert ("x-kroute-attempts" in found) == (attempts > 1)
    if attempts > 1:
        assert found["x-kroute-attempts"] == str(attempts)
    if replica is None:
        assert "x-kroute-time-lag-ms" not in found
        return
    expected = replica.time_lag_ms(NOW_MS)
    if expected is None:
        assert "x-kroute-time-lag-ms" not in found  # unknown: said by x-kroute-lag: unknown
    else:
        # Measured now, so at least what it was at NOW_MS when caught_up_at is in the past.
        assert int(found["x-kroute-time-lag-ms"]) >= 0
