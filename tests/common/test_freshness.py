"""The freshness headers proxies and nodes both read (common.freshness)."""

from __future__ import annotations

import pytest

from common.freshness import (
    BadFreshnessHeader,
    MinOffsets,
    parse_count,
    parse_min_offsets,
    parse_position_token,
    position_token,
    reached,
)


def test_a_bare_offset_bounds_whatever_partition_the_key_is_in():
    parsed = parse_min_offsets(" 41 ")
    assert parsed == MinOffsets(bare=41)
    assert parsed.for_partition(0) == parsed.for_partition(7) == 41


def test_a_position_vector_bounds_only_its_partitions_the_highest_entry_counting():
    parsed = parse_min_offsets("3:10, 5:2,3:12,4:-1")
    assert parsed.for_partition(3) == 12
    assert parsed.for_partition(5) == 2
    assert parsed.for_partition(4) == -1
    assert parsed.for_partition(0) is None


def test_an_answers_position_token_asks_for_at_least_that_position():
    # A store at position 8 (next offset) has applied offset 7: its token says 7, and a read
    # bounded by it needs a store at 8 or later.
    token = position_token(2, 8)
    assert token == "2:7"
    assert parse_position_token(token) == (2, 7)
    bound = parse_min_offsets(token).for_partition(2)
    assert bound is not None
    assert reached(8, bound)
    assert not reached(7, bound)
    assert position_token(2, 0) == "2:-1"  # nothing applied: bounds nothing
    assert reached(0, -1)


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ("", "offset ''"),
        ("abc", "offset 'abc'"),
        ("-2", "offset '-2'"),
        ("+3", "offset '+3'"),
        ("1.5", "offset '1.5'"),
        ("1" * 19, "is not an integer"),
        ("3:x", "offset 'x'"),
        ("x:3", "partition 'x'"),
        ("3:1,7", "entry '7'"),
        ("-1:5", "partition '-1'"),
        ("3:", "offset ''"),
    ],
)
def test_malformed_min_offsets_say_what_is_wrong(raw, says):
    with pytest.raises(BadFreshnessHeader) as caught:
        parse_min_offsets(raw)
    assert caught.value.header == "x-kroute-min-offset"
    assert says in str(caught.value)
    assert parse_position_token(raw) is None


@pytest.mark.parametrize("raw", ["-1", "x", "", "1e3", "9" * 19])
def test_budgets_are_non_negative_integers(raw):
    with pytest.raises(BadFreshnessHeader, match="must be a non-negative integer"):
        parse_count(raw, "x-kroute-max-lag")
    assert parse_count(" 12 ", "x-kroute-max-lag") == 12
