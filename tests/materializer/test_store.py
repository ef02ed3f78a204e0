"""The RocksDB store: atomic rows + checkpoint, no double application, survives reopening."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def test_the_newest_record_time_only_grows(store):
    """A batch of older records (a producer with a late clock, or no timestamps at all) must not
    make the partition's newest record look older than one it already holds."""
    store.apply(0, [Row(b"a", b"1", 0, 5_000)], 1, 5_000)
    store.apply(0, [Row(b"b", b"2", 1, 3_000)], 2, 3_000)
    assert store.checkpoint(0).newest_record_ms == 5_000
    store.apply(0, [Row(b"c", b"3", 2, None)], 3, None)
    assert store.checkpoint(0).newest_record_ms == 5_000
    store.apply(0, [Row(b"d", b"4", 3, 7_000)], 4, 7_000)
    assert store.checkpoint(0).newest_record_ms == 7_000


class Crash(Exception):
    """The process died here: this write never reached RocksDB."""


class CrashingWrites:
    """Stands between the store and RocksDB and kills the process at the n-th write of any
    kind (a write batch, a put, a delete, on the database or on any column family)."""

    def __init__(self, crash_at: int) -> None:
        self.crash_at = crash_at
        self.writes = 0

    def before_write(self) -> None:
        self.writes += 1
        if self.writes == self.crash_at:
            raise Crash(f"killed at write {self.writes}")

    def wrap(self, real: Any) -> Any:
        return _Guarded(real, self)


class _Guarded:
    _WRITES = frozenset({"write", "put", "delete"})

    def __init__(self, real: Any, crashes: CrashingWrites) -> None:
        self._real, self._crashes = real, crashes

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._real, name)
        if name == "get_column_family":
            return lambda *args, **kwargs: self._crashes.wrap(attribute(*args, **kwargs))
        if name not in self._WRITES:
            return attribute
        return self._guarded(attribute)

    def _guarded(self, write: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            self._crashes.before_write()
            return write(*args, **kwargs)

        return guarded

    def __setitem__(self, key: Any, value: Any) -> None:
        self._crashes.before_write()
        self._real[key] = value

    def __delitem__(self, key: Any) -> None:
        self._crashes.before_write()
        del self._real[key]

    def __getitem__(self, key: Any) -> Any:
        return self._real[key]


def _counting(previous: bytes | None, new: bytes | None) -> bytes | None:
    """A merge that is wrong if a record is applied twice or lost: it counts them."""
    count = json.loads(previous)["count"] if previous else 0
    return json.dumps({"count": count + 1}).encode()


def _counts(store: Store) -> dict[bytes, int]:
    return {key: json.loads(stored.value)["count"] for key, stored in store.items(0)}


def _apply_crashing(
    store: Store, crashes: CrashingWrites, rows: list[Row], next_offset: int, newest: int
) -> bool:
    """`store.apply` with every RocksDB handle it writes through guarded; True if it crashed.
    The real handles are put back (and no reference kept: they hold the database open)."""
    real = (store._db, store._checkpoints, store._partitions)
    store._db = crashes.wrap(real[0])
    store._checkpoints = crashes.wrap(real[1])
    store._partitions = {p: (crashes.wrap(cf), handle) for p, (cf, handle) in real[2].items()}
    try:
        store.apply(0, rows, next_offset, newest, merge=_counting)
    except Crash:
        return True
    finally:
        store._db, store._checkpoints, store._partitions = real
    return False


def test_a_crash_at_any_write_of_apply_leaves_rows_and_checkpoint_together(tmp_path):
    """Kill the process at each write `apply` makes in turn, reopen, and read the batch again
    from the checkpoint as the pipeline does: the counts are exact every time. A checkpoint
    written apart from the rows is caught either way: before them, a crash loses the batch
    (the re-read skips it); after them, a crash applies it twice."""
    first = [Row(b"a", b"x", 0, 1_000), Row(b"b", b"x", 1, 1_001)]
    second = [Row(b"a", b"x", 2, 1_002), Row(b"c", b"x", 3, 1_003)]
    for crash_at in range(1, 10):
        path = tmp_path / f"crash-at-{crash_at}"
        opened = Store(path)
        opened.add_partition(0)
        opened.apply(0, first, 2, 1_001, merge=_counting)
        crashed = _apply_crashing(opened, CrashingWrites(crash_at), second, 4, 1_003)
        opened.close()

        reopened = Store(path)
        try:
            next_offset = reopened.checkpoint(0).next_offset
            assert next_offset in (2, 4), f"crash at write {crash_at}: checkpoint {next_offset}"
            reopened.apply(0, [r for r in second if r.offset >= next_offset], 4, 1_003, _counting)
            assert _counts(reopened) == {b"a": 2, b"b": 1, b"c": 1}, f"crash at write {crash_at}"
            assert reopened.checkpoint(0).next_offset == 4
        finally:
            reopened.close()
        if not crashed:
            assert crash_at > 1, "apply wrote nothing the crash could stop"
            return
    raise AssertionError("apply made more than 8 writes")
