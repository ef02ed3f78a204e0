"""Store.apply and its checkpoint pinned where mutants of materializer/store.py survived the
other tests (scripts/mutation, docs/testing.md): exact counts, what a redelivered batch does,
a batch with no rows, the merge-broken threshold and its message, and what is read back.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from materializer.errors import StoreError
from materializer.store import MERGE_BROKEN_AFTER, MergeBroken, Row, Store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = Store(tmp_path / "s")
    opened.add_partition(0)
    yield opened
    opened.close()


def fail_on_poison(previous: bytes | None, new: bytes | None) -> bytes | None:
    if new is not None and new.startswith(b"poison"):
        raise ValueError(f"cannot merge {new.decode()}")
    return (previous or b"") + (new or b"")


def test_the_first_row_of_a_new_partition_is_offset_0_and_counts_are_exact(store: Store) -> None:
    result = store.apply(0, [Row(b"a", b"1", 0, 10), Row(b"b", None, 1, None)], 2, 10)
    assert (result.written, result.skipped_already_applied, result.merge_failures) == (2, 0, [])
    assert store.get(0, b"a") is not None
    assert result.checkpoint == store.checkpoint(0)
    assert (result.checkpoint.next_offset, result.checkpoint.newest_record_ms) == (2, 10)


def test_a_redelivered_batch_changes_nothing_not_even_the_checkpoint(store: Store) -> None:
    first = store.apply(0, [Row(b"a", b"1", 0, 10), Row(b"a", b"2", 1, 11)], 2, 11)
    for replay_end in (1, 2):  # ending below, and exactly at, the checkpoint
        replay = store.apply(0, [Row(b"a", b"1", 0, 10)], replay_end, 10)
        assert (replay.written, replay.skipped_already_applied) == (0, 0)
        assert replay.checkpoint == first.checkpoint == store.checkpoint(0)


def test_skipped_rows_are_counted_and_the_rows_after_them_applied(store: Store) -> None:
    store.apply(0, [Row(b"a", b"1", 0, 10), Row(b"a", b"2", 1, 11)], 2, 11)
    result = store.apply(
        0, [Row(b"a", b"1", 0, 10), Row(b"a", b"2", 1, 11), Row(b"a", b"3", 2, 12)], 3, 12
    )
    assert (result.written, result.skipped_already_applied) == (1, 2)
    assert store.get(0, b"a").value == b"3"  # type: ignore[union-attr]


def test_a_batch_with_no_rows_still_moves_the_checkpoint(store: Store) -> None:
    """Transaction markers and compacted-away offsets: a range read may hold no record."""
    result = store.apply(0, [], 5, None)
    assert (result.written, result.skipped_already_applied) == (0, 0)
    assert store.checkpoint(0).next_offset == 5  # type: ignore[union-attr]
    assert store.checkpoint(0).newest_record_ms is None  # type: ignore[union-attr]


def test_values_are_read_back_with_their_offset_and_time(store: Store) -> None:
    store.apply(0, [Row(b"t", b"timed", 3, 1_234), Row(b"u", b"untimed", 4, None)], 5, 1_234)
    timed, untimed = store.get(0, b"t"), store.get(0, b"u")
    assert timed is not None
    assert untimed is not None
    assert (timed.value, timed.offset, timed.timestamp_ms) == (b"timed", 3, 1_234)
    assert (untimed.value, untimed.offset, untimed.timestamp_ms) == (b"untimed", 4, None)
    assert dict(store.items(0)) == {b"t": timed, b"u": untimed}
    assert store.checkpoints() == {0: store.checkpoint(0)}


def test_exactly_the_threshold_of_failures_with_nothing_written_is_broken(store: Store) -> None:
    poison = [Row(b"k%d" % i, b"poison%d" % i, 7 + i, None) for i in range(MERGE_BROKEN_AFTER)]
    with pytest.raises(MergeBroken) as broken:
        store.apply(0, poison, 7 + MERGE_BROKEN_AFTER, None, merge=fail_on_poison)
    assert str(broken.value) == (
        f"the merge failed on all {MERGE_BROKEN_AFTER} rows of a batch of partition 0, "
        "e.g. at offset 7: merge failed: ValueError: cannot merge poison0"
    )


def test_failures_beside_a_written_row_are_skipped_not_broken(store: Store) -> None:
    poison = [Row(b"k%d" % i, b"poison", i, None) for i in range(MERGE_BROKEN_AFTER)]
    good = Row(b"good", b"x", MERGE_BROKEN_AFTER, None)
    result = store.apply(0, [*poison, good], MERGE_BROKEN_AFTER + 1, None, merge=fail_on_poison)
    assert result.written == 1
    assert len(result.merge_failures) == MERGE_BROKEN_AFTER
    few = [Row(b"f%d" % i, b"poison", 20 + i, None) for i in range(MERGE_BROKEN_AFTER - 1)]
    result = store.apply(0, few, 20 + MERGE_BROKEN_AFTER, None, merge=fail_on_poison)
    assert (result.written, len(result.merge_failures)) == (0, MERGE_BROKEN_AFTER - 1)


def test_a_merge_sees_the_stored_value_and_a_delete_as_none(store: Store) -> None:
    seen: list[tuple[bytes | None, bytes | None]] = []

    def record(previous: bytes | None, new: bytes | None) -> bytes | None:
        seen.append((previous, new))
        return json.dumps(len(seen)).encode() if new is not None else None

    store.apply(0, [Row(b"k", b"v1", 0, None)], 1, None, merge=record)
    store.apply(0, [Row(b"k", b"v2", 1, None), Row(b"k", None, 2, None)], 3, None, merge=record)
    assert seen == [(None, b"v1"), (b"1", b"v2"), (b"2", None)]
    assert store.get(0, b"k") is None


def test_a_partition_the_store_does_not_hold_is_refused_by_name(store: Store) -> None:
    with pytest.raises(StoreError) as applying:
        store.apply(5, [Row(b"a", b"1", 0, None)], 1, None)
    with pytest.raises(StoreError) as reading:
        store.get(5, b"a")
    assert str(applying.value) == str(reading.value) == "partition 5 is not in this store"
