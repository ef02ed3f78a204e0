"""The RocksDB store: atomic rows + checkpoint, no double application, survives reopening."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from materializer.errors import StoreCorrupted, StoreError
from materializer.store import MERGE_BROKEN_AFTER, MergeBroken, Row, Store, open_or_rebuild


def rows(*triples):
    return [Row(key, value, offset, 1_000 + offset) for key, value, offset in triples]


@pytest.fixture
def store(tmp_path):
    opened = Store(tmp_path / "customers")
    opened.add_partition(0)
    opened.add_partition(3)
    yield opened
    opened.close()


def test_latest_value_per_key_and_deletes(store):
    result = store.apply(
        0, rows((b"a", b"1", 0), (b"b", b"2", 1), (b"a", b"3", 2), (b"b", None, 3)), 4, 1_003
    )
    assert result.written == 4
    assert store.get(0, b"a").value == b"3"
    assert store.get(0, b"a").offset == 2
    assert store.get(0, b"b") is None
    assert store.checkpoint(0).next_offset == 4
    assert store.checkpoint(0).newest_record_ms == 1_003


def test_rows_below_the_checkpoint_are_never_applied_twice(store):
    store.apply(0, rows((b"a", b"first", 0), (b"a", b"second", 1)), 2, None)
    store.apply(0, rows((b"a", b"late", 5)), 6, None)
    # A re-read from offset 0 (as after a crash before the checkpoint moved) changes nothing.
    replay = store.apply(0, rows((b"a", b"first", 0), (b"a", b"second", 1)), 2, None)
    assert replay.written == 0
    assert store.get(0, b"a").value == b"late"
    # An overlapping batch applies only the new part.
    overlap = store.apply(0, rows((b"a", b"late", 5), (b"a", b"newest", 6)), 7, None)
    assert (overlap.written, overlap.skipped_already_applied) == (1, 1)
    assert store.get(0, b"a").value == b"newest"


def test_partitions_are_independent(store):
    store.apply(0, rows((b"k", b"zero", 0)), 1, None)
    store.apply(3, rows((b"k", b"three", 0)), 1, None)
    assert store.get(0, b"k").value == b"zero"
    assert store.get(3, b"k").value == b"three"
    assert store.partitions() == {0, 3}


def test_everything_survives_reopening(tmp_path):
    first = Store(tmp_path / "s")
    first.add_partition(2)
    first.apply(2, rows((b"k", b"v", 41)), 42, 5_000)
    first.close()
    second = Store(tmp_path / "s")
    try:
        assert second.partitions() == {2}
        assert second.get(2, b"k").value == b"v"
        assert second.checkpoint(2).next_offset == 42
    finally:
        second.close()


def test_dropping_a_partition_forgets_rows_and_checkpoint(store):
    store.apply(3, rows((b"k", b"v", 0)), 1, None)
    store.drop_partition(3)
    assert store.partitions() == {0}
    assert store.checkpoint(3) is None
    with pytest.raises(StoreError, match="partition 3 is not in this store"):
        store.get(3, b"k")
    store.add_partition(3)  # added back: empty, reads from the start again
    assert store.get(3, b"k") is None
    assert store.checkpoint(3) is None


def test_merge_combines_with_the_stored_value_and_earlier_rows_of_the_batch(store):
    def add_counts(previous, new):
        total = (json.loads(previous)["count"] if previous else 0) + json.loads(new)["count"]
        return json.dumps({"count": total}).encode()

    store.apply(0, rows((b"c", b'{"count": 2}', 0)), 1, None, merge=add_counts)
    store.apply(
        0, rows((b"c", b'{"count": 3}', 1), (b"c", b'{"count": 4}', 2)), 3, None, merge=add_counts
    )
    assert json.loads(store.get(0, b"c").value) == {"count": 9}


def test_unknown_partition_is_refused(store):
    with pytest.raises(StoreError):
        store.apply(7, rows((b"k", b"v", 0)), 1, None)


def filled(path: Path) -> None:
    made = Store(path)
    made.add_partition(1)
    made.apply(1, rows(*((b"k%d" % i, b"v" * 50, i) for i in range(2_000))), 2_000, None)
    made.close()


def damage_current(path: Path) -> None:
    (path / "CURRENT").write_text("not a manifest name\n")


def damage_manifest(path: Path) -> None:
    manifest = next(path.glob("MANIFEST-*"))
    manifest.write_bytes(b"\xff" * 64 + manifest.read_bytes()[64:])


def lose_table_files(path: Path) -> None:
    for table in [*path.glob("*.sst"), *path.glob("*.log")]:
        table.unlink()


@pytest.mark.parametrize("damage", [damage_current, damage_manifest, lose_table_files])
def test_a_damaged_store_is_moved_aside_and_rebuilt_empty(tmp_path, damage):
    path = tmp_path / "s"
    filled(path)
    damage(path)
    with pytest.raises(StoreCorrupted):
        Store(path).close()
    rebuilt = open_or_rebuild(path)
    try:
        assert rebuilt.partitions() == frozenset()  # no checkpoint: read from the start
        assert (tmp_path / "s.corrupted" / "LOCK").exists()  # kept for a post-mortem
    finally:
        rebuilt.close()


def test_a_store_held_by_another_process_is_an_error_not_a_rebuild(tmp_path):
    path = tmp_path / "s"
    filled(path)
    holder = Store(path)  # RocksDB's LOCK: a second opener fails, wherever it is
    try:
        with pytest.raises(StoreError) as raised:
            open_or_rebuild(path)
        assert not isinstance(raised.value, StoreCorrupted)
        assert holder.checkpoint(1).next_offset == 2_000
        assert not (tmp_path / "s.corrupted").exists()
    finally:
        holder.close()


def test_a_crash_inside_drop_partition_never_leaves_an_empty_partition_applied(tmp_path):
    """Either half of drop_partition done alone (a crash between them) is undone on open:
    a checkpoint without rows would answer 404 with lag 0 for keys that exist."""
    path = tmp_path / "s"
    first = Store(path)
    first.add_partition(1)
    first.add_partition(2)
    first.apply(1, rows((b"k", b"v", 99)), 100, None)
    first.apply(2, rows((b"k", b"v", 99)), 100, None)
    first._db.drop_column_family("p1")  # rows gone, checkpoint left (the old order)
    first._checkpoints.delete(b"2")  # checkpoint gone, rows left (the new order)
    first._partitions = {}
    first.close()
    second = Store(path)
    try:
        assert second.checkpoint(1) is None
        assert second.checkpoint(2) is None
        assert second.partitions() == frozenset()  # both read again from the log start
    finally:
        second.close()


def test_dropping_a_partition_removes_its_checkpoint_first(tmp_path):
    store = Store(tmp_path / "s")
    real_db = store._db
    seen = []

    class Watching:  # what RocksDB is asked, in order
        def __getattr__(self, name):
            return getattr(real_db, name)

        def drop_column_family(self, name):
            seen.append((name, store.checkpoint(4)))
            real_db.drop_column_family(name)

    try:
        store.add_partition(4)
        store.apply(4, rows((b"k", b"v", 0)), 1, None)
        store._db = Watching()
        store.drop_partition(4)
        assert seen == [("p4", None)]  # the checkpoint was already gone
    finally:
        store._db = real_db
        store.close()


def _count_or_fail(previous: bytes | None, new: bytes | None) -> bytes | None:
    if new == b"poison":
        raise ValueError("cannot merge poison")
    count = json.loads(previous)["count"] if previous else 0
    return json.dumps({"count": count + 1}).encode()


def test_a_row_the_merge_fails_on_is_skipped_and_reported_the_rest_applied(store):
    result = store.apply(
        0,
        rows((b"c", b"x", 0), (b"c", b"poison", 1), (b"c", b"x", 2), (b"d", b"x", 3)),
        4,
        None,
        merge=_count_or_fail,
    )
    assert result.merge_failures == [(1, "merge failed: ValueError: cannot merge poison")]
    assert result.written == 3
    assert json.loads(store.get(0, b"c").value) == {"count": 2}, "the poison row changed nothing"
    assert store.checkpoint(0).next_offset == 4, "the partition moves on past it"


def test_a_merge_that_fails_on_every_row_is_broken_and_nothing_is_written(store):
    poison = [(b"k%d" % i, b"poison", i) for i in range(MERGE_BROKEN_AFTER)]
    with pytest.raises(MergeBroken, match="failed on all"):
        store.apply(0, rows(*poison), MERGE_BROKEN_AFTER, None, merge=_count_or_fail)
    assert store.checkpoint(0) is None or store.checkpoint(0).next_offset == 0
    assert store.get(0, b"k0") is None
